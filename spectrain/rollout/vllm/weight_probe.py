"""Check that the engine serves the weights the trainer sent, without reading them back.

vLLM's CPU backend prepacks every linear layer's weight after loading (the parameter is left
empty), so a sync cannot be verified by comparing tensors. Instead each linear layer is
*probed*: inside the worker it is applied to a fixed pseudo-random input, and the output must
equal `x @ W.T + b` computed from the trainer's tensors. Every other parameter (norms,
embeddings, an un-prepacked head) is compared on a fixed sample of its entries plus its sum.
This catches a sync that did nothing, sent scaled weights, or sent only some tensors, and
also names vLLM silently ignored (a reload drops tensors it does not know).
"""
from __future__ import annotations

import zlib

import torch

from spectrain.rollout.engine import ProbeResult
from spectrain.rollout.vllm import compat

PROBE_ROWS = 2
SAMPLED_ENTRIES = 4096
# vLLM's EAGLE-3 drafter names -> the checkpoint names the trainer sends
_DRAFTER_PREFIXES = (("model.layers.0.", "midlayer."), ("model.fc", "fc"), ("model.norm", "norm"),
                     ("draft_id_to_target_id", "d2t"))


def probe_input(name: str, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The fixed input of layer `name`: the same in the worker and in the trainer."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(PROBE_ROWS, in_features, generator=generator).to(dtype)


def sampled_entries(t: torch.Tensor) -> torch.Tensor:
    """A fixed sample of a tensor's entries and its sum, in float64 (cheap to ship for any size)."""
    flat = t.detach().reshape(-1).double()
    count = min(flat.numel(), SAMPLED_ENTRIES)
    index = torch.arange(count, device=flat.device) * flat.numel() // count  # integers: the same on every side
    return torch.cat([flat[index], flat.sum()[None]]).cpu()


def report_engine_weights(worker, which: str) -> tuple[dict[str, tuple[str, torch.Tensor]], dict[str, list[str]]]:
    """Runs inside the vLLM worker (`collective_rpc`): probe outputs of the target or the drafter.

    Returns `{engine name: ("linear", output [rows, out]) | ("param", sampled entries)}` and the
    model's fused-layer map (e.g. `qkv_proj -> [q_proj, k_proj, v_proj]`).
    """
    linear_base = compat.internal("vllm.model_executor.layers.linear", "LinearBase")
    model = compat.worker_model(worker, which)
    report: dict[str, tuple[str, torch.Tensor]] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, linear_base):
                device = next((p.device for p in module.parameters()), torch.device("cpu"))
                out = module(probe_input(name, module.input_size, module.params_dtype).to(device))
                report[name] = ("linear", (out[0] if isinstance(out, tuple) else out).float().cpu())
                continue
            rows = getattr(module, "org_vocab_size", None)  # vocab embeddings are padded past the real vocab
            for param_name, param in module.named_parameters(recurse=False):
                if param.numel():
                    report[f"{name}.{param_name}" if name else param_name] = ("param", sampled_entries(param[:rows]))
    return report, dict(getattr(model, "packed_modules_mapping", {}))


def _trainer_names(engine_name: str, which: str, packed: dict[str, list[str]]) -> list[str]:
    """The checkpoint names whose tensors make up one engine tensor (fused layers: several, in order)."""
    name = engine_name
    if which == "draft":
        for theirs, ours in _DRAFTER_PREFIXES:
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                break
    for fused, parts in packed.items():
        if f".{fused}" in name or name.startswith(fused):
            return [name.replace(fused, part) for part in parts]
    return [name]


def compare_report(report: dict[str, tuple[str, torch.Tensor]], sent: dict[str, torch.Tensor], which: str,
                   rtol: float, packed: dict[str, list[str]]) -> ProbeResult:
    """Compare the engine's probe report with the tensors the trainer sent (checkpoint names)."""
    used, mismatches, worst = set(), [], 0.0
    for engine_name, (kind, observed) in sorted(report.items()):
        if kind == "linear":
            parts = _trainer_names(engine_name, which, packed)
            weights = [f"{p}.weight" for p in parts]
            if not any(w in sent for w in weights):
                continue  # a tensor the trainer does not own (e.g. the drafter's shared embedding)
            missing = [w for w in weights if w not in sent]
            if missing:
                mismatches.append(f"{engine_name}: fused from {weights}, but {missing} were not sent")
                continue
            weight = torch.cat([sent[w] for w in weights]).double()
            x = probe_input(engine_name, weight.shape[1], sent[weights[0]].dtype).double()
            expected = x @ weight.T
            biases = [f"{p}.bias" for p in parts]
            if all(b in sent for b in biases):
                expected = expected + torch.cat([sent[b] for b in biases]).double()
                used.update(biases)
            used.update(weights)
        else:
            names = _trainer_names(engine_name, which, {})
            if names[0] not in sent:
                continue
            expected = sampled_entries(sent[names[0]])
            used.add(names[0])
        if observed.shape != expected.shape:
            mismatches.append(f"{engine_name}: the engine holds shape {tuple(observed.shape)}, the trainer "
                              f"{tuple(expected.shape)}")
            continue
        error = float((observed.double() - expected).norm() / expected.norm().clamp_min(1e-12))
        worst = max(worst, error)
        if not error <= rtol:  # NaN fails too
            mismatches.append(f"{engine_name}: relative error {error:.2e} > {rtol:.0e}")
    mismatches += [f"{name}: sent, but the engine has no such tensor (vLLM ignored it)"
                   for name in sorted(set(sent) - used)]
    return ProbeResult(worst, mismatches)
