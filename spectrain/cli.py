"""`spectrain` command line: fit, eval, show-config, plan, bench, calibrate, recipes.

Every `SpecTrainError` (a bad recipe, run directory, prompt file, engine start...) is printed
as one line, `error: <message>`, on stderr with exit code 2; `spectrain --debug ...` raises
it with its traceback instead. A multi-process `fit` checks its inputs before it relaunches
itself under torchrun, and an error its ranks raise is printed once, by this process, after
torchrun's own report.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path

from spectrain import console, cpu_runtime
from spectrain.config import DEFAULT_RECIPE, load_config, packaged_recipe_dir, to_yaml
from spectrain.errors import ConfigError, InputWarning, SpecTrainError
from spectrain.parallel.slurm import adopt_slurm_environment

BENCHMARKS = ("drift", "draft_optimizer", "cp", "pp", "adaptive", "kernels", "memory", "speedup", "cotraining_cost",
              "regime", "rollout_scaling")
ERROR_FILE_ENV = "SPECTRAIN_ERROR_FILE"  # set for the ranks by a relaunching `spectrain fit`: they report to it


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_override(arg: str) -> bool:
    """A `key=value` override, not a file that happens to hold `=` in its name."""
    return "=" in arg and not Path(arg).expanduser().is_file()


def recipe_description(path: Path) -> str:
    """The first sentence of a recipe's header comment (its leading `#` lines, up to the first empty one)."""
    lines: list[str] = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text:
            if lines:
                break
            continue
        lines.append(text)
    header = " ".join(lines)
    end = next((i + 1 for i, ch in enumerate(header) if ch == "." and (i + 1 == len(header) or header[i + 1] == " ")
                and not header[max(0, i - 3):i + 1].endswith(("e.g.", "i.e."))), len(header))
    return header[:end] or "(no header comment)"


def packaged_recipes() -> list[tuple[str, str]]:
    """(name, one-line description) of every packaged recipe, by name."""
    return [(p.stem, recipe_description(p)) for p in sorted(packaged_recipe_dir().glob("*.yaml"))]


def recipes_listing() -> str:
    recipes = packaged_recipes()
    width = max((len(name) for name, _ in recipes), default=0)
    return "\n".join(f"  {name:<{width}}  {description}" for name, description in recipes)


def _recipes(args) -> int:
    print(recipes_listing())
    return 0


def _fit(args) -> int:
    from spectrain.train.trainer import SpecTrainer

    adopt_slurm_environment()  # under srun every task is a rank already (RANK from here on): nothing to relaunch
    if args.recipe is None:  # a bare `spectrain fit`: say what it runs
        args.recipe = DEFAULT_RECIPE
        if ERROR_FILE_ENV not in os.environ and _rank() == 0:
            print(f"no recipe given: running {DEFAULT_RECIPE}, the embedded CPU demo; `spectrain recipes` lists the "
                  f"others", file=sys.stderr)
    if ERROR_FILE_ENV in os.environ or _rank() != 0:  # the launching process (or rank 0) gave the input warnings
        warnings.filterwarnings("ignore", category=InputWarning)
    config = load_config(args.recipe, args.overrides)
    p = config.parallel
    # not under torchrun yet: start it (its run id, not LOCAL_WORLD_SIZE, which an in-process vLLM engine sets)
    if p.pp * p.dp * p.cp > 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        from spectrain.parallel.strategy import check_standalone_launch

        check_standalone_launch(p.pp * p.dp * p.cp)  # MASTER_ADDR, NODE_RANK, ... set: refused, not ignored
        SpecTrainer(config).check_inputs()  # a bad input fails here, once, and writes nothing
        return _relaunch(p.pp * p.dp * p.cp, args)
    result = SpecTrainer(config).fit()
    if _rank() == 0:
        print(json.dumps(result.summary(), indent=2))
    return 0


def _relaunch(nproc: int, args) -> int:
    """`fit` as `nproc` processes under torchrun; their errors are printed here, once each."""
    from spectrain.parallel.strategy import relaunch_under_torchrun

    cli_args = [*(["--debug"] if args.debug else []), "fit", args.recipe, *args.overrides]
    with tempfile.TemporaryDirectory(prefix="spectrain_errors_") as tmp:
        errors_path = Path(tmp) / "errors.txt"
        os.environ[ERROR_FILE_ENV] = str(errors_path)
        try:
            code = relaunch_under_torchrun(nproc, cli_args)
        finally:
            del os.environ[ERROR_FILE_ENV]
        errors = errors_path.read_text().splitlines() if errors_path.is_file() else []
    for message in dict.fromkeys(errors):  # ranks that hit the same error report it once
        print(f"error: {message}", file=sys.stderr)
    return code if code > 128 else 2 if errors else code  # > 128: stopped by a signal, with a checkpoint


