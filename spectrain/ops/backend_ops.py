"""The attention backends' ops classes (the table of which runs where: spectrain.ops.backends).

Each has the ``(out, lse)`` seam of ``spectrain.ops.attention.LocalAttentionOps``; the flash kernels'
backward takes the given joint statistics directly, the others recompute their part
(``recompute_backward``).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from collections import OrderedDict

import torch

from spectrain.errors import ConfigError

# the module a backend runs on (a real import: a flash-attn built for another torch, or Transformer Engine without
# its torch extension, is "installed" but cannot run), and the command that installs it
INSTALL = {"flash_attn": ("flash_attn.flash_attn_interface", 'pip install -e ".[flash-attn]"'),
           "te": ("transformer_engine.pytorch", 'pip install -e ".[transformer-engine]"')}
_HALF = (torch.float16, torch.bfloat16)


def _autocast_off(fn):
    """The kernels pick their compute dtype themselves (as `spectrain.ops.attention`'s blockwise ops do): an
    outer autocast (Lightning's bf16-mixed) must not re-cast inside them, nor in a recompute."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        with torch.autocast(device_type=device, enabled=False):
            return fn(*args, **kwargs)

    return wrapper


def backend_error(detail: str) -> ConfigError:
    return ConfigError(f"policy.attention_backend: {detail}")


def kernel_dtype(dtype: torch.dtype, half_dtype: torch.dtype | None, name: str) -> torch.dtype:
    """The dtype a 16-bit-only kernel computes in: the inputs' own, or `half_dtype` for float32 inputs."""
    if dtype in _HALF:
        return dtype
    if dtype == torch.float32 and half_dtype is not None:
        return half_dtype
    raise backend_error(f"{name} computes in fp16/bf16 only and got {dtype} inputs; set policy.dtype=bfloat16, "
                        f"or use flex, triton or torch (or auto)")


def _varlen_meta(cu_q: torch.Tensor, cu_k: torch.Tensor, q: torch.Tensor) -> tuple:
    """int32 cu_seqlens on q's device and the longest q / k document, as flash kernels take them."""
    cu_q, cu_k = (cu.to(device=q.device, dtype=torch.int32).contiguous() for cu in (cu_q, cu_k))
    return cu_q, cu_k, int(cu_q.diff().max()), int(cu_k.diff().max())


def _lse_from_kernel(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Flash kernels' ``[Hq, Tq]`` lse, +inf on rows that see no key, as the seam's ``[Tq, Hq]`` with -inf."""
    assert lse.shape == (q.shape[1], q.shape[0]), (lse.shape, q.shape)
    lse = lse.float().t()
    return torch.where(torch.isinf(lse), float("-inf"), lse)


def _lse_to_kernel(lse: torch.Tensor) -> torch.Tensor:
    """The seam's joint lse in the kernels' layout; a row with none gets +inf, so its P = exp(s - lse) is 0."""
    lse = lse.float().t().contiguous()
    return torch.where(torch.isneginf(lse), float("inf"), lse)


def _doc_positions(cu: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document id of each packed row and its position counted from its document's END (-len..-1)."""
    rows = torch.arange(n, device=cu.device)
    doc = torch.searchsorted(cu[1:].contiguous().long(), rows, right=True)
    return doc, rows - cu[1:].long()[doc]


def doc_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, n_q: int, n_k: int, causal: bool):
    """``mask_mod(b, h, q_idx, kv_idx)`` of packed documents: same document and, when causal, key not after
    the query, aligned at the documents' ends (equal lengths: ``k <= q``; a longer key side: its extra
    leading keys are seen by every query, as the sink of ``_lse_by_sink`` is)."""
    doc_q, end_q = _doc_positions(cu_q, n_q)
    doc_k, end_k = _doc_positions(cu_k, n_k)

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_q[q_idx] == doc_k[kv_idx]
        return same & (end_k[kv_idx] <= end_q[q_idx]) if causal else same

    return mask_mod


def dense_attention(q, k, v, mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable masked attention ``(out, lse)`` over a dense ``[Tq, Tk]`` mask (tiny sizes: the
    recompute of flex on CPU); rows without a visible key give 0 and -inf with finite gradients."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k).mul(scale).masked_fill(~mask, float("-inf"))
    empty = ~mask.any(-1)
    lse = torch.logsumexp(s.masked_fill(empty[:, None], 0.0), -1)
    p = torch.exp(s - lse[..., None]).masked_fill(empty[:, None], 0.0)
    return torch.einsum("hqk,khd->qhd", p, v).to(q.dtype), lse.masked_fill(empty, float("-inf")).t()


@_autocast_off
def recompute_backward(part_forward, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    """``(dq, dk, dv)`` of one attention part from the JOINT ``(out, lse)``, for a backend whose
    ``(out_p, lse_p) = part_forward(q, k, v, cu_q, cu_k, causal, scale)`` is differentiable but has no
    backward taking given statistics.

    The merge gives ``out = sum_p w_p out_p`` with ``w_p = exp(lse_p - lse)``, ``lse = logsumexp_p lse_p``.
    So ``dL/dout_p = w_p dout`` and, since ``d out / d lse_p = w_p (out_p - out)``,
    ``dL/dlse_p = w_p rowsum(dout * (out_p - out))``; autograd through the part does the rest.
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out_p, lse_p = part_forward(*leaves, cu_q, cu_k, causal, scale)
        joint = lse.to(acc)
        w = torch.exp(lse_p.detach().to(acc) - torch.where(torch.isneginf(joint), 0.0, joint))
        w = torch.where(torch.isneginf(joint), 0.0, w)
        d = dout.to(acc)
        grad_out = w[..., None] * d
        grad_lse = w * (d * (out_p.detach().to(acc) - out.to(acc))).sum(-1)
        return torch.autograd.grad((out_p, lse_p), leaves, (grad_out.to(out_p.dtype), grad_lse.to(lse_p.dtype)))


class _PackedOps:
    """The seam's two calls; a side without rows (a ring step's empty half) never reaches a kernel."""

    supports_context_parallel = True

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale=None):
        if q.shape[0] == 0 or k.shape[0] == 0:
            return torch.zeros_like(q), q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
        return self._forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale=None):
        if q.shape[0] == 0 or k.shape[0] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return self._backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale)


class _HalfKernelOps(_PackedOps):
    """A 16-bit kernel: `half_dtype` is what float32 inputs are computed in (None: refused)."""

    name = ""

    def __init__(self, half_dtype: torch.dtype | None = None) -> None:
        self.half_dtype = half_dtype

    def _dtype(self, q: torch.Tensor) -> torch.dtype:
        return kernel_dtype(q.dtype, self.half_dtype, self.name)


class _RecomputeOps(_PackedOps):
    """A backend whose differentiable ``_part`` has no backward taking given statistics (`recompute_backward`)."""

    @torch.no_grad()
    def _forward(self, q, k, v, cu_q, cu_k, causal, scale):
        return self._part(q, k, v, cu_q, cu_k, causal, scale)

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
        return recompute_backward(self._part, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)


@functools.cache
def _varlen_api() -> tuple[frozenset[str], frozenset[str]]:
    """The argument names of this torch's ``varlen_attn`` and of its backward op: they grew between torch
    releases (``scale``, ``window_size``, ``enable_gqa`` are newer than ``is_causal``), so calls name only
    what the installed torch takes."""
    from torch.nn.attention.varlen import varlen_attn

    backward = torch.ops.torch_attn._varlen_attn_backward.default._schema.arguments
    return frozenset(inspect.signature(varlen_attn).parameters), frozenset(a.name for a in backward)


class VarlenOps(_HalfKernelOps):
    """torch's own ``varlen_attn`` (the flash kernels shipped inside torch): the default CUDA backend.

    Older torch releases take no ``scale`` (q is pre-scaled instead, and dq rescaled), no ``window_size``
    (``is_causal`` instead) and no GQA flag (k and v are repeated per q head, their gradients summed).
    """

    name = "varlen"

    def _inputs(self, q, k, v, scale):
        """q, k, v as this torch's kernel takes them, the kwargs that say so, and dq's rescale factor."""
        fwd, _ = _varlen_api()
        dt, group = self._dtype(q), q.shape[1] // k.shape[1]
        default_scale = q.shape[-1] ** -0.5
        factor = 1.0 if "scale" in fwd or scale is None else scale / default_scale
        kwargs = {"scale": scale} if "scale" in fwd else {}
        if "enable_gqa" in fwd:
            kwargs["enable_gqa"] = group > 1
        elif group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return [x.to(dt).contiguous() for x in (q * factor, k, v)], kwargs, factor

    @_autocast_off
    def _forward(self, q, k, v, cu_q, cu_k, causal, scale):
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        fwd, _ = _varlen_api()
        (qk, kk, vk), kwargs, _ = self._inputs(q, k, v, scale)
        if "window_size" in fwd:
            kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
        else:
            kwargs["is_causal"] = causal
        out, lse = varlen_attn(qk, kk, vk, *_varlen_meta(cu_q, cu_k, q), return_aux=AuxRequest(lse=True), **kwargs)
        return out.to(q.dtype), _lse_from_kernel(lse, q)

    @_autocast_off
    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
        _, bwd = _varlen_api()
        (qk, kk, vk), _, factor = self._inputs(q, k, v, scale)
        extra = [scale] if "scale" in bwd else []
        if "window_size" in bwd:
            extra = [scale, [-1, 0] if causal else [-1, -1]]
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
        dt = qk.dtype
        dq, dk, dv = torch.ops.torch_attn._varlen_attn_backward(
            dout.to(dt).contiguous(), qk, kk, vk, out.to(dt).contiguous(), _lse_to_kernel(lse),
            *_varlen_meta(cu_q, cu_k, q), causal, rng_state, *extra)
        if dk.shape[1] != k.shape[1]:  # repeated for a torch without GQA: a kv head's gradient sums its group
            dk, dv = (g.view(g.shape[0], k.shape[1], -1, g.shape[-1]).sum(2) for g in (dk, dv))
        return (dq * factor).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


class FlexOps(_RecomputeOps):
    """FlexAttention with a document (+ causal) BlockMask from cu_seqlens: compiled on CUDA, eager on CPU."""

    MASK_CACHE = 8  # a step's layers share one mask; the ring has three (diagonal, front, back)

    def __init__(self) -> None:
        self._masks: OrderedDict = OrderedDict()

    def _block_mask(self, cu_q, cu_k, n_q, n_k, causal):
        from torch.nn.attention.flex_attention import create_block_mask

        key = (tuple(cu_q.tolist()), tuple(cu_k.tolist()), causal, cu_q.device)
        if key not in self._masks:
            mask_mod = doc_mask(cu_q, cu_k, n_q, n_k, causal)
            self._masks[key] = create_block_mask(mask_mod, None, None, n_q, n_k, device=cu_q.device,
                                                 _compile=cu_q.device.type == "cuda")
            while len(self._masks) > self.MASK_CACHE:
                self._masks.popitem(last=False)
        self._masks.move_to_end(key)
        return self._masks[key]

    @_autocast_off
    def _flex(self, q, k, v, cu_q, cu_k, causal, scale):
        """Differentiable on CUDA; forward only on CPU, where torch has no flex backward."""
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        block_mask = self._block_mask(cu_q.to(q.device), cu_k.to(q.device), q.shape[0], k.shape[0], causal)
        heads_first = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
        fn = _compiled_flex() if q.device.type == "cuda" else flex_attention
        with warnings.catch_warnings():  # eager on CPU materialises the scores: fine at the sizes CPU runs
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out, aux = fn(*heads_first, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                          return_aux=AuxRequest(lse=True))
        lse = aux.lse[0].t()
        return out[0].transpose(0, 1), lse if q.dtype == torch.float64 else lse.float()

    @torch.no_grad()
    def _forward(self, q, k, v, cu_q, cu_k, causal, scale):
        # detached: inside an autograd Function the inputs still say requires_grad, which flex refuses on CPU
        return self._flex(q.detach(), k.detach(), v.detach(), cu_q, cu_k, causal, scale)

    def _part(self, q, k, v, cu_q, cu_k, causal, scale):
        if q.device.type == "cuda":
            return self._flex(q, k, v, cu_q, cu_k, causal, scale)
        mask = doc_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal)
        rows, cols = torch.arange(q.shape[0])[:, None], torch.arange(k.shape[0])[None, :]
        return dense_attention(q, k, v, mask(0, 0, rows, cols), q.shape[-1] ** -0.5 if scale is None else scale)


def import_installed(name: str):
    """The optional module backend `name` runs on, or the error saying how to get it."""
    module, command = INSTALL[name]
    try:
        return importlib.import_module(module)
    except Exception as exc:  # not installed, or built for another torch / CUDA (ImportError, OSError, ...)
        raise backend_error(f"{name} needs {module}, which does not import here ({type(exc).__name__}: {exc}). "
                            f"Install it with `{command}` (it compiles against your CUDA toolkit), or use "
                            f"policy.attention_backend=auto, which runs without it (torch's varlen flash kernels "
                            f"on CUDA)") from exc


def installed(name: str) -> bool:
    """Whether optional backend `name` imports here."""
    try:
        import_installed(name)
    except ConfigError:
        return False
    return True


def _call_with_known_kwargs(fn, **candidates):
    """Call `fn` with those of `candidates` its signature names: flash-attn renamed arguments across 2.x."""
    # flash-attn >= 2.7 wraps its functions in torch custom ops, whose own signature is (*args, **kwargs)
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    missing = [n for n, p in params.items()
               if n not in candidates and p.default is inspect.Parameter.empty and p.kind not in variadic]
    if missing:
        raise ConfigError(f"policy.attention_backend: flash_attn's {getattr(fn, '__name__', fn)!r} wants {missing}, "
                          f"which this version of spectrain does not know; use policy.attention_backend=varlen")
    return fn(**{n: v for n, v in candidates.items() if n in params})


class FlashAttnOps(_HalfKernelOps):
    """flash-attn's varlen kernels (``flash_attn_varlen_func`` with its softmax lse); where installed."""

    name = "flash_attn"

    def __init__(self, half_dtype: torch.dtype | None = None) -> None:
        super().__init__(half_dtype)
        self.flash_attn = import_installed("flash_attn")

    @_autocast_off
    def _forward(self, q, k, v, cu_q, cu_k, causal, scale):
        dt = self._dtype(q)
        cu_q, cu_k, max_q, max_k = _varlen_meta(cu_q, cu_k, q)
        out, lse, _ = self.flash_attn.flash_attn_varlen_func(
            *(x.to(dt).contiguous() for x in (q, k, v)), cu_q, cu_k, max_q, max_k, dropout_p=0.0,
            softmax_scale=scale, causal=causal, return_attn_probs=True)
        return out.to(q.dtype), _lse_from_kernel(lse, q)

    @_autocast_off
    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

        dt = self._dtype(q)
        cu_q, cu_k, max_q, max_k = _varlen_meta(cu_q, cu_k, q)
        dout, q16, k16, v16, out = (x.to(dt).contiguous() for x in (dout, q, k, v, out))
        dq, dk, dv = torch.empty_like(q16), torch.empty_like(k16), torch.empty_like(v16)
        _call_with_known_kwargs(
            _flash_attn_varlen_backward, dout=dout, q=q16, k=k16, v=v16, out=out, softmax_lse=_lse_to_kernel(lse),
            dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            dropout_p=0.0, softmax_scale=q.shape[-1] ** -0.5 if scale is None else scale, causal=causal,
            window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
            deterministic=False, rng_state=None, zero_tensors=False)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


SINK_SCORE = -20.0  # the sink's weight e^(c - lse) stays a normal float for lse < c + 85, out exact for lse > c + 5
SINK_PAD = 8  # extra head channels: kernels take head dims in multiples of 8


def _lse_by_sink(attend, q, k, v, cu_q, cu_k, causal, scale):
    """``(out, lse)`` from a kernel ``attend(q, k, v, cu_q, cu_k, causal, scale) -> out`` that returns no lse.

    Each document's keys get a leading sink key scoring ``c = SINK_SCORE`` against every query (an extra
    channel: q 1, sink key c/scale, other keys 0) whose value is 1 in that channel and 0 elsewhere. The
    kernel's weight on it is ``p = e^c / (e^c + e^lse)``, so ``lse = c + log((1 - p) / p)`` and the
    attention without it is ``out / (1 - p)``. Differentiable where ``attend`` is.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cu_q, cu_k = cu_q.to(q.device), cu_k.to(q.device)
    n_docs, d = cu_k.numel() - 1, q.shape[-1]
    doc_k, _ = _doc_positions(cu_k, k.shape[0])
    key_rows = torch.arange(k.shape[0], device=k.device) + doc_k + 1
    sink_rows = cu_k[:-1].long() + torch.arange(n_docs, device=k.device)
    pad = [0, SINK_PAD]
    qs = torch.nn.functional.pad(q, pad).index_fill(-1, torch.tensor([d], device=q.device), 1.0)
    ks = k.new_zeros(k.shape[0] + n_docs, k.shape[1], d + SINK_PAD).index_copy(0, key_rows,
                                                                               torch.nn.functional.pad(k, pad))
    ks[sink_rows, :, d] = SINK_SCORE / scale
    vs = v.new_zeros(ks.shape).index_copy(0, key_rows, torch.nn.functional.pad(v, pad))
    vs[sink_rows, :, d] = 1.0
    out = attend(qs, ks, vs, cu_q, cu_k + torch.arange(n_docs + 1, device=cu_k.device, dtype=cu_k.dtype),
                 causal, scale)
    p = out[..., d].to(torch.promote_types(out.dtype, torch.float32))
    seen = p < 1.0  # p = 1: only the sink, the document has no key
    p = torch.where(seen, p, 0.5)  # finite in both branches of the wheres: no NaN gradients
    lse = torch.where(seen, SINK_SCORE + torch.log1p(-p) - torch.log(p), float("-inf"))
    return (out[..., :d] / (1.0 - p)[..., None]).to(q.dtype), lse


class TransformerEngineOps(_HalfKernelOps, _RecomputeOps):
    """Transformer Engine's ``DotProductAttention`` (thd layout, cu_seqlens); where installed."""

    name = "te"
    supports_context_parallel = False  # the sink's lse has the 16-bit output's precision: too coarse for ring merges

    def __init__(self, half_dtype: torch.dtype | None = None) -> None:
        super().__init__(half_dtype)
        self.te = import_installed("te")
        self._modules: dict = {}

    def _attend(self, q, k, v, cu_q, cu_k, causal, scale):
        key = (q.shape[1], k.shape[1], q.shape[2], causal, scale)
        if key not in self._modules:
            self._modules[key] = self.te.DotProductAttention(
                num_attention_heads=q.shape[1], kv_channels=q.shape[2], num_gqa_groups=k.shape[1],
                attention_dropout=0.0, qkv_format="thd", softmax_scale=scale,
                attn_mask_type="padding_causal_bottom_right" if causal else "padding")
        cu_q, cu_k, max_q, max_k = _varlen_meta(cu_q, cu_k, q)
        out = self._modules[key](q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max_q,
                                 max_seqlen_kv=max_k)
        return out.view(q.shape)

    @_autocast_off
    def _part(self, q, k, v, cu_q, cu_k, causal, scale):
        dt = self._dtype(q)
        out, lse = _lse_by_sink(self._attend, q.to(dt), k.to(dt), v.to(dt), cu_q, cu_k, causal, scale)
        return out.to(q.dtype), lse
