"""`spectrain bench memory`: the peak memory of one GRPO training step as the rollout grows, and the planner's estimate.

One step as `GRPOModule` runs it with `grpo.minibatches=1`: the policy forward and backward over the update's
micro-batches (`LocalPlan.policy_forward_backward` with the draft's taps and the teacher over the draft vocabulary,
each micro-batch's taps backpropagated at once through `DraftGradients`), the policy's clip and AdamW step, then
the draft's. The rollout is synthetic (random tokens, documents of `prompt` + `response` tokens) at `scales` x
`docs` documents, each run twice: "after", in micro-batches of `micro_batch_tokens`, and "before", the whole
minibatch in one forward (`micro_batch_tokens=None`), which is what the micro-batches are for.

CPU torch keeps no allocator statistics, so `LiveBytes` counts the bytes of the tensor storages the step
allocates while they live; its peak is the step's. Every point runs in a fresh process of its own (all side by
side), after a one-document warm-up step that creates the optimizers' state, so the weights and the moments are
live before the step and not counted; the process's `ru_maxrss` growth over the step is a coarse check.

Usage: `spectrain bench memory [scales=1,4,16] [docs=8] [prompt=64] [response=192] [hidden=256] [layers=4]
[vocab=8000] [draft_vocab=2000] [micro_batch_tokens=1024] [loss_kernel=chunked] [quick=false]
[out_dir=runs/bench_memory]`; writes memory.json, memory.md and memory.png under `out_dir`. `quick=true` shrinks
every size not given explicitly (for the tests).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import resource
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.common import int_list, parse_options
from spectrain.errors import ConfigError
from spectrain.machine import machine_label
from spectrain.parallel.spawn import run_distributed
from spectrain.plots import plot_panels

DEFAULTS = {"scales": "1,4,16", "docs": 8, "prompt": 64, "response": 192, "hidden": 256, "layers": 4,
            "vocab": 8000, "draft_vocab": 2000, "micro_batch_tokens": 1024, "loss_kernel": "chunked",
            "quick": "false", "out_dir": "runs/bench_memory"}
QUICK = {"scales": "1,4", "docs": 4, "prompt": 8, "response": 24, "hidden": 64, "layers": 4, "vocab": 512,
         "draft_vocab": 128, "micro_batch_tokens": 64}
MODES = ("before", "after")  # micro_batch_tokens None / the option
TTT_PASSES, PASS_DECAY, GRAD_CLIP, LR = 3, 0.8, 1.0, 1e-6
TARGET_ERROR, TARGET_RATIO = 0.15, 1.2
MIB = 1 << 20
MMAP_THRESHOLD = 1 << 16  # bytes: glibc maps every block above it on its own (`_fixed_mmap_threshold`)
POLICY, DRAFT, OPTIMIZERS = "policy forward/backward", "draft update", "optimizer steps"  # the step's phases


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensor storages allocated under this mode that are still alive, and their peak per phase of
    the step (`phase`, set by the step as it goes).

    Each op's outputs count once per storage (keyed by its data pointer), unless they share an input's storage
    (a view or an in-place result); a `weakref.finalize` on the storage takes its bytes off when it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.live, self.phase = 0, ""
        self.peaks: dict[str, int] = {}

    @property
    def peak(self) -> int:
        return max(self.peaks.values(), default=0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for tensor in _tensors(out):
            self._track(tensor.untyped_storage(), inputs)
        return out

    def _track(self, storage, inputs: set[int]) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in inputs or key in self.sizes:
            return
        self.sizes[key] = size
        self.live += size
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key)


# ------------------------------------------------------------------------------ the setup


def parse(args: list[str]) -> dict:
    """The options; `quick=true` swaps in the quick sizes, under any size given explicitly."""
    options = parse_options("memory", args, DEFAULTS)
    if options["quick"] not in ("true", "false"):
        raise ConfigError(f"bench memory: quick={options['quick']!r}: expected true or false")
    if options["quick"] == "true":
        options = parse_options("memory", args, {**DEFAULTS, **QUICK})
    options["scales"] = int_list("memory", "scales", options["scales"])
    return options


def step_config(o: dict, scale: int, micro_batch_tokens: int | None):
    """The recipe this step is a step of (tiny_cpu resized: float32, one process, one update, no KL) and the policy's
    architecture (the toy policy at `vocab`, not the character tokenizer's)."""
    from spectrain.config import load_config
    from spectrain.train.inputs import policy_architecture

    doc, heads = o["prompt"] + o["response"], max(1, o["hidden"] // 64)
    config = load_config("tiny_cpu", [
        f"toy.hidden_size={o['hidden']}", f"toy.intermediate_size={3 * o['hidden']}",
        f"toy.num_hidden_layers={o['layers']}", f"toy.num_attention_heads={heads}",
        f"toy.num_key_value_heads={max(1, heads // 2)}", f"toy.max_position_embeddings={doc}",
        "policy.dtype=float32", f"data.max_prompt_length={o['prompt']}", f"rollout.response_length={o['response']}",
        f"rollout.max_model_len={doc}", f"rollout.prompts_per_step={scale}", f"rollout.n={o['docs']}",
        "grpo.minibatches=1", "grpo.ppo_epochs=1", "grpo.kl_loss_coef=0",
        f"grpo.micro_batch_tokens={'null' if micro_batch_tokens is None else micro_batch_tokens}",
        f"draft.draft_vocab_size={o['draft_vocab']}", f"draft.ttt_passes={TTT_PASSES}",
        f"draft.loss_kernel={o['loss_kernel']}",
        "parallel.dp=1", "parallel.cp=1", "parallel.pp=1"])
    return config, dataclasses.replace(policy_architecture(config), vocab_size=o["vocab"])


def planner_estimate(config, policy) -> dict:
    """The planner's rows for what the step allocates, per phase: the policy backward's peak (its table) and the
    draft update's (`draft_update_bytes`, which the table adds only beyond the freed activations); its estimate of
    the step's peak is the larger. Left out: the weights and optimizer moments (live before the step), the engine
    and the CUDA reserve (no GPU here); of the draft's row (16 B a parameter: weights, gradients, moments) only
    its gradients, 4 B, come with the step."""
    from spectrain.train.memory_plan import FP32, GIB, draft_parameters, draft_update_bytes, plan_config

    plan = plan_config(config, 80 * GIB, policy)  # the GPU's size only sizes the engine's row, left out here
    x, draft_gradients = plan.inputs, FP32 * draft_parameters(plan.inputs.draft)
    held = {"gradients": plan.gradients, "draft_gradients": draft_gradients, "draft_inputs": plan.draft_inputs}
    phases = {POLICY: {**held, "activations": plan.activations, "logits": plan.logits},
              DRAFT: {**held, "draft_activations": draft_update_bytes(x.draft, x.precision, x.tokens, x.ttt_passes)}}
    totals = {phase: sum(rows.values()) for phase, rows in phases.items()}
    table = plan.training - plan.parameters - plan.optimizer - (plan.draft - draft_gradients) - plan.reserved
    assert max(totals.values()) == table, (totals, table)  # the same rows as `spectrain plan` adds up
    return {"phases": phases, "phase_totals": totals, "total": table, "micro_batch_tokens": x.tokens}


def synthetic_rollout(documents: int, o: dict, seed: int = 1):
    """`documents` completions of random tokens (`prompt` + `response` each), random advantages and engine logprobs."""
    from spectrain.batch import build_rollout_batch
    from spectrain.rollout.engine import Completion

    g = torch.Generator().manual_seed(seed)
    completions = []
    for i in range(documents):
        ids = torch.randint(4, o["vocab"], (o["prompt"] + o["response"],), generator=g).tolist()
        logprobs = (-3 * torch.rand(o["response"], generator=g) - 0.05).tolist()
        completions.append(Completion(i, ids[:o["prompt"]], ids[o["prompt"]:], logprobs, False))
    return build_rollout_batch(completions, torch.randn(documents, generator=g))


# ------------------------------------------------------------------------------ the step


def grpo_step(policy, draft, policy_opt, draft_opt, batch, micro_batch_tokens: int | None, loss_kernel: str,
              phase=lambda name: None) -> int:
    """One GRPO step's training as `GRPOModule.policy_update` and `DraftCoTraining` run it, naming each `phase` as
    it enters it; its micro-batch count."""
    from spectrain.batch import micro_batches
    from spectrain.parallel.plan import LocalPlan, ttt_valid_tokens
    from spectrain.train.draft_update import DraftGradients
    from spectrain.train.grpo import grpo_loss

    phase(POLICY)
    plan, num_tokens, valid = LocalPlan(), batch.num_response_tokens, ttt_valid_tokens(batch)
    grads = DraftGradients(draft, draft_opt, ttt_passes=TTT_PASSES, pass_decay=PASS_DECAY, loss_kernel=loss_kernel)

    def loss_fn(logprobs, part):
        out = grpo_loss(logprobs, part.rollout_logprobs, part.advantages, part.response_mask, 0.2,
                        num_tokens=num_tokens)
        return out.loss, logprobs

    def on_taps(taps) -> None:
        phase(DRAFT)
        grads.add(dataclasses.replace(taps, num_valid_tokens=valid))
        phase(POLICY)

    policy_opt.zero_grad(set_to_none=True)
    plan.policy_forward_backward(policy, batch, loss_fn, tuple(draft.cfg.tap_layers), torch.Tensor.backward, on_taps,
                                 micro_batch_tokens, draft.t2d)
    phase(OPTIMIZERS)
    plan.clip_grad_norm(policy, GRAD_CLIP)
    policy_opt.step()
    grads.finish(GRAD_CLIP)
    return len(micro_batches(batch, micro_batch_tokens))


@contextmanager
def _fixed_mmap_threshold():
    """For the workers started inside: a fixed glibc mmap threshold, so that the RSS check measures the step, not
    the C allocator's caching (by default glibc raises the threshold after the first large frees and then keeps
    freed blocks of up to 32 MiB in heaps it does not return). glibc reads it once, at a process's start."""
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    try:
        yield
    finally:
        if old is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _measure(rank: int, world: int, o: dict) -> dict:
    """One point, (scale, mode) by `rank`, in this fresh process: build, warm up on one document, measure one step."""
    from spectrain.models.eagle3 import Eagle3Draft
    from spectrain.models.llama import LlamaForCausalLM
    from spectrain.train.draft_update import draft_optimizer
    from spectrain.train.inputs import policy_attention_ops
    from spectrain.train.memory_plan import draft_architecture

    scale, mode = o["scales"][rank // len(MODES)], MODES[rank % len(MODES)]
    micro_batch_tokens = o["micro_batch_tokens"] if mode == "after" else None
    config, policy_cfg = step_config(o, scale, micro_batch_tokens)
    torch.manual_seed(0)
    policy = LlamaForCausalLM(policy_cfg)
    policy.attention_ops = policy_attention_ops(config)
    draft = Eagle3Draft(draft_architecture(config, policy_cfg))
    policy_opt, draft_opt = torch.optim.AdamW(policy.parameters(), lr=LR), draft_optimizer(draft, LR)
    batch, kernel = synthetic_rollout(o["docs"] * scale, o), config.draft.loss_kernel
    grpo_step(policy, draft, policy_opt, draft_opt, synthetic_rollout(1, o, seed=2), micro_batch_tokens, kernel)
    gc.collect()
    rss_before = _max_rss_bytes()
    with LiveBytes() as live:
        micro_count = grpo_step(policy, draft, policy_opt, draft_opt, batch, micro_batch_tokens, kernel,
                                lambda name: setattr(live, "phase", name))
    return {"scale": scale, "mode": mode, "documents": batch.num_docs, "tokens": int(batch.input_ids.numel()),
            "micro_batch_tokens": micro_batch_tokens, "micro_batches": micro_count, "peak_bytes": live.peak,
            "phase_peaks": live.peaks, "rss_growth_bytes": _max_rss_bytes() - rss_before,
            "planner": planner_estimate(config, policy_cfg)}


# ------------------------------------------------------------------------------ the report


def _point(points: list[dict], scale: int, mode: str) -> dict:
    return next(p for p in points if p["scale"] == scale and p["mode"] == mode)


def headline(points: list[dict], scales: list[int]) -> dict:
    """Peak growth from the smallest to the largest rollout, per mode, and the planner's error at the largest."""
    small, large = scales[0], scales[-1]
    ratio = {m: _point(points, large, m)["peak_bytes"] / _point(points, small, m)["peak_bytes"] for m in MODES}
    after = _point(points, large, "after")
    signed = (after["planner"]["total"] - after["peak_bytes"]) / after["peak_bytes"]
    error = abs(signed)
    return {"peak_ratio_16x_over_1x": ratio["after"], "peak_ratio_16x_over_1x_before": ratio["before"],
            "planner_relative_error": error, "planner_signed_error": signed, "scales_compared": [small, large],
            "target_peak_ratio": TARGET_RATIO, "target_planner_error": TARGET_ERROR,
            "peak_ratio_target_met": ratio["after"] <= TARGET_RATIO, "planner_target_met": error <= TARGET_ERROR}


def settings(o: dict) -> dict:
    """The models the step trains: parameter counts and the architecture (what the planner reads)."""
    from spectrain.train.memory_plan import draft_architecture, draft_parameters, policy_parameters

    config, policy = step_config(o, 1, o["micro_batch_tokens"])
    draft = draft_architecture(config, policy)
    return {"policy": dataclasses.asdict(policy), "policy_parameters": policy_parameters(policy),
            "draft_parameters": draft_parameters(draft), "draft_vocab_size": draft.draft_vocab_size,
            "tap_layers": list(draft.tap_layers), "ttt_passes": TTT_PASSES, "dtype": "float32",
            "draft_loss_kernel": config.draft.loss_kernel, "grpo_minibatches": 1, "torch_threads_per_process": 1}


def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def plot(path: Path, points: list[dict], scales: list[int]) -> None:
    def series(mode: str, key) -> tuple[list[int], list[float]]:
        return scales, [key(_point(points, s, mode)) / MIB for s in scales]

    measured = {f"measured, {m}": series(m, lambda p: p["peak_bytes"]) for m in MODES}
    planned = {f"planner, {m}": series(m, lambda p: p["planner"]["total"]) for m in MODES}
    rss = {f"ru_maxrss growth, {m}": series(m, lambda p: p["rss_growth_bytes"]) for m in MODES}
    plot_panels(path, "peak memory of one GRPO step (policy + draft) vs rollout size",
                [("tensors allocated by the step, peak (MiB)", {**measured, **planned}),
                 ("RSS high-water growth over the step (MiB)", rss)],
                xlabel="rollout size (x base documents)", logx=True, logy=True)


def _phase_table(point: dict) -> str:
    """Measured peak per phase beside the planner's rows for it, at one point."""
    planner = point["planner"]
    rows = []
    for phase in (POLICY, DRAFT, OPTIMIZERS):
        parts = planner["phases"].get(phase)
        planned = (f"{_mib(planner['phase_totals'][phase])} = " + " + ".join(
            f"{name.replace('_', ' ')} {_mib(v)}" for name, v in parts.items())) if parts else "not planned"
        rows.append(f"| {phase} | {_mib(point['phase_peaks'].get(phase, 0))} | {planned} |")
    return "\n".join(rows)


# the header row of the report's Markdown table, too long for one source line
ROLLOUT_TABLE_HEADER = ("| rollout | documents | tokens | micro-batches (after) | peak before (MiB) | "
                        "peak after (MiB) | RSS growth before / after (MiB) | planner before / after (MiB) |")


def markdown(o: dict, points: list[dict], h: dict, s: dict, label: str, command: str) -> str:
    rows = []
    for scale in o["scales"]:
        b, a = _point(points, scale, "before"), _point(points, scale, "after")
        rows.append(f"| {scale}x | {a['documents']} | {a['tokens']} | {a['micro_batches']} | {_mib(b['peak_bytes'])} | "
                    f"{_mib(a['peak_bytes'])} | {_mib(b['rss_growth_bytes'])} / {_mib(a['rss_growth_bytes'])} | "
                    f"{_mib(b['planner']['total'])} / {_mib(a['planner']['total'])} |")
    small, large = h["scales_compared"]
    pct = lambda x: f"{100 * x:+.1f}%"  # noqa: E731
    verdict = lambda met: "met" if met else "**missed**"  # noqa: E731
    return f"""# Peak memory of one GRPO step vs rollout size

`{command}` on {label}.

One GRPO step's training on CPU in float32, as `GRPOModule` runs it with `grpo.minibatches=1`: the policy
forward and backward over the update's micro-batches with the draft's taps (the teacher over the draft
vocabulary), each micro-batch's taps backpropagated through the draft at once (`DraftGradients`), the policy's
clip and AdamW step, then the draft's.

- policy: the toy Llama, hidden {o['hidden']}, {o['layers']} layers, vocabulary {o['vocab']}: \
{s['policy_parameters'] / 1e6:.2f}M parameters;
- draft: EAGLE-3 over layers {s['tap_layers']}, draft vocabulary {o['draft_vocab']}: \
{s['draft_parameters'] / 1e6:.2f}M parameters, {TTT_PASSES} TTT passes, loss kernel `{s['draft_loss_kernel']}`;
- rollout: random tokens, {o['docs']} documents of {o['prompt']} + {o['response']} tokens at 1x;
- "after": `grpo.micro_batch_tokens={o['micro_batch_tokens']}`; "before": the whole minibatch in one forward.

The sizes make activations, logits and the draft's inputs the bulk of the step while the whole benchmark takes
a minute or two on 2 cores.

{ROLLOUT_TABLE_HEADER}
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Headlines:

- peak "after" at {large}x / at {small}x: **{h['peak_ratio_16x_over_1x']:.3f}** (target <= {TARGET_RATIO}: \
{verdict(h['peak_ratio_target_met'])}); "before", without micro-batches: {h['peak_ratio_16x_over_1x_before']:.2f};
- planner vs measured peak, "after" at {large}x: **{pct(h['planner_signed_error'])}** (|error| target <= \
{100 * TARGET_ERROR:.0f}%: {verdict(h['planner_target_met'])}; + is an overestimate).

## How to read them

"peak" is the largest sum of the bytes of the tensor storages the step allocated that were alive at once
(`LiveBytes`, a `TorchDispatchMode`: CPU torch keeps no allocator statistics). It leaves out what was live before
the step: the weights, both optimizers' moments (a one-document warm-up step created them) and the batch. "RSS
growth" is the process's `ru_maxrss` after the step minus before it, a coarse check: the high-water mark before
the step already holds the imports and the warm-up, so it reads low by what those left resident, and high by the
C allocator's slack (the workers run with `MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}`, so glibc returns every large
block when it is freed instead of caching it). Every point runs in a fresh process of its own, all side by side.

The planner (`spectrain plan`, spectrain/train/memory_plan.py) plans a GPU that also hosts vLLM; only its
training rows apply here, and of those only what the step allocates: the policy's gradients, the draft's
gradients (4 B of the draft row's 16 B a parameter), the draft's taps and teacher, and either the policy
backward's activations and logits chunk or the draft update's activations, whichever is larger (its table adds
the draft update only beyond the freed activations; the sum of the rows is checked against its table). Left out:
the weights and optimizer moments (live before the step), the engine and the CUDA reserve. The draft's loss runs
`{s['draft_loss_kernel']}`: the planner models the fused losses (`chunked`, and `triton`, what `auto` picks on a
GPU), which never hold whole probabilities; `auto` on CPU picks the dense `torch` loss, which keeps
[tokens x draft vocabulary] probabilities per pass (`loss_kernel=torch` shows it).

Per phase of the step, "after" at {large}x (MiB):

| phase | measured peak | planner |
|---|---|---|
{_phase_table(_point(points, large, "after"))}

Where the two differ: the planner sums its rows at one moment, the start of a micro-batch's backward: the whole
activations, one decoder layer of gradients in flight, and the logits chunk only beyond that layer (the chunk lives
in the lm_head's backward, which runs and frees it before any layer's). Its draft phase counts the draft's
activations but not its loss's own logits chunk and lm_head gradient. Neither row counts the optimizer steps'
temporaries (they come after the backward freed more).

![memory](memory.png)
"""


def write_report(o: dict, points: list[dict], h: dict, label: str, command: str) -> None:
    out = Path(o["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    s = settings(o)
    (out / "memory.json").write_text(json.dumps({"command": command, "machine": label, "options": o, "settings": s,
                                                 "headline": h, "points": points}, indent=1))
    plot(out / "memory.png", points, o["scales"])
    (out / "memory.md").write_text(markdown(o, points, h, s, label, command))


def main(args: list[str]) -> int:
    o = parse(args)
    try:  # a size the recipe refuses fails here, before any process starts
        step_config(o, o["scales"][-1], o["micro_batch_tokens"])
    except ConfigError as exc:
        raise ConfigError(f"bench memory: {exc} (the benchmark sets these keys from its options: "
                          f"{', '.join(DEFAULTS)})") from None
    started = time.perf_counter()
    print(f"[bench memory] scales {o['scales']} x {o['docs']} documents, before and after: "
          f"{len(o['scales']) * len(MODES)} processes side by side")
    with _fixed_mmap_threshold():
        points = run_distributed(_measure, len(o["scales"]) * len(MODES), o, timeout=900.0)
    h = headline(points, o["scales"])
    label = f"{machine_label()} (workers: 1 torch thread each); {time.perf_counter() - started:.0f} s"
    write_report(o, points, h, label, " ".join(["spectrain bench memory", *args]))
    print(json.dumps(h, indent=2))
    return 0
