"""`spectrain bench adaptive`: fixed k vs the concurrency rule vs the bandit on a long-tailed rollout.

One process, two in-process engines: a plain one (the no-draft baseline, which also writes
the draft's training data) and one with an EAGLE-3 draft started with `k_max` and a
per-batch-size schedule, so every config runs on the same engine by setting `k` per step.

Workload: a tiny random Llama policy decoding greedily (so every config generates the same
tokens and only speed differs), per-request `max_tokens` drawn from a lognormal (a few long
completions hold the batch while most have finished), and a draft trained with TTT on the
policy's own greedy outputs so it agrees often. Every config runs `repeats` times,
interleaved; the tables report median and spread (min..max).

The end-to-end part runs GRPO-like steps (rollout with sampling, GRPO policy step, draft TTT
step, weight sync) with and without long-tail spot draft training.

Options (key=value): see `BenchOptions`.
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

import torch

from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft, draft_sync_weights, export_draft, load_draft, ttt_loss
from spectrain.models.hf_io import load_pretrained, save_pretrained
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM
from spectrain.plots import plot_panels
from spectrain.batch import RolloutBatch, build_rollout_batch
from spectrain.train.grpo import group_advantages, grpo_loss, token_logprobs
from spectrain.rollout.speculation._adaptive_old import (
    BanditController,
    ConcurrencyController,
    FixedK,
    LongTailTrainer,
    SpecController,
    machine_label,
    measure_engine_verify_budget,
)
from spectrain.rollout.engine import Completion, SamplingConfig
from spectrain.rollout.speculation._old import (
    BanditSelector,
    ConcurrencyAwareRule,
    LongTailPolicy,
    SpecArm,
    buckets_by_verify_budget,
)
from spectrain.rollout.step_loop import StepLoopResult, StepRecord, generate_stepwise
from spectrain.rollout.vllm.engine import VLLMRolloutEngine


@dataclass
class BenchOptions:
    out: str = "docs/benchmarks"
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
    draft_steps: int = 120
    draft_batch: int = 4
    draft_len: int = 72  # tokens per training sequence (greedy outputs of the policy): cover every position the rollout reaches
    ttt_passes: int = 3  # TTT passes when training the draft (it still proposes up to k_max)
    bandit_arms: str = "0,1,2,3,5"
    bandit_edges: str = "4,16,64"
    verify_budget: int = 0  # 0: calibrate here with the `spectrain calibrate` procedure
    e2e_prompts: int = 8
    e2e_group: int = 4
    e2e_steps: int = 4  # per mode, interleaved; the first has no taps to spot-train on and is not timed
    e2e_temperature: float = 0.7
    long_tail_threshold: int = 8
    long_tail_max_steps: int = 4


def parse_options(overrides: list[str]) -> BenchOptions:
    fields = {f.name: f for f in dataclasses.fields(BenchOptions)}
    values = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"bench adaptive: bad option '{item}'; use key=value with key in {sorted(fields)}")
        values[key] = type(getattr(BenchOptions(), key))(value)
    return BenchOptions(**values)


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


def draft_loss_on(draft: Eagle3Draft, policy: LlamaForCausalLM, batch: RolloutBatch, out, ttt_passes: int):
    logits = draft(out.embeds, out.tap_hidden, batch.position_ids, batch.cu_seqlens, ttt_passes,
                   ops=policy.attention_ops)
    return ttt_loss(logits, out.logits, batch.response_mask, batch.cu_seqlens, draft.t2d)


def train_draft(draft: Eagle3Draft, policy: LlamaForCausalLM, data: list[Completion], opts: BenchOptions) -> float:
    """TTT on the policy's own greedy outputs; returns the last pass-1 top-1 agreement."""
    rng = random.Random(opts.seed)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    top1 = 0.0
    for step in range(opts.draft_steps):
        batch = build_rollout_batch(rng.sample(data, min(opts.draft_batch, len(data))), torch.zeros(
            min(opts.draft_batch, len(data))))
        with torch.no_grad():
            out = policy(batch.input_ids, batch.position_ids, batch.cu_seqlens, tap_layers=draft.cfg.tap_layers)
        loss, metrics = draft_loss_on(draft, policy, batch, out, opts.ttt_passes)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        top1 = metrics.accuracy.tolist()
        if step % 50 == 0 or step == opts.draft_steps - 1:
            log(f"draft TTT step {step}: loss {loss.item():.3f}, top-1 by pass {[round(a, 2) for a in top1]}")
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


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def throughput_configs(opts: BenchOptions, budget: int) -> dict[str, Callable[[], SpecController | None]]:
    arms = [SpecArm(int(k)) for k in opts.bandit_arms.split(",")]
    edges = [int(e) for e in opts.bandit_edges.split(",")]
    bandit = BanditController(BanditSelector(arms, buckets_by_verify_budget(arms, edges, budget), seed=opts.seed))
    rule = ConcurrencyController(ConcurrencyAwareRule(budget, k_max=opts.k_max, n_max=opts.k_max + 1))
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
@dataclass
class E2EState:
    policy: LlamaForCausalLM
    draft: Eagle3Draft
    policy_opt: torch.optim.Optimizer
    draft_opt: torch.optim.Optimizer
    taps: tuple | None = None  # (batch, policy output) of the latest policy step


