"""`spectrain bench adaptive`: fixed k vs the concurrency rule vs the bandit on a long-tailed rollout.

One process, two in-process engines: a plain one (the no-draft baseline, which also writes
the draft's training data) and one with an EAGLE-3 draft started with `k_max` and a
per-batch-size schedule, so every config runs on the same engine by setting `k` per step.

Workload: a tiny random Llama policy decoding greedily (so every config generates the same
tokens and only speed differs), per-request `max_tokens` drawn from a lognormal (a few long
completions hold the batch while most have finished), and a draft trained with TTT on the
policy's own greedy outputs so it agrees often. Every config runs `repeats` times,
interleaved; the tables report median and spread (min..max).

The end-to-end part runs real GRPO steps (`GRPOModule` under a Lightning Trainer with the
`DraftCoTraining` and `WeightSync` callbacks, as `spectrain fit` runs them: rollout with
sampling, policy update, draft update, weight sync) with and without long-tail spot updates.

Options (key=value): `BenchOptions` (`spectrain bench adaptive --help` lists them with their defaults).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.common import paired_ratios, parse_options, summarize
from spectrain.batch import build_rollout_batch
from spectrain.callbacks import DraftCoTraining, WeightSync
from spectrain.config import load_config
from spectrain.machine import machine_label
from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft, export_draft, load_draft
from spectrain.models.hf_io import load_pretrained, save_pretrained
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM
from spectrain.parallel.plan import draft_inputs_from, ttt_valid_tokens
from spectrain.plots import plot_panels
from spectrain.rollout.engine import Completion, SamplingConfig
from spectrain.rollout.speculation.bandit import BanditSelector, SpecArm, buckets_by_verify_budget
from spectrain.rollout.speculation.calibration import measure_engine_verify_budget
from spectrain.rollout.speculation.controllers import BanditController, ConcurrencyController, FixedK
from spectrain.rollout.speculation.rule import ConcurrencyAwareRule
from spectrain.rollout.step_loop import SpecController, StepLoopResult, StepRecord, generate_stepwise
from spectrain.rollout.vllm.engine import VLLMRolloutEngine
from spectrain.tasks.rewards import per_sample
from spectrain.train.draft_update import draft_update
from spectrain.train.module import GRPOModule


@dataclass
class BenchOptions:
    out: str = "runs/bench_adaptive"  # out=docs/benchmarks regenerates the committed results
    threads: int = 0  # torch/vLLM CPU threads; 0 = torch's default (all cores). 1 is far steadier on a shared machine
    run_dir: str = ""  # use <run_dir>/final/{policy,draft} instead of the built-in tiny pair
    seed: int = 0
    hidden: int = 512  # deep enough that a target step costs several draft passes, as with real LLMs
    layers: int = 16
    logit_scale: float = 10.0
    embed_scale: float = 10.0
    prompts: int = 48
    median_tokens: float = 12.0  # lognormal per-request max_tokens: median, sigma, clipped to [4, max_tokens]
    sigma: float = 1.0
    max_tokens: int = 64
    k_max: int = 5
    repeats: int = 5  # throughput rounds (short rollouts: many interleaved rounds beat a noisy machine)
    draft_updates: int = 120
    draft_batch: int = 4
    # tokens per training sequence (greedy outputs of the policy): cover every position the rollout reaches
    draft_len: int = 72
    ttt_passes: int = 3  # TTT passes when training the draft (it still proposes up to k_max)
    bandit_arms: str = "0,1,2,3,5"
    bandit_edges: str = "4,16,64"
    verify_budget: int = 0  # 0: calibrate here with the `spectrain calibrate` procedure
    e2e_prompts: int = 8
    e2e_group: int = 4
    e2e_steps: int = 4  # per mode; the first has no taps to spot-train on and is not timed
    e2e_temperature: float = 0.7
    long_tail_threshold: int = 8
    long_tail_max_updates: int = 4


def log(msg: str) -> None:
    print(f"[bench adaptive {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- models
def tiny_policy(opts: BenchOptions) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=128, hidden_size=opts.hidden, intermediate_size=2 * opts.hidden,
                      num_hidden_layers=opts.layers, num_attention_heads=opts.hidden // 32,
                      num_key_value_heads=max(1, opts.hidden // 64), max_position_embeddings=256)
    torch.manual_seed(opts.seed)
    policy = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # A random init is nearly uniform and mixes context at random; a trained policy is
        # confident and mostly predictable from the last tokens. Sharper logits (same argmax)
        # and a stronger token embedding (the residual stream keeps the token) get there, so
        # a short TTT run gives a draft that agrees often.
        policy.lm_head.weight.mul_(opts.logit_scale)
        policy.model.embed_tokens.weight.mul_(opts.embed_scale)
        policy.lm_head.weight[cfg.eos_token_id].zero_()  # greedy rarely stops early: max_tokens sets lengths
    return policy


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 80) for _ in range(8)] for _ in range(n)]


def long_tailed_lengths(opts: BenchOptions, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(opts.max_tokens, max(4, round(rng.lognormvariate(math.log(opts.median_tokens), opts.sigma))))
            for _ in range(n)]


def train_draft(draft: Eagle3Draft, policy: LlamaForCausalLM, data: list[Completion],
                opts: BenchOptions) -> list[float]:
    """TTT on the policy's own greedy outputs; returns the last update's top-1 agreement by pass."""
    rng = random.Random(opts.seed)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    top1 = []
    for step in range(opts.draft_updates):
        batch = build_rollout_batch(rng.sample(data, min(opts.draft_batch, len(data))), torch.zeros(
            min(opts.draft_batch, len(data))))
        with torch.no_grad():
            out = policy(batch.input_ids, batch.position_ids, batch.cu_seqlens, tap_layers=draft.cfg.tap_layers)
        taps = draft_inputs_from(out, batch, policy.attention_ops, None, ttt_valid_tokens(batch))
        update = draft_update(draft, opt, [taps], ttt_passes=opts.ttt_passes, pass_decay=0.8, grad_clip=1.0)
        top1 = update.metrics.accuracy.tolist()
        if step % 50 == 0 or step == opts.draft_updates - 1:
            log(f"draft TTT step {step}: loss {update.loss:.3f}, top-1 by pass {[round(a, 2) for a in top1]}")
    return top1


def prepare_models(opts: BenchOptions, work: Path) -> tuple[Path, Path | None, LlamaForCausalLM]:
    """(policy dir, draft dir or None if it must be trained, policy)."""
    if opts.run_dir:
        final = Path(opts.run_dir) / "final"
        return final / "policy", final / "draft", load_pretrained(final / "policy")
    from spectrain.tasks.tokenizer import save_tokenizer

    policy = tiny_policy(opts)
    policy_dir = save_pretrained(policy, work / "policy")
    save_tokenizer(policy_dir)
    return policy_dir, None, policy


# -------------------------------------------------------------------------- running
def timed_rollout(engine, prompts, sampling, controller=None) -> tuple[StepLoopResult, float, float]:
    """The rollout with its wall and process-CPU seconds (CPU time is less hurt by a shared machine)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = generate_stepwise(engine, prompts, sampling, controller)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def throughput_configs(opts: BenchOptions, budget: int) -> dict[str, Callable[[], SpecController | None]]:
    arms = [SpecArm(int(k)) for k in opts.bandit_arms.split(",")]
    edges = [int(e) for e in opts.bandit_edges.split(",")]
    bandit = BanditController(BanditSelector(arms, buckets_by_verify_budget(arms, edges, budget), seed=opts.seed))
    rule = ConcurrencyController(ConcurrencyAwareRule(budget, k_max=opts.k_max))
    configs: dict[str, Callable[[], SpecController | None]] = {"no draft": lambda: None}
    for k in range(1, opts.k_max + 1):
        configs[f"fixed k={k}"] = lambda k=k: FixedK(k)
    configs["concurrency"] = lambda: rule
    configs["bandit"] = lambda: bandit  # one bandit: it keeps learning across repeats, as in training
    return configs


