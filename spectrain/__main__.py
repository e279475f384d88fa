"""`python -m spectrain` and the `spectrain` command: the CLI, with the console quieted before torch and vLLM load
(they read their log levels at import; `spectrain.cli` imports torch)."""
import sys

from spectrain import console


def main() -> int:
    console.prepare(sys.argv[1:])
    from spectrain.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
