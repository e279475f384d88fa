"""`spectrain plan`: the memory one GPU needs for a recipe, computed from `config.json` alone (docs/gpu.md).

The plan is for the busiest GPU: one that holds its training share and also hosts a rollout engine (vLLM runs
inside the trainer's processes: one engine per TP group of `rollout.tensor_parallel_size` GPUs, so every GPU
hosts its part of one; `rollout.engine_ranks=rank0` and the torch engine keep
one engine on rank 0). Every row is in bytes. The training phase is the sum of every row but the engine: what is
resident at the policy backward's peak (the start of a micro-batch's backward), where the micro-batch's
activations, one logits chunk and the draft's inputs are live at once. The total (the device peak) is

    without sleep mode    training phase + engine share               (the engine keeps its share through the step)
    with sleep mode       max(training phase, rollout phase)          (the share is free while the policy trains)
    rollout phase         engine share + parameters + optimizer + reference + draft + reserve

(the gradients are set to None after each optimizer step and the activations are gone while the engine
decodes). `rollout.enable_sleep_mode` None is on with CUDA (off only under `trainer.accelerator=cpu`), as the
trainer resolves it; vLLM only. Sleep level 1 offloads the engine's weights to host memory: the plan reports
weight shard x the node's GPUs hosting an engine (min(ranks, 8), or 1 with one engine on rank 0) a node.

A plan fits when its total is at most the GPU's memory AND the vLLM engine's share holds its weight shard plus a
minimum KV cache (vLLM refuses to start otherwise):

    weight shard     ceil(P_all x b / TP)                        P_all the whole policy's parameters, b the rollout
                                                                 dtype's bytes (auto: policy.dtype), TP its size
    KV per token     2 x L_all x ceil(kv_heads / TP) x head_dim x b    (a key and a value per layer; vLLM
                                                                 replicates kv heads when TP > kv_heads)
    minimum KV       KV per token x rollout.max_model_len x N    N = rollout.vllm_kwargs.max_num_seqs if set,
                                                                 else 1 (one full sequence: vLLM's start check)

E.g. Qwen2.5-32B (32,763,876,352 parameters, 64 layers, 8 kv heads of 128) at TP=1 in bf16: 61.03 GiB of
weights + 2 x 64 x 8 x 128 x 2 = 262,144 B a token x 2048 = 0.50 GiB: a 0.4 x 80 = 32 GiB share does not hold
it. Nothing is measured: the numbers are these formulas on the checkpoint's
`config.json` (no weights are read) or the toy `policy.*`.

Notation: P parameters (the heaviest pipeline stage's), S the FSDP shard count (dp x cp with
`parallel.fsdp=true`, else 1: replicated), T tokens per micro-batch per rank, L decoder layers (the stage's),
H hidden, Q = heads x head_dim, K = kv_heads x head_dim, I intermediate, V vocabulary, Vd the draft's.

Training state, AdamW over float32 master weights (also under `policy.dtype=bfloat16`: Lightning's
bf16-mixed): parameters 4P/S, gradients 4P/S, optimizer state 8P/S (two float32 moments). The KL reference
(`grpo.kl_loss_coef > 0`) is a frozen copy in `grpo.reference_dtype`, sharded like the policy: 4P/S in float32
(the default), 2P/S in bfloat16 (verl's and NeMo-RL's bf16 reference). The draft (`Eagle3Config`):
fc 3H x H, one decoder layer whose q/k/v read 2H inputs, 4 RMSNorms, lm_head H x Vd (the embedding is the
policy's, frozen): 16 bytes a parameter co-trained (weights, gradients, two moments), 4 frozen, over S.

Gathered weights: FSDP all-gathers a unit in the compute dtype c before it runs: the root unit (embedding,
final norm, lm_head; FSDP2 keeps the root gathered through forward and backward) and two decoder layers (the
running one and the prefetched one), plus one layer's unsharded gradients until their reduce-scatter (the
lm_head's is in the logits row; the embedding's comes at the end of the backward, after the activations are
freed); the KL reference gathers its root and two layers too (its root reshards after each forward). Without
FSDP, bf16 autocast caches a bf16 copy of every trainable weight for the step: 2P (float32: none).

Activations, in bytes per token: what autograd saves in `models/llama.py` with flash-style attention (no
T^2 scores), tested against the saved tensors themselves (tests/unit/test_memory_plan.py). r is the residual
stream's element size, c the matmuls', a = max(r, c) the attention inputs' (the rotary tables are in the
residual dtype and `common_dtype` promotes v to q's dtype). float32: r = c = 4; bfloat16 without FSDP:
r = 4, c = 2 (autocast over float32 weights: the embedding and the residual adds keep the stream float32);
bfloat16 under FSDP: r = c = 2 (the gathered weights are bf16). One decoder layer saves

    2 RMSNorms                        2 ((4 + r) H + 4)    a float32 copy of the input, the normed output, 1/rms
    q/k/v and gate/up inputs          5 c H if r != c      autocast casts the input once per linear
                                      2 r H if r == c      one input shared by each block
    qk-norm (Qwen3)                   (4 + c)(Q + K) + 4 (heads + kv_heads)
    attention q, k, v, out, lse       a (2Q + 2K) + 4 heads
    o_proj input                      c Q if a != c        its cast copy
    SwiGLU gate, silu, up, product    4 c I

and outside the layers: 8 (the input id) + 2 head_dim r (rotary tables) + (4 + r) H + 4 (final norm) + what
the chunked log-softmax keeps: the lm_head input (c H if r != c, else r H) and a float32 log-sum-exp (4). The
backward adds about one layer of gradients in flight:

    without checkpointing   T (L layer + layer + outside)
    with checkpointing      T (L r H + 2 layer + outside)    each layer keeps its input; one is recomputed

Logits: the chunked log-softmax (`ops.chunked_logprobs`) holds at most `LOGITS_CHUNK_TOKENS` = 4096 tokens of
float32 logits and a temporary of their size, and accumulates the lm_head's gradient in float32:
min(T, 4096) x V x 8 + V x H x 4. Its backward runs first, before any layer's: the chunk is gone before the
layers' gradients in flight (and, checkpointed, the recomputed layer) appear, so only the chunk's excess over
those is added: max(0, min(T, 4096) x V x 8 - T x layer x (2 if checkpointed else 1)) + V x H x 4.
The draft's inputs, kept from the policy forward to the draft update:
T ((taps + 1) H r + 4 Vd + 8): the tapped residuals, the embedding output, the float32 teacher over the draft
vocabulary and the policy's top-1 id. The draft update's own activations (its residual stream is fc's output,
in c; `draft.ttt_passes` passes; tested like the policy's) come after the policy backward has freed its
activations, logits and gathered weights, so only what they need beyond those is added ("draft update beyond
the freed activations").

Tokens per micro-batch per rank: `grpo.micro_batch_tokens` if set (whole documents: at least one document's
share ceil(doc / cp), at most the minibatch), else the whole minibatch per rank: ceil(rollout.prompts_per_step x
rollout.n / grpo.minibatches / dp) documents x doc / cp tokens, every document at its longest, doc =
(data.max_prompt_length, else rollout.max_model_len - rollout.response_length) + rollout.response_length.
Under pp a rank holds its stages' layers for the whole micro-batch (GPipe's bound; 1F1B holds less), and the
plan is the pipeline rank with the largest total.

The engine: vLLM takes `rollout.gpu_memory_utilization` x the GPU's memory on each GPU it runs on (weights and
KV cache; freed while the policy trains under sleep mode); `rollout.engine=torch` holds a copy of the policy in the
rollout dtype. A fixed `RESERVED_BYTES` (2 GiB) covers the CUDA context, NCCL's buffers and the allocator's slack.
Not counted in the engine's needs: vLLM's CUDA graphs and its sampler's activations (inside its share's KV room).

Suggestions (`suggest_fixes`): the smallest change that fits. The GPU levers, as layouts ordered by GPUs then
engine TP: parallel.dp doubled with parallel.fsdp=true (more nodes of 8), under pp more pipeline ranks, and
rollout.tensor_parallel_size doubled up to 8; on each layout the same-GPU keys (FSDP, checkpointing, the
micro-batch, the draft vocabulary, rollout.gpu_memory_utilization: raised to the smallest share that holds the
engine, or lowered to the largest that fits) are applied, largest row first. Every candidate is re-planned and
validated and kept only if it fits; among those on the fewest GPUs the one with the fewest keys wins.

Not counted, because they come after the backward has freed more than they need: the optimizer step's
temporaries and the gradient all-reduce's buffers.
"""
from __future__ import annotations

