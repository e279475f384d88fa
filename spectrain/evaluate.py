"""`spectrain eval RUN_OR_EXPORT`: pass@k of a trained policy, served with its draft by the rollout engine, on the
run's held-out prompts (or `--val-files`), without training.

The run's own `config.yaml` says how to build the tokenizer, prompts, reward and engine, so an evaluation scores
exactly what training's held-out evaluation scored: the same prompts, sampling settings and reward.
"""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch

from spectrain.callbacks.periodic_export import exported_steps
from spectrain.config import load_config
from spectrain.errors import ConfigError
from spectrain.tasks.hf_tokenizer import TOKENIZER_FILES
from spectrain.tasks.rewards import reward_inputs, reward_name, score_batch
from spectrain.train.module import sampling_config
from spectrain.train.trainer import SpecTrainer


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt from `n` samples of which `c` are correct (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k), as a product (no huge binomials)."""
    assert 0 <= c <= n and 1 <= k <= n, (n, c, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """The mean over prompts and its standard error (sample std / sqrt(n); 0 for one prompt)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def ks_for(samples: int) -> list[int]:
    """1, 2, 4, ... up to `samples`, and `samples` itself."""
    return sorted({*(2**i for i in range(samples.bit_length()) if 2**i <= samples), samples})


def resolve(target: str | Path) -> tuple[Path, Path]:
    """The `config.yaml` and the export directory (holding `policy/`, maybe `draft/`) that `target` names: a run
    directory (its `final/`, else its newest `exports/step_NNNNNN/`; an interrupted final export, `final.partial/`, is
    named instead of passed over) or an export directory itself."""
    path = Path(target).expanduser()
    if not path.is_dir():
        raise ConfigError(f"eval: {target} is not a directory; give a run directory (holding config.yaml) or an "
                          f"export directory (holding policy/), e.g. runs/tiny_cpu or runs/tiny_cpu/final")
    if (path / "policy" / "config.json").is_file():
        run = next((p for p in path.resolve().parents if (p / "config.yaml").is_file()), None)
        if run is None:
            raise ConfigError(f"eval: no config.yaml in a directory above {path}: evaluate an export inside the "
                              f"run directory it came from")
        return run / "config.yaml", path
    if not (path / "config.yaml").is_file():
        raise ConfigError(f"eval: {target} holds neither config.yaml (a run directory) nor policy/config.json (an "
                          f"export directory)")
    if (path / "final" / "policy" / "config.json").is_file():
        return path / "config.yaml", path / "final"
    steps = exported_steps(path / "exports")
    if (path / "final.partial").is_dir():
        newest = f"; or evaluate its newest export, {path / 'exports' / f'step_{steps[-1]:06d}'}" if steps else ""
        raise ConfigError(f"eval: the final export of {target} was interrupted (final.partial/ is incomplete, there "
                          f"is no final/): run the run's `spectrain fit` command again, which resumes "
                          f"checkpoints/last.ckpt and writes final/{newest}")
    if not steps:
        raise ConfigError(f"eval: the run {target} has no exported policy yet (no final/, no exports/): finish "
                          f"the run, or set trainer.export_every_n_steps to export while it trains")
    return path / "config.yaml", path / "exports" / f"step_{steps[-1]:06d}"


def check_export(export: Path, config) -> None:
    """Refuse an export that lacks what the engine loads (the policy's weights and tokenizer, and the draft of a run
    that trains one), naming what is missing, before vLLM fails on it. spectrain writes an export aside and renames
    it when complete, so such a folder was cut short by an older version, or changed since."""
    policy, draft = export / "policy", config.draft.mode
    present = {"policy/*.safetensors (the weights)": any(policy.glob("*.safetensors")),
               f"tokenizer in policy/ ({' or '.join(TOKENIZER_FILES)})": any((policy / name).is_file()
                                                                             for name in TOKENIZER_FILES),
               f"draft/config.json (the run trains a draft: draft.mode={draft})":
                   draft == "none" or (export / "draft" / "config.json").is_file()}
    missing = [what for what, there in present.items() if not there]
    if missing:
        fix = ("run the run's `spectrain fit` command again: it resumes checkpoints/last.ckpt and writes final/ anew"
               if export.name == "final" else "evaluate a complete export, e.g. the run's final/")
        raise ConfigError(f"eval: {export} is incomplete: no {', no '.join(missing)}; {fix}")