def run_throughput(opts, plain, spec, configs, prompts, sampling) -> tuple[dict, dict, dict]:
    """Interleaved repeats (the order rotates every round) after a short warm-up of every config.

    Returns tokens per wall second and per process-CPU second, per config (runs aligned by
    round, for paired ratios), and the last round's traces.
    """
    warmup = [dataclasses.replace(s, max_tokens=8) for s in sampling[:8]]
    for name, make in configs.items():
        timed_rollout(plain if name == "no draft" else spec, prompts[:8], warmup, make())
    names = list(configs)
    wall = {name: [0.0] * opts.repeats for name in names}
    cpu = {name: [0.0] * opts.repeats for name in names}
    traces = {}
    for rep in range(opts.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            result, wall_s, cpu_s = timed_rollout(plain if name == "no draft" else spec, prompts, sampling,
                                                  configs[name]())
            wall[name][rep], cpu[name][rep] = result.num_tokens / wall_s, result.num_tokens / cpu_s
            traces[name] = result.trace
        log(f"repeat {rep} tokens/s: " + ", ".join(f"{n} {v[rep]:.0f}" for n, v in wall.items()))
    return ({n: summarize(v) for n, v in wall.items()}, {n: summarize(v) for n, v in cpu.items()}, traces)


# ----------------------------------------------------------------------- end to end
@dataclass(frozen=True)
class TokenPrompt:
    """A prompt already in token ids (the benchmark's policy has no task); no answer: the reward needs none."""

    prompt: list[int]
    answer: str = ""


@dataclass(frozen=True)
class SamePrompts:
    """The training "dataloader": the same prompts every step (speed, not learning, is measured)."""

    prompts: list[TokenPrompt]
    steps: int

    def __iter__(self):
        return iter([self.prompts] * self.steps)


class TokenIds:
    """The tokenizer `GRPOModule` asks for, on prompts and completions that are token ids already. The policy's EOS is
    never sampled (its logit row is zero), so `max_tokens` sets every length."""

    def __init__(self, eos_id: int) -> None:
        self.eos_id, self.stop_ids = eos_id, [eos_id]

    def encode_prompt(self, ids: list[int]) -> list[int]:
        return list(ids)

    def encode(self, ids: list[int], add_bos: bool = True) -> list[int]:
        return list(ids)

    def decode(self, ids: list[int]) -> list[int]:
        return list(ids)


def even_token_share(ids: list[int], answer: str) -> float:
    """Toy verifiable reward: share of even token ids (varies within a group, so advantages are non-zero)."""
    return sum(t % 2 == 0 for t in ids) / max(len(ids), 1)


class LongTailedGRPOModule(GRPOModule):
    """`GRPOModule` whose prompts each have their own `max_tokens`: a long-tailed training rollout."""

    def __init__(self, *args, max_tokens: list[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_tokens = max_tokens

    def sampling_config(self, n: int, greedy: bool = False) -> list[SamplingConfig]:
        base = super().sampling_config(n, greedy)
        return [dataclasses.replace(base, max_tokens=m) for m in self.max_tokens]


class StepRecorder(Callback):
    """Seconds of each GRPO step and its parts; listed after the callbacks it times.

    train_s is everything that is neither the rollout nor the sync: scoring, policy updates,
    the draft update.
    """

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.started = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step_s, stats = time.perf_counter() - self.started, outputs["step"].rollout
        sync_s = outputs["step"].seconds["weight_sync"]
        spot = pl_module.stepwise.metrics
        self.records.append({"step_s": step_s, "rollout_s": stats.seconds, "sync_s": sync_s,
                             "train_s": step_s - stats.seconds - sync_s,
                             "spot_updates": spot.get("spot/draft_updates", 0.0),
                             "spot_s": spot.get("spot/seconds", 0.0),
                             "acceptance_length": stats.spec.mean_acceptance_length})


E2E_KEYS = ("step_s", "rollout_s", "train_s", "sync_s", "spot_updates", "spot_s", "acceptance_length")


def e2e_config(opts: BenchOptions, budget: int, long_tail: bool, work: Path):
    """The recipe of the end-to-end runs: one policy update and one draft update per step, concurrency rule."""
    return load_config(None, [
        f"trainer.seed={opts.seed}", f"trainer.run_dir={work}", f"trainer.max_steps={opts.e2e_steps}",
        f"rollout.n={opts.e2e_group}", f"rollout.temperature={opts.e2e_temperature}",
        f"rollout.response_length={opts.max_tokens}",
        "grpo.lr=1e-4", "grpo.minibatches=1", "grpo.ppo_epochs=1", "grpo.kl_loss_coef=0.0", "grpo.grad_clip=1.0",
        "draft.mode=cotrained", "draft.lr=1e-3", f"draft.ttt_passes={opts.ttt_passes}", "draft.pass_decay=0.8",
        "draft.grad_clip=1.0", f"draft.num_speculative_tokens={opts.k_max}",
        "speculation.mode=concurrency", f"speculation.verify_budget={budget}",
        f"speculation.long_tail.enabled={long_tail}", f"speculation.long_tail.threshold={opts.long_tail_threshold}",
        f"speculation.long_tail.max_updates={opts.long_tail_max_updates}"])


def run_grpo(opts: BenchOptions, engine, policy_dir: Path, draft_dir: Path, budget: int, long_tail: bool,
             work: Path) -> list[dict]:
    """`e2e_steps` GRPO steps from the saved policy and draft, as `spectrain fit` runs them; a record per step."""
    config = e2e_config(opts, budget, long_tail, work)
    prompts = [TokenPrompt(p) for p in random_prompts(opts.e2e_prompts, opts.seed + 7)]
    lengths = long_tailed_lengths(opts, len(prompts), opts.seed + 7)
    lengths[-1] = opts.max_tokens  # one straggler prompt: the long tail spot training is for
    policy = load_pretrained(policy_dir)
    module = LongTailedGRPOModule(config, policy, load_draft(draft_dir), TokenIds(policy.cfg.eos_token_id),
                                  per_sample(even_token_share), max_tokens=lengths, engine=engine)
    sync = WeightSync(check_alive=False)  # no drafter probes: the toy draft's acceptance may well swing
    recorder = StepRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=opts.e2e_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(work),
                        callbacks=[DraftCoTraining(), sync, recorder])
    trainer.fit(module, train_dataloaders=SamePrompts(prompts, opts.e2e_steps))
    return recorder.records


def run_e2e(opts, spec, policy_dir, draft_dir, budget, work: Path) -> dict:
    """GRPO steps without / with spot training, one mode after the other from the same start.

    Each mode has its own policy, draft and optimizers; `WeightSync` gives the engine the
    mode's weights when its run starts (untimed). Step 1 has no taps to spot-train on and is
    not timed.
    """
    out = {}
    for name, long_tail in (("without long tail", False), ("with long tail", True)):
        records = run_grpo(opts, spec, policy_dir, draft_dir, budget, long_tail, work / name.replace(" ", "_"))[1:]
        log(f"e2e {name}: step s " + ", ".join(f"{r['step_s']:.2f} ({r['spot_updates']:.0f} spot)" for r in records))
        out[name] = {key: summarize([r[key] for r in records]) for key in E2E_KEYS}
    return out


# -------------------------------------------------------------------------- reports
def cost_curve(traces: dict) -> dict[str, tuple[list[int], list[float]]]:
    """Median engine-step seconds by live batch, per fixed k (the verify + draft cost the rules trade)."""
    curves = {}
    for name, trace in traces.items():
        if name.startswith("fixed"):
            by_live: dict[int, list[float]] = {}
            for r in trace[1:]:
                by_live.setdefault(r.live, []).append(r.seconds)
            lives = sorted(by_live)
            curves[name] = (lives, [1e3 * statistics.median(by_live[b]) for b in lives])
    return curves


LIVE_BUCKET_EDGES = (2, 4, 8, 16, 32)  # upper edges of the live-batch buckets; the last is open


def live_bucket(live: int) -> str:
    lo = 1
    for hi in LIVE_BUCKET_EDGES:
        if live <= hi:
            return f"{lo}-{hi}"
        lo = hi + 1
    return f"{lo}+"


def headroom(traces: dict[str, list[StepRecord]], best_fixed: str) -> dict:
    """What any per-batch choice of `k` could gain on this engine and workload.

    For each live-batch bucket, the `k` with the fewest measured seconds per generated token
    (all speculative traces pooled, each step filed under the `k` it proposed), applied to the
    best fixed config's tokens per bucket. An estimate: a step verifies the previous step's `k`.
    """
    cost: dict[str, dict[int, list[float]]] = {}  # bucket -> k -> [seconds, tokens]
    for name, trace in traces.items():
        for r in trace[1:] if name != "no draft" else ():  # the first step is the prefill
            total = cost.setdefault(live_bucket(r.live), {}).setdefault(r.k, [0.0, 0])
            total[0] += r.seconds
            total[1] += r.tokens
    per_token = {b: {k: s / n for k, (s, n) in ks.items() if n} for b, ks in cost.items()}
    tokens: Counter[str] = Counter()
    for r in traces[best_fixed][1:]:
        tokens[live_bucket(r.live)] += r.tokens
    fixed_k = int(best_fixed.split("=")[1])
    fixed_s = sum(n * per_token[b][fixed_k] for b, n in tokens.items())
    oracle_s = sum(n * min(per_token[b].values()) for b, n in tokens.items())
    return {"oracle_vs_best_fixed": fixed_s / oracle_s, "tokens_by_bucket": dict(tokens),
            "ms_per_token": {b: {str(k): 1e3 * v for k, v in sorted(ks.items())} for b, ks in per_token.items()}}


def write_reports(out: Path, data: dict) -> None:
    """adaptive.{json,md,png} from a run's data (also re-renders an old run's JSON)."""
    out.mkdir(parents=True, exist_ok=True)
    traces = {n: [StepRecord(**r) for r in t] for n, t in data["traces"].items()}
    data = {**data, "headroom": headroom(traces, data["headline"]["best_fixed"])}
    (out / "adaptive.json").write_text(json.dumps(data, indent=2) + "\n")
    tp = data["throughput_tokens_per_s"]
    ks = [k for k in range(1, data["options"]["k_max"] + 1)]
    flat = lambda v: ([0, ks[-1]], [v, v])  # noqa: E731
    steps = lambda name: list(range(1, len(traces[name]) + 1))  # noqa: E731
    plot_panels(out / "adaptive.png", f"adaptive speculation, long-tailed rollout ({data['machine']})", [
        ("rollout tokens/s (median)", {
            "fixed k": (ks, [tp[f"fixed k={k}"]["median"] for k in ks]),
            "no draft": flat(tp["no draft"]["median"]),
            "concurrency rule": flat(tp["concurrency"]["median"]),
            "bandit": flat(tp["bandit"]["median"])}),
        ("engine step ms (median) by live batch", cost_curve(traces)),
        ("live batch per engine step", {name: (steps(name), [r.live for r in traces[name]])
                                        for name in ("no draft", f"fixed k={ks[-1]}", "concurrency")}),
        ("k per engine step (last round)", {name: (steps(name), [r.k for r in traces[name]])
                                            for name in ("concurrency", "bandit")}),
    ], xlabel="k (1st) | live batch (2nd) | engine step (3rd, 4th)")
    (out / "adaptive.md").write_text(markdown(data))


def ratio(r: dict) -> str:
    return f"**{r['median']:.2f}x** ({r['min']:.2f}..{r['max']:.2f})"


def markdown(data: dict) -> str:
    tp, cpu, e2e, h, hc = (data["throughput_tokens_per_s"], data["throughput_tokens_per_cpu_s"], data["end_to_end"],
                           data["headline"], data["headline_cpu_time"])
    trace = data["trace_summary"]
    rows = "\n".join(f"| {n} | {v['median']:.0f} | {v['min']:.0f}..{v['max']:.0f} | {cpu[n]['median']:.0f} | "
                     f"{trace[n]['acceptance_length']:.2f} | {trace[n]['engine_steps']} |" for n, v in tp.items())
    e2e_rows = "\n".join(
        f"| {name} | {v['step_s']['median']:.2f} ({v['step_s']['min']:.2f}..{v['step_s']['max']:.2f}) | "
        f"{v['rollout_s']['median']:.2f} | {v['train_s']['median']:.2f} | {v['spot_updates']['median']:.1f} | "
        f"{v['spot_s']['median']:.2f} | {v['acceptance_length']['median']:.2f} |" for name, v in e2e.items())
    o = data["options"]
    room = data["headroom"]
    ks = sorted({int(k) for per_k in room["ms_per_token"].values() for k in per_k})
    room_rows = "\n".join(
        f"| {b} | {room['tokens_by_bucket'].get(b, 0)} | "
        + " | ".join(f"{per_k[str(k)]:.1f}" if str(k) in per_k else "-" for k in ks) + " |"
        for b, per_k in sorted(room["ms_per_token"].items(), key=lambda item: int(item[0].rstrip("+").split("-")[0])))
    machine_line = (f"Machine: {data['machine']}, {data['threads']} torch threads; "
                    f"load average (1, 5, 15 min) {data['load_average_start']} at start,")
    return f"""# Adaptive speculation benchmark

`{data['command']}`: one process, {data['seconds']:.0f} s wall, {data['cpu_seconds']:.0f} s CPU.
{machine_line}
{data['load_average_end']} at end (the benchmark itself keeps {data['threads']} threads busy; a start load near
0 means nothing else ran). Absolute numbers only compare within one run.

Workload: {o['prompts']} prompts, greedy (every config generates the same tokens), per-request max_tokens ~
lognormal(median {o['median_tokens']}, sigma {o['sigma']}) clipped to [4, {o['max_tokens']}]
({data['workload']['total_tokens']} tokens, longest {data['workload']['longest']}). Policy: {data['policy']}.
Draft: EAGLE-3 trained {o['draft_updates']} TTT steps on the policy's greedy outputs (top-1 agreement by pass
{data['draft_top1']}). Verify budget C = {data['verify_budget']} ({data['verify_budget_source']}).

## Headline

Ratios to the best fixed k ({h['best_fixed']}), median (min..max) of the per-round paired ratios:
concurrency rule {ratio(h['concurrency_vs_best_fixed'])}, bandit {ratio(h['bandit_vs_best_fixed'])};
best fixed k vs no draft {ratio(h['best_fixed_vs_no_draft'])}.
Target (>= 1.1x of the best fixed k): {'met' if h['target_met'] else 'NOT met'}.
Per process-CPU second: concurrency {ratio(hc['concurrency_vs_best_fixed'])}, bandit
{ratio(hc['bandit_vs_best_fixed'])} of {hc['best_fixed']}.

Headroom: an oracle that picks, in each live-batch bucket, the k with the fewest measured ms per
generated token would be **{room['oracle_vs_best_fixed']:.2f}x** the best fixed k on this workload
(estimated from the traces below: every speculative step pooled under the k it proposed, weighted by
{h['best_fixed']}'s tokens per bucket). By this estimate no per-batch choice of k gains more than that here.

| live batch | tokens ({h['best_fixed']}) | {' | '.join(f'ms/token k={k}' for k in ks)} |
|---|---|{'---|' * len(ks)}
{room_rows}

## Rollout throughput ({o['repeats']} interleaved repeats, order rotated every round)

| config | tokens/s median | spread (min..max) | tokens per CPU-s | acceptance length | engine steps |
|---|---|---|---|---|---|
{rows}

## End to end: GRPO steps (rollout + policy update + draft update + weight sync)

`GRPOModule` with the `DraftCoTraining` and `WeightSync` callbacks under a Lightning Trainer, as `spectrain fit`
runs them.

Concurrency rule in both; {o['e2e_prompts']} prompts x {o['e2e_group']} samples (one prompt at
max_tokens={o['max_tokens']}: a straggler, so the tail is long), temperature
{o['e2e_temperature']}; spot training below {o['long_tail_threshold']} live sequences, at most
{o['long_tail_max_updates']} draft updates per rollout, on the previous step's taps. The two modes run one after the
other from the same start; steps 2..{o['e2e_steps']} are timed (median, spread). With long tail / without, paired
by step: {ratio(data['e2e_with_vs_without'])} step time.

| | step s (spread) | rollout s | train s | spot steps | spot s | acceptance length |
|---|---|---|---|---|---|---|
{e2e_rows}

![adaptive speculation](adaptive.png)
"""


def trace_summary(traces: dict) -> dict:
    out = {}
    for name, trace in traces.items():
        drafts = sum(r.drafts for r in trace)
        out[name] = {"engine_steps": len(trace),
                     "acceptance_length": 1 + sum(r.accepted for r in trace) / drafts if drafts else 1.0}
    return out


def ensure_draft(opts: BenchOptions, plain, policy, draft_dir: Path | None, work: Path):
    """The given draft, or one trained with TTT on the policy's greedy outputs (from the plain engine)."""
    if draft_dir is not None:
        return draft_dir, None
    data = plain.generate(random_prompts(128, opts.seed + 1),
                          SamplingConfig(max_tokens=opts.draft_len, temperature=0.0))
    draft = Eagle3Draft(Eagle3Config.from_policy(policy.cfg))
    top1 = [round(a, 2) for a in train_draft(draft, policy, data, opts)]
    return export_draft(draft, work / "draft", policy.cfg), top1


def verify_budget(opts: BenchOptions, plain) -> tuple[int, str, dict | None]:
    if opts.verify_budget:
        return opts.verify_budget, "given", None
    result = measure_engine_verify_budget(plain)
    return (result.verify_budget, "calibrated here as `spectrain calibrate` does (ridge point of the plain "
            "engine's decode step time vs batch)", result.to_dict())


def headline(throughput: dict) -> dict:
    """Ratios to the best fixed k (by median): median and spread of the per-round (paired) ratios."""
    fixed = {n: v["median"] for n, v in throughput.items() if n.startswith("fixed")}
    best = max(fixed, key=fixed.get)

    def paired(a: str, b: str) -> dict:
        return paired_ratios(throughput[a]["runs"], throughput[b]["runs"])

    out = {"best_fixed": best, "concurrency_vs_best_fixed": paired("concurrency", best),
           "bandit_vs_best_fixed": paired("bandit", best), "best_fixed_vs_no_draft": paired(best, "no draft")}
    out["target_met"] = max(out["concurrency_vs_best_fixed"]["median"], out["bandit_vs_best_fixed"]["median"]) >= 1.1
    return out


DEFAULTS = dataclasses.asdict(BenchOptions())


def parse(args: list[str]) -> BenchOptions:
    return BenchOptions(**parse_options("adaptive", args, DEFAULTS))


def main(overrides: list[str]) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    opts = parse(overrides)
    if opts.threads:
        torch.set_num_threads(opts.threads)  # before vLLM starts: it pins the count afterwards
    with tempfile.TemporaryDirectory(prefix="spectrain_bench_adaptive_") as work:
        data = run(opts, Path(work))
    data["command"] = "spectrain bench adaptive " + " ".join(overrides)
    write_reports(Path(opts.out), data)
    h = data["headline"]
    log(f"vs best fixed ({h['best_fixed']}): concurrency {h['concurrency_vs_best_fixed']['median']:.2f}x, bandit "
        f"{h['bandit_vs_best_fixed']['median']:.2f}x; wrote {opts.out}/adaptive.{{json,md,png}}")
    return 0


def run(opts: BenchOptions, work: Path) -> dict:
    started, cpu_started, load_start = time.perf_counter(), time.process_time(), os.getloadavg()
    policy_dir, draft_dir, policy = prepare_models(opts, work)
    # Two in-process engines share vLLM's global parallel state: shutting one down breaks the
    # other, so both live until the end.
    plain, spec = VLLMRolloutEngine(policy_dir, None, max_model_len=256, seed=opts.seed), None
    try:
        draft_dir, top1 = ensure_draft(opts, plain, policy, draft_dir, work)
        spec = VLLMRolloutEngine(policy_dir, draft_dir, num_speculative_tokens=opts.k_max,
                                 spec_schedule=[(1, 1, opts.k_max)], max_model_len=256, seed=opts.seed)
        budget, source, calibration = verify_budget(opts, plain)
        log(f"verify budget C = {budget} ({source})")
        prompts = random_prompts(opts.prompts, opts.seed + 2)
        lengths = long_tailed_lengths(opts, opts.prompts, opts.seed + 2)
        sampling = [SamplingConfig(max_tokens=m, temperature=0.0) for m in lengths]
        throughput, per_cpu_s, traces = run_throughput(opts, plain, spec, throughput_configs(opts, budget), prompts,
                                                       sampling)
        e2e = run_e2e(opts, spec, policy_dir, draft_dir, budget, work)
    finally:
        for engine in filter(None, (spec, plain)):
            engine.shutdown()
    return {"machine": machine_label(), "threads": torch.get_num_threads(),
            "load_average_start": [round(x, 1) for x in load_start],
            "load_average_end": [round(x, 1) for x in os.getloadavg()],
            "seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu_started,
            "options": dataclasses.asdict(opts),
            "policy": opts.run_dir or (f"random Llama hidden {opts.hidden}, {opts.layers} layers, vocab 128, "
                                       f"logits x{opts.logit_scale}, embeddings x{opts.embed_scale}"),
            "draft_top1": top1, "verify_budget": budget, "verify_budget_source": source, "calibration": calibration,
            "workload": {"total_tokens": sum(lengths), "longest": max(lengths), "max_tokens": lengths},
            "throughput_tokens_per_s": throughput, "throughput_tokens_per_cpu_s": per_cpu_s,
            "end_to_end": e2e, "e2e_with_vs_without": paired_ratios(
                e2e["with long tail"]["step_s"]["runs"], e2e["without long tail"]["step_s"]["runs"]),
            "headline": headline(throughput), "headline_cpu_time": headline(per_cpu_s),
            "trace_summary": trace_summary(traces),
            "traces": {n: [dataclasses.asdict(r) for r in t] for n, t in traces.items()}}
