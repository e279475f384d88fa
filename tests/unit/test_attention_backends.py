"""`policy.attention_backend`: every backend behind the (out, lse) seam against a dense float64 reference.

On CPU: torch and flex in float64 (atol = rtol = 1e-9), triton under the interpreter in float32 (1e-4);
the joint-statistics backward of two parts merged by `merge_attn` (for flex on CPU that is
`recompute_backward` over the dense part, which proves its formula); TE's sink lse with an out-only
kernel; `auto`; the errors of backends that cannot run. On CUDA (`gpu`): varlen, compiled flex, triton
and, where installed, flash_attn / te in bf16 against the same reference: atol = rtol = 3e-2 for out,
5e-2 for lse and the gradients (bf16 keeps 8 bits of mantissa; the gradients sum over a document).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spectrain.config import load_config
from spectrain.errors import ConfigError
from spectrain.ops import backend_ops, backends
from spectrain.ops.attention import LocalAttentionOps, varlen_attention
from spectrain.ops.backend_ops import FlexOps, recompute_backward
from spectrain.ops.backends import AutoAttentionOps, build_attention_ops, check_attention_backend
from spectrain.ops.lse_merge import merge_attn
from spectrain.parallel.cp.plan import check_cp_attention_ops
from spectrain.parallel.cp.ring import ZigzagRingAttentionOps
from spectrain.parallel.cp.zigzag import ZigzagLayout, shard, unshard
from spectrain.parallel.spawn import run_distributed
from spectrain.train import inputs
from tests.helpers import cu_of, dense_attention, dense_mask

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
HQ, HKV, D = 4, 2, 16  # GQA
CASES = {  # (q lengths, k lengths, causal): packed uneven documents, an empty document
    "causal": ([1, 7, 20, 0, 5], [1, 7, 20, 0, 5], True),
    "cross": ([3, 7, 0, 12, 5], [6, 0, 4, 20, 2], False),  # ring blocks: unequal q/k, a doc without keys
}
TOL = {torch.float64: dict(atol=1e-9, rtol=1e-9), torch.float32: dict(atol=1e-4, rtol=1e-4),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
GRAD_TOL_BF16 = dict(atol=5e-2, rtol=5e-2)


def _inputs(lens_q, lens_k, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(sum(lens_q), HQ, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(sum(lens_k), HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, dout)]


def _reference(q, k, v, dout, mask, scale=None):
    """Dense float64 (out, lse, dq, dk, dv)."""
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    out, lse = dense_attention(*leaves, mask, scale)
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout.double().cpu()))


def _check(got, ref, dtype, names=("out", "lse", "dq", "dk", "dv")):
    for name, a, b in zip(names, got, ref):
        tol = GRAD_TOL_BF16 if dtype == torch.bfloat16 and name != "out" else TOL[dtype]
        torch.testing.assert_close(a.double().cpu(), b, **tol, msg=lambda m: f"{name}: {m}")


def _forward_backward(ops, case, dtype, device="cpu"):
    lens_q, lens_k, causal = CASES[case]
    q, k, v, dout = _inputs(lens_q, lens_k, dtype, device)
    cu_q, cu_k = cu_of(lens_q).to(device), cu_of(lens_k).to(device)
    out, lse = ops.forward(q, k, v, cu_q, cu_k, causal)
    assert out.dtype == q.dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    grads = ops.backward(dout, q, k, v, out, lse, cu_q, cu_k, causal)
    _check((out, lse, *grads), _reference(q, k, v, dout, dense_mask(lens_q, lens_k, causal)), dtype)


CPU_BACKENDS = {"torch": torch.float64, "flex": torch.float64, "triton": torch.float32}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_cpu_backend_matches_dense(name, case):
    _forward_backward(build_attention_ops(name), case, CPU_BACKENDS[name])


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_cpu_backend_under_autograd_as_the_model_calls_it(name):
    lens = CASES["causal"][0]
    q, k, v, dout = _inputs(lens, lens, CPU_BACKENDS[name])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = varlen_attention(*leaves, cu_of(lens), causal=True, ops=build_attention_ops(name))
    grads = torch.autograd.grad(out, leaves, dout)
    ref = _reference(q, k, v, dout, dense_mask(lens, lens, True))
    _check((out.detach(), *grads), (ref[0], *ref[2:]), CPU_BACKENDS[name], names=("out", "dq", "dk", "dv"))


def _two_part_problem(dtype, device="cpu"):
    """A ring step's shape: each document's queries see their own keys causally (part 1) and a block of
    earlier keys of another length entirely (part 2, non-causal); the reference sees both at once."""
    lens, lens_b = [4, 9, 1, 6], [5, 0, 3, 8]
    q, k1, v1, dout = _inputs(lens, lens, dtype, device, seed=1)
    _, k2, v2, _ = _inputs(lens, lens_b, dtype, device, seed=2)
    parts = [(k1, v1, cu_of(lens).to(device), True), (k2, v2, cu_of(lens_b).to(device), False)]
    mask = torch.cat([dense_mask(lens, lens, True), dense_mask(lens, lens_b, False)], dim=1)
    return q, dout, cu_of(lens).to(device), parts, mask


def _joint_statistics(ops, dtype, device="cpu"):
    q, dout, cu_q, parts, mask = _two_part_problem(dtype, device)
    out = lse = None
    for k, v, cu_k, causal in parts:
        out, lse = merge_attn(out, lse, *ops.forward(q, k, v, cu_q, cu_k, causal))
    grads = [ops.backward(dout, q, k, v, out.to(q.dtype), lse, cu_q, cu_k, causal) for k, v, cu_k, causal in parts]
    dq = sum(g[0].double() for g in grads)
    dk, dv = (torch.cat([g[i] for g in grads]) for i in (1, 2))
    k_all, v_all = (torch.cat([p[i] for p in parts]) for i in (0, 1))
    _check((out, lse, dq, dk, dv), _reference(q, k_all, v_all, dout, mask), dtype)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_joint_statistics_backward_of_two_merged_parts(name):
    """Each part's backward from the merged (out, lse) gives exactly its share of the dense gradients."""
    _joint_statistics(build_attention_ops(name), CPU_BACKENDS[name])