def evaluate_run(target: str | Path, val_files: list[str] | None = None, samples: int | None = None,
                 correct_at: float = 1.0, overrides: list[str] | None = None) -> dict:
    """Greedy and sampled held-out completions of the export `target` names, scored by the run's reward: pass@1
    greedy, pass@k sampled (a sample passes when its reward >= `correct_at`), mean rewards, standard errors."""
    started = time.perf_counter()
    config_path, export = resolve(target)
    config = load_config(str(config_path), list(overrides or []))
    check_export(export, config)
    if val_files:
        config.data.val_files = [str(Path(f).expanduser()) for f in val_files]
    k = config.eval.samples if samples is None else samples
    if k < 1:
        raise ConfigError(f"eval: --samples is {k}; give at least 1 sample per prompt")
    trainer = SpecTrainer(config)
    trainer.build_inputs()
    examples = trainer.eval_examples()
    draft_dir = export / "draft" if (export / "draft" / "config.json").is_file() else None
    engine = trainer.build_rollout_engine(export / "policy", draft_dir)
    try:
        before = engine.spec_decode_counters()
        torch.manual_seed(config.trainer.seed)
        greedy = _rewards(trainer, engine, examples, 1, greedy=True)
        sampled = _rewards(trainer, engine, examples, k, greedy=False)
        spec = engine.spec_decode_counters() - before
    finally:
        engine.shutdown()
    result = {"policy": str(export / "policy"), "draft": None if draft_dir is None else str(draft_dir),
              "val_files": list(config.data.val_files or []) or None, "prompts": len(examples), "samples": k,
              "correct_at": correct_at, **_metrics(greedy, sampled, k, correct_at)}
    if spec.num_drafts:
        result["mean_acceptance_length"] = spec.mean_acceptance_length
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _rewards(trainer: SpecTrainer, engine, examples, n: int, greedy: bool) -> list[list[float]]:
    """`n` completions per prompt through the engine, scored by the trainer's reward: one list per prompt."""
    prompts = [trainer.tokenizer.encode_prompt(ex.prompt) for ex in examples]
    completions = engine.generate(prompts, sampling_config(trainer.config, trainer.tokenizer, n, greedy))
    rows = [(c.prompt_index, trainer.tokenizer.decode(c.token_ids), examples[c.prompt_index].answer)
            for c in completions]
    r = trainer.config.reward
    name = trainer.reward_hook_name() or reward_name(r.name, r.path, r.function)
    scores = score_batch(trainer.rewards, reward_inputs(rows, [ex.prompt for ex in examples]), name,
                         "the evaluation").tolist()
    per_prompt: list[list[float]] = [[] for _ in examples]
    for (index, _, _), value in zip(rows, scores):
        per_prompt[index].append(value)
    assert all(len(p) == n for p in per_prompt), [len(p) for p in per_prompt]
    return per_prompt


def _metrics(greedy: list[list[float]], sampled: list[list[float]], k: int, correct_at: float) -> dict:
    out = {}
    passed = [float(g[0] >= correct_at) for g in greedy]
    p = statistics.fmean(passed)
    out["greedy_pass@1"], out["greedy_pass@1_se"] = p, math.sqrt(p * (1 - p) / len(passed))
    correct = [sum(v >= correct_at for v in s) for s in sampled]
    for kk in ks_for(k):
        out[f"sampled_pass@{kk}"], out[f"sampled_pass@{kk}_se"] = mean_and_se([pass_at_k(k, c, kk) for c in correct])
    out["greedy_reward"], out["greedy_reward_se"] = mean_and_se([g[0] for g in greedy])
    out["sampled_reward"], out["sampled_reward_se"] = mean_and_se([statistics.fmean(s) for s in sampled])
    return out
