"""`rollout.engine: torch`: a plain torch `RolloutEngine`, for machines without vLLM and for debugging.

It samples from its own copy of the policy on the trainer's device, with the sampling semantics
of the vLLM engine: temperature (greedy below 1e-5), top-p after temperature, `min_tokens` hiding
every stop id, EOS and `stop_token_ids` kept as the last token (`finished=True`), `max_tokens`
clamped to `max_model_len`; each token's logprob is vLLM's default `raw_logprobs`, the float32
log-softmax of the unprocessed logits, which is what the trainer recomputes.

There is no KV cache: every decoding step re-runs the packed forward over each live sequence's
whole prefix (O(L^2) per sequence of length L), all live sequences in one packed forward. That is
fine for the tiny models this engine serves and keeps it a few dozen lines. It does not speculate:
the co-trained draft is synced (its version kept) but never drafts, so the spec-decode counters stay
at zero and the draft's acceptance checks have nothing to act on.
"""
from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch

from spectrain.errors import RolloutEngineError
from spectrain.models.hf_io import load_pretrained
from spectrain.models.llama import LlamaForCausalLM, pack_sequences
from spectrain.rollout.engine import (
    Completion,
    LoadStats,
    NamedTensors,
    ProbeResult,
    Sampling,
    SamplingConfig,
    SpecDecodeCounters,
    per_prompt,
)

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it decodes greedily


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches `top_p` (at least one); vLLM's order of ops."""
    ordered, index = logits.sort(dim=-1, descending=False)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[:, -1] = False
    ordered = ordered.masked_fill(drop, -float("inf"))
    return ordered.scatter(-1, index, ordered)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | list[torch.Generator | None] | None) -> torch.Tensor:
    """One token per row of float32 `logits [B, V]`: argmax when greedy, else an exponential race
    (argmax of p / Exp(1), an exact draw from p, as vLLM samples) over the tempered, top-p filtered logits.
    `generator`: one for every row, or one per row (a seeded request's; None: torch's global RNG)."""
    if temperature < SAMPLING_EPS:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    probs = logits.softmax(dim=-1)
    if isinstance(generator, list):
        race = torch.stack([torch.empty_like(row).exponential_(generator=g) for row, g in zip(probs, generator)])
    else:
        race = torch.empty_like(probs).exponential_(generator=generator)
    return probs.div(race).argmax(dim=-1)


