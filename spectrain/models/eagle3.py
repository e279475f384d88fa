"""The EAGLE-3 draft, co-trained from the policy's own hidden states (docs/cotraining.md).

Parameter names, the midlayer's data flow and the checkpoint format are those of vLLM's
`Eagle3LlamaForCausalLM` (vllm/model_executor/models/llama_eagle3.py), so a trained draft
is exported once and then synced into a live engine by name. The draft has no embedding
of its own: like vLLM with a checkpoint without `embed_tokens`, it reads the policy's.

Training uses the training-time-test (TTT) unroll: K passes over the packed batch, pass d
at anchor i playing the d-th speculative step from position i, with branch attention
(`ttt_attention`) so that memory stays O(T * K).
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from spectrain.errors import ConfigError
from spectrain.models.hf_io import check_finite, safetensors_tensors
from spectrain.models.llama import (
    Attention,
    LlamaConfig,
    RMSNorm,
    SwiGLU,
    rope_cos_sin,
)
from spectrain.ops.draft_loss import DEFAULT_CHUNK, dense_soft_ce_top1, draft_soft_ce_top1
from spectrain.ops.ttt_attention import ttt_attention
from spectrain.tasks.draft_vocab import build_vocab_mapping

_WEIGHTS = "model.safetensors"
_TORCH_WEIGHTS = "pytorch_model.bin"  # the original EAGLE-3 releases

# shift_fn(x, cu_seqlens, shift, fill): row i of the result is x[i + shift] of the same document.
ShiftFn = Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]


@dataclass
class Eagle3Config:
    """Architecture of the draft; names match vLLM's EAGLE-3 `config.json`.

    `tap_layers` is kept sorted: vLLM captures the aux states in layer order whatever
    order the config lists them in, and `fc` must see them in that order.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    tap_layers: tuple[int, ...]
    head_dim: int = 0  # 0 (or None): hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 256
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        ids = tuple(int(i) for i in self.tap_layers)
        if len(set(ids)) != len(ids) or not ids:
            raise ValueError(f"tap_layers={ids} must be distinct and non-empty: vLLM "
                             "captures each layer once, so duplicates break the fc input size")
        self.tap_layers = tuple(sorted(ids))
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"draft hidden_size={self.hidden_size} must equal target_hidden_size="
                f"{self.target_hidden_size}: the draft shares the policy's embeddings")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in "
                             f"1..vocab_size={self.vocab_size}")

    @classmethod
    def from_policy(
        cls,
        policy: LlamaConfig,
        draft_vocab_size: int | None = None,
        tap_layers: Sequence[int] | None = None,
        intermediate_size: int | None = None,
    ) -> "Eagle3Config":
        """A draft sized like one layer of `policy`, reading its embeddings and aux states
        (by default `default_tap_layers`)."""
        n = policy.num_hidden_layers
        if tap_layers is None:
            tap_layers = default_tap_layers(n)
        if max(tap_layers) >= n or min(tap_layers) < 0:
            raise ValueError(f"tap_layers={tuple(tap_layers)} must be in 0..{n - 1} "
                             f"(the policy has {n} layers)")
        return cls(
            hidden_size=policy.hidden_size,
            intermediate_size=intermediate_size or policy.intermediate_size,
            num_attention_heads=policy.num_attention_heads,
            num_key_value_heads=policy.num_key_value_heads,
            head_dim=policy.head_dim,
            vocab_size=policy.vocab_size,
            draft_vocab_size=draft_vocab_size or policy.vocab_size,
            target_hidden_size=policy.hidden_size,
            tap_layers=tuple(tap_layers),
            rms_norm_eps=policy.rms_norm_eps,
            rope_theta=policy.rope_theta,
            max_position_embeddings=policy.max_position_embeddings,
            initializer_range=policy.initializer_range,
        )

    def attention_config(self) -> LlamaConfig:
        """The Llama view `Attention` is built from (vLLM's drafter is plain Llama: no qk-norm)."""
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
        )


