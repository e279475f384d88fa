"""`spectrain` command line: fit, show-config, bench, calibrate, export-draft."""
from __future__ import annotations

import argparse
import json
import os
import sys

from spectrain.config import DEFAULT_RECIPE, ConfigError, load_config, to_yaml

BENCHMARKS = ("drift", "cp", "pp", "adaptive")


def _fit(args) -> int:
    from spectrain.trainer import RunDirError, SpecTrainer

    config = load_config(args.recipe, args.overrides)
    p = config.parallel
    if p.pp * p.dp * p.cp > 1 and "LOCAL_WORLD_SIZE" not in os.environ:  # not under torchrun yet: start it
        from spectrain.parallel.strategy import relaunch_under_torchrun

        return relaunch_under_torchrun(p.pp * p.dp * p.cp, ["fit", args.recipe, *args.overrides])
    try:
        result = SpecTrainer(config).fit()
    except RunDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result.summary(), indent=2))
    return 0


def _show_config(args) -> int:
    print(to_yaml(load_config(args.recipe, args.overrides)))
    return 0


def _calibrate(args) -> int:
    from spectrain.rollout.adaptive import calibrate
    from spectrain.trainer import RunDirError

    config = load_config(args.recipe, args.overrides)
    try:
        result, path = calibrate(config)
    except RunDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for n, t, per in zip(result.token_counts, result.times_s, result.per_token_s):
        print(f"  {n:5d} tokens/step  {1e3 * t:8.2f} ms  {1e6 * per:8.1f} us/token")
    note = "" if result.compute_bound_reached else " (the fitted counts start below C: extend the sweep; the slope, and so C, may be off)"
    print(f"verify budget C = {result.verify_budget} tokens per target forward{note}; written to {path}")
    return 0


def _bench(args) -> int:
    module = __import__(f"spectrain.bench.{args.name}", fromlist=["main"])
    return module.main(args.overrides) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spectrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="run GRPO with online draft co-training from a recipe")
    show = sub.add_parser("show-config", help="print the fully resolved config of a recipe")
    calib = sub.add_parser("calibrate", help="measure the verify budget C of adaptive speculation "
                                             "into <run_dir>/calibration.json")
    for p in (fit, show, calib):
        p.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE, help="recipe name or YAML path")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_steps=5")
    fit.set_defaults(func=_fit)
    show.set_defaults(func=_show_config)
    calib.set_defaults(func=_calibrate)
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
