"""`spectrain` command line: fit, show-config, bench, calibrate, export-draft."""
from __future__ import annotations

import argparse
import json
import sys

from spectrain.config import DEFAULT_RECIPE, ConfigError, load_config, to_yaml

BENCHMARKS = ("drift", "cp", "pp", "adaptive")


def _fit(args) -> int:
    from spectrain.trainer import RunDirError, SpecTrainer

    config = load_config(args.recipe, args.overrides)
    try:
        result = SpecTrainer(config).fit()
    except RunDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.summary(), indent=2))
    return 0


def _show_config(args) -> int:
    print(to_yaml(load_config(args.recipe, args.overrides)))
    return 0


def _bench(args) -> int:
    module = __import__(f"spectrain.bench.{args.name}", fromlist=["main"])
    return module.main(args.overrides) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spectrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="run GRPO with online draft co-training from a recipe")
    show = sub.add_parser("show-config", help="print the fully resolved config of a recipe")
    for p in (fit, show):
        p.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE, help="recipe name or YAML path")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_steps=5")
    fit.set_defaults(func=_fit)
    show.set_defaults(func=_show_config)
    bench = sub.add_parser("bench", help="run a benchmark; results go to docs/benchmarks/")
    bench.add_argument("name", choices=BENCHMARKS)
    bench.add_argument("overrides", nargs="*", help="key=value options of the benchmark")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