def default_tap_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's EAGLE-3 default aux ids, the residual entering layers `(2, n//2, n-3)`, or `(1, n//2, n-1)` where
    those are not three distinct layers (shallow policies: vLLM would capture fewer states than `fc` expects)."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) < 3 or min(ids) < 0:
        ids = (1, num_layers // 2, num_layers - 1)
    return ids


class Eagle3Midlayer(nn.Module):
    """vLLM's EAGLE-3 `layers.0` (`midlayer.*` in the checkpoint); attention takes 2H inputs."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.self_attn = Attention(cfg.attention_config(), input_size=2 * cfg.hidden_size)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft head: `fc` over the aux states, one midlayer, final norm, draft-vocab head.

    Buffers: `d2t [draft_vocab]` (target id = draft id + d2t[draft id]) and `t2d [vocab]`
    (bool mask of the target ids in the draft vocab).
    """

    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.tap_layers) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Midlayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        d2t, t2d = build_vocab_mapping(torch.ones(cfg.vocab_size), cfg.draft_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=self.cfg.initializer_range)

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        assert d2t.shape == self.d2t.shape and t2d.shape == self.t2d.shape, (d2t.shape, t2d.shape)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def forward(
        self,
        embeds: torch.Tensor,
        tap_hidden: Sequence[torch.Tensor],
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        passes: int,
        ops=None,
        shift_fn: ShiftFn | None = None,
        normed_hidden: bool = False,
    ) -> list[torch.Tensor]:
        """TTT unroll: draft logits `[T, draft_vocab]` for passes 1..passes.

        Args:
            embeds: the policy's embedding output `[T, H]` (its `CausalLMOutput.embeds`),
                i.e. `e(x_t)`; detached (the draft never trains the policy) and cast to the
                draft's dtype.
            tap_hidden: the policy's aux states `[T, H_target]`, one per `tap_layers`
                entry in that (sorted) order; detached and cast likewise.
            position_ids, cu_seqlens: the packed batch (RoPE positions of the tokens).
            passes: K, the TTT passes unrolled (`draft.ttt_passes`).
            ops: attention ops of the causal trunk (local, or ring under CP).
            shift_fn: document-local shift (`shift_within_docs`; CP passes its boundary
                exchanging version).
            normed_hidden: return the final-normed hidden states `[T, H]` instead of the
                logits, for `ttt_loss(..., lm_head=self.lm_head.weight)` to apply the head
                chunk by chunk (the logits are the largest tensors of a draft update).

        Pass d at anchor i takes `cat(input_layernorm(e(x_{i+d})), hidden_norm(h^{d-1}_i))`
        at RoPE position `pos_i + d - 1`, with `h^0 = fc(cat(aux))` and `h^d` the midlayer
        output before the final norm (vLLM's next-step hidden state).
        """
        cfg, mid = self.cfg, self.midlayer
        shift_fn = shift_fn or shift_within_docs
        t = embeds.shape[0]
        assert embeds.shape == (t, cfg.hidden_size), (embeds.shape, cfg.hidden_size)
        assert position_ids.shape == (t,), (position_ids.shape, t)
        assert passes >= 1, passes
        embeds = embeds.detach().to(self.fc.weight.dtype)
        hidden = self.combine_aux(tap_hidden)
        keys, values, outputs = [], [], []
        for d in range(1, passes + 1):
            next_embeds = shift_fn(embeds, cu_seqlens, d, 0.0)
            cos, sin = rope_cos_sin(position_ids + (d - 1), cfg.head_dim, cfg.rope_theta, embeds.dtype)
            x = torch.cat([mid.input_layernorm(next_embeds), mid.hidden_norm(hidden)], dim=-1)
            q, k, v = mid.self_attn.project_qkv(x, cos, sin)
            keys.append(k)
            values.append(v)
            attn = ttt_attention(q, keys, values, cu_seqlens, ops=ops)
            residual = hidden + mid.self_attn.o_proj(attn.reshape(t, -1))
            hidden = residual + mid.mlp(mid.post_attention_layernorm(residual))
            normed = self.norm(hidden)
            outputs.append(normed if normed_hidden else self.lm_head(normed))
        return outputs

    def combine_aux(self, tap_hidden: Sequence[torch.Tensor]) -> torch.Tensor:
        """`fc(cat(aux))`, vLLM's `combine_hidden_states`: the draft's pass-1 hidden `[T, H]`."""
        assert len(tap_hidden) == len(self.cfg.tap_layers), (len(tap_hidden), self.cfg.tap_layers)
        for a in tap_hidden:
            assert a.shape == (tap_hidden[0].shape[0], self.cfg.target_hidden_size), a.shape
        return self.fc(torch.cat([a.detach() for a in tap_hidden], dim=-1).to(self.fc.weight.dtype))