import bisect
import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from spectrain.config import SpecTrainConfig, validate
from spectrain.config.schema import PP_STAGES_PER_RANK, engines_on_every_rank
from spectrain.errors import ConfigError, InputWarning
from spectrain.models.eagle3 import Eagle3Config, read_draft_config
from spectrain.models.llama import LlamaConfig
from spectrain.train.inputs import policy_architecture

GIB = 1 << 30
FP32 = 4
ADAMW_BYTES = 2 * FP32  # two float32 moments a parameter
LOGITS_CHUNK_TOKENS = 4096  # rows of float32 logits the chunked log-softmax holds (ops.chunked_logprobs' default)
RESERVED_BYTES = 2 * GIB  # CUDA context, NCCL buffers, allocator slack
MICRO_BATCH_STEP = 1024  # suggested grpo.micro_batch_tokens are multiples of this
MICRO_BATCH_TARGET = 16384  # suggested when no micro-batch fits alone: enough tokens to keep an 8B's matmuls busy
SUGGESTED_DRAFT_VOCAB = 32000  # SpecForge's and vLLM's EAGLE-3 drafts for Llama 3 and Qwen3
MAX_SUGGESTED_DP = 1024
MAX_SUGGESTED_TP = 8  # an engine's TP group stays within one node
GPUS_PER_NODE = 8  # the node the host-memory row and the suggestions' node counts assume
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

ITEMS = {  # MemoryPlan field -> its row in the table; the total is their sum
    "parameters": "parameters (float32 master weights)",
    "gradients": "gradients (float32)",
    "optimizer": "optimizer state (AdamW: 2 float32 moments)",
    "gathered": "gathered weights (FSDP units / autocast copies)",
    "reference": "KL reference policy (frozen, grpo.reference_dtype)",
    "draft": "draft (EAGLE-3) + its optimizer",
    "activations": "activations",
    "logits": "logits chunk beyond the layers' backward + lm_head grad (float32)",
    "draft_inputs": "draft taps + teacher",
    "draft_update": "draft update beyond the freed activations",
    "engine": "rollout engine",
    "reserved": "CUDA context, NCCL, allocator slack",
}


RESIDENT = ("parameters", "optimizer", "reference", "draft")  # kept on the GPU through the rollout (sleep mode)


@dataclass(frozen=True)
class Precision:
    """Element sizes of the residual stream (`residual`) and of the matmuls (`compute`), in bytes."""

    residual: int
    compute: int

    @property
    def attention(self) -> int:
        return max(self.residual, self.compute)


@dataclass(frozen=True)
class StageShare:
    """What one pipeline rank holds: its decoder layers, the embedding (first), the head (last), the engine."""

    layers: int
    embedding: bool
    head: bool
    engine: bool


@dataclass(frozen=True)
class PlanInputs:
    """Everything the arithmetic reads, derived from the config once (`plan_inputs`)."""

    policy: LlamaConfig
    draft: Eagle3Config | None
    draft_trained: bool
    share: StageShare
    shards: int
    fsdp: bool
    precision: Precision
    tokens: int
    minibatch_tokens: int
    checkpointing: bool
    reference: bool
    ttt_passes: int
    engine: int
    engine_note: str
    gpu_memory: int
    reference_bytes: int = FP32  # per parameter of the KL reference (grpo.reference_dtype)
    engine_vllm: bool = False  # the engine row is a vLLM share that must hold `engine_weights` + `engine_kv_min`
    engine_tp: int = 1
    engine_weights: int = 0  # the engine's weight shard on this GPU: rollout-dtype parameters / TP
    engine_kv_token: int = 0  # its KV cache per token on this GPU
    engine_kv_sequences: int = 1  # full max_model_len sequences the minimum KV cache holds
    engine_kv_min: int = 0  # engine_kv_token x max_model_len x engine_kv_sequences
    sleep: bool = False  # vLLM's sleep mode: the engine's share is free while the policy trains
    host_per_node: int = 0  # host memory a node needs for the engines' offloaded weights (sleep level 1)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU, one field per row of the table (`ITEMS`); `activations` is the configured one of
    `activations_full` / `activations_checkpointed`."""

    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    reference: int
    draft: int
    activations: int
    logits: int
    draft_inputs: int
    draft_update: int
    engine: int
    reserved: int
    activations_full: int
    activations_checkpointed: int
    inputs: PlanInputs

    @property
    def training(self) -> int:
        """The training phase's peak: every row but the engine (the policy backward's peak, with the reserve)."""
        return sum(getattr(self, name) for name in ITEMS if name != "engine")

    @property
    def rollout(self) -> int:
        """The rollout phase under sleep mode: the engine's whole share, the state that stays on the GPU through the
        rollout (`RESIDENT`: weights, optimizer, reference, draft; the gradients are set to None after each
        optimizer step, the activations are gone) and the reserve."""
        return self.engine + sum(getattr(self, name) for name in RESIDENT) + self.reserved

    @property
    def total(self) -> int:
        """The device peak: with sleep mode the engine's share is free while the policy trains, so the peak is
        max(training phase, rollout phase); without it the engine keeps its share through the step: their sum."""
        if self.inputs.sleep:
            return max(self.training, self.rollout)
        return self.training + self.engine

    @property
    def gpu_memory(self) -> int:
        return self.inputs.gpu_memory

    @property
    def engine_needs(self) -> int:
        """What the engine's share must hold: its weight shard and the minimum KV cache (vLLM only)."""
        x = self.inputs
        return x.engine_weights + x.engine_kv_min if x.engine_vllm else 0

    @property
    def engine_holds(self) -> bool:
        """Whether the engine's share holds its weight shard and the minimum KV cache (vLLM refuses to start
        otherwise)."""
        return self.engine_needs <= self.engine

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_memory and self.engine_holds

    def largest(self) -> list[str]:
        """The rows of the peak from the largest down: what to shrink first (under sleep mode, those of its
        peak phase: the training rows, or the engine and the resident state)."""
        rows = list(ITEMS)
        if self.inputs.sleep:
            rows = [n for n in ITEMS if n != "engine"] if self.training >= self.rollout else ["engine", *RESIDENT]
        return sorted(rows, key=lambda name: -getattr(self, name))