def _show_config(args) -> int:
    print(to_yaml(load_config(args.recipe, args.overrides)))
    return 0


PLAN_PLACEHOLDERS = {"data.train_files": "unread-by-spectrain-plan/train.jsonl",
                     "data.val_files": "unread-by-spectrain-plan/val.jsonl"}


def _plan_config(args):
    """The recipe as `plan` reads it: the prompt files are never read, so unset (`???`) ones get placeholders."""
    try:
        return load_config(args.recipe, args.overrides)
    except ConfigError as exc:
        given = {item.split("=", 1)[0] for item in args.overrides}
        fill = [f"{k}={v}" for k, v in PLAN_PLACEHOLDERS.items() if k not in given]
        if not str(exc).startswith("required values are missing") or not fill:
            raise
        return load_config(args.recipe, [*fill, *args.overrides])


def _plan(args) -> int:
    """Exit 0 when the plan fits `--gpu-memory`, 1 when it does not (with the keys to change)."""
    from spectrain.train.inputs import policy_architecture
    from spectrain.train.memory_plan import GIB, format_plan, plan_config, verdict

    if not (math.isfinite(args.gpu_memory) and args.gpu_memory > 0):
        raise ConfigError(f"--gpu-memory: is {args.gpu_memory}; give one GPU's memory in GiB, a finite number "
                          f"above 0, e.g. --gpu-memory 80")
    config = _plan_config(args)
    policy = policy_architecture(config)
    plan = plan_config(config, int(args.gpu_memory * GIB), policy)
    print(format_plan(plan, args.recipe))
    print(f"verdict: {verdict(plan, config, policy)}")
    return 0 if plan.fits else 1


def _calibrate(args) -> int:
    from spectrain.train.calibrate import calibrate

    result, path = calibrate(load_config(args.recipe, args.overrides))
    for n, t, per in zip(result.token_counts, result.times_s, result.per_token_s):
        print(f"  {n:5d} tokens/step  {1e3 * t:8.2f} ms  {1e6 * per:8.1f} us/token")
    note = ("" if result.compute_bound_reached else f" ({result.fallback})" if result.fallback else
            " (the fitted counts start below C: extend the sweep; the slope, and so C, may be off)")
    print(f"verify budget C = {result.verify_budget} tokens per target forward{note}; written to {path}")
    return 0


def _eval(args) -> int:
    from spectrain.evaluate import evaluate_run

    # `--val-files a.jsonl key=value`: the overrides after the files (argparse gives them to --val-files)
    given = args.val_files or []
    val_files = [f for f in given if not is_override(f)]
    if given and not val_files:
        raise ConfigError(f"--val-files: {' '.join(given)} names no prompt file; give the files first, e.g. "
                          f"--val-files val.jsonl {given[0]}")
    overrides = [*args.overrides, *(f for f in given if is_override(f))]
    result = evaluate_run(args.run, val_files=val_files, samples=args.samples, correct_at=args.correct_at,
                          overrides=overrides)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).expanduser().parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).expanduser().write_text(text + "\n")
    print(text)
    return 0


def benchmark_module(name: str):
    """Benchmarks live beside the package in the source tree (`benchmarks/`), not in the wheel."""
    repo = Path(__file__).resolve().parents[1]
    if not (repo / "benchmarks" / f"{name}.py").is_file():
        raise ConfigError(f"benchmark '{name}': no {repo / 'benchmarks'} folder; benchmarks ship with the source "
                          f"repository, not the installed package: run `spectrain bench` from a clone installed with "
                          f"`pip install -e .` (`make setup`)")
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    return importlib.import_module(f"benchmarks.{name}")


def _bench(args) -> int:
    return benchmark_module(args.name).main(args.overrides) or 0