def _rows_within_docs(cu_seqlens: torch.Tensor, shift: int,
                     device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(src, inside)` `[T]`: row i reads row `src[i] = i + shift`, which is in i's document where `inside`."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lens = cu.diff()
    src = torch.arange(int(cu[-1]), device=cu.device) + shift
    inside = (src >= torch.repeat_interleave(cu[:-1], lens)) & (src < torch.repeat_interleave(cu[1:], lens))
    return src, inside


def shift_within_docs(x: torch.Tensor, cu_seqlens: torch.Tensor, shift: int, fill: float = 0) -> torch.Tensor:
    """Row i of the result is `x[i + shift]` if that row is in i's document, else `fill`.

    The single-rank version of the CP-aware shift (`spectrain.parallel.cp.zigzag.shift_left`
    has the same semantics on zigzag shards), so TTT never looks across a document.
    """
    src, inside = _rows_within_docs(cu_seqlens, shift, x.device)
    assert src.shape[0] == x.shape[0], (src.shape[0], x.shape[0])
    out = x.new_full(x.shape, fill)
    out[inside] = x[src[inside]]
    return out


@dataclass
class TTTMetrics:
    """Per-pass sums `[K]` (all-reduce them across DP/CP ranks before dividing)."""

    loss_sum: torch.Tensor  # soft cross-entropy summed over valid anchors
    correct: torch.Tensor  # draft top-1 == policy top-1 (target ids)
    count: torch.Tensor  # valid anchors

    @property
    def loss(self) -> torch.Tensor:
        return self.loss_sum / self.count.clamp(min=1)

    @property
    def accuracy(self) -> torch.Tensor:
        """Top-1 agreement with the policy: a proxy of the per-position acceptance rate."""
        return self.correct / self.count.clamp(min=1)


def ttt_loss(
    draft_outputs: Sequence[torch.Tensor],
    teacher_logits: torch.Tensor,
    response_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    t2d: torch.Tensor,
    pass_decay: float = 0.8,
    num_valid_tokens: torch.Tensor | float | None = None,
    shift_fn: ShiftFn | None = None,
    lm_head: torch.Tensor | None = None,
    loss_kernel: str = "auto",
    chunk: int = DEFAULT_CHUNK,
    teacher_top1: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TTTMetrics]:
    """Soft cross-entropy of each pass against the policy, restricted to the draft vocab.

    Pass d at anchor i predicts token i+d+1: its teacher is `softmax(policy logits at i+d)`
    over the draft vocab; it counts where i+d is in i's document and `response_mask[i+d]`
    (position i+d predicts a response token). Pass d is weighted `pass_decay**(d-1)`.
    The sum is divided by `num_valid_tokens`, the global count of valid pass-1 anchors
    (default: the local one, `shift_within_docs(response_mask, cu_seqlens, 1).sum()`);
    under DP/CP pass the all-reduced count so that summed gradients are the global mean.

    Args:
        draft_outputs: K tensors from `Eagle3Draft.forward`: the logits `[T, Vd]` (scored
            densely), or with `lm_head` the normed hidden states `[T, H]` (`normed_hidden=True`).
        teacher_logits: policy logits `[T, V]` (`[T, Vd]` with `teacher_top1`); detached here,
            kept in their own dtype (bf16 stays bf16) and upcast per pass by the dense path, per
            chunk by the others. On one
            rank (`shift_fn` None or `shift_within_docs`) every pass reads the one restricted
            teacher at rows i + d (`draft_soft_ce_top1(..., rows=)`); other shifts (context
            parallel) copy it shifted per pass.
        response_mask: `[T]`, nonzero where position t predicts a response token.
        t2d: bool `[V]`, the draft vocabulary.
        teacher_top1: with it, `teacher_logits` is the teacher already restricted to the draft
            vocab `[T, Vd]` (any per-row shift of the logits, e.g. the policy's log-probs from
            `ops.chunked_logprobs.teacher_on_draft_vocab`) and this int64 `[T]` is the policy's
            top-1 over the whole vocab: no `[T, V]` logits needed.
        lm_head: the draft's `lm_head.weight` `[Vd, H]`, applied by `draft_soft_ce_top1`
            with `loss_kernel` (`draft.loss_kernel`) and `chunk` rows at a time.
    """
    local = shift_fn in (None, shift_within_docs)
    shift_fn = shift_fn or shift_within_docs
    t, vocab = teacher_logits.shape[0], t2d.shape[0]
    assert len(draft_outputs) >= 1, "no TTT pass to score"
    assert response_mask.shape == (t,), (response_mask.shape, t)
    assert t2d.dim() == 1 and t2d.dtype == torch.bool, (t2d.shape, t2d.dtype)
    used = torch.nonzero(t2d).flatten()  # draft id -> target id
    teacher = teacher_logits.detach()
    if teacher_top1 is None:
        assert teacher.shape == (t, vocab), (teacher.shape, vocab)
        restricted = teacher if used.numel() == vocab else teacher[:, used]
        teacher_top1 = teacher.argmax(-1)
    else:
        assert teacher.shape == (t, used.numel()) and teacher_top1.shape == (t,), (teacher.shape, teacher_top1.shape)
        restricted = teacher
    # Validity and the policy's top-1 (over the full vocab) travel together, one shift per pass
    # (target ids are exact in float32 below 2**24).
    policy = torch.stack([(response_mask != 0).float(), teacher_top1.float()], dim=-1)
    total: torch.Tensor | None = None
    loss_sum, correct, count = [], [], []
    for d, out in enumerate(draft_outputs, start=1):
        shifted = shift_fn(policy, cu_seqlens, d, 0.0)
        valid, policy_top1 = shifted[:, 0] > 0.5, shifted[:, 1].long()
        if local:  # read the teacher at rows i + d (row 0 where that leaves the document: not valid there)
            src, inside = _rows_within_docs(cu_seqlens, d, restricted.device)
            target, rows = restricted, torch.where(inside, src, 0)
        else:
            target, rows = shift_fn(restricted, cu_seqlens, d, 0.0), None
        if lm_head is None:
            assert out.shape == (t, used.numel()), (out.shape, t, used.numel())
            ce, top1 = dense_soft_ce_top1(out, target if rows is None else target[rows], valid)
        else:
            ce, top1 = draft_soft_ce_top1(out, lm_head, target, valid, impl=loss_kernel, chunk=chunk, rows=rows)
        if d == 1 and num_valid_tokens is None:
            num_valid_tokens = valid.sum().clamp(min=1)
        term = pass_decay ** (d - 1) * ce.sum()
        total = term if total is None else total + term
        agree = (used[top1] == policy_top1) & valid
        loss_sum.append(ce.detach().sum())
        correct.append(agree.sum().float())
        count.append(valid.sum().float())
    metrics = TTTMetrics(torch.stack(loss_sum), torch.stack(correct), torch.stack(count))
    assert total is not None and num_valid_tokens is not None  # there is a pass 1
    return total / num_valid_tokens, metrics


# export / import -------------------------------------------------------------------------
def _checkpoint_tensors(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What vLLM's `Eagle3LlamaForCausalLM.load_weights` takes, by checkpoint name.

    `d2t` only when the draft vocab is smaller: with `Vd = V` vLLM has no
    `draft_id_to_target_id` parameter and rejects the name.
    """
    tensors = {}
    for name, p in draft.state_dict().items():
        if name == "t2d" or (name == "d2t" and draft.cfg.draft_vocab_size == draft.cfg.vocab_size):
            continue
        tensors[name] = p.detach() if name == "d2t" else p.detach().to(dtype)
    return tensors


def policy_mismatches(cfg: Eagle3Config, policy_cfg: LlamaConfig) -> list[str]:
    """Why the draft cannot run on `policy_cfg` (empty if it can): it reads the policy's
    embeddings and aux states, and proposes ids of the policy's vocabulary."""
    problems = []
    if cfg.vocab_size != policy_cfg.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != policy's {policy_cfg.vocab_size}")
    if cfg.target_hidden_size != policy_cfg.hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != policy's hidden_size "
                        f"{policy_cfg.hidden_size}")
    if cfg.hidden_size != policy_cfg.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != policy's {policy_cfg.hidden_size} "
                        "(the draft reads the policy's embeddings)")
    if max(cfg.tap_layers) >= policy_cfg.num_hidden_layers:
        problems.append(f"tap_layers {cfg.tap_layers} beyond the policy's "
                        f"{policy_cfg.num_hidden_layers} layers")
    return problems


def draft_config_dict(cfg: Eagle3Config, policy_cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The vLLM EAGLE-3 `config.json`; checks that the draft fits `policy_cfg`."""
    problems = policy_mismatches(cfg, policy_cfg)
    if problems:
        raise ValueError("the draft does not fit the policy: " + "; ".join(problems))
    fields = {f: getattr(cfg, f) for f in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "rope_theta", "vocab_size", "draft_vocab_size", "target_hidden_size",
        "initializer_range")}
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **fields,
        "num_hidden_layers": 1,
        # vLLM sizes the drafter's rotary cache from it (must cover the target's positions)
        "max_position_embeddings": max(cfg.max_position_embeddings, policy_cfg.max_position_embeddings),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": policy_cfg.bos_token_id,
        "eos_token_id": policy_cfg.eos_token_id,
        "pad_token_id": policy_cfg.pad_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.tap_layers),
                         "use_aux_hidden_state": True},
    }


def export_draft(draft: Eagle3Draft, out_dir: str | Path, policy_cfg: LlamaConfig,
                 dtype: torch.dtype = torch.float32) -> Path:
    """Write `config.json` + `model.safetensors` in the vLLM EAGLE-3 format.

    No `embed_tokens` (vLLM then shares the target's, as this draft does); the aux layers
    always go into `eagle_config`, so vLLM taps what the draft was trained on; `t2d` rides
    along for `load_draft` (vLLM's loader skips it).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = draft_config_dict(draft.cfg, policy_cfg, dtype)
    tensors = {k: v.contiguous().clone() for k, v in _checkpoint_tensors(draft, dtype).items()}
    tensors["t2d"] = draft.t2d.detach().clone()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / _WEIGHTS), metadata={"format": "pt"})
    return out


# vLLM EAGLE-3 options and the value this draft implements: any other changes the numerics.
_IMPLEMENTED_VARIANT = {
    "num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "fc_norm": False, "norm_before_fc": False, "norm_output": False, "norm_before_residual": False,
    "use_aux_hidden_state": True,
}


def load_draft(draft_dir: str | Path, dtype: torch.dtype = torch.float32, policy_cfg: LlamaConfig | None = None,
               policy_embeddings: torch.Tensor | None = None) -> Eagle3Draft:
    """Read an EAGLE-3 directory (`LlamaForCausalLMEagle3`): `export_draft`'s, vLLM's or SpecForge's.

    Args:
        policy_cfg: the policy the draft will run on; checked against, and needed for a
            config without `eagle_config` (then the aux layers default, with a warning).
        policy_embeddings: the policy's `embed_tokens` weight. A checkpoint's own
            `embed_tokens.weight` (SpecForge saves the frozen copy of the target's) is
            dropped when it equals it, and refused otherwise: this draft always reads the
            policy's embeddings (`forward(embeds=...)`), as vLLM does for a draft without one.

    Errors are `ConfigError`s naming `draft.path`, the mismatch and the fix.
    """
    path = Path(draft_dir)
    cfg = read_draft_config(path, policy_cfg)
    state = _read_draft_weights(path)
    _drop_policy_embeddings(path, state, policy_embeddings)
    _complete_vocab_mapping(path, state, cfg)
    draft = Eagle3Draft(cfg).to(dtype)
    expected = {name: tuple(t.shape) for name, t in draft.state_dict().items()}
    misshapen = [f"{name} is {tuple(t.shape)}, the config needs {expected[name]}"
                 for name, t in state.items() if name in expected and tuple(t.shape) != expected[name]]
    allowed_missing = {"d2t", "t2d"} if cfg.draft_vocab_size == cfg.vocab_size else set()
    missing, unexpected = sorted(set(expected) - set(state) - allowed_missing), sorted(set(state) - set(expected))
    problems = misshapen + ([f"missing {missing}"] if missing else []) + (
        [f"unexpected {unexpected}"] if unexpected else [])
    if problems:
        raise ConfigError(f"draft.path={path}: the weights do not match config.json (" + "; ".join(problems)
                          + "): fix config.json (sizes, eagle_config.eagle_aux_hidden_state_layer_ids) "
                            "or point draft.path at the matching checkpoint")
    draft.load_state_dict(state, strict=False)
    return draft


def read_draft_config(draft_dir: str | Path, policy_cfg: LlamaConfig | None = None) -> Eagle3Config:
    """The draft's architecture from its config.json, checked against `policy_cfg` (no weights are read, so a run
    can refuse a draft that does not fit before it trains anything)."""
    path = Path(draft_dir)
    cfg = _draft_config(path, _read_draft_config(path), policy_cfg)
    if policy_cfg is not None and (problems := policy_mismatches(cfg, policy_cfg)):
        raise ConfigError(f"draft.path={path} does not fit the policy: {'; '.join(problems)}. "
                          "Use a draft trained for this policy, or draft.init=scratch")
    return cfg


def _read_draft_config(path: Path) -> dict:
    if not (path / "config.json").is_file():
        raise ConfigError(f"draft.path={path} has no config.json: point it at an EAGLE-3 directory "
                          "(vLLM's or SpecForge's layout, or one written by export_draft)")
    raw = json.loads((path / "config.json").read_text())
    eagle = raw.get("eagle_config") or {}
    settings = {**raw, **eagle}  # vLLM reads these switches from eagle_config first
    unsupported = {k: settings[k] for k, want in _IMPLEMENTED_VARIANT.items() if settings.get(k, want) != want}
    rope = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        unsupported["rope_scaling"] = rope
    if raw.get("architectures", ["LlamaForCausalLMEagle3"]) != ["LlamaForCausalLMEagle3"] or unsupported:
        raise ConfigError(
            f"draft.path={path}: only Llama EAGLE-3 drafts (architectures [\"LlamaForCausalLMEagle3\"]) with "
            f"{_IMPLEMENTED_VARIANT} and no rope scaling are supported; config.json has architectures "
            f"{raw.get('architectures')} and {unsupported}. Use such a draft or draft.init=scratch")
    return raw


def _draft_config(path: Path, raw: dict, policy_cfg: LlamaConfig | None) -> Eagle3Config:
    """`Eagle3Config` from the keys vLLM reads (`target_hidden_size` and `draft_vocab_size`
    default to `hidden_size` and `vocab_size`, as in vLLM)."""
    names = {f.name for f in dataclasses.fields(Eagle3Config)} - {"tap_layers"}
    kwargs = {k: v for k, v in raw.items() if k in names and v is not None}
    kwargs["rope_theta"] = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 10000.0))
    kwargs.setdefault("draft_vocab_size", raw["vocab_size"])
    kwargs.setdefault("target_hidden_size", raw["hidden_size"])
    tap_layers = _aux_layer_ids(path, raw, policy_cfg)  # outside the try: its ConfigError already names the fix
    try:
        return Eagle3Config(tap_layers=tap_layers, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"draft.path={path}: config.json is not a usable EAGLE-3 draft config: {exc}") from exc


def _aux_layer_ids(path: Path, raw: dict, policy_cfg: LlamaConfig | None) -> tuple[int, ...]:
    """The policy layers whose input residuals the draft reads; where the config does not say
    (SpecForge's Llama/Qwen configs), the default vLLM would tap for this policy depth."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(ids)
    if policy_cfg is None:
        raise ConfigError(f"draft.path={path}: config.json does not say which policy layers the draft reads (no "
                          "eagle_config.eagle_aux_hidden_state_layer_ids, as SpecForge writes it); add them, e.g. "
                          "\"eagle_config\": {\"eagle_aux_hidden_state_layer_ids\": [1, 2, 3]}")
    ids = default_tap_layers(policy_cfg.num_hidden_layers)
    warnings.warn(f"draft.path={path}: config.json has no eagle_config.eagle_aux_hidden_state_layer_ids; "
                  f"using the default aux layers {ids} for a {policy_cfg.num_hidden_layers}-layer policy "
                  "(vLLM's (2, n//2, n-3), made distinct for shallow policies). Exported drafts record them; "
                  "if the draft was trained on other layers, add eagle_config to its config.json", stacklevel=4)
    return ids


def check_draft_weights(draft_dir: str | Path) -> None:
    """Refuse a draft whose weights hold NaN/inf, before anything is written (a draft is one layer: a quick read)."""
    file = _weight_file(Path(draft_dir))
    check_finite("draft.path", file, _tensors(file))


def _read_draft_weights(path: Path) -> dict[str, torch.Tensor]:
    return dict(_tensors(_weight_file(path)))


def _weight_file(path: Path) -> Path:
    for name in (_WEIGHTS, _TORCH_WEIGHTS):
        if (path / name).is_file():
            return path / name
    raise ConfigError(f"draft.path={path} has no {_WEIGHTS} (or {_TORCH_WEIGHTS}): sharded drafts are not "
                      "supported; merge the shards into one file")


def _tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if file.name == _WEIGHTS:
        return safetensors_tensors(file)
    return iter(torch.load(file, map_location="cpu", weights_only=True).items())


def _drop_policy_embeddings(path: Path, state: dict[str, torch.Tensor],
                            policy_embeddings: torch.Tensor | None) -> None:
    own = state.pop("embed_tokens.weight", None)
    if own is None:
        return
    if policy_embeddings is None:
        warnings.warn(f"draft.path={path}: embed_tokens.weight dropped unchecked (no policy embeddings given): "
                      "the draft reads the policy's", stacklevel=3)
        return
    theirs = policy_embeddings.detach().to(device="cpu", dtype=own.dtype)
    if own.shape != theirs.shape or not torch.equal(own, theirs):
        raise ConfigError(
            f"draft.path={path}: embed_tokens.weight {tuple(own.shape)} differs from the policy's embeddings "
            f"{tuple(theirs.shape)}: spectrain's draft reads the policy's embeddings, so a draft trained on "
            "other ones would drift. Use the draft trained for this policy checkpoint, or draft.init=scratch")


def _complete_vocab_mapping(path: Path, state: dict[str, torch.Tensor], cfg: Eagle3Config) -> None:
    """Fill in whichever of `d2t` / `t2d` the checkpoint lacks (vLLM needs only `d2t`), and check
    that they agree and keep draft ids in target-id order (`ttt_loss` relies on it)."""
    vocab, draft_vocab = cfg.vocab_size, cfg.draft_vocab_size
    d2t, t2d = state.get("d2t"), state.get("t2d")
    if d2t is None and t2d is None:
        if draft_vocab < vocab:
            raise ConfigError(f"draft.path={path}: draft_vocab_size {draft_vocab} < vocab_size {vocab} but the "
                              "checkpoint has neither d2t nor t2d to map draft ids to target ids: add them "
                              "(SpecForge writes both) or use a full-vocabulary draft")
        return
    if t2d is not None and tuple(t2d.shape) != (vocab,):
        raise ConfigError(f"draft.path={path}: t2d has shape {tuple(t2d.shape)}, vocab_size is {vocab}")
    marked = None if t2d is None else torch.nonzero(t2d.bool()).flatten()
    if d2t is None:
        assert marked is not None  # one of the two is given (checked above)
        used = marked
    else:
        used = torch.arange(d2t.numel()) + d2t.long()
    ordered = used.numel() == draft_vocab and bool((used.diff() > 0).all())
    in_range = ordered and 0 <= int(used[0]) and int(used[-1]) < vocab
    if not in_range or (marked is not None and not torch.equal(marked, used)):
        raise ConfigError(f"draft.path={path}: d2t/t2d do not map {draft_vocab} draft ids to increasing target "
                          f"ids below {vocab} (target = draft + d2t[draft], t2d marks the same ids): "
                          "rebuild the vocabulary mapping")
    state["d2t"], state["t2d"] = used - torch.arange(draft_vocab), torch.zeros(vocab, dtype=torch.bool)
    state["t2d"][used] = True


def draft_sync_weights(draft: Eagle3Draft, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
    """`(checkpoint name, tensor)` pairs for `VLLMRolloutEngine.sync_draft` (detached, not copied)."""
    dtype = dtype or draft.fc.weight.dtype
    return list(_checkpoint_tensors(draft, dtype).items())
