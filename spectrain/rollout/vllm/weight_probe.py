"""Check that the engine serves the weights the trainer sent, without reading them back.

vLLM's CPU backend prepacks every linear layer's weight after loading (the parameter is left
empty), so a sync cannot be verified by comparing tensors. Instead each linear layer is
*probed*: inside the worker it is applied to a fixed pseudo-random input, and the output must
equal `x @ W.T + b` computed from the trainer's tensors. Every other parameter (norms,
embeddings, an un-prepacked head) is compared on a fixed sample of its entries plus its sum.
This catches a sync that did nothing, sent scaled weights, or sent only some tensors, and
also names vLLM silently ignored (a reload drops tensors it does not know).

Under tensor parallelism each rank holds shards, and each rank probes its own: the report names
the slice of the full tensor a shard is (`Shard`), and the trainer computes the same slice's product.
A column-parallel layer holds some output rows of each fused part (GQA's K and V heads replicated
when there are fewer than ranks); a row-parallel one holds some input columns and is applied to the
same columns of the probe input, before vLLM's all-reduce; a vocab embedding holds a range of rows.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

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
    if not count:
        return torch.zeros(1, dtype=torch.float64)
    index = torch.arange(count, device=flat.device) * flat.numel() // count  # integers: the same on every side
    return torch.cat([flat[index], flat.sum()[None]]).cpu()


@dataclass(frozen=True)
class Shard:
    """Which slice of the full tensor one tensor-parallel rank holds (a whole tensor: both None)."""
    rows: tuple[tuple[int, int], ...] | None = None  # per fused part, [start, end) of its output rows / vocab rows
    columns: tuple[int, int] | None = None  # [start, end) of the input features (a row-parallel layer)


def linear_shard(module) -> Shard:
    """The slice of the full layer a (vLLM) linear layer on this TP rank holds."""
    rank = getattr(module, "tp_rank", 0)
    per_rank = getattr(module, "input_size_per_partition", module.input_size)
    if per_rank != module.input_size:
        return Shard(columns=(rank * per_rank, (rank + 1) * per_rank))
    sizes = list(getattr(module, "output_partition_sizes", [module.output_size]))
    if sum(sizes) == module.output_size:
        return Shard()
    replicas = getattr(module, "num_kv_head_replicas", 1)  # QKV (q, k, v): K and V heads shared by this many ranks
    qkv = len(sizes) == 3 and hasattr(module, "num_kv_head_replicas")
    per_part = [1, replicas, replicas] if qkv else [1] * len(sizes)
    return Shard(rows=tuple(((rank // r) * n, (rank // r + 1) * n) for n, r in zip(sizes, per_part)))


Report = dict[str, tuple[str, torch.Tensor, Shard]]  # engine name -> (kind, probe output or sampled entries, shard)


def report_engine_weights(worker, which: str) -> tuple[Report, dict[str, list[str]]]:
    """Runs inside the vLLM worker (`collective_rpc`): probe outputs of the target or the drafter on this rank.

    Returns `{engine name: ("linear", output [rows, out], shard) | ("param", sampled entries, shard)}` and the
    model's fused-layer map (e.g. `qkv_proj -> [q_proj, k_proj, v_proj]`). A linear layer's output is its local
    product (with its bias), before any TP all-reduce or gather.
    """
    linear_base = compat.internal("vllm.model_executor.layers.linear", "LinearBase")
    model = compat.worker_model(worker, which)
    report: Report = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, linear_base):
                device = next((p.device for p in module.parameters()), torch.device("cpu"))
                shard = linear_shard(module)
                x = probe_input(name, module.input_size, module.params_dtype)
                if shard.columns is not None:
                    x = x[:, shard.columns[0]:shard.columns[1]]
                # the bias too (forward may leave it to the caller): the trainer adds the sent one
                out = module.quant_method.apply(module, x.contiguous().to(device), getattr(module, "bias", None))
                report[name] = ("linear", out.float().cpu(), shard)
                continue
            indices = getattr(module, "shard_indices", None)  # vocab embeddings: a row range, padded past it
            rows = (indices.org_vocab_start_index, indices.org_vocab_end_index) if indices is not None else None
            for param_name, param in module.named_parameters(recurse=False):
                if param.numel():  # a vocab shard may hold no real row (a tiny vocabulary): then its sum, 0
                    kept = param if rows is None else param[:rows[1] - rows[0]]
                    report[f"{name}.{param_name}" if name else param_name] = (
                        "param", sampled_entries(kept), Shard() if rows is None else Shard(rows=(rows,)))
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


def _rows(tensors: list[torch.Tensor], shard: Shard) -> list[torch.Tensor]:
    """Each fused part's rows that the shard holds (all of them for a whole tensor)."""
    if shard.rows is None:
        return tensors
    assert len(shard.rows) == len(tensors), (shard, [t.shape for t in tensors])
    return [t[a:b] for t, (a, b) in zip(tensors, shard.rows)]


def compare_report(report: Report, sent: dict[str, torch.Tensor], which: str,
                   rtol: float, packed: dict[str, list[str]]) -> ProbeResult:
    """Compare one rank's probe report with the tensors the trainer sent (full tensors, checkpoint names)."""
    used, mismatches, worst = set(), [], 0.0
    for engine_name, (kind, observed, shard) in sorted(report.items()):
        if kind == "linear":
            parts = _trainer_names(engine_name, which, packed)
            weights = [f"{p}.weight" for p in parts]
            if not any(w in sent for w in weights):
                continue  # a tensor the trainer does not own (e.g. the drafter's shared embedding)
            missing = [w for w in weights if w not in sent]
            if missing:
                mismatches.append(f"{engine_name}: fused from {weights}, but {missing} were not sent")
                continue
            if shard.rows is not None and len(shard.rows) != len(weights):
                mismatches.append(f"{engine_name}: the engine fuses {len(shard.rows)} parts, the trainer sent "
                                  f"{len(weights)} ({weights})")
                continue
            weight = torch.cat(_rows([sent[w] for w in weights], shard)).double()
            x = probe_input(engine_name, weight.shape[1], sent[weights[0]].dtype).double()
            if shard.columns is not None:
                (a, b), x = shard.columns, x[:, shard.columns[0]:shard.columns[1]]
                weight = weight[:, a:b]
            expected = x @ weight.T
            biases = [f"{p}.bias" for p in parts]
            if all(b in sent for b in biases):
                expected = expected + torch.cat(_rows([sent[b] for b in biases], shard)).double()
                used.update(biases)
            used.update(weights)
        else:
            names = _trainer_names(engine_name, which, {})
            if names[0] not in sent:
                continue
            expected = sampled_entries(_rows([sent[names[0]]], shard)[0])
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