class _OldTorchVarlen:
    """A CPU stand-in for the flash kernels behind an older torch's varlen API (``is_causal``, no ``scale``,
    no GQA): dense math with the kernels' conventions (``[H, T]`` lse). It proves VarlenOps' adapter, which
    pre-scales q, repeats k/v per q head and sums their gradients back; the kernels themselves run on GPUs."""

    def __init__(self):
        self.calls = []

    def _mask(self, cu_q, cu_k, causal):
        return dense_mask(cu_q.diff().tolist(), cu_k.diff().tolist(), causal)

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
        assert q.shape[1] == k.shape[1], "this API has no GQA: k and v must come repeated"
        self.calls.append("forward")
        out, lse = dense_attention(q, k, v, self._mask(cu_q, cu_k, is_causal), None)
        return out, lse.t()

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, rng_state):
        assert q.shape[1] == k.shape[1] and lse.shape == (q.shape[1], q.shape[0])
        self.calls.append("backward")
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        with torch.enable_grad():
            out_p, _ = dense_attention(*leaves, self._mask(cu_q, cu_k, is_causal), None)
            return torch.autograd.grad(out_p, leaves, dout)


@pytest.mark.parametrize("case", CASES)
def test_varlen_adapts_to_an_older_torch_api(case, monkeypatch):
    """GPUs may have an older torch than this one: the same VarlenOps call is right on its API too."""
    import torch.nn.attention.varlen as varlen

    old = _OldTorchVarlen()
    monkeypatch.setattr(backend_ops, "_varlen_api", lambda: (
        frozenset({"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "return_aux"}),
        frozenset({"grad_out", "query", "key", "value", "out", "lse", "cu_seq_q", "cu_seq_k", "max_q", "max_k",
                   "is_causal", "rng_state"})))
    monkeypatch.setattr(varlen, "varlen_attn", old.forward)
    monkeypatch.setattr(torch.ops.torch_attn, "_varlen_attn_backward", old.backward)
    lens_q, lens_k, causal = CASES[case]
    q, k, v, dout = _inputs(lens_q, lens_k, torch.float32)
    ops, scale = backend_ops.VarlenOps(half_dtype=torch.float32), 0.3  # not the kernel's default D**-0.5
    cu_q, cu_k = cu_of(lens_q), cu_of(lens_k)
    out, lse = ops.forward(q, k, v, cu_q, cu_k, causal, scale)
    grads = ops.backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)
    assert old.calls == ["forward", "backward"]
    _check((out, lse, *grads), _reference(q, k, v, dout, dense_mask(lens_q, lens_k, causal), scale), torch.float32)


def _dense_out_only(q, k, v, cu_q, cu_k, causal, scale):
    """An out-only kernel (as Transformer Engine's): end-aligned causal when k is longer (the sink)."""
    mask_mod = backend_ops.doc_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal)
    mask = mask_mod(0, 0, torch.arange(q.shape[0])[:, None], torch.arange(k.shape[0])[None, :])
    return backend_ops.dense_attention(q, k, v, mask, scale)[0]