def draft_step(state: E2EState, ttt_passes: int) -> None:
    batch, out = state.taps
    loss, _ = draft_loss_on(state.draft, state.policy, batch, out, ttt_passes)
    state.draft_opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(state.draft.parameters(), 1.0)
    state.draft_opt.step()


def grpo_like_step(state: E2EState, engine, prompts, sampling, controller, spot: LongTailTrainer | None,
                   opts: BenchOptions) -> dict:
    """Rollout, GRPO policy step (taps captured), draft step, weight sync; seconds of each."""
    t0 = time.perf_counter()
    result = generate_stepwise(engine, prompts, sampling, controller, spot)
    t1 = time.perf_counter()
    # toy verifiable reward: share of even token ids (varies within a group, so advantages are non-zero)
    rewards = torch.tensor([sum(t % 2 == 0 for t in c.token_ids) / max(len(c.token_ids), 1)
                            for c in result.completions])
    batch = build_rollout_batch(result.completions, group_advantages(rewards, opts.e2e_group))
    out = state.policy(batch.input_ids, batch.position_ids, batch.cu_seqlens,
                       tap_layers=state.draft.cfg.tap_layers)
    logprobs = token_logprobs(out.logits, batch.targets)
    loss = grpo_loss(logprobs, logprobs.detach(), batch.advantages, batch.response_mask).loss
    state.policy_opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(state.policy.parameters(), 1.0)
    state.policy_opt.step()
    state.taps = (batch, out)  # the draft and its loss detach what they read
    draft_step(state, opts.ttt_passes)
    t2 = time.perf_counter()
    sync_engine(engine, state)
    t3 = time.perf_counter()
    spec = sum(r.accepted for r in result.trace), sum(r.drafts for r in result.trace)
    return {"step_s": t3 - t0, "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2,
            "spot_steps": spot.steps if spot else 0, "spot_s": spot.seconds if spot else 0.0,
            "acceptance_length": 1 + spec[0] / spec[1] if spec[1] else 1.0}


E2E_KEYS = ("step_s", "rollout_s", "train_s", "sync_s", "spot_steps", "spot_s", "acceptance_length")


def run_e2e(opts, spec, policy_dir, draft_dir, budget) -> dict:
    """GRPO-like steps without / with spot training, interleaved step by step from the same start.

    Each mode keeps its own policy, draft and optimizers; the engine gets a mode's weights
    before its step (untimed). Step 1 has no taps to spot-train on and is not timed.
    """
    prompts = random_prompts(opts.e2e_prompts, opts.seed + 7)
    lengths = long_tailed_lengths(opts, len(prompts), opts.seed + 7)
    lengths[-1] = opts.max_tokens  # one straggler prompt: the long tail spot training is for
    sampling = [SamplingConfig(n=opts.e2e_group, max_tokens=m, temperature=opts.e2e_temperature, seed=opts.seed)
                for m in lengths]
    rule = ConcurrencyAwareRule(budget, k_max=opts.k_max, n_max=opts.k_max + 1)
    modes = ["without long tail", "with long tail"]
    states = {name: fresh_state(policy_dir, draft_dir) for name in modes}
    spot_policy = {name: LongTailPolicy(opts.long_tail_threshold, mode=name == "with long tail",
                                        max_steps=opts.long_tail_max_steps) for name in modes}
    records = {name: [] for name in modes}
    for i in range(opts.e2e_steps):
        for name in modes if i % 2 == 0 else modes[::-1]:
            state = states[name]
            sync_engine(spec, state)
            spot = LongTailTrainer(spot_policy[name], lambda: draft_step(state, opts.ttt_passes)) if state.taps else None
            record = grpo_like_step(state, spec, prompts, sampling, ConcurrencyController(rule), spot, opts)
            if i:
                records[name].append(record)
        if i:
            log(f"e2e step {i}: " + ", ".join(f"{n} {r[-1]['step_s']:.2f} s ({r[-1]['spot_steps']} spot)"
                                              for n, r in records.items()))
    return {name: {key: summarize([r[key] for r in recs]) for key in E2E_KEYS} for name, recs in records.items()}


