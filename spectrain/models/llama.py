"""A compact Llama/Qwen3-family decoder over packed batches.

Parameter names follow Hugging Face (`model.layers.N.self_attn.q_proj.weight`, ...) so a
state dict goes to vLLM and to `save_pretrained`-style directories unchanged. Batches are
packed (no batch dimension, `cu_seqlens` marks documents); attention goes through an
ops object (`LocalAttentionOps` by default, zigzag ring attention under context parallel)
that returns `(out, lse)`. The forward can capture the residual stream entering chosen
layers: exactly the tensors vLLM's EAGLE-3 integration hands the draft at inference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from spectrain.ops.attention import LocalAttentionOps, varlen_attention
from spectrain.ops.chunked_logprobs import (
    DEFAULT_CHUNK_TOKENS,
    dense_token_logprobs,
    teacher_on_draft_vocab,
    token_logprobs,
)

# model_type -> the HF architecture this module implements for it
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass
class LlamaConfig:
    """Architecture of the policy; field names match HF `config.json`.

    `rope_scaling` is the checkpoint's rope parameters reduced to what `rope_cos_sin` reads
    (`rope_type` linear | llama3 | yarn and that type's fields); None is plain RoPE.
    A policy read from a checkpoint keeps its `config.json` (`hf_config`) and directory
    (`source_dir`), so an export hands vLLM exactly what the user gave.
    """

    vocab_size: int = 128
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0 (or None): hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3-style per-head RMSNorm on q and k
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int = 0
    initializer_range: float = 0.02
    attention_bias: bool = False  # biases on q/k/v (Qwen2; Llama's attention_bias sets o_proj_bias too)
    o_proj_bias: bool = False
    rope_scaling: dict | None = None
    model_type: str = ""  # "" (or None): "qwen3" with qk_norm, else "llama"
    hf_config: dict | None = field(default=None, repr=False, compare=False)
    source_dir: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.model_type:
            self.model_type = "qwen3" if self.qk_norm else "llama"
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 for half inputs, fp64 kept
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 rope_scaling: dict | None = None):
    """cos/sin tables `[T, head_dim]` in the HF "rotate half" layout (float64, then `dtype`).

    `rope_scaling` (`LlamaConfig.rope_scaling`) rescales the frequencies as transformers and
    vLLM do; yarn also scales cos and sin by its attention factor.
    """
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, rope_scaling)
    freqs = position_ids.to(torch.float64)[:, None] * inv_freq.to(position_ids.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def rope_frequencies(head_dim: int, theta: float, rope_scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies `[head_dim // 2]` (float64) and the factor that scales cos/sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    params = rope_scaling or {"rope_type": "default"}
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_frequencies(inv_freq, head_dim, theta, params)
    raise ValueError(f"rope_type {rope_type!r} is not implemented; supported: {', '.join(ROPE_TYPES)}")


def _llama3_frequencies(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float, params: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the slow dimensions by `factor`, keep the fast ones, ramp between the
    `beta_fast`/`beta_slow` rotation counts; cos/sin scaled by the attention factor (mscale)."""
    factor = params["factor"]
    context = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `context`
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the dimension's frequency, 0: divide it by `factor`
    return inv_freq / factor * ramp + inv_freq * extrapolation, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, H, D]` by the per-token angles of `cos, sin [T, D]`."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, input_size: int | None = None) -> None:
        super().__init__()
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        in_size = input_size or cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.q_proj = nn.Linear(in_size, hq * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(in_size, hkv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(in_size, hkv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projected, normed and rotated `q [T,Hq,D]`, `k, v [T,Hkv,D]`."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, cu_seqlens, ops) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        out = varlen_attention(q, k, v, cu_seqlens, causal=True, ops=ops)
        return self.o_proj(out.reshape(x.shape[0], -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.activation_checkpointing = False  # set by `apply_activation_checkpointing`

    def forward(self, x, cos, sin, cu_seqlens, ops) -> torch.Tensor:
        """The layer; with activation checkpointing its input alone is kept and the rest recomputed in the
        backward (inside this module's call, so FSDP's hooks on the layer gather the weights for the recompute)."""
        if self.activation_checkpointing and torch.is_grad_enabled():
            # no dropout, no random numbers: no RNG state to stash for the recompute
            return checkpoint(self._forward, x, cos, sin, cu_seqlens, ops, use_reentrant=False,
                              preserve_rng_state=False)
        return self._forward(x, cos, sin, cu_seqlens, ops)

    def _forward(self, x, cos, sin, cu_seqlens, ops) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, ops)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None
    hidden: torch.Tensor  # after the final norm, [T, H]
    embeds: torch.Tensor | None  # embedding output, [T, H] (None: a pipeline's last stage without taps)
    tap_hidden: list[torch.Tensor] = field(default_factory=list)  # residual entering each captured layer
    logprobs: torch.Tensor | None = None  # [T] of `logprob_targets`, from the lm_head in chunks
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None  # `teacher_on_draft_vocab`: ([T, Vd], top-1 [T])


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (`model.*` in HF names).

    Layers are kept in a ModuleDict keyed by their global index so a pipeline stage can
    drop the layers it does not own and keep HF names (`model.layers.5.*`) intact.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg) for i in range(cfg.num_hidden_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attention_ops = LocalAttentionOps()
        # rows of logits the lm_head computes at a time for logprobs and the teacher (`policy.logprob_chunk_tokens`);
        # None: whole [T, V] logits, the dense path (small vocabularies: the toy's, bit for bit as before)
        self.logprob_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.initializer_range
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=std)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        tap_layers: tuple[int, ...] = (),
        compute_logits: bool = True,
        logprob_targets: torch.Tensor | None = None,
        teacher_t2d: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """Logits `[T, V]` unless `compute_logits` is False. Without them (`ops.chunked_logprobs`,
        `logprob_chunk_tokens` rows of logits at a time, inside the forward so that FSDP has the lm_head
        gathered): the logprobs of `logprob_targets` (int64 `[T]`, -1 for none; differentiable) and the draft's
        teacher over `teacher_t2d` (bool `[V]`, the draft vocabulary; no gradient). With
        `logprob_chunk_tokens=None` the logprobs come from whole logits and the teacher is the logits."""
        assert input_ids.dim() == 1 and input_ids.shape == position_ids.shape, (
            f"packed input_ids/position_ids must be 1-D and equal: {input_ids.shape} vs {position_ids.shape}"
        )
        assert int(cu_seqlens[-1]) == input_ids.shape[0], "cu_seqlens[-1] must equal the token count"
        embeds = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, embeds.dtype,
                                self.cfg.rope_scaling)
        captured: dict[int, torch.Tensor] = {}
        x = embeds
        for idx, layer in self.model.layers.items():
            if int(idx) in tap_layers:
                captured[int(idx)] = x
            x = layer(x, cos, sin, cu_seqlens, self.attention_ops)
        hidden = self.model.norm(x)
        chunk, weight = self.logprob_chunk_tokens, self.lm_head.weight
        if chunk is None:  # the dense path
            logits = self.lm_head(hidden)
            logprobs = None if logprob_targets is None else dense_token_logprobs(logits, logprob_targets)
            teacher = None
        else:
            logits = self.lm_head(hidden) if compute_logits else None
            logprobs = None if logprob_targets is None else token_logprobs(hidden, weight, logprob_targets, chunk)
            teacher = None if teacher_t2d is None else teacher_on_draft_vocab(hidden, weight, teacher_t2d, chunk)
        missing = set(tap_layers) - set(captured)
        if missing:
            raise ValueError(
                f"aux layer ids {sorted(missing)} do not exist: the policy has layers "
                f"0..{self.cfg.num_hidden_layers - 1}; fix draft.tap_layers"
            )
        return CausalLMOutput(logits, hidden, embeds, [captured[i] for i in tap_layers], logprobs, teacher)


def apply_activation_checkpointing(policy: LlamaForCausalLM, enabled: bool) -> None:
    """Recompute every decoder layer of `policy` in the backward (`policy.activation_checkpointing`): one extra
    layer forward each, for keeping only the layer inputs. A flag on each layer, read at its call: a pipeline
    stage holding the layers checkpoints too, and `fully_shard` (before or after) keeps it."""
    for layer in policy.model.layers.values():
        assert isinstance(layer, DecoderLayer), type(layer)
        layer.activation_checkpointing = enabled


def pack_sequences(seqs: list[list[int]], device=None):
    """Concatenate token lists into `(input_ids, position_ids, cu_seqlens)`."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
    position_ids = torch.cat([torch.arange(n) for n in lengths.tolist()]).to(device)
    return input_ids, position_ids, cu.to(device)
