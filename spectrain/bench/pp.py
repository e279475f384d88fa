"""`spectrain bench pp`: what carrying the draft's taps across pipeline stages costs.

One spawned 2-process gloo run (pp=2, one thread per process) of `PipelinePlan` on a policy
deep enough for a pipeline to matter on CPU (8 layers, hidden 256 by default) and a fake
rollout. For each schedule (1F1B, GPipe) it times the same policy step (every microbatch's
forward and backward, gradient reduction, global clip) in three modes:

- `taps`: the draft's aux layers captured, taps carried by the `TapChannel`;
- `no_taps`: draft off: no capture, no taps (the floor);
- `blocking`: taps carried by `BlockingTapTransport` (blocking sends inside the forward).

In `taps` mode the draft's TTT step then runs on the last stage from those taps; it is
timed on its own (`draft_seconds`), not inside the policy step. Rounds interleave every
(schedule, mode) after a warm-up, the mode order rotating each round, so slow drift of a
shared machine's load hits all modes alike. Overhead is reported both as the ratio of
medians and as the median of the per-round ratios (paired, the headline).

Usage: `spectrain bench pp [layers=8] [hidden=256] [docs=24] [doc_len=64] [microbatches=4]
[rounds=10] [out=docs/benchmarks]`; writes pp.json, pp.md and pp.png under `out`.
"""
from __future__ import annotations

import json
import os
import queue
import socket
import statistics
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from spectrain.bench.drift import machine_label, split_options
from spectrain.plots import plot_panels

SCHEDULES = ("1F1B", "GPipe")
MODES = ("taps", "no_taps", "blocking")
DEFAULTS = {"layers": 8, "hidden": 256, "docs": 24, "doc_len": 64, "microbatches": 4, "rounds": 10,
            "out": "docs/benchmarks"}
TARGET_OVERHEAD = 0.05