class BenchHelp(argparse.Action):
    """`bench --help`: the command's help; `bench NAME --help`: the benchmark's own (its docstring and options)."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        if namespace.name is None:
            parser.print_help()
            parser.exit()
        try:
            module = benchmark_module(namespace.name)
        except ConfigError as exc:
            parser.exit(2, f"error: {exc}\n")
        options = "\n".join(f"  {key}={value}" for key, value in module.DEFAULTS.items())
        print(f"{module.__doc__.strip()}\n\noptions (key=value), with their defaults:\n{options}")
        parser.exit()


def report_error(exc: SpecTrainError) -> None:
    """`error: <message>` as one line on stderr, once per run however many ranks raise it.

    Under a relaunching `spectrain fit` every rank hands its message to the parent, which
    prints each distinct one (so it is printed even when torchrun stops rank 0 before it
    reports). Under a plain torchrun a rank other than 0 stays quiet about an error rank 0
    reports too (`SpecTrainer` marks those it re-raises from rank 0).
    """
    rank = _rank()
    message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    errors_path = os.environ.get(ERROR_FILE_ENV)
    if errors_path:
        with open(errors_path, "a") as f:
            f.write(message + "\n")
    elif rank == 0 or not getattr(exc, "reported_by_rank_zero", False):
        print(f"error: {'' if rank == 0 else f'rank {rank}: '}{message}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spectrain", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true",
                        help="raise errors with their traceback instead of printing one line")
    parser.add_argument("--verbose", action="store_true",
                        help="show vLLM's, Lightning's and torch's own start-up logs and warnings (hidden by default)")
    sub = parser.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="run GRPO with online draft co-training from a recipe",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog=f"packaged recipes (`spectrain recipes`; without one, fit runs {DEFAULT_RECIPE}):\n"
                                f"{recipes_listing()}")
    show = sub.add_parser("show-config", help="print the fully resolved config of a recipe")
    calib = sub.add_parser("calibrate", help="measure the verify budget C of adaptive speculation "
                                             "into <run_dir>/calibration.json")
    plan = sub.add_parser("plan", help="print the memory per GPU of a recipe from its config.json alone; "
                                       "exit 1 when it does not fit")
    for p in (fit, show, plan, calib):
        p.add_argument("recipe", nargs="?", default=None if p is fit else DEFAULT_RECIPE,
                       help=f"recipe name or YAML path (default {DEFAULT_RECIPE}; `spectrain recipes` lists them)")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_steps=5")
        p.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="show vLLM's, Lightning's and torch's own logs and warnings")
    plan.add_argument("--gpu-memory", type=float, default=80.0, metavar="GiB",
                      help="memory of one GPU in GiB (default 80)")
    fit.set_defaults(func=_fit)
    show.set_defaults(func=_show_config)
    plan.set_defaults(func=_plan)
    calib.set_defaults(func=_calibrate)
    evaluate = sub.add_parser("eval", help="pass@k of a run's (or an export's) policy and draft on held-out prompts, "
                                           "as JSON; no training")
    evaluate.add_argument("run", help="a run directory (its final/, else its newest exports/step_NNNNNN/) or an "
                                      "export directory")
    evaluate.add_argument("overrides", nargs="*", help="key=value overrides of the run's config, e.g. "
                                                        "eval.prompts=500")
    evaluate.add_argument("--val-files", nargs="+", metavar="FILE",
                          help="held-out prompt files (.jsonl, .json or .parquet) instead of the run's; key=value "
                               "overrides may follow them")
    evaluate.add_argument("--samples", type=int, metavar="K",
                          help="sampled completions per prompt (default: the run's eval.samples)")
    evaluate.add_argument("--correct-at", type=float, default=1.0, metavar="X",
                          help="a sample passes when its reward >= X (default 1.0)")
    evaluate.add_argument("--out", metavar="PATH", help="also write the JSON here")
    evaluate.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                          help="show vLLM's, Lightning's and torch's own logs and warnings")
    evaluate.set_defaults(func=_eval)
    recipes = sub.add_parser("recipes", help="list the packaged recipes, one line each")
    recipes.set_defaults(func=_recipes)
    bench = sub.add_parser("bench", help="run a benchmark (source tree only); its report goes to runs/bench_NAME/",
                           add_help=False, epilog="`spectrain bench NAME --help` shows what NAME measures and its "
                                                  "options. A report goes to runs/bench_NAME/ unless the benchmark's "
                                                  "out option (out_dir for memory) names another folder, e.g. "
                                                  "out=docs/benchmarks to regenerate the committed results")
    bench.add_argument("-h", "--help", action=BenchHelp, help="this help; after NAME, the benchmark's own options")
    bench.add_argument("name", choices=BENCHMARKS, metavar="NAME", help=", ".join(BENCHMARKS))
    bench.add_argument("overrides", nargs="*", help="key=value options of the benchmark (a recipe benchmark takes "
                                                    "a recipe name first and recipe overrides too)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        os.environ[console.VERBOSE_ENV] = "1"
    console.quiet_third_party_output()  # again for in-process callers: what is not read at import still applies
    recipe = getattr(args, "recipe", None)
    if recipe is not None and is_override(recipe):  # `fit key=value`: an override, no recipe
        args.overrides, args.recipe = [recipe, *args.overrides], None if args.command == "fit" else DEFAULT_RECIPE
    try:
        return args.func(args)
    except SpecTrainError as exc:
        if args.debug:
            raise
        report_error(exc)
        return getattr(exc, "exit_code", 2)  # 128 + signal for a run stopped by SIGTERM/SIGINT


if __name__ == "__main__":  # `python -m spectrain.cli` (torchrun, srun): the CPU runtime of `spectrain`, whose restart
    cpu_runtime.preload_and_restart(sys.argv[1:])  # is `python -m spectrain` (spectrain/__main__.py) with it preloaded
    sys.exit(main())