# ---------------------------------------------------------------- parameters

def layer_parameters(cfg: LlamaConfig) -> int:
    """One decoder layer: attention (with Qwen2's biases, Qwen3's qk-norm), SwiGLU, two RMSNorms."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attention = h * (q + 2 * kv) + q * h
    biases = (q + 2 * kv if cfg.attention_bias else 0) + (h if cfg.o_proj_bias else 0)
    qk_norm = 2 * cfg.head_dim if cfg.qk_norm else 0
    return attention + biases + qk_norm + 3 * h * cfg.intermediate_size + 2 * h


def root_parameters(cfg: LlamaConfig, share: StageShare) -> int:
    """What is not in a decoder layer (FSDP's root unit): the embedding, the final norm and an untied lm_head."""
    embedding = cfg.vocab_size * cfg.hidden_size if share.embedding else 0
    lm_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    head = (cfg.hidden_size + lm_head) if share.head else 0
    return embedding + head


def stage_parameters(cfg: LlamaConfig, share: StageShare) -> int:
    return share.layers * layer_parameters(cfg) + root_parameters(cfg, share)


def policy_parameters(cfg: LlamaConfig) -> int:
    return stage_parameters(cfg, StageShare(cfg.num_hidden_layers, embedding=True, head=True, engine=True))


def draft_parameters(d: Eagle3Config) -> int:
    """fc over the taps, one layer with 2H attention inputs, four RMSNorms, lm_head over the draft vocabulary."""
    h, q, kv = d.hidden_size, d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    fc = len(d.tap_layers) * d.target_hidden_size * h
    attention = 2 * h * (q + 2 * kv) + q * h
    return fc + attention + 3 * h * d.intermediate_size + 4 * h + h * d.draft_vocab_size


def pipeline_shares(num_layers: int, pp: int, stages_per_rank: int,
                    engine_everywhere: bool = False) -> list[StageShare]:
    """Each pipeline rank's share: stage s (earlier stages take the remainder, as `stage_layer_ids`) runs on
    rank s % pp; the first stage has the embedding, the last the head; rank 0 hosts an engine (every rank
    with `engine_everywhere`)."""
    stages = pp * stages_per_rank
    base, extra = divmod(num_layers, stages)
    layers = [base + (s < extra) for s in range(stages)]
    assert min(layers) >= 1, f"{num_layers} layers cannot fill {stages} stages (validation refuses this)"
    return [StageShare(sum(layers[r::pp]), embedding=r == 0, head=r == (stages - 1) % pp,
                       engine=r == 0 or engine_everywhere) for r in range(pp)]


# ---------------------------------------------------------------- activations

def _norm(input_bytes: int, width: int, rows: int = 1) -> int:
    """An RMSNorm saves a float32 copy of its input, its normed output (in the input's dtype) and the float32
    reciprocal norm of each of its `rows`."""
    return (FP32 + input_bytes) * width + FP32 * rows


def _linear_inputs(p: Precision, linears: int, width: int) -> int:
    """`linears` projections reading one input: autocast saves one cast copy each when the dtypes differ."""
    return linears * p.compute * width if p.residual != p.compute else p.residual * width


def layer_activation_bytes(cfg: LlamaConfig, p: Precision) -> int:
    """Bytes autograd saves per token in one decoder layer (the table in the module docstring)."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    norms = 2 * _norm(p.residual, h)
    inputs = _linear_inputs(p, 3, h) + _linear_inputs(p, 2, h)
    heads = cfg.num_attention_heads + cfg.num_key_value_heads
    qk_norm = _norm(p.compute, q + kv, heads) if cfg.qk_norm else 0
    attention = p.attention * (2 * q + 2 * kv) + FP32 * cfg.num_attention_heads
    o_proj = p.compute * q if p.attention != p.compute else 0
    return norms + inputs + qk_norm + attention + o_proj + 4 * p.compute * cfg.intermediate_size


def outside_activation_bytes(cfg: LlamaConfig, p: Precision) -> int:
    """Per token outside the layers: the input id, the rotary tables, the final norm, and what the chunked
    log-softmax keeps (the lm_head's input and a float32 log-sum-exp)."""
    rotary = 2 * cfg.head_dim * p.residual
    return 8 + rotary + _norm(p.residual, cfg.hidden_size) + _linear_inputs(p, 1, cfg.hidden_size) + FP32


def policy_activation_bytes(cfg: LlamaConfig, p: Precision, layers: int, tokens: int, checkpointed: bool) -> int:
    """A micro-batch's activations at the start of its backward, with one layer of gradients in flight (and,
    checkpointed, the layer inputs plus the one layer recomputed)."""
    layer = layer_activation_bytes(cfg, p)
    kept = layers * p.residual * cfg.hidden_size + 2 * layer if checkpointed else (layers + 1) * layer
    return tokens * (kept + outside_activation_bytes(cfg, p))


def logits_bytes(cfg: LlamaConfig, tokens: int, layers_backward: int) -> int:
    """One chunk of float32 logits and a temporary of its size, and the lm_head gradient the chunked backward
    accumulates in float32 (`ops.chunked_logprobs`). The chunk is freed before the layers' backward starts, so
    it adds only what exceeds `layers_backward`, the bytes the activations row counts for that backward."""
    chunk = min(tokens, LOGITS_CHUNK_TOKENS) * cfg.vocab_size * 2 * FP32
    return max(0, chunk - layers_backward) + FP32 * cfg.vocab_size * cfg.hidden_size


def layers_backward_bytes(cfg: LlamaConfig, p: Precision, tokens: int, checkpointed: bool) -> int:
    """What the activations row adds for the layers' backward: one layer of gradients in flight and, checkpointed,
    the layer being recomputed."""
    return tokens * layer_activation_bytes(cfg, p) * (2 if checkpointed else 1)


def draft_input_bytes(d: Eagle3Config, p: Precision, tokens: int) -> int:
    """The taps and the embedding output (residual dtype), the float32 teacher over the draft vocabulary and the
    policy's top-1 id (`teacher_on_draft_vocab`)."""
    residuals = (len(d.tap_layers) + 1) * d.target_hidden_size * p.residual
    return tokens * (residuals + FP32 * d.draft_vocab_size + 8)


def draft_pass_bytes(d: Eagle3Config, p: Precision) -> int:
    """Per token, one TTT pass of the draft's layer. Its residual stream is fc's output, in the compute dtype;
    the embedding it reads is detached, so that norm saves only its output; each pass has its own rotary tables."""
    h, q, kv = d.hidden_size, d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    norms = p.residual * h + 3 * _norm(p.compute, h)  # input (embedding), hidden, post-attention, final norm
    inputs = _linear_inputs(p, 3, 2 * h) + _linear_inputs(p, 2, h)
    attention = p.attention * (2 * q + 2 * kv) + FP32 * d.num_attention_heads
    o_proj = p.compute * q if p.attention != p.compute else 0
    rotary = 2 * d.head_dim * p.residual
    return norms + inputs + attention + o_proj + 4 * p.compute * d.intermediate_size + rotary


def draft_unroll_bytes(d: Eagle3Config, p: Precision, passes: int) -> int:
    """Per token, what the draft update's forward saves: fc's input, `passes` passes, and per pass the loss's
    normed hidden, row index, mask and two float32 log-sum-exps (`_FusedSoftCE`). Pass k re-casts the k values
    it attends to when attention runs wider than v (`common_dtype`); in float32 one pass's final norm and the
    next pass's hidden norm save the same tensor."""
    h, kv = d.hidden_size, d.num_key_value_heads * d.head_dim
    recast = p.attention * kv * passes * (passes - 1) // 2 if p.attention != p.compute else 0
    shared = (passes - 1) * FP32 * h if p.compute == FP32 else 0
    loss = p.residual * h + 8 + 1 + 2 * FP32
    fc = _linear_inputs(p, 1, len(d.tap_layers) * d.target_hidden_size)
    return fc + passes * (draft_pass_bytes(d, p) + loss) + recast - shared


def draft_update_bytes(d: Eagle3Config, p: Precision, tokens: int, passes: int) -> int:
    """The draft update's activations, with one pass of gradients in flight."""
    return tokens * (draft_unroll_bytes(d, p, passes) + draft_pass_bytes(d, p))


# ---------------------------------------------------------------- tokens

def document_tokens(config: SpecTrainConfig) -> int:
    """The longest document: the longest prompt plus a full completion."""
    r = config.rollout
    prompt = config.data.max_prompt_length or r.max_model_len - r.response_length
    return prompt + r.response_length


def minibatch_tokens_per_rank(config: SpecTrainConfig) -> int:
    """One update's documents on one data-parallel rank, split over the context-parallel ranks."""
    r, par = config.rollout, config.parallel
    documents = math.ceil(r.prompts_per_step * r.n / config.grpo.minibatches / par.dp)
    return math.ceil(documents * document_tokens(config) / par.cp)


def micro_batch_floor(config: SpecTrainConfig) -> int:
    """A micro-batch holds whole documents: at least one document's share per rank."""
    return math.ceil(document_tokens(config) / config.parallel.cp)


def micro_batch_tokens(config: SpecTrainConfig) -> int:
    """Tokens per micro-batch per rank: `grpo.micro_batch_tokens` (within one document .. the minibatch), else
    the whole minibatch."""
    whole, cap = minibatch_tokens_per_rank(config), config.grpo.micro_batch_tokens
    return whole if cap is None else min(whole, max(cap, micro_batch_floor(config)))


# ---------------------------------------------------------------- the plan

def precision(config: SpecTrainConfig) -> Precision:
    if config.policy.dtype == "float32":
        return Precision(residual=4, compute=4)
    return Precision(residual=2 if config.parallel.fsdp else 4, compute=2)


def rollout_dtype_bytes(config: SpecTrainConfig) -> int:
    r = config.rollout
    return DTYPE_BYTES[config.policy.dtype if r.dtype == "auto" else r.dtype]


def engine_weight_bytes(policy: LlamaConfig, dtype_bytes: int, tp: int) -> int:
    """The engine's weights on one GPU of its TP group: every parameter in the rollout dtype over TP (vLLM shards
    the layers' matmuls and the vocabulary-parallel embedding and lm_head; the replicated norms are negligible)."""
    return math.ceil(policy_parameters(policy) * dtype_bytes / tp)


def kv_bytes_per_token(policy: LlamaConfig, dtype_bytes: int, tp: int) -> int:
    """vLLM's KV cache per token on one GPU of its TP group: a key and a value (2) per layer, for the GPU's
    ceil(kv_heads / TP) kv heads (vLLM replicates them when TP > kv_heads), of head_dim elements in the cache's
    dtype (the rollout dtype): 2 x L x ceil(kv_heads / TP) x head_dim x bytes."""
    kv_heads = math.ceil(policy.num_key_value_heads / tp)
    return 2 * policy.num_hidden_layers * kv_heads * policy.head_dim * dtype_bytes


def engine_kv_sequences(config: SpecTrainConfig) -> int:
    """Full `rollout.max_model_len` sequences the minimum KV cache must hold: `rollout.vllm_kwargs.max_num_seqs`
    when set (all of them at once), else 1 (vLLM refuses to start when its cache cannot hold one
    max_model_len sequence; it runs more sequences by preempting)."""
    return int(config.rollout.vllm_kwargs.get("max_num_seqs", 1))


def sleep_mode(config: SpecTrainConfig) -> bool:
    """`rollout.enable_sleep_mode` resolved as the trainer resolves it: None is on with CUDA, off on CPU (a plan is
    for a GPU: off only under trainer.accelerator=cpu); vLLM only."""
    r = config.rollout
    if r.engine != "vllm":
        return False
    return r.enable_sleep_mode if r.enable_sleep_mode is not None else config.trainer.accelerator != "cpu"


def engine_share(config: SpecTrainConfig, policy: LlamaConfig, gpu_memory: int) -> tuple[int, str]:
    """What the rollout engine takes of a GPU that hosts it, and how that was computed."""
    r = config.rollout
    if r.engine == "vllm":
        return int(r.gpu_memory_utilization * gpu_memory), f"vLLM: {r.gpu_memory_utilization} x GPU memory"
    dtype = config.policy.dtype if r.dtype == "auto" else r.dtype
    return policy_parameters(policy) * DTYPE_BYTES[dtype], f"torch engine: the policy in {dtype}"


def plan_inputs(config: SpecTrainConfig, policy: LlamaConfig, draft: Eagle3Config | None, share: StageShare,
                gpu_memory: int) -> PlanInputs:
    par, r = config.parallel, config.rollout
    engine, note = engine_share(config, policy, gpu_memory) if share.engine else (0, "on pipeline rank 0")
    vllm = share.engine and r.engine == "vllm"
    dtype_bytes, tp = rollout_dtype_bytes(config), r.tensor_parallel_size
    weights = engine_weight_bytes(policy, dtype_bytes, tp) if vllm else 0
    kv_token = kv_bytes_per_token(policy, dtype_bytes, tp) if vllm else 0
    sequences = engine_kv_sequences(config)
    sleep = vllm and sleep_mode(config)
    world = par.dp * par.cp * par.pp
    engine_gpus = min(world, GPUS_PER_NODE) if engines_on_every_rank(config) else 1
    return PlanInputs(
        policy=policy, draft=draft if share.head else None, draft_trained=config.draft.mode == "cotrained",
        share=share, shards=par.dp * par.cp if par.fsdp else 1, fsdp=par.fsdp, precision=precision(config),
        tokens=micro_batch_tokens(config), minibatch_tokens=minibatch_tokens_per_rank(config),
        checkpointing=config.policy.activation_checkpointing, reference=config.grpo.kl_loss_coef > 0,
        ttt_passes=config.draft.ttt_passes, engine=engine, engine_note=note, gpu_memory=gpu_memory,
        reference_bytes=DTYPE_BYTES[config.grpo.reference_dtype], engine_vllm=vllm, engine_tp=tp,
        engine_weights=weights, engine_kv_token=kv_token, engine_kv_sequences=sequences,
        engine_kv_min=kv_token * r.max_model_len * sequences, sleep=sleep,
        host_per_node=weights * engine_gpus if sleep else 0)


def gathered_bytes(x: PlanInputs) -> int:
    """FSDP: the root unit and two layers gathered, one layer's unsharded gradients (the lm_head's is the logits
    row's accumulator; the embedding's comes at the end of the backward), and the reference's root and two
    layers; without FSDP, autocast's cached bf16 copy of every trainable weight."""
    c, layer = x.precision.compute, layer_parameters(x.policy)
    if not x.fsdp:
        return stage_parameters(x.policy, x.share) * 2 if c == 2 else 0
    gathered = root_parameters(x.policy, x.share) + 2 * layer
    reference = min(c, x.reference_bytes) * gathered if x.reference else 0  # a bf16 reference gathers in bf16
    return c * (gathered + layer) + reference


def draft_gathered_bytes(x: PlanInputs) -> int:
    """During the draft update: FSDP gathers the draft and its gradients in the compute dtype; without FSDP,
    autocast caches a bf16 copy of its weights."""
    if x.draft is None:
        return 0
    if x.fsdp:
        return 2 * x.precision.compute * draft_parameters(x.draft)
    return 2 * draft_parameters(x.draft) if x.precision.compute == 2 else 0


def draft_state_bytes(x: PlanInputs) -> int:
    if x.draft is None:
        return 0
    per_parameter = 2 * FP32 + ADAMW_BYTES if x.draft_trained else FP32  # weights (+ gradients and moments)
    return _sharded(per_parameter, draft_parameters(x.draft), x.shards)


def _sharded(bytes_per_parameter: int, parameters: int, shards: int) -> int:
    return math.ceil(bytes_per_parameter * parameters / shards)


def plan_memory(x: PlanInputs) -> MemoryPlan:
    """The plan for one GPU's share `x.share`: pure arithmetic on `x`."""
    p, cfg, t = x.precision, x.policy, x.tokens
    params = stage_parameters(cfg, x.share)
    full = policy_activation_bytes(cfg, p, x.share.layers, t, checkpointed=False)
    checkpointed = policy_activation_bytes(cfg, p, x.share.layers, t, checkpointed=True)
    activations = checkpointed if x.checkpointing else full
    layers_backward = layers_backward_bytes(cfg, p, t, x.checkpointing)
    logits = logits_bytes(cfg, t, layers_backward) if x.share.head else 0
    gathered = gathered_bytes(x)
    trained_draft = x.draft if x.draft_trained else None
    draft_inputs = draft_input_bytes(trained_draft, p, t) if trained_draft is not None else 0
    draft_update = 0
    if trained_draft is not None:  # counted only beyond what the policy backward freed before it
        draft_phase = draft_update_bytes(trained_draft, p, t, x.ttt_passes) + draft_gathered_bytes(x)
        draft_update = max(0, draft_phase - (activations + logits + gathered))
    weights = _sharded(FP32, params, x.shards)
    return MemoryPlan(
        parameters=weights, gradients=weights, optimizer=_sharded(ADAMW_BYTES, params, x.shards), gathered=gathered,
        reference=_sharded(x.reference_bytes, params, x.shards) if x.reference else 0, draft=draft_state_bytes(x),
        activations=activations,
        logits=logits, draft_inputs=draft_inputs, draft_update=draft_update, engine=x.engine,
        reserved=RESERVED_BYTES, activations_full=full, activations_checkpointed=checkpointed, inputs=x)


def draft_architecture(config: SpecTrainConfig, policy: LlamaConfig) -> Eagle3Config | None:
    """The draft `SpecTrainer.build_draft` would build: from `draft.path`'s config.json, or sized from the policy."""
    d = config.draft
    if d.mode == "none":
        return None
    if d.init == "path":
        assert d.path is not None  # validated: draft.init=path needs draft.path
        return read_draft_config(d.path, policy)
    try:
        return Eagle3Config.from_policy(policy, draft_vocab_size=d.draft_vocab_size,
                                        tap_layers=tuple(d.tap_layers) if d.tap_layers is not None else None)
    except ValueError as exc:  # named as the warm start names it
        key = "draft.tap_layers" if "tap_layers" in str(exc) else "draft.draft_vocab_size"
        raise ConfigError(f"{key}: {exc}") from exc


def plan_config(config: SpecTrainConfig, gpu_memory: int, policy: LlamaConfig | None = None) -> MemoryPlan:
    """The plan of the busiest GPU (under pp, the pipeline rank with the largest total)."""
    policy = policy or policy_architecture(config)
    draft = draft_architecture(config, policy)
    par = config.parallel
    shares = pipeline_shares(policy.num_hidden_layers, par.pp, PP_STAGES_PER_RANK[par.pp_schedule],
                             engine_everywhere=engines_on_every_rank(config))
    plans = [plan_memory(plan_inputs(config, policy, draft, share, gpu_memory)) for share in shares]
    return max(plans, key=lambda plan: plan.total)


# ---------------------------------------------------------------- what to change

Overrides = dict[str, object]
Fixer = Callable[[SpecTrainConfig, LlamaConfig, int], "Overrides | None"]


def with_overrides(config: SpecTrainConfig, overrides: Overrides) -> SpecTrainConfig:
    """A copy of `config` with dotted keys set (checked apart, by `_valid`, where a suggestion needs it)."""
    out = copy.deepcopy(config)
    for key, value in overrides.items():
        section, name = key.rsplit(".", 1)
        node = out
        for part in section.split("."):
            node = getattr(node, part)
        assert hasattr(node, name), key
        setattr(node, name, value)
    return out


def _valid(config: SpecTrainConfig) -> bool:
    """Whether a suggestion is a config `spectrain fit` accepts (a plan that fits an impossible layout is none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InputWarning)
        try:
            validate(config)
        except ConfigError:
            return False
    return True


def _fits(config: SpecTrainConfig, policy: LlamaConfig, gpu_memory: int, overrides: Overrides) -> bool:
    candidate = with_overrides(config, overrides)
    return _valid(candidate) and plan_config(candidate, gpu_memory, policy).fits


def _smallest_micro_batch(config: SpecTrainConfig) -> int:
    """The smallest suggestion: one document's share, rounded up to `MICRO_BATCH_STEP`."""
    return math.ceil(micro_batch_floor(config) / MICRO_BATCH_STEP) * MICRO_BATCH_STEP


def largest_fitting_micro_batch(config: SpecTrainConfig, policy: LlamaConfig, gpu_memory: int,
                                below: int) -> int | None:
    """The largest multiple of `MICRO_BATCH_STEP` under `below` (and not under one document) that fits (memory
    grows with the micro-batch, so a bisection finds it)."""
    candidates = range(_smallest_micro_batch(config), below, MICRO_BATCH_STEP)
    first_too_large = bisect.bisect_left(
        candidates, True, key=lambda n: not _fits(config, policy, gpu_memory, {"grpo.micro_batch_tokens": n}))
    return candidates[first_too_large - 1] if first_too_large else None


def _smaller_micro_batch(config: SpecTrainConfig, policy: LlamaConfig, gpu_memory: int) -> Overrides | None:
    """The largest micro-batch that fits; if none does, `MICRO_BATCH_TARGET` (then one document), and the next
    row shrinks."""
    current, start = micro_batch_tokens(config), _smallest_micro_batch(config)
    if start >= current:
        return None
    best = largest_fitting_micro_batch(config, policy, gpu_memory, current)
    fallback = max(start, MICRO_BATCH_TARGET) if MICRO_BATCH_TARGET < current else start
    return {"grpo.micro_batch_tokens": best or fallback}


def _checkpointing(config: SpecTrainConfig, policy: LlamaConfig, gpu_memory: int) -> Overrides | None:
    return None if config.policy.activation_checkpointing else {"policy.activation_checkpointing": True}


def _shard(config: SpecTrainConfig, policy: LlamaConfig, gpu_memory: int) -> Overrides | None:
    par = config.parallel
    return None if par.fsdp or par.dp * par.cp == 1 else {"parallel.fsdp": True}  # under pp: each stage sharded


def _draft_vocab(config: SpecTrainConfig, policy: LlamaConfig, gpu_memory: int) -> Overrides | None:
    d = config.draft
    if d.init != "scratch" or d.draft_vocab_size is not None or policy.vocab_size <= SUGGESTED_DRAFT_VOCAB:
        return None
    return {"draft.draft_vocab_size": SUGGESTED_DRAFT_VOCAB}


def engine_share_needed(config: SpecTrainConfig, policy: LlamaConfig, gpu_memory: int) -> float:
    """The smallest `rollout.gpu_memory_utilization` (in 0.01 steps) that holds the engine's weight shard and the
    minimum KV cache."""
    tp, dtype_bytes = config.rollout.tensor_parallel_size, rollout_dtype_bytes(config)
    kv = kv_bytes_per_token(policy, dtype_bytes, tp) * config.rollout.max_model_len * engine_kv_sequences(config)
    return math.ceil(100 * (engine_weight_bytes(policy, dtype_bytes, tp) + kv) / gpu_memory) / 100


def _engine_share(config: SpecTrainConfig, policy: LlamaConfig, gpu_memory: int) -> Overrides | None:
    """The largest `rollout.gpu_memory_utilization` (in 0.01 steps) that fits, if it still holds the engine's
    weights and minimum KV cache; or the smallest that holds them, if the current one does not."""
    r = config.rollout
    if r.engine != "vllm":
        return None
    plan = plan_config(config, gpu_memory, policy)
    needed = engine_share_needed(config, policy, gpu_memory)
    if not plan.engine_holds:
        return {"rollout.gpu_memory_utilization": needed} if needed <= MAX_ENGINE_SHARE else None
    rest = plan.training if not plan.inputs.sleep else plan.rollout - plan.engine
    share = math.floor(100 * (gpu_memory - rest) / gpu_memory) / 100
    if share >= r.gpu_memory_utilization or share < needed:
        return None
    return {"rollout.gpu_memory_utilization": share}


FIXERS: dict[str, tuple[Fixer, ...]] = {  # each row -> the keys of the same GPUs that shrink it, in order to try
    "parameters": (_shard,),
    "gradients": (_shard,),
    "optimizer": (_shard,),
    "reference": (_shard,),
    "draft": (_shard, _draft_vocab),
    "activations": (_checkpointing, _smaller_micro_batch),
    "logits": (_smaller_micro_batch,),
    "draft_inputs": (_smaller_micro_batch, _draft_vocab),
    "draft_update": (_smaller_micro_batch,),
    "engine": (_engine_share,),
}
MAX_ENGINE_SHARE = 0.95  # the largest rollout.gpu_memory_utilization a suggestion sets


def _next_fix(config: SpecTrainConfig, policy: LlamaConfig, gpu_memory: int, plan: MemoryPlan) -> Overrides | None:
    """The first key that shrinks the largest row it can shrink (the engine first when it cannot hold its
    weights)."""
    rows = (["engine"] if not plan.engine_holds else []) + plan.largest()
    for item in rows:
        for fixer in FIXERS.get(item, ()):
            change = fixer(config, policy, gpu_memory)
            if change and _valid(with_overrides(config, change)):
                return change
    return None


def _same_gpus(config: SpecTrainConfig, policy: LlamaConfig, gpu_memory: int, applied: Overrides
               ) -> tuple[Overrides, MemoryPlan]:
    """From `applied`, keys of the same GPUs (`FIXERS`), largest row first, until the plan fits or none is left."""
    applied = dict(applied)
    plan = plan_config(with_overrides(config, applied), gpu_memory, policy)
    for _ in range(len(FIXERS) + 8):  # each fix shrinks its row for good: a handful are ever applied
        if plan.fits:
            break
        change = _next_fix(with_overrides(config, applied), policy, gpu_memory, plan)
        if change is None:
            break
        applied.update(change)
        plan = plan_config(with_overrides(config, applied), gpu_memory, policy)
    return applied, plan


def _world(config: SpecTrainConfig, overrides: Overrides) -> int:
    par = with_overrides(config, overrides).parallel
    return par.dp * par.cp * par.pp


def _layouts(config: SpecTrainConfig, policy: LlamaConfig) -> list[Overrides]:
    """The GPU levers, each a layout: the ranks (parallel.dp doubled, with FSDP; under pp, more pipeline ranks;
    so more nodes) and the engine's tensor-parallel size (doubled up to `MAX_SUGGESTED_TP`, a divisor of the
    ranks). Ordered by cost: GPUs, then engine TP."""
    par, r = config.parallel, config.rollout
    ranks: list[Overrides] = [{}]
    dp = par.dp * 2
    while dp <= MAX_SUGGESTED_DP:
        ranks.append({"parallel.dp": dp, "parallel.fsdp": True})
        dp *= 2
    if par.pp > 1:
        stages_per_rank = PP_STAGES_PER_RANK[par.pp_schedule]
        for pp in range(par.pp + 1, policy.num_hidden_layers // stages_per_rank + 1):
            enough = math.ceil(max(par.microbatches, pp * stages_per_rank) / pp) * pp  # 1F1B: a microbatch a stage
            ranks.append({"parallel.pp": pp, "parallel.microbatches": enough})
    tps = [r.tensor_parallel_size]
    while r.engine == "vllm" and tps[-1] * 2 <= MAX_SUGGESTED_TP:
        tps.append(tps[-1] * 2)
    layouts = [{**rank, **({"rollout.tensor_parallel_size": tp} if tp != r.tensor_parallel_size else {})}
               for rank in ranks for tp in tps]
    return sorted(layouts, key=lambda o: (_world(config, o), o.get("rollout.tensor_parallel_size", 0)))


def _cost(config: SpecTrainConfig, overrides: Overrides) -> tuple[int, int, int]:
    """GPUs, then keys changed, then engine TP: the smallest change first."""
    return (_world(config, overrides), len(overrides),
            int(str(overrides.get("rollout.tensor_parallel_size", config.rollout.tensor_parallel_size))))


def suggest_fixes(config: SpecTrainConfig, gpu_memory: int, policy: LlamaConfig | None = None
                  ) -> tuple[Overrides, MemoryPlan]:
    """The smallest change that fits: for each layout (`_layouts`, fewest GPUs first), the same-GPU keys
    (`_same_gpus`) on top; every candidate is re-planned and kept only if it fits and validates; the cheapest
    (`_cost`) of the fewest GPUs wins. Returns the keys and their plan (no keys, and the best plan tried, if
    nothing fits)."""
    policy = policy or policy_architecture(config)
    plan = plan_config(config, gpu_memory, policy)
    if plan.fits:
        return {}, plan
    fitting: list[tuple[tuple[int, int, int], Overrides, MemoryPlan]] = []
    fallback: tuple[Overrides, MemoryPlan] = ({}, plan)
    for layout in _layouts(config, policy):
        if fitting and _world(config, layout) > fitting[0][0][0]:
            break  # a fit on fewer GPUs is cheaper than any on more
        if layout and not _valid(with_overrides(config, layout)):
            continue
        applied, fixed = _same_gpus(config, policy, gpu_memory, layout)
        applied = {k: v for k, v in applied.items() if _value(v) != _value(_current(config, k))}
        if fixed.fits and _valid(with_overrides(config, applied)):
            fitting.append((_cost(config, applied), applied, fixed))
            fitting.sort(key=lambda f: f[0])
        elif not layout:
            fallback = (applied, fixed)
    if fitting:
        return fitting[0][1], fitting[0][2]
    return fallback


def _current(config: SpecTrainConfig, key: str) -> object:
    node: object = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def format_overrides(overrides: Overrides) -> str:
    return " ".join(f"{key}={_value(value)}" for key, value in overrides.items())


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _nodes(world: int) -> str:
    nodes = math.ceil(world / GPUS_PER_NODE)
    return f"{nodes} node{'s' if nodes > 1 else ''} x {min(world, GPUS_PER_NODE)} GPUs"


def engine_problem(plan: MemoryPlan) -> str:
    """Why the engine's share cannot start vLLM, or '' if it can."""
    if plan.engine_holds:
        return ""
    x = plan.inputs
    return (f"the rollout engine's share ({_gib(plan.engine)} GiB) cannot hold its weight shard "
            f"({_gib(x.engine_weights)} GiB at rollout.tensor_parallel_size={x.engine_tp}) plus a minimum KV cache "
            f"({_gib(x.engine_kv_min)} GiB)")


def verdict(plan: MemoryPlan, config: SpecTrainConfig, policy: LlamaConfig | None = None) -> str:
    """One paragraph: it fits (how much is free), or why not and the smallest change that fits."""
    if plan.fits:
        free = plan.gpu_memory - plan.total
        return f"fits: {_gib(plan.total)} of {_gib(plan.gpu_memory)} GiB ({_gib(free)} GiB free)"
    largest = plan.largest()[0]
    problems = [engine_problem(plan)] if not plan.engine_holds else []
    if plan.total > plan.gpu_memory:
        problems.append(f"{_gib(plan.total)} GiB > {_gib(plan.gpu_memory)} GiB; the largest item is "
                        f"{ITEMS[largest]} ({_gib(getattr(plan, largest))} GiB)")
    head = "does not fit: " + "; and ".join(problems)
    fixes, fixed = suggest_fixes(config, plan.gpu_memory, policy)
    if fixed.fits and fixes:
        world = _world(config, fixes)
        return (f"{head}. To fit, set {format_overrides(fixes)} (plans to {_gib(fixed.total)} GiB a GPU on "
                f"{_nodes(world)})")
    return (f"{head}. No layout up to parallel.dp={MAX_SUGGESTED_DP} (with parallel.fsdp=true) and "
            f"rollout.tensor_parallel_size={MAX_SUGGESTED_TP} fits: use GPUs with more memory")


# ---------------------------------------------------------------- the table

def _count(n: int) -> str:
    return f"{n / 1e9:.2f}e9" if n >= 1e8 else f"{n / 1e6:.2f}e6" if n >= 1e5 else str(n)


def _gathered_note(x: PlanInputs) -> str:
    if not x.fsdp:
        params = stage_parameters(x.policy, x.share)
        return f"2 B x {_count(params)} (autocast's bf16 weights)" if x.precision.compute == 2 else "none in float32"
    root, layer = _count(root_parameters(x.policy, x.share)), _count(layer_parameters(x.policy))
    reference = "; the reference's root + 2 layers" if x.reference else ""
    return f"{x.precision.compute} B x (root {root} + 2 layers of {layer}, 1 layer's grads){reference}"


def _activations_note(x: PlanInputs) -> str:
    p, layer = x.precision, layer_activation_bytes(x.policy, x.precision)
    kept = (f"{x.share.layers} x {p.residual * x.policy.hidden_size} + 2 x {layer}" if x.checkpointing
            else f"{x.share.layers + 1} x {layer}")
    how = "checkpointed" if x.checkpointing else "not checkpointed"
    return f"{how}: {x.tokens} tokens x ({kept} + {outside_activation_bytes(x.policy, p)} B)"


def _engine_note(x: PlanInputs) -> str:
    if not x.engine_vllm:
        return x.engine_note
    sleep = "; asleep while the policy trains" if x.sleep else "; held through the step (no sleep mode)"
    return f"{x.engine_note}{sleep}"


def _engine_lines(plan: MemoryPlan) -> list[str]:
    """The engine's needs, the two phases under sleep mode, and the host memory for the offloaded weights."""
    x = plan.inputs
    if not x.engine_vllm:
        return []
    need = (f"rollout engine needs {_gib(plan.engine_needs)} GiB of its {_gib(plan.engine)}: weights "
            f"{_gib(x.engine_weights)} (parameters x {rollout_bytes(x)} B / TP {x.engine_tp}) + minimum KV cache "
            f"{_gib(x.engine_kv_min)} ({x.engine_kv_sequences} x "
            f"{x.engine_kv_min // max(1, x.engine_kv_token * x.engine_kv_sequences)} tokens x "
            f"{x.engine_kv_token} B: 2 x {x.policy.num_hidden_layers} layers x "
            f"ceil({x.policy.num_key_value_heads} kv heads / {x.engine_tp}) x {x.policy.head_dim} x "
            f"{rollout_bytes(x)} B){'' if plan.engine_holds else ': DOES NOT HOLD'}")
    lines = [need]
    if x.sleep:
        lines.append(f"sleep mode: peak = max(training {_gib(plan.training)}, rollout {_gib(plan.rollout)}: engine + "
                     f"parameters, optimizer, reference, draft + reserve); host memory for the offloaded weights: "
                     f"{_gib(x.host_per_node)} GiB a node ({_gib(x.engine_weights)} x the node's GPUs with an engine)")
    else:
        lines.append(f"no sleep mode: peak = training {_gib(plan.training)} + engine {_gib(plan.engine)}")
    return lines


def rollout_bytes(x: PlanInputs) -> int:
    """The rollout dtype's element size, from the plan's weight shard (bytes per parameter per TP rank)."""
    return round(x.engine_weights * x.engine_tp / policy_parameters(x.policy)) if x.engine_weights else 0


def _notes(plan: MemoryPlan) -> dict[str, str]:
    """The 'how' column: each row's formula with this plan's numbers."""
    x = plan.inputs
    params, s = _count(stage_parameters(x.policy, x.share)), x.shards
    d = x.draft
    return {
        "parameters": f"4 B x {params} / {s}", "gradients": f"4 B x {params} / {s}",
        "optimizer": f"8 B x {params} / {s}", "gathered": _gathered_note(x),
        "reference": f"{x.reference_bytes} B x {params} / {s}" if x.reference else "none (grpo.kl_loss_coef=0)",
        "draft": "none" if d is None else f"{16 if x.draft_trained else 4} B x {_count(draft_parameters(d))} / {s}",
        "activations": _activations_note(x),
        "logits": "none" if not plan.logits else f"{min(x.tokens, LOGITS_CHUNK_TOKENS)} tokens x {x.policy.vocab_size}"
        f" x 8 B less the layers' backward, + lm_head grad {x.policy.vocab_size} x {x.policy.hidden_size} x 4 B",
        "draft_inputs": "none" if d is None or not plan.draft_inputs else
        f"{x.tokens} tokens x ({len(d.tap_layers) + 1} x {d.target_hidden_size} x {x.precision.residual} B"
        f" + {d.draft_vocab_size} x 4 + 8 B)",
        "draft_update": "none" if d is None or not plan.draft_inputs else
        f"{x.tokens} tokens x {draft_unroll_bytes(d, x.precision, x.ttt_passes) + draft_pass_bytes(d, x.precision)} B"
        f" ({x.ttt_passes} passes), less what the policy backward freed",
        "engine": _engine_note(x), "reserved": "fixed",
    }


def format_plan(plan: MemoryPlan, title: str) -> str:
    """The table `spectrain plan` prints (its verdict follows)."""
    x = plan.inputs
    cfg, p = x.policy, x.precision
    draft = "no draft" if x.draft is None else (
        f"draft {_count(draft_parameters(x.draft))} parameters (vocab {x.draft.draft_vocab_size}, "
        f"{'co-trained' if x.draft_trained else 'frozen'})")
    layout = f"FSDP over {x.shards} ranks" if x.fsdp else "replicated (no FSDP)"
    lines = [
        f"memory per GPU for {title} (GiB), on a GPU that hosts a rollout engine",
        f"policy {cfg.architecture}: {_count(policy_parameters(cfg))} parameters, {cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; {draft}",
        f"layout: {layout}, {x.share.layers} layers on this GPU; residual stream {p.residual} B, matmuls "
        f"{p.compute} B; {x.tokens} tokens per micro-batch per rank (the whole minibatch: {x.minibatch_tokens})",
        "",
    ]
    notes = _notes(plan)
    width = max(len(label) for label in ITEMS.values()) + 2
    for name, label in ITEMS.items():
        lines.append(f"  {label:<{width}}{_gib(getattr(plan, name)):>8}   {notes[name]}")
        if name == "activations":
            other = plan.activations_full if x.checkpointing else plan.activations_checkpointed
            label = f"  ({'without' if x.checkpointing else 'with'} checkpointing)"
            lines.append(f"  {label:<{width}}{_gib(other):>8}   not counted "
                         f"(policy.activation_checkpointing={_value(not x.checkpointing)})")
    lines += [f"  {'total':<{width}}{_gib(plan.total):>8}", f"  {'GPU memory':<{width}}{_gib(plan.gpu_memory):>8}"]
    lines += [f"  {line}" for line in _engine_lines(plan)]
    return "\n".join(lines)


def check_memory_plan(config: SpecTrainConfig) -> None:
    """On CUDA, refuse a run whose plan does not fit the GPU, before the engine starts: an out-of-memory error
    would otherwise come after the engine start or in the first step's backward, with no key named. Off CUDA
    (the CPU recipes) there is nothing to plan for."""
    import torch

    if config.trainer.accelerator == "cpu" or not torch.cuda.is_available():
        return
    device = torch.cuda.get_device_properties(0)
    policy = policy_architecture(config)
    plan = plan_config(config, device.total_memory, policy)
    if plan.fits:
        return
    raise ConfigError(f"memory plan for {device.name} ({_gib(device.total_memory)} GiB): "
                      f"{verdict(plan, config, policy)}. `spectrain plan RECIPE [overrides]` prints the whole table")