@pytest.mark.parametrize("case", CASES)
def test_sink_key_recovers_lse_from_an_out_only_kernel(case):
    lens_q, lens_k, causal = CASES[case]
    q, k, v, dout = _inputs(lens_q, lens_k, torch.float64)
    cu_q, cu_k = cu_of(lens_q), cu_of(lens_k)

    def part(q, k, v, cu_q, cu_k, causal, scale):
        return backend_ops._lse_by_sink(_dense_out_only, q, k, v, cu_q, cu_k, causal, scale)

    out, lse = part(q, k, v, cu_q, cu_k, causal, None)
    grads = recompute_backward(part, dout, q, k, v, out, lse, cu_q, cu_k, causal, None)
    _check((out, lse, *grads), _reference(q, k, v, dout, dense_mask(lens_q, lens_k, causal)), torch.float64)


def test_auto_on_cpu_resolves_to_torch_and_says_so_once(capfd):
    assert check_attention_backend("auto", "cpu") == "torch"
    backends._say_once.cache_clear()  # once per process: this test must not depend on which ran before it
    ops = build_attention_ops("auto")
    lens_q, lens_k, causal = CASES["causal"]
    q, k, v, _ = _inputs(lens_q, lens_k, torch.float64)
    cu = cu_of(lens_q)
    for _ in range(2):
        out, lse = ops.forward(q, k, v, cu, cu, causal)
    assert isinstance(ops.resolved["cpu"], LocalAttentionOps)
    ref_out, ref_lse = LocalAttentionOps().forward(q, k, v, cu, cu, causal)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert capfd.readouterr().err.count("policy.attention_backend=auto -> torch") == 1
    check_cp_attention_ops(ops)


def test_auto_takes_the_fastest_candidate_timed_on_the_first_call(monkeypatch, capfd):
    """On CUDA `auto` times its candidates on the first call; here the same logic over two CPU backends."""
    monkeypatch.setattr(backends, "auto_candidates", lambda device, half: (["torch", "flex"], "two candidates"))
    backends._say_once.cache_clear()
    lens_q, lens_k, causal = CASES["causal"]
    q, k, v, dout = _inputs(lens_q, lens_k, torch.float64)
    cu = cu_of(lens_q)
    name, timings = backends.fastest(["torch", "flex"], None, q, k, v, cu, cu, causal, None)
    assert set(timings) == {"torch", "flex"} and name == min(timings, key=timings.get)
    ops = build_attention_ops("auto")
    out, lse = ops.forward(q, k, v, cu, cu, causal)
    grads = ops.backward(dout, q, k, v, out, lse, cu, cu, causal)
    assert type(ops.resolved["cpu"]) in (LocalAttentionOps, FlexOps)
    said = capfd.readouterr().err
    assert said.count("policy.attention_backend=auto -> ") == 1 and "torch " in said and "flex " in said, said
    _check((out, lse, *grads), _reference(q, k, v, dout, dense_mask(lens_q, lens_k, causal)), torch.float64)