def _models(o: dict):
    from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft
    from spectrain.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=o["hidden"], intermediate_size=3 * o["hidden"],
                      num_hidden_layers=o["layers"], num_attention_heads=o["hidden"] // 64,
                      num_key_value_heads=max(1, o["hidden"] // 128), max_position_embeddings=2 * o["doc_len"])
    policy = LlamaForCausalLM(cfg)
    return policy, Eagle3Draft(Eagle3Config.from_policy(cfg))


def _rollout(o: dict):
    """`docs` documents of `doc_len` tokens (a quarter prompt), random advantages and engine logprobs."""
    from spectrain.rl.batch import build_rollout_batch
    from spectrain.rollout.base import Completion

    g = torch.Generator().manual_seed(1)
    prompt = o["doc_len"] // 4
    completions = []
    for i in range(o["docs"]):
        ids = torch.randint(4, 64, (o["doc_len"],), generator=g).tolist()
        logprobs = (-2 * torch.rand(o["doc_len"] - prompt, generator=g)).tolist()
        completions.append(Completion(i, ids[:prompt], ids[prompt:], logprobs, True))
    return build_rollout_batch(completions, torch.randn(o["docs"], generator=g))


def _timed(transport):
    """`transport` that adds the seconds its calls hold the caller (post, wait, finish_step) to `seconds`."""

    class Timed(transport):
        seconds = 0.0

        def _timed_call(self, fn, *args):
            started = time.perf_counter()
            try:
                return fn(*args)
            finally:
                type(self).seconds += time.perf_counter() - started

        def post(self, microbatch, name, tap):
            self._timed_call(super().post, microbatch, name, tap)

        def wait(self, microbatch):
            return self._timed_call(super().wait, microbatch)

        def finish_step(self):
            self._timed_call(super().finish_step)

    Timed.__name__ = f"Timed{transport.__name__}"
    return Timed


def _worker(rank: int, port: int, o: dict, results) -> None:
    try:
        results.put((rank, True, _measure(rank, port, o)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _measure(rank: int, port: int, o: dict) -> dict:
    import torch.distributed as dist

    from spectrain.callbacks.draft_cotraining import draft_loss
    from spectrain.parallel.mesh import build_mesh
    from spectrain.parallel.pipeline_plan import PipelinePlan
    from spectrain.parallel.tap_channel import BlockingTapTransport, TapChannel
    from spectrain.rl.grpo import grpo_loss, token_logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(minutes=10))
    mesh = build_mesh(2, 1, 1)
    policy, draft = _models(o)
    module = torch.nn.Module()  # the stand-in GRPOModule that `draft_loss` reads
    module.draft, module.draft_inputs = draft, []
    draft_opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    batch = _rollout(o)
    num_tokens = batch.num_response_tokens

    def loss_fn(logits, part):
        logprobs = token_logprobs(logits, part.targets)
        out = grpo_loss(logprobs, part.rollout_logprobs, part.advantages, part.response_mask, 0.2,
                        num_tokens=num_tokens)
        return out.loss, logprobs

    transports = {"taps": _timed(TapChannel), "no_taps": _timed(TapChannel), "blocking": _timed(BlockingTapTransport)}
    plans = {(s, m): PipelinePlan(mesh, s, o["microbatches"], transports[m]) for s in SCHEDULES for m in MODES}
    aux = tuple(draft.cfg.aux_layer_ids)

    def step(schedule: str, mode: str) -> tuple[float, float, float]:
        plan, transport = plans[schedule, mode], transports[mode]
        capture = () if mode == "no_taps" else aux
        policy.zero_grad(set_to_none=True)
        dist.barrier()
        transport.seconds = 0.0
        started = time.perf_counter()
        result = plan.policy_forward_backward(policy, batch, loss_fn, capture, None)
        plan.reduce_gradients(policy)
        plan.clip_grad_norm(policy, 1.0)
        seconds, tap_seconds = time.perf_counter() - started, transport.seconds
        dist.barrier()
        draft_seconds = 0.0
        if mode == "taps" and plan.hosts_draft:
            started = time.perf_counter()
            module.draft_inputs = result.draft_inputs
            loss, _ = draft_loss(module, 3, 0.8)
            draft_opt.zero_grad(set_to_none=True)
            loss.backward()
            draft_opt.step()
            draft_seconds = time.perf_counter() - started
        module.draft_inputs = []
        return seconds, tap_seconds, draft_seconds

    for s in SCHEDULES:  # warm-up: runners, buffers, allocator
        for m in MODES:
            step(s, m)
    times = {s: {m: [] for m in MODES} for s in SCHEDULES}
    tap_times = {s: {m: [] for m in MODES} for s in SCHEDULES}
    draft_times = {s: [] for s in SCHEDULES}
    for r in range(o["rounds"]):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for s in SCHEDULES:
            for m in order:
                seconds, tap_seconds, draft_seconds = step(s, m)
                times[s][m].append(seconds)
                tap_times[s][m].append(tap_seconds)
                if m == "taps":
                    draft_times[s].append(draft_seconds)
    budget = next(iter(plans[SCHEDULES[0], "taps"]._runners))[1]
    dist.destroy_process_group()
    return {"step_seconds": times, "tap_call_seconds": tap_times, "draft_seconds": draft_times,
            "tokens_per_microbatch": budget}


def _spawn(o: dict, timeout_s: float = 900.0) -> list[dict]:
    """`_measure` on two spawned ranks; the per-rank results."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # inherited by the spawned workers
    try:
        procs = [ctx.Process(target=_worker, args=(r, port, o, results), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        out, deadline = {}, time.monotonic() + timeout_s
        while len(out) < 2:
            try:
                rank, ok, payload = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"bench pp: no result after {timeout_s:.0f}s") from None
            if not ok:
                raise RuntimeError(f"bench pp: rank {rank} failed:\n{payload}")
            out[rank] = payload
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        os.environ.update({k: v for k, v in env.items() if v is not None})
        for k in (k for k, v in env.items() if v is None):
            os.environ.pop(k, None)
    return [out[0], out[1]]


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarise(ranks: list[dict]) -> dict:
    """Per schedule and mode: rank 0's step time (stage 0 ends the step), tap-call time per rank, draft time."""
    times = ranks[0]["step_seconds"]
    out = {}
    for s in SCHEDULES:
        row = {m: _spread(times[s][m]) for m in MODES}
        floor = row["no_taps"]["median"]
        for m in ("taps", "blocking"):
            paired = [a / b - 1 for a, b in zip(times[s][m], times[s]["no_taps"])]
            q1, q2, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
            calls = [statistics.median(r["tap_call_seconds"][s][m]) for r in ranks]
            row[f"{m}_overhead"] = {"paired_median": statistics.median(paired), "paired_iqr": [q1, q3],
                                    "paired": paired, "ratio_of_medians": row[m]["median"] / floor - 1,
                                    "tap_call_seconds_per_rank": calls, "tap_call_share": max(calls) / floor}
        row["draft_seconds"] = _spread(ranks[1]["draft_seconds"][s])
        out[s] = row
    h = {f"tapchannel_overhead_{s}": out[s]["taps_overhead"]["paired_median"] for s in SCHEDULES}
    h.update({f"tapchannel_call_share_{s}": out[s]["taps_overhead"]["tap_call_share"] for s in SCHEDULES})
    h.update({f"blocking_overhead_{s}": out[s]["blocking_overhead"]["paired_median"] for s in SCHEDULES})
    h["target"] = TARGET_OVERHEAD
    h["target_met"] = all(h[f"tapchannel_overhead_{s}"] <= TARGET_OVERHEAD for s in SCHEDULES)
    out["headline"] = h
    return out


def write_report(out_dir: Path, o: dict, ranks: list[dict], summary: dict, label: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"machine": label, "options": o, "tokens_per_microbatch": ranks[0]["tokens_per_microbatch"],
               "summary": summary, "per_rank": ranks}
    (out_dir / "pp.json").write_text(json.dumps(payload, indent=2))
    rounds = list(range(1, o["rounds"] + 1))
    panels = [(f"{s} policy step (s)", {m: (rounds, ranks[0]["step_seconds"][s][m]) for m in MODES})
              for s in SCHEDULES]
    panels.append(("step vs no_taps, same round (%)", {
        f"{s} {m}": (rounds, [100 * x for x in summary[s][f"{m}_overhead"]["paired"]])
        for s in SCHEDULES for m in ("taps", "blocking")}))
    plot_panels(out_dir / "pp.png", "pipeline step with the draft's taps: TapChannel vs none vs blocking",
                panels, xlabel="round")
    pct = lambda x: f"{100 * x:+.1f}%"  # noqa: E731
    rows = []
    for s in SCHEDULES:
        r = summary[s]
        for m in MODES:
            t = r[m]
            over, calls, draft = "—", "—", ""
            if m != "no_taps":
                ov = r[f"{m}_overhead"]
                over = (f"{pct(ov['paired_median'])} [{pct(ov['paired_iqr'][0])}, {pct(ov['paired_iqr'][1])}] "
                        f"({pct(ov['ratio_of_medians'])})")
                c = ov["tap_call_seconds_per_rank"]
                calls = f"{1e3 * c[0]:.1f} / {1e3 * c[1]:.1f} ({100 * ov['tap_call_share']:.1f}%)"
            if m == "taps":
                draft = f"{r['draft_seconds']['median']:.3f}"
            rows.append(f"| {s} | {m} | {t['median']:.3f} | {t['min']:.3f} .. {t['max']:.3f} | {over} | {calls} "
                        f"| {draft} |")
    h = summary["headline"]
    verdict = "met" if h["target_met"] else "**missed**"
    opts = " ".join(f"{k}={v}" for k, v in o.items() if k != "out")
    (out_dir / "pp.md").write_text(f"""# Pipeline taps benchmark

`spectrain bench pp {opts}` on {label}.
2 pipeline stages (1 process x 1 thread each, gloo), {o['layers']} layers, hidden {o['hidden']},
{o['docs']} documents x {o['doc_len']} tokens per step in {o['microbatches']} microbatches of
{ranks[0]['tokens_per_microbatch']} tokens. Policy step = every microbatch's forward and backward,
gradient reduction and global clip; {o['rounds']} interleaved rounds after a warm-up.
Step-time overhead is paired per round (median [quartiles], then the ratio of medians). Tap
calls: median seconds per step that `post`/`wait`/`finish_step` hold stage 0 / the last stage,
and the larger as a share of the no-taps step: the time the transport itself puts on a stage.

| schedule | mode | step s (median) | min .. max | step vs no_taps: paired median [IQR] (ratio of medians) | tap calls ms, stage 0 / last (share) | draft TTT step s (last stage) |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Headline: the TapChannel adds **{pct(h['tapchannel_overhead_1F1B'])}** to the 1F1B step and
**{pct(h['tapchannel_overhead_GPipe'])}** to the GPipe step (paired medians; target <= {pct(TARGET_OVERHEAD)}:
{verdict}); its calls hold a stage for {100 * h['tapchannel_call_share_1F1B']:.1f}% (1F1B) and
{100 * h['tapchannel_call_share_GPipe']:.1f}% (GPipe) of the step. Blocking sends: {pct(h['blocking_overhead_1F1B'])}
(1F1B), {pct(h['blocking_overhead_GPipe'])} (GPipe).

![pp](pp.png)
""")


def main(args: list[str]) -> int:
    o, unknown = split_options(args, DEFAULTS)
    if unknown:
        raise SystemExit(f"bench pp: unknown options {unknown}; known: {sorted(DEFAULTS)}")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    ranks = _spawn(o)
    summary = summarise(ranks)
    label = (f"{machine_label()}; load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on "
             f"{os.cpu_count()} cores; {time.perf_counter() - started:.0f} s")
    write_report(Path(o["out"]), o, ranks, summary, label)
    print(json.dumps(summary["headline"], indent=2))
    return 0
