"""The EAGLE-3 draft vocabulary: the most frequent target tokens of the training data.

A draft head over the whole vocabulary of a modern model (151,936 rows for Qwen3) is most of
the draft's parameters and compute; the ecosystem (EAGLE-3, SpecForge, vLLM) keeps the
`draft_vocab_size` most frequent target ids and maps them with `d2t` / `t2d`. Tokens outside
it are never proposed, so they only cost acceptance where the policy emits them, which the
frequency ranking makes rare. It lives with the data (below the models) so that asset writers
can build a mapping without importing the draft.
"""
from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import torch

VOCAB_SAMPLE = 4096  # synthetic-task examples counted for the draft vocabulary (a file source counts every row)


def build_vocab_mapping(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d2t int64 [Vd], t2d bool [V])` for the `Vd` most frequent target tokens.

    The kept ids are sorted so draft id order is target id order (`logits[:, t2d]` is then
    in draft order); ties go to the lower id. `d2t[i] = used[i] - i`, vLLM's offset form.
    """
    assert token_counts.dim() == 1, token_counts.shape
    vocab = token_counts.shape[0]
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in 1..{vocab}")
    order = torch.sort(token_counts.cpu().double(), descending=True, stable=True).indices
    used = order[:draft_vocab_size].sort().values
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return d2t.long(), t2d


def completion_token_ids(source, tokenizer) -> list[list[int]]:
    """The train completions (worked targets, else answers), tokenized: what the draft will have to propose. A
    source without rows to list (the synthetic task) is sampled with a fixed seed."""
    examples = (list(source) if hasattr(source, "__iter__")
                else source.sample(VOCAB_SAMPLE, random.Random("draft-vocab")))
    return [tokenizer.encode(ex.target or ex.answer, add_bos=False) for ex in examples]


def token_counts(token_id_lists: Iterable[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """How often each target id occurs in `token_id_lists` (float64 [V])."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for token_ids in token_id_lists:
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
            raise ValueError(f"token ids {int(ids.min())}..{int(ids.max())} are outside the "
                             f"vocabulary 0..{vocab_size - 1}: tokenizer and vocab_size disagree")
        counts += torch.bincount(ids, minlength=vocab_size).double()
    return counts


def _ranked(counts: torch.Tensor, always_include: Sequence[int]) -> torch.Tensor:
    """The counts the draft vocabulary is chosen by: `always_include` first, whatever their count."""
    ranked = counts.clone()
    ranked[sorted(set(int(i) for i in always_include))] = float("inf")
    return ranked


def vocab_mapping_from_counts(counts: torch.Tensor, draft_vocab_size: int,
                              always_include: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """`build_vocab_mapping` over token frequencies; `always_include` (the stop and special ids) are kept whatever
    their count: a draft that cannot propose the end of turn loses the last token of every completion."""
    forced = set(int(i) for i in always_include)
    if len(forced) > draft_vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} cannot hold the {len(forced)} ids that "
                         "must always be in it (stop and special tokens): raise draft.draft_vocab_size")
    return build_vocab_mapping(_ranked(counts, always_include), draft_vocab_size)


def vocab_mapping_from_token_ids(
    token_id_lists: Iterable[Sequence[int]],
    vocab_size: int,
    draft_vocab_size: int,
    always_include: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """`vocab_mapping_from_counts` over the token frequencies of `token_id_lists` (e.g. tokenized answers)."""
    return vocab_mapping_from_counts(token_counts(token_id_lists, vocab_size), draft_vocab_size, always_include)


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """The share of the counted tokens the draft vocabulary `t2d` holds: the draft can propose no other, so it
    bounds the share of drafted tokens the target can accept."""
    total = float(counts.sum())
    return float(counts[t2d].sum()) / total if total else 1.0


def size_for_coverage(counts: torch.Tensor, share: float, always_include: Sequence[int] = ()) -> int:
    """The smallest draft vocabulary (chosen as `vocab_mapping_from_counts` does) that covers `share` of `counts`."""
    order = torch.sort(_ranked(counts, always_include), descending=True, stable=True).indices
    covered = counts[order].cumsum(0) / max(float(counts.sum()), 1.0)
    return min(int((covered < share).sum()) + 1, counts.numel())
