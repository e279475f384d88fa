"""`spectrain bench cp`: per-rank peak activation memory and time of context parallelism vs tokens.

Workloads, over total tokens T (a few long packed documents of unequal length, <= 4K each):

- `ttt`: the draft's TTT attention, forward + backward of K passes (`ttt_attention`; its trunk
  on the zigzag ring under CP, on `LocalAttentionOps` at CP=1);
- `step`: a full training step: the tiny policy's forward + backward with the draft's taps
  (`LocalPlan` at CP=1, `ContextParallelPlan` under CP), then the draft's K-pass TTT loss
  forward + backward, gradients reduced.

Methods: `ring` (ours) at CP=1/2/4, and two baselines for `ttt`, in the same run:
`dense` (one process: each pass as plain `scaled_dot_product_attention` with the dense staircase
mask `[S, d*S]`, causal trunk plus one diagonal per earlier pass: O(S^2)) and `allgather` at the
largest CP (every rank all-gathers the whole K/V, O(S), computes the same blocks without overlap,
and sums dK/dV with an all-reduce). `dense` points whose scores would exceed `dense_max_gib` are
skipped.

Memory, per rank: every CP size runs in fresh spawned processes (gloo, one thread each) with
`MALLOC_MMAP_THRESHOLD_=65536`, so glibc serves every block >= 64 KiB with its own mmap and
unmaps it on free: the resident set follows the live tensors (torch's CPU allocator keeps no
cache). Once a point's model and inputs exist, the worker resets the kernel's peak-RSS mark
(`/proc/self/clear_refs` <- 5) and reports `VmHWM - VmRSS` after the work: the peak of saved
activations, temporaries, communication buffers and input gradients. Parameter gradients
are allocated before the reset (they are not activations). Tables give the max over ranks.
Time is the wall time of the same run (one warm-up per process before the sweep); at CP=4 on a
2-core machine four processes share two cores, so times there are not speed-ups.

Usage: `spectrain bench cp [tokens=1024,2048,...,32768] [cp=1,2,4] [ttt_passes=3]
[dense_max_gib=2] [out=runs/bench_cp]`; writes cp.json, cp.md and cp.png under `out`.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import int_list, parse_options
from spectrain.errors import ConfigError
from spectrain.machine import machine_label
from spectrain.parallel.cp.ring import ZigzagRingAttentionOps, _acc_dtype, _add_rows, _Hop
from spectrain.parallel.spawn import run_distributed
from spectrain.plots import plot_panels

DEFAULTS = {"tokens": "1024,2048,4096,8192,16384,32768", "cp": "1,2,4", "ttt_passes": 3, "dense_max_gib": 2.0,
            "out": "runs/bench_cp", "timeout": 1800.0}
POLICY = dict(vocab_size=128, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2)
HQ, HKV, D = 4, 2, 32  # the draft's attention (hidden 128)
MAX_DOC = 4096
TARGET_RATIO = 0.35  # CP=4 / CP=1 peak activation memory at equal tokens


# ------------------------------------------------------------------------------ baselines
class AllGatherKVOps(ZigzagRingAttentionOps):
    """Baseline: each rank all-gathers every K/V shard (O(S) per rank) and computes the ring's
    blocks from them, no overlap; dK/dV of every shard summed with one all-reduce (gloo has no
    reduce-scatter) and each rank keeps its own."""

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def _held_kv(self, kv):
        parts = self._gather(kv)
        for hop in range(self.world):
            yield hop, parts[(self.rank - hop) % self.world]

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale=None):
        h = self._halves(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
        acc = _acc_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc)
        dkvs = torch.zeros((self.world, 2, *k.shape), dtype=acc)
        for hop, kv in self._held_kv(torch.stack([k, v])):
            st = _Hop.at(hop, self.rank, cu_seqlens_q, h)
            dq_b, dkv_b = self._hop_backward(st, kv, dout, q, out, lse, scale)
            _add_rows(dq, st.q_rows, dq_b)
            _add_rows(dkvs[(self.rank - hop) % self.world], st.kv_rows, dkv_b, dim=1)
        dist.all_reduce(dkvs, group=self.group)
        return dq.to(q.dtype), dkvs[self.rank, 0].to(k.dtype), dkvs[self.rank, 1].to(v.dtype)


def staircase_mask(cu_seqlens: torch.Tensor, passes: int) -> torch.Tensor:
    """`[S, passes*S]` bool: the causal trunk within documents, then one diagonal per earlier pass."""
    s = int(cu_seqlens[-1])
    doc = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff().long())
    idx = torch.arange(s)
    trunk = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    return torch.cat([trunk] + [torch.eye(s, dtype=torch.bool)] * (passes - 1), dim=1)


def dense_ttt_attention(q, keys, values, cu_seqlens):
    """TTT pass `len(keys)` as plain attention over the concatenated keys with the staircase mask."""
    mask = staircase_mask(cu_seqlens, len(keys))
    g = HQ // HKV
    k = torch.cat(keys).repeat_interleave(g, 1).transpose(0, 1)  # [Hq, d*S, D]
    v = torch.cat(values).repeat_interleave(g, 1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


def dense_bytes(tokens: int, passes: int) -> float:
    """Scores of the last pass in float32, forward and backward (the dense baseline's floor)."""
    return 2 * 4 * HQ * tokens * passes * tokens


# ------------------------------------------------------------------------------ measuring
def _status_kib(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def measure(work) -> dict:
    """Peak resident memory above the current one while `work()` runs, and its wall time."""
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    base = _status_kib("VmRSS")
    started = time.perf_counter()
    work()
    seconds = time.perf_counter() - started
    return {"peak_mib": (_status_kib("VmHWM") - base) / 1024, "seconds": seconds}


def doc_lengths(tokens: int) -> list[int]:
    """A few long documents of unequal length (+-30%) summing to `tokens`, none over MAX_DOC."""
    n = max(4, -(-tokens // MAX_DOC) * 4 // 3)
    weights = [1.0 + 0.3 * math.cos(2.3 * i) for i in range(n)]
    lens = [int(tokens * w / sum(weights)) for w in weights]
    lens[0] += tokens - sum(lens)
    assert sum(lens) == tokens and max(lens) <= MAX_DOC + tokens // n, lens
    return lens


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _ttt_point(method: str, tokens: int, passes: int, rank: int, world: int) -> dict:
    from spectrain.ops.attention import LocalAttentionOps
    from spectrain.ops.ttt_attention import ttt_attention
    from spectrain.parallel.cp.zigzag import ZigzagLayout

    cu = _cu(doc_lengths(tokens))
    if world > 1:
        layout = ZigzagLayout.build(cu, world, rank)
        cu, n = layout.cu_seqlens_local, layout.num_local_tokens
        ops = (AllGatherKVOps if method == "allgather" else ZigzagRingAttentionOps)(dist.group.WORLD)
    else:
        n, ops = tokens, LocalAttentionOps()
    g = torch.Generator().manual_seed(rank)
    leaf = lambda *shape: torch.randn(*shape, generator=g).requires_grad_()  # noqa: E731
    qs = [leaf(n, HQ, D) for _ in range(passes)]
    ks = [leaf(n, HKV, D) for _ in range(passes)]
    vs = [leaf(n, HKV, D) for _ in range(passes)]
    douts = [torch.randn(n, HQ, D, generator=g) for _ in range(passes)]

    def attend(d):
        if method == "dense":
            return dense_ttt_attention(qs[d], ks[:d + 1], vs[:d + 1], cu)
        return ttt_attention(qs[d], ks[:d + 1], vs[:d + 1], cu, ops=ops)

    def work():
        torch.autograd.backward([attend(d) for d in range(passes)], douts)
        if world > 1:
            dist.barrier()

    return measure(work)


def _step_models():
    from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft
    from spectrain.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(**POLICY, max_position_embeddings=2 * MAX_DOC))
    return policy, Eagle3Draft(Eagle3Config.from_policy(policy.cfg))


def _step_batch(tokens: int):
    """Documents of `doc_lengths(tokens)`, a quarter prompt each, random advantages and engine logprobs."""
    from spectrain.batch import build_rollout_batch
    from spectrain.rollout.engine import Completion

    g = torch.Generator().manual_seed(1)
    completions = []
    for i, n in enumerate(doc_lengths(tokens)):
        ids = torch.randint(4, POLICY["vocab_size"], (n,), generator=g).tolist()
        logprobs = (-2 * torch.rand(n - n // 4, generator=g)).tolist()
        completions.append(Completion(i, ids[:n // 4], ids[n // 4:], logprobs, True))
    return build_rollout_batch(completions, torch.randn(len(completions), generator=g))


def _step_point(policy, draft, plan, tokens: int, passes: int, world: int) -> dict:
    from spectrain.parallel.plan import TapCollector
    from spectrain.train.draft_update import draft_loss
    from spectrain.train.grpo import grpo_loss

    batch = _step_batch(tokens)
    num_tokens = batch.num_response_tokens

    def loss_fn(logprobs, part):
        return grpo_loss(logprobs, part.rollout_logprobs, part.advantages, part.response_mask, 0.2,
                         num_tokens=num_tokens).loss, logprobs

    for p in (*policy.parameters(), *draft.parameters()):  # parameter gradients are not activations: first
        p.grad = torch.zeros_like(p)

    def work():
        taps = TapCollector(batch)
        plan.policy_forward_backward(policy, batch, loss_fn, draft.cfg.tap_layers, lambda loss: loss.backward(), taps)
        plan.reduce_gradients(policy)
        loss, _ = draft_loss(draft, taps.chunks, passes, 0.8)
        loss.backward()
        plan.reduce_gradients(draft)
        if world > 1:
            dist.barrier()

    return measure(work)


def _sweep(rank: int, world: int, o: dict) -> list[dict]:
    """Every (workload, method, tokens) point of this CP size on this rank, smallest tokens first."""
    from spectrain.parallel.cp.plan import ContextParallelPlan
    from spectrain.parallel.mesh import build_mesh
    from spectrain.parallel.plan import LocalPlan

    tokens, passes = o["token_list"], o["ttt_passes"]
    rows = []

    def record(workload, method, t, point):
        rows.append({"workload": workload, "method": method, "cp": world, "tokens": t, **point})

    methods = ["ring", "dense"] if world == 1 else ["ring", "allgather"] if world == max(o["cp_list"]) else ["ring"]
    for method in methods:
        _ttt_point(method, tokens[0], passes, rank, world)  # warm-up
        for t in tokens:
            if method == "dense" and dense_bytes(t, passes) > o["dense_max_gib"] * 2**30:
                record("ttt", method, t, {"skipped": f"scores alone would take {dense_bytes(t, passes) / 2**30:.1f} "
                                                     f"GiB > dense_max_gib={o['dense_max_gib']}"})
                continue
            record("ttt", method, t, _ttt_point(method, t, passes, rank, world))
    policy, draft = _step_models()
    plan = LocalPlan() if world == 1 else ContextParallelPlan(build_mesh(1, 1, world))
    _step_point(policy, draft, plan, tokens[0], passes, world)  # warm-up
    for t in tokens:
        record("step", "ring", t, _step_point(policy, draft, plan, t, passes, world))
    return rows


# ------------------------------------------------------------------------------ processes
def spawn_sweep(world: int, o: dict) -> list[list[dict]]:
    """`_sweep` on `world` fresh processes (the memory method needs the malloc setting at start-up)."""
    saved = dict(os.environ)
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    try:
        return run_distributed(_sweep, world, o, timeout=o["timeout"])
    finally:
        os.environ.clear()
        os.environ.update(saved)


# ------------------------------------------------------------------------------ report
def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """One row per point: the max peak over ranks (and each rank's), the slowest rank's time."""
    rows = []
    for points in zip(*per_rank):
        row = dict(points[0])
        if "skipped" not in row:
            row["peak_mib_per_rank"] = [p["peak_mib"] for p in points]
            row["peak_mib"] = max(row["peak_mib_per_rank"])
            row["seconds"] = max(p["seconds"] for p in points)
        rows.append(row)
    return rows


def series(rows: list[dict], workload: str, key: str) -> dict:
    """`{label: (tokens, values)}`, ours first by CP, then the baselines (same colours in every panel)."""
    out = {}
    for r in sorted(rows, key=lambda r: (r["method"] != "ring", r["method"], r["cp"], r["tokens"])):
        if r["workload"] == workload and "skipped" not in r:
            label = f"{r['method']} cp={r['cp']}" if r["method"] != "dense" else "dense mask (cp=1)"
            xs, ys = out.setdefault(label, ([], []))
            xs.append(r["tokens"])
            ys.append(r[key])
    return out


def loglog_slope(xs: list[float], ys: list[float]) -> float:
    """Growth exponent between the two largest points (1: linear, 2: quadratic)."""
    return math.log(ys[-1] / ys[-2]) / math.log(xs[-1] / xs[-2])


def summarise(rows: list[dict], cps: list[int]) -> dict:
    find = {(r["workload"], r["method"], r["cp"], r["tokens"]): r for r in rows if "skipped" not in r}
    top = max(cps)
    out = {"ratios": {}, "slopes": {}}
    for workload in ("ttt", "step"):
        ratios = {t: find[workload, "ring", top, t]["peak_mib"] / find[workload, "ring", 1, t]["peak_mib"]
                  for (w, m, c, t) in find if w == workload and m == "ring" and c == top and (w, m, 1, t) in find}
        out["ratios"][workload] = ratios
        for label, (xs, ys) in series(rows, workload, "peak_mib").items():
            if len(xs) >= 2:
                out["slopes"][f"{workload}: {label}"] = loglog_slope(xs, ys)
    largest = max(out["ratios"]["step"])
    out["headline"] = {"cp": top, "tokens": largest, "step_ratio": out["ratios"]["step"][largest],
                       "ttt_ratio": out["ratios"]["ttt"][max(out["ratios"]["ttt"])], "target": TARGET_RATIO}
    out["headline"]["target_met"] = max(out["headline"]["step_ratio"], out["headline"]["ttt_ratio"]) <= TARGET_RATIO
    return out


def write_report(out_dir: Path, o: dict, rows: list[dict], summary: dict, label: str, seconds: float) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    opts = {k: v for k, v in o.items() if k not in ("token_list", "cp_list", "timeout")}
    (out_dir / "cp.json").write_text(json.dumps({"machine": label, "options": opts, "rows": rows,
                                                 "summary": summary, "seconds": seconds}, indent=2))
    panels = [("TTT attention: peak MiB per rank", series(rows, "ttt", "peak_mib")),
              ("training step: peak MiB per rank", series(rows, "step", "peak_mib")),
              ("TTT attention: seconds", series(rows, "ttt", "seconds")),
              ("training step: seconds", series(rows, "step", "seconds"))]
    plot_panels(out_dir / "cp.png", f"context parallel: activation memory and time vs tokens (K={o['ttt_passes']})",
                panels, xlabel="total tokens", logx=True, logy=True)

    def table(workload):
        methods = sorted({(r["method"], r["cp"]) for r in rows if r["workload"] == workload},
                         key=lambda mc: (mc[0] != "ring", mc))
        head = " | ".join(f"{m} cp={c}" for m, c in methods)
        lines = [f"| tokens | {head} |", "|---" * (len(methods) + 1) + "|"]
        for t in o["token_list"]:
            cells = []
            for m, c in methods:
                r = next(r for r in rows if (r["workload"], r["method"], r["cp"], r["tokens"]) == (workload, m, c, t))
                cells.append("skipped" if "skipped" in r else f"{r['peak_mib']:.1f} MiB / {r['seconds']:.2f} s")
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    docs = ", ".join(f"{t}: {len(d)} ({min(d)}..{max(d)})" for t in o["token_list"] for d in [doc_lengths(t)])
    h = summary["headline"]
    skipped = [f"{r['method']} at {r['tokens']} tokens ({r['skipped']})" for r in rows if "skipped" in r]
    ratio_lines = "\n".join(f"| {t} | {summary['ratios']['ttt'].get(t, float('nan')):.3f} | "
                            f"{summary['ratios']['step'].get(t, float('nan')):.3f} |" for t in o["token_list"])
    slope_lines = "\n".join(f"- {k}: **{v:.2f}**" for k, v in summary["slopes"].items())
    verdict = "met" if h["target_met"] else "**missed**"
    cli = " ".join(f"{k}={v}" for k, v in opts.items())
    (out_dir / "cp.md").write_text(f"""# Context parallel memory benchmark

`spectrain bench cp {cli}` on {label}; {seconds / 60:.1f} min.
Per-rank peak activation memory (MiB, max over ranks) / wall time (s) per point. Packed documents
per point (count, shortest..longest): {docs}.
Method and caveats: see the docstring of `benchmarks/cp.py` (fresh processes, mmap'd malloc,
peak-RSS reset after setup; at CP=4 four processes share two cores, so times there are not speed-ups).

## Draft TTT attention, forward + backward of K={o['ttt_passes']} passes

{table("ttt")}

## Training step (policy {POLICY['num_hidden_layers']} layers x {POLICY['hidden_size']} + draft, K={o['ttt_passes']})

{table("step")}

## Headline

CP={h['cp']} / CP=1 per-rank peak activation memory at equal tokens (target <= {TARGET_RATIO}: {verdict}):
**{h['step_ratio']:.3f}** for the training step and **{h['ttt_ratio']:.3f}** for the TTT attention at
{h['tokens']} tokens.

| tokens | TTT attention CP={h['cp']}/CP=1 | training step CP={h['cp']}/CP=1 |
|---|---|---|
{ratio_lines}

Growth of peak memory with tokens (log-log slope between the two largest points; 1 = linear, 2 = quadratic):
{slope_lines}

Skipped: {'; '.join(skipped) if skipped else 'none'}.

![cp](cp.png)
""")


def parse(args: list[str]) -> dict:
    """The options with their token and CP lists, checked before anything runs."""
    o = parse_options("cp", args, DEFAULTS)
    o["token_list"], o["cp_list"] = int_list("cp", "tokens", o["tokens"]), int_list("cp", "cp", o["cp"])
    if o["cp_list"][0] != 1:
        raise ConfigError(f"bench cp: cp={o['cp']} has no 1; the memory ratios compare every CP size with cp=1")
    return o


def main(args: list[str]) -> int:
    o = parse(args)
    started = time.perf_counter()
    rows = []
    for world in o["cp_list"]:
        print(f"[bench cp] cp={world}: {len(o['token_list'])} token sizes", flush=True)
        rows += merge_ranks(spawn_sweep(world, o))
    seconds = time.perf_counter() - started
    summary = summarise(rows, o["cp_list"])
    write_report(Path(o["out"]), o, rows, summary, machine_label(), seconds)
    h = summary["headline"]
    print(f"[bench cp] {seconds / 60:.1f} min; CP={h['cp']}/CP=1 peak memory at {h['tokens']} tokens: "
          f"step {h['step_ratio']:.3f}, TTT attention {h['ttt_ratio']:.3f} (target <= {TARGET_RATIO})")
    return 0