def test_auto_leaves_out_a_candidate_that_fails_and_says_so(monkeypatch, capfd):
    backends._say_once.cache_clear()
    lens_q, lens_k, causal = CASES["causal"]
    q, k, v, _ = _inputs(lens_q, lens_k, torch.float64)
    cu = cu_of(lens_q)
    name, timings = backends.fastest(["te", "torch"], None, q, k, v, cu, cu, causal, None)  # te: not installed
    assert name == "torch" and list(timings) == ["torch"]
    assert "auto: te left out (ConfigError" in capfd.readouterr().err
    with pytest.raises(ConfigError, match="te needs"):
        backends.fastest(["te"], None, q, k, v, cu, cu, causal, None)


@torch.library.custom_op("spectrain_test::scaled_sum", mutates_args=())
def _scaled_sum(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    return (a + b) * scale


def test_flash_attn_arguments_are_read_through_a_torch_custom_op():
    """flash-attn >= 2.7 wraps its kernels in torch custom ops (signature `*args, **kwargs`): the names it takes
    still come from the wrapped function, unknown candidates are dropped, a missing one is a clear error."""
    a, b = torch.ones(2), torch.full((2,), 2.0)
    out = backend_ops._call_with_known_kwargs(_scaled_sum, a=a, b=b, scale=0.5, window_size=(-1, -1))
    assert out.tolist() == [1.5, 1.5]
    with pytest.raises(ConfigError, match=r"wants \['scale'\]"):
        backend_ops._call_with_known_kwargs(_scaled_sum, a=a, b=b)


@pytest.mark.parametrize("name,command", [("flash_attn", 'pip install -e ".[flash-attn]"'),
                                          ("te", 'pip install -e ".[transformer-engine]"')])
def test_backend_not_installed_says_how_to_get_it(name, command):
    if backend_ops.installed(name):
        pytest.skip(f"optional: {name} is installed here")
    for attempt in (lambda: build_attention_ops(name), lambda: check_attention_backend(name, "cuda")):
        with pytest.raises(ConfigError, match="policy.attention_backend") as err:
            attempt()
        assert command in str(err.value) and "policy.attention_backend=auto" in str(err.value)


def test_backends_that_cannot_run_fail_at_start_up(monkeypatch):
    with pytest.raises(ConfigError, match="varlen runs on CUDA only.*trainer.accelerator"):
        check_attention_backend("varlen", "cpu")
    with pytest.raises(ConfigError, match="varlen computes in fp16/bf16 only .* policy.dtype=bfloat16"):
        check_attention_backend("varlen", "cuda", half_dtype=None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="triton runs on CUDA, or on CPU under TRITON_INTERPRET=1"):
        check_attention_backend("triton", "cpu")
    assert check_attention_backend("flex", "cpu") == "flex"
    assert backend_ops.TransformerEngineOps.supports_context_parallel is False


def test_policy_attention_backend_is_checked_for_the_device_and_built(tmp_path):
    config = load_config(None, ["trainer.accelerator=cpu", "policy.dtype=bfloat16"])
    assert inputs.attention_backend(config) == {"configured": "auto", "device": "cpu", "resolved": "torch"}
    ops = inputs.policy_attention_ops(config)
    assert isinstance(ops, AutoAttentionOps) and ops.half_dtype == torch.bfloat16
    config = load_config(None, ["trainer.accelerator=cpu", "policy.attention_backend=flex"])
    assert isinstance(inputs.policy_attention_ops(config), FlexOps)
    assert inputs.attention_backend(config)["resolved"] == "flex"
    with pytest.raises(ConfigError, match="varlen runs on CUDA only"):
        inputs.attention_backend(load_config(None, ["trainer.accelerator=cpu", "policy.attention_backend=varlen"]))


# ------------------------------------------------------------- flex as the ring's local block (2 gloo processes)

RING_LENS = [6, 10, 4]


def _ring_worker(rank, world):
    torch.set_num_threads(1)
    lay = ZigzagLayout.build(cu_of(RING_LENS), world, rank)
    q, k, v, dout = (shard(x, lay) for x in _inputs(RING_LENS, RING_LENS, torch.float64, seed=3))
    ops = ZigzagRingAttentionOps(dist.group.WORLD, local_ops=FlexOps())
    cu = lay.cu_seqlens_local
    out, lse = ops.forward(q, k, v, cu, cu, True)
    dq, dk, dv = ops.backward(dout, q, k, v, out, lse, cu, cu, True)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


@pytest.mark.slow
def test_flex_is_the_local_block_of_ring_attention():
    results = run_distributed(_ring_worker, 2, timeout=300)
    layout = ZigzagLayout.build(cu_of(RING_LENS), 2, 0)
    got = {name: unshard([r[name] for r in results], layout) for name in ("out", "lse", "dq", "dk", "dv")}
    q, k, v, dout = _inputs(RING_LENS, RING_LENS, torch.float64, seed=3)
    ref = _reference(q, k, v, dout, dense_mask(RING_LENS, RING_LENS, True))
    _check([got[n] for n in ("out", "lse", "dq", "dk", "dv")], ref, torch.float64)


# ------------------------------------------------------------- CUDA

GPU_BACKENDS = ["varlen", "flex", "triton", "flash_attn", "te"]


def _gpu_ops(name):
    """The backend on this GPU: varlen / flex / triton must exist on any CUDA torch >= 2.11 (a failure if not);
    flash_attn / te are optional and skip, saying so, when not installed."""
    if name in backend_ops.INSTALL and not backend_ops.installed(name):
        pytest.skip(f"optional: {name} is not installed ({backend_ops.INSTALL[name][1]})")
    check_attention_backend(name, "cuda", torch.bfloat16)
    return build_attention_ops(name, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_gpu_backend_matches_dense_in_bf16(name, case):
    _forward_backward(_gpu_ops(name), case, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in GPU_BACKENDS if n != "te"])  # te: no CP, no joint statistics
def test_gpu_joint_statistics_backward(name):
    _joint_statistics(_gpu_ops(name), torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_gpu_auto_picks_a_flash_backend_and_takes_float32_of_a_bf16_run():
    ops = build_attention_ops("auto", torch.bfloat16)
    lens_q, lens_k, causal = CASES["causal"]
    q, k, v, dout = _inputs(lens_q, lens_k, torch.float32, "cuda")
    cu = cu_of(lens_q).cuda()
    out, lse = ops.forward(q, k, v, cu, cu, causal)
    grads = ops.backward(dout, q, k, v, out, lse, cu, cu, causal)
    assert type(ops.resolved["cuda"]).__name__ in ("FlashAttnOps", "VarlenOps", "TritonAttentionOps")
    _check((out, lse, *grads), _reference(q, k, v, dout, dense_mask(lens_q, lens_k, causal)), torch.bfloat16)


# ------------------------------------------------------------- `spectrain fit` (torch engine, CPU)

@pytest.mark.slow
def test_fit_trains_the_policy_on_the_configured_backend(tmp_path):
    """`auto` reaches the policy's forward (it says what it resolved to) and the run records the choice."""
    run_dir = tmp_path / "run"
    args = ["fit", "tiny_cpu", f"trainer.run_dir={run_dir}", "trainer.max_steps=1", "trainer.accelerator=cpu",
            "rollout.engine=torch", "sft.steps=5", "draft.warmup_steps=2", "rollout.prompts_per_step=2",
            "rollout.n=4", "eval.prompts=4", "eval.samples=2", "trainer.progress_bar=false",
            "sync.check_alive=false", "eval.every_n_steps=0", "grpo.kl_loss_coef=0.05"]  # + a KL reference
    done = subprocess.run([sys.executable, "-m", "spectrain.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stderr.count("policy.attention_backend=auto -> torch (cpu:") == 1, done.stderr[-2000:]
    record = json.loads((run_dir / "spectrain_run.json").read_text())
    assert record["attention_backend"] == {"configured": "auto", "device": "cpu", "resolved": "torch"}
    assert record["result"]["steps"] == 1