@dataclass
class _Sequence:
    prompt_index: int
    prompt_ids: list[int]
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False  # ended by a stop id
    done: bool = False  # ended by a stop id or by max_tokens

    def append(self, token: int, logprob: float, stops: set[int]) -> None:
        """vLLM's `check_stop` order: a stop id ends the sequence (kept in it) before the length cap does."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.finished = token in stops
        self.done = self.finished or len(self.token_ids) >= self.max_tokens

    def completion(self) -> Completion:
        return Completion(self.prompt_index, list(self.prompt_ids), self.token_ids, self.logprobs, self.finished)


class TorchSamplingEngine:
    """A `RolloutEngine` sampling in plain torch from its own copy of the policy (no vLLM, no speculation).

    Args:
        policy_dir: HF directory of the policy (what the vLLM engine would load).
        device: where the copy lives (`resolve_device(trainer.accelerator)`: the trainer's device).
        dtype: its dtype ("float32" | "bfloat16"); logits are taken in float32 whatever it is.
        max_model_len: prompt + completion limit, as vLLM's.
        eos_token_ids: the ids that end every completion; None: the checkpoint's `eos_token_id`.
        max_num_seqs: most sequences decoded in one step (the rest wait), bounding the packed forward.
    """

    def __init__(self, policy_dir: str | Path, device: str | torch.device = "cpu", dtype: str = "float32",
                 max_model_len: int = 128, eos_token_ids: Sequence[int] | None = None,
                 max_num_seqs: int = 256, attention_ops=None) -> None:
        self.policy_dir, self.device = Path(policy_dir), torch.device(device)
        if not (self.policy_dir / "config.json").is_file():
            raise RolloutEngineError(f"{policy_dir} has no config.json: export the policy first "
                                     f"(save_pretrained) or fix the path")
        self.policy: LlamaForCausalLM | None = load_pretrained(
            policy_dir, getattr(torch, dtype), self.device).eval().requires_grad_(False)  # None after shutdown
        if attention_ops is not None:  # the trainer's `policy.attention_backend`
            self.policy.attention_ops = attention_ops
        if eos_token_ids is None:
            eos = self.policy.cfg.eos_token_id
            eos_token_ids = () if eos is None else [eos] if isinstance(eos, int) else eos
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.policy_version = 0
        self.draft_version = 0
        self._load = LoadStats()

    # generation -----------------------------------------------------------------------
    def max_tokens_for(self, prompt_len: int, wanted: int) -> int:
        """Clamp so prompt + completion fit in max_model_len (no speculative lookahead here)."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"prompt of {prompt_len} tokens leaves no room in max_model_len="
                             f"{self.max_model_len}; raise rollout.max_model_len")
        return min(wanted, room)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        """`sampling.n` completions per prompt, grouped by prompt in order.

        A config with a `seed` draws its sample j from a generator seeded with seed + j, as vLLM
        seeds a request's samples (the same seeds, the same completions, however the prompts are
        batched); None draws from torch's global RNG of the device. Per-prompt configs may differ
        only in their seed.
        """
        configs = per_prompt(sampling, len(prompts))
        sampling = configs[0] if configs else SamplingConfig()
        if any(replace(c, seed=None) != replace(sampling, seed=None) for c in configs):
            raise ValueError("the torch engine takes one sampling config for all prompts, or per-prompt seeds only")
        stops = set(self.eos_token_ids) | set(sampling.stop_token_ids)
        sequences, generators = [], {}
        for i, (p, c) in enumerate(zip(prompts, configs)):
            for j in range(sampling.n):
                sequence = _Sequence(i, list(p), self.max_tokens_for(len(p), sampling.max_tokens))
                sequences.append(sequence)
                if c.seed is not None:
                    generators[id(sequence)] = torch.Generator(self.device).manual_seed(c.seed + j)
        waiting = deque(sequences)
        running: list[_Sequence] = []
        while waiting or running:
            while waiting and len(running) < self.max_num_seqs:
                running.append(waiting.popleft())
            self._record_load(len(running), len(waiting))
            logits = self.next_token_logits([s.prompt_ids + s.token_ids for s in running])
            raw_logprobs = torch.log_softmax(logits, dim=-1)
            young = torch.tensor([len(s.token_ids) < sampling.min_tokens for s in running], device=self.device)
            tokens = sample_tokens(self._hide_stops(logits, young, stops), sampling.temperature, sampling.top_p,
                                   [generators.get(id(s)) for s in running] if generators else None)
            chosen = raw_logprobs.gather(-1, tokens[:, None]).squeeze(-1)
            for s, token, logprob in zip(running, tokens.tolist(), chosen.tolist()):
                s.append(token, logprob, stops)
            running = [s for s in running if not s.done]
        return [s.completion() for s in sequences]

    def next_token_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """Float32 logits `[B, V]` at the last position of each sequence, from one packed forward."""
        input_ids, position_ids, cu_seqlens = pack_sequences(sequences, device=self.device)
        policy = self._live_policy()
        hidden = policy(input_ids, position_ids, cu_seqlens, compute_logits=False).hidden
        return policy.lm_head(hidden[cu_seqlens[1:].long() - 1]).float()

    def _live_policy(self) -> LlamaForCausalLM:
        if self.policy is None:
            raise RolloutEngineError("the rollout engine was shut down")
        return self.policy

    @staticmethod
    def _hide_stops(logits: torch.Tensor, rows: torch.Tensor, stops: set[int]) -> torch.Tensor:
        """`min_tokens`: no stop id (EOS included) may be sampled in `rows` yet."""
        ids = [i for i in stops if 0 <= i < logits.shape[-1]]
        if not ids or not bool(rows.any()):
            return logits
        hidden = logits.clone()
        hidden[rows.nonzero()[:, :1], torch.tensor(ids, device=logits.device)] = -float("inf")
        return hidden

    # weight sync ----------------------------------------------------------------------
    def _parameters(self) -> dict[str, torch.nn.Parameter]:
        """The checkpoint names the trainer sends (a tied head is the embedding's: `lm_head.weight` absent)."""
        return dict(self._live_policy().named_parameters())

    @torch.no_grad()
    def sync_policy(self, weights: NamedTensors, version: int) -> None:
        """Copy the named tensors in (cast to the engine's dtype); names it lacks are left to `verify_weights`,
        which reports them, as vLLM's reload ignores them."""
        params = self._parameters()
        for name, tensor in weights:
            if name in params:
                params[name].copy_(tensor.detach())
        self.policy_version = version

    def sync_draft(self, weights: NamedTensors, version: int) -> None:
        """Only the version: this engine does not speculate, so the draft is trained but never drafts."""
        self.draft_version = version

    def verify_weights(self, weights: NamedTensors, which: str, rtol: float) -> ProbeResult:
        """Whether the engine's policy holds `weights` (relative error of each tensor within `rtol`).

        `which="draft"` has nothing to check: the engine holds no draft.
        """
        if which != "policy":
            return ProbeResult(0.0, [])
        params, worst, mismatches = self._parameters(), 0.0, []
        for name, tensor in weights:
            if name not in params:
                mismatches.append(f"{name}: sent, but the engine has no such tensor")
                continue
            held = params[name].detach().double()
            sent = tensor.detach().to(held.device, torch.float64)
            if held.shape != sent.shape:
                mismatches.append(f"{name}: the engine holds shape {tuple(held.shape)}, the trainer "
                                  f"{tuple(sent.shape)}")
                continue
            error = float((held - sent).norm() / sent.norm().clamp_min(1e-12))
            worst = max(worst, error)
            if not error <= rtol:  # NaN fails too
                mismatches.append(f"{name}: relative error {error:.2e} > {rtol:.0e}")
        return ProbeResult(worst, mismatches)

    # metrics and lifecycle ---------------------------------------------------------------
    def _record_load(self, running: int, waiting: int) -> None:
        self._load.max_running = max(self._load.max_running, running)
        self._load.max_waiting = max(self._load.max_waiting, waiting)

    def take_load_stats(self) -> LoadStats:
        """Peak running/waiting sequences since the last call (then reset); nothing is ever preempted."""
        stats, self._load = self._load, LoadStats()
        return stats

    def spec_decode_counters(self) -> SpecDecodeCounters:
        """Always zero: nothing is drafted (acceptance logging and the draft's alive check then skip)."""
        return SpecDecodeCounters()

    def disable_speculation(self) -> None:
        """Nothing to disable: this engine never speculates."""

    def without_speculation(self) -> AbstractContextManager[None]:
        return nullcontext()  # it decodes plainly anyway

    def sleep(self) -> None:
        """Nothing to free: the policy copy is small beside the trainer's (and shares its device)."""

    def wake_up(self) -> bool:
        """Nothing was freed."""
        return False

    def shutdown(self) -> None:
        self.policy = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
