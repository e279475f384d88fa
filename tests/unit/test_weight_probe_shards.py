"""The weight probe under tensor parallelism: each rank's shard slice and the trainer's product of the same slice.

The shards here are cut by hand from full tensors, the way vLLM's loaders cut them (QKV: each rank's query heads
and its K/V heads, shared by `tp // kv_heads` ranks when there are fewer K/V heads than ranks; row-parallel: a
range of input features), and probed as a vLLM worker would: the shard applied to the probe input's slice. The
real engine's shards are probed in tests/distributed/test_engines.py (TP=2 over two ranks).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spectrain.rollout.vllm.weight_probe import Shard, compare_report, linear_shard, probe_input

HIDDEN, HEAD = 16, 4
QKV = "model.layers.0.self_attn.qkv_proj"
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


def _full(heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.layers.0.self_attn.q_proj.weight": torch.randn(heads * HEAD, HIDDEN, generator=g),
            "model.layers.0.self_attn.k_proj.weight": torch.randn(kv_heads * HEAD, HIDDEN, generator=g),
            "model.layers.0.self_attn.v_proj.weight": torch.randn(kv_heads * HEAD, HIDDEN, generator=g),
            "model.layers.0.self_attn.o_proj.weight": torch.randn(HIDDEN, heads * HEAD, generator=g)}


def _qkv_module(rank: int, tp: int, heads: int, kv_heads: int):
    """What a vLLM QKVParallelLinear on `rank` says about itself."""
    replicas = max(1, tp // kv_heads)
    kv_per_rank = max(1, kv_heads // tp)
    return SimpleNamespace(tp_rank=rank, input_size=HIDDEN, input_size_per_partition=HIDDEN,
                           output_size=(heads + 2 * kv_heads) * HEAD, num_kv_head_replicas=replicas,
                           output_partition_sizes=[heads // tp * HEAD, kv_per_rank * HEAD, kv_per_rank * HEAD])


def _qkv_shard_by_heads(full: dict, rank: int, tp: int, heads: int, kv_heads: int) -> torch.Tensor:
    """The rank's fused QKV rows, cut by head index (an independent construction of vLLM's layout)."""
    q_heads = range(rank * heads // tp, (rank + 1) * heads // tp)
    kv = [rank * kv_heads // tp] if kv_heads < tp else range(rank * kv_heads // tp, (rank + 1) * kv_heads // tp)
    rows = lambda w, hs: torch.cat([w[h * HEAD:(h + 1) * HEAD] for h in hs])  # noqa: E731
    return torch.cat([rows(full["model.layers.0.self_attn.q_proj.weight"], q_heads),
                      rows(full["model.layers.0.self_attn.k_proj.weight"], kv),
                      rows(full["model.layers.0.self_attn.v_proj.weight"], kv)])


@pytest.mark.parametrize("tp,heads,kv_heads", [(1, 4, 2), (2, 4, 2), (4, 8, 2), (4, 4, 1)])
def test_every_rank_of_a_gqa_qkv_layer_passes_and_a_wrong_shard_fails(tp, heads, kv_heads):
    full = _full(heads, kv_heads)
    reports = []
    for rank in range(tp):
        shard = linear_shard(_qkv_module(rank, tp, heads, kv_heads))
        weight = _qkv_shard_by_heads(full, rank, tp, heads, kv_heads)
        out = probe_input(QKV, HIDDEN, torch.float32) @ weight.T
        reports.append({QKV: ("linear", out, shard)})
    sent = {k: v for k, v in full.items() if "o_proj" not in k}
    for report in reports:
        assert compare_report(report, sent, "policy", 1e-5, PACKED).mismatches == []
    if tp > 1:  # rank 0's output on the last rank: its K/V or query heads are not that rank's
        (_, out0, _), (_, _, last) = reports[0][QKV], reports[-1][QKV]
        found = compare_report({QKV: ("linear", out0, last)}, sent, "policy", 1e-5, PACKED).mismatches
        assert found and found[0].startswith(f"{QKV}: relative error"), found


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_row_parallel_shard_is_probed_on_its_input_columns(tp):
    name, full = "model.layers.0.self_attn.o_proj", _full(4, 2)
    weight = full[f"{name}.weight"]
    for rank in range(tp):
        width = weight.shape[1] // tp
        module = SimpleNamespace(tp_rank=rank, input_size=weight.shape[1], input_size_per_partition=width,
                                 output_size=HIDDEN, output_partition_sizes=[HIDDEN])
        shard = linear_shard(module)
        assert shard == (Shard() if tp == 1 else Shard(columns=(rank * width, (rank + 1) * width)))
        x = probe_input(name, weight.shape[1], torch.float32)[:, rank * width:(rank + 1) * width]
        out = x @ weight[:, rank * width:(rank + 1) * width].T  # the partial sum before vLLM's all-reduce
        sent = {f"{name}.weight": weight}
        assert compare_report({name: ("linear", out, shard)}, sent, "policy", 1e-5, {}).mismatches == []
        doubled = {f"{name}.weight": weight * torch.where(torch.arange(weight.shape[1]) // width == rank, 2.0, 1.0)}
        assert compare_report({name: ("linear", out, shard)}, doubled, "policy", 1e-5, {}).mismatches


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_of_a_merged_gate_up_layer_holds_its_rows_of_each_part(tp):
    name, inner = "model.layers.0.mlp.gate_up_proj", 8
    g = torch.Generator().manual_seed(1)
    parts = [f"model.layers.0.mlp.{part}.weight" for part in ("gate_proj", "up_proj")]
    sent = {part: torch.randn(inner, HIDDEN, generator=g) for part in parts}
    x = probe_input(name, HIDDEN, torch.float32)
    for rank in range(tp):
        module = SimpleNamespace(tp_rank=rank, input_size=HIDDEN, input_size_per_partition=HIDDEN,
                                 output_size=2 * inner, output_partition_sizes=[inner // tp, inner // tp])
        rows = slice(rank * inner // tp, (rank + 1) * inner // tp)
        weight = torch.cat([sent[part][rows] for part in parts])
        report = {name: ("linear", x @ weight.T, linear_shard(module))}
        assert compare_report(report, sent, "policy", 1e-5, {"gate_up_proj": ["gate_proj", "up_proj"]}).mismatches == []


def test_a_vocab_shard_is_compared_on_its_own_rows():
    from spectrain.rollout.vllm.weight_probe import sampled_entries

    embed = torch.randn(10, 4)
    rows = Shard(rows=((5, 10),))
    report = {"model.embed_tokens.weight": ("param", sampled_entries(embed[5:10]), rows)}
    assert compare_report(report, {"model.embed_tokens.weight": embed}, "policy", 1e-6, {}).mismatches == []
    wrong = {"model.embed_tokens.weight": ("param", sampled_entries(embed[0:5]), rows)}
    assert compare_report(wrong, {"model.embed_tokens.weight": embed}, "policy", 1e-6, {}).mismatches
    # a rank whose padded shard holds no real row of a tiny vocabulary (vLLM pads each shard to 64 rows)
    empty = {"model.embed_tokens.weight": ("param", sampled_entries(embed[10:10]), Shard(rows=((10, 10),)))}
    assert compare_report(empty, {"model.embed_tokens.weight": embed}, "policy", 1e-6, {}).mismatches == []
