"""The packed rollout batch: a plain data type below the parallel layouts and the training step.

Documents are prompt + completion, packed back to back (`cu_seqlens`); `parallel/` shards and
microbatches it, `train/` computes the GRPO and draft losses on it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from spectrain.models.llama import pack_sequences


@dataclass
class RolloutBatch:
    """A packed batch; position `t` predicts token `t + 1` of its own document.

    `response_mask[t]` is 1 where the predicted token is a sampled (response) token, so
    prompts never carry loss. `targets[t]` is -1 at the last token of each document.
    """

    input_ids: torch.Tensor  # [T]
    position_ids: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [N + 1]
    targets: torch.Tensor  # [T]
    response_mask: torch.Tensor  # [T] bool
    advantages: torch.Tensor  # [T] float32, the document's advantage on every token
    rollout_logprobs: torch.Tensor  # [T] float32, the engine's logprob of targets (0 off-response)
    # [T] float32, on every token its document's response token count (the seq-mean `grpo.loss_agg_mode`s weigh
    # tokens by it); None: counted from `cu_seqlens` and `response_mask`, so it must be passed for a CP shard
    response_lengths: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.response_lengths is None:
            self.response_lengths = document_response_lengths(self.cu_seqlens, self.response_mask)

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    def to(self, device: torch.device) -> "RolloutBatch":
        """The batch on `device` (the engine hands back CPU lists; the policy may train on a GPU)."""
        return RolloutBatch(*(getattr(self, f.name).to(device) for f in fields(self)))

    def select(self, doc_indices: list[int]) -> "RolloutBatch":
        """The sub-batch of the given documents (microbatching, dp sharding)."""
        starts, ends = self.cu_seqlens[:-1].tolist(), self.cu_seqlens[1:].tolist()
        rows = torch.cat([torch.arange(starts[i], ends[i]) for i in doc_indices])
        lengths = torch.tensor([ends[i] - starts[i] for i in doc_indices])
        cu = torch.zeros(len(doc_indices) + 1, dtype=self.cu_seqlens.dtype)
        cu[1:] = torch.cumsum(lengths, 0)
        assert self.response_lengths is not None  # __post_init__ fills it in
        return RolloutBatch(self.input_ids[rows], self.position_ids[rows], cu, self.targets[rows],
                            self.response_mask[rows], self.advantages[rows], self.rollout_logprobs[rows],
                            self.response_lengths[rows])


def document_response_lengths(cu_seqlens: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[T] float32: on each token, the number of response tokens of its document (whole documents only)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    counts = torch.zeros(lengths.numel(), dtype=torch.float32, device=response_mask.device)
    counts.index_add_(0, doc.to(response_mask.device), response_mask.to(torch.float32))
    return counts[doc.to(response_mask.device)]


def pack_documents(lengths: Sequence[int], max_tokens: int | None) -> list[list[int]]:
    """Document indices, in order, packed greedily into contiguous groups of at most `max_tokens` tokens.

    Documents are never split: one longer than the budget is a group of its own. None is one
    group (the whole batch in one forward). Order is kept, so the groups back to back are the batch.
    """
    if max_tokens is None:
        return [list(range(len(lengths)))] if len(lengths) else []
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if not groups or used + n > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def micro_batches(batch: RolloutBatch, max_tokens: int | None) -> list[RolloutBatch]:
    """`batch` cut into micro-batches of at most `max_tokens` tokens (`pack_documents`); the batch itself when it
    fits (no copy)."""
    groups = pack_documents((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist(), max_tokens)
    return [batch] if len(groups) == 1 else [batch.select(g) for g in groups]


def concat_batches(parts: list[RolloutBatch], like: RolloutBatch) -> RolloutBatch:
    """Micro-batches back to back, in order (`like`, emptied, when there are none; the one part itself)."""
    names = [f.name for f in fields(RolloutBatch) if f.name != "cu_seqlens"]
    if not parts:
        return RolloutBatch(cu_seqlens=like.cu_seqlens[:1], **{n: getattr(like, n)[:0] for n in names})
    if len(parts) == 1:
        return parts[0]
    cu, offset = [parts[0].cu_seqlens[:1]], 0
    for p in parts:
        cu.append(p.cu_seqlens[1:] + offset)
        offset += p.input_ids.numel()
    return RolloutBatch(cu_seqlens=torch.cat(cu), **{n: torch.cat([getattr(p, n) for p in parts]) for n in names})


def build_rollout_batch(completions: Sequence, advantages: torch.Tensor) -> RolloutBatch:
    """Pack completions (anything with `prompt_ids`, `token_ids` and `logprobs`, e.g. the rollout
    engine's `Completion`) with one advantage each."""
    assert advantages.shape == (len(completions),), (
        f"one advantage per completion: {tuple(advantages.shape)} vs {len(completions)}")
    seqs = [c.prompt_ids + c.token_ids for c in completions]
    input_ids, position_ids, cu = pack_sequences(seqs)
    total = input_ids.numel()
    targets = torch.full((total,), -1, dtype=torch.long)
    mask = torch.zeros(total, dtype=torch.bool)
    adv = torch.zeros(total, dtype=torch.float32)
    old = torch.zeros(total, dtype=torch.float32)
    for i, c in enumerate(completions):
        start, end = int(cu[i]), int(cu[i + 1])
        targets[start:end - 1] = input_ids[start + 1:end]
        first = start + len(c.prompt_ids) - 1  # position predicting the first response token
        mask[first:end - 1] = True
        adv[start:end] = float(advantages[i])
        if c.logprobs:
            old[first:first + len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
    return RolloutBatch(input_ids, position_ids, cu, targets, mask, adv, old)