def fresh_state(policy_dir: Path, draft_dir: Path) -> E2EState:
    policy, draft = load_pretrained(policy_dir), load_draft(draft_dir)
    return E2EState(policy, draft, torch.optim.AdamW(policy.parameters(), lr=1e-4),
                    torch.optim.AdamW(draft.parameters(), lr=1e-3))


def sync_engine(engine, state: E2EState) -> None:
    engine.sync_policy([(n, p.detach()) for n, p in state.policy.state_dict().items()], 0)
    engine.sync_draft(draft_sync_weights(state.draft), 0)


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
        f"{v['rollout_s']['median']:.2f} | {v['train_s']['median']:.2f} | {v['spot_steps']['median']:.1f} | "
        f"{v['spot_s']['median']:.2f} | {v['acceptance_length']['median']:.2f} |" for name, v in e2e.items())
    o = data["options"]
    room = data["headroom"]
    ks = sorted({int(k) for per_k in room["ms_per_token"].values() for k in per_k})
    room_rows = "\n".join(
        f"| {b} | {room['tokens_by_bucket'].get(b, 0)} | "
        + " | ".join(f"{per_k[str(k)]:.1f}" if str(k) in per_k else "-" for k in ks) + " |"
        for b, per_k in sorted(room["ms_per_token"].items(), key=lambda item: int(item[0].rstrip("+").split("-")[0])))
    return f"""# Adaptive speculation benchmark

`{data['command']}`: one process, {data['seconds']:.0f} s wall, {data['cpu_seconds']:.0f} s CPU.
Machine: {data['machine']}, {data['threads']} torch threads; load average (1, 5, 15 min) {data['load_average_start']} at start,
{data['load_average_end']} at end (the benchmark itself keeps {data['threads']} threads busy; a start load near
0 means nothing else ran). Absolute numbers only compare within one run.

Workload: {o['prompts']} prompts, greedy (every config generates the same tokens), per-request max_tokens ~
lognormal(median {o['median_tokens']}, sigma {o['sigma']}) clipped to [4, {o['max_tokens']}]
({data['workload']['total_tokens']} tokens, longest {data['workload']['longest']}). Policy: {data['policy']}.
Draft: EAGLE-3 trained {o['draft_steps']} TTT steps on the policy's greedy outputs (top-1 agreement by pass
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

## End to end: GRPO-like steps (rollout + policy step + draft step + weight sync)

Concurrency rule in both; {o['e2e_prompts']} prompts x {o['e2e_group']} samples (one prompt at
max_tokens={o['max_tokens']}: a straggler, so the tail is long), temperature
{o['e2e_temperature']}; spot training below {o['long_tail_threshold']} live sequences, at most
{o['long_tail_max_steps']} draft steps per rollout, on the previous step's taps. The two modes alternate step by
step from the same start; steps 2..{o['e2e_steps']} are timed (median, spread). With long tail / without, paired
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
    data = plain.generate(random_prompts(128, opts.seed + 1), SamplingConfig(max_tokens=opts.draft_len, temperature=0.0))
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
        return summarize([x / y for x, y in zip(throughput[a]["runs"], throughput[b]["runs"])])

    out = {"best_fixed": best, "concurrency_vs_best_fixed": paired("concurrency", best),
           "bandit_vs_best_fixed": paired("bandit", best), "best_fixed_vs_no_draft": paired(best, "no draft")}
    out["target_met"] = max(out["concurrency_vs_best_fixed"]["median"], out["bandit_vs_best_fixed"]["median"]) >= 1.1
    return out


def main(overrides: list[str]) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    opts = parse_options(overrides)
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
        e2e = run_e2e(opts, spec, policy_dir, draft_dir, budget)
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
            "end_to_end": e2e, "e2e_with_vs_without": summarize(
                [w / wo for w, wo in zip(e2e["with long tail"]["step_s"]["runs"],
                                         e2e["without long tail"]["step_s"]["runs"])]),
            "headline": headline(throughput), "headline_cpu_time": headline(per_cpu_s),
            "trace_summary": trace_summary(traces),
            "traces": {n: [dataclasses.asdict(r) for r in t] for n, t in traces.items()}}
