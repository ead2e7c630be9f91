"""The FA2 forward and backward (kernels/forward.py, kernels/backward.py, and on Hopper the Gluon
kernels of kernels/flash_attn_hopper.py) against the float64 reference, by flash-attn's
criterion (tests/attention_checks.py): causal edge cases, zero-length sequences, determinism,
autograd and a training step.

On CPU the kernels run in Triton's interpreter (fp16/fp32, small shapes); the `gpu` tests
repeat the checks in bf16/fp16 at real sizes on a CUDA device.
"""

import dataclasses
import math

import pytest
import torch

from baselines.reference import attention_reference, attention_same_dtype
from kernels import (
    configs,
    dispatch,
    flash_attn_func,
    flash_attn_hopper,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    ops,
)
from kernels.checks import DENSE
from kernels.configs import FwdConfig
from kernels.dispatch import GluonPath, fwd_memory_path
from kernels.forward import flash_attn_forward
from kernels.ops import FlashAttnFunc
from tests.attention_checks import (  # noqa: F401 (poisoned_allocations: a fixture, used by name)
    CPU_SHAPES,
    GPU_SHAPES,
    assert_close_to_reference,
    check_backward,
    check_forward,
    make_qkv,
    poisoned_allocations,
    shape_id,
    spy_backward_kernels,
)

INTERPRETER_TESTS = True  # unmarked tests run in Triton's interpreter (tests/conftest.py)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=shape_id)
@pytest.mark.usefixtures("poisoned_allocations")
def test_forward_matches_reference(shape, causal):
    check_forward(*shape, causal, torch.float16, "cpu")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 45, 45, 2, 32), (2, 33, 70, 1, 24)], ids=shape_id)
@pytest.mark.usefixtures("poisoned_allocations")
def test_forward_fp32_matches_reference(shape, causal):
    check_forward(*shape, causal, torch.float32, "cpu")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 17, 17, 2, 16), (2, 113, 70, 1, 59), (1, 40, 97, 2, 64),
                                   (1, 64, 64, 1, 128)], ids=shape_id)
@pytest.mark.usefixtures("poisoned_allocations")
def test_backward_matches_reference(shape, causal):
    check_backward(*shape, causal, torch.float16, "cpu")


@pytest.mark.parametrize("query_major", [False, True], ids=["key-major", "query-major"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 17, 17, 2, 16), (2, 113, 70, 1, 59), (1, 40, 97, 2, 64),
                                   (1, 64, 64, 2, 16)],  # whole blocks: the unmasked atomics
                         ids=shape_id)
@pytest.mark.usefixtures("poisoned_allocations")
def test_backward_with_fused_dq_matches_reference(shape, causal, query_major, monkeypatch):
    """dQ added by the dK/dV kernel (element-wise atomics here: the interpreter has no TMA
    reduce) instead of the dQ kernel, which must not run: ragged lengths both ways, whole blocks,
    both dK/dV layouts."""
    dkdv, dq = spy_backward_kernels(monkeypatch)
    fusing = dataclasses.replace(configs.INTERPRETER_BWD_CONFIG, fused_dq_min_rows=1, query_major=query_major)
    check_backward(*shape, causal, torch.float16, "cpu", bwd_config=fusing)
    assert [launch["FUSED_DQ"] for launch in dkdv.launches] == [1] and not dq.launches


# The query-major dK/dV layout (the head-dim-256 production config on Hopper) with the
# interpreter's block sizes: ragged lengths both ways, a head dim that is not a power of two.
QUERY_MAJOR_BWD_CONFIG = dataclasses.replace(configs.INTERPRETER_BWD_CONFIG, query_major=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 113, 70, 1, 59), (1, 40, 97, 2, 64), (1, 64, 64, 1, 32)], ids=shape_id)
@pytest.mark.usefixtures("poisoned_allocations")
def test_backward_query_major_matches_reference(shape, causal):
    check_backward(*shape, causal, torch.float16, "cpu", bwd_config=QUERY_MAJOR_BWD_CONFIG)


@pytest.mark.usefixtures("poisoned_allocations")
def test_backward_fp32_matches_reference():
    check_backward(1, 50, 37, 2, 24, True, torch.float32, "cpu")


@pytest.mark.usefixtures("poisoned_allocations")
def test_causal_bottom_right_when_sq_gt_sk_gives_zero_rows_not_nan():
    """seqlen_q > seqlen_k with causal: the first seqlen_q - seqlen_k rows see no key, so
    they output exactly 0 with L = +inf (flash-attn's convention) and their grads are 0."""
    q, k, v = make_qkv(1, 40, 10, 2, 32, torch.float16, "cpu", requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.all(out[:, :30] == 0) and torch.all(torch.isposinf(lse[:, :, :30]))
    assert torch.isfinite(lse[:, :, 30:]).all() and out[:, 30:].abs().sum() > 0
    out.backward(torch.randn_like(out))
    assert torch.all(q.grad[:, :30] == 0)
    assert all(torch.isfinite(g).all() for g in (q.grad, k.grad, v.grad))


def test_causal_bottom_right_when_sq_lt_sk_sees_the_key_prefix():
    """seqlen_q < seqlen_k with causal: the last query row sees every key, the first sees
    seqlen_k - seqlen_q + 1 keys (bottom-right alignment, flash-attn >= 2.1)."""
    q, k, v = make_qkv(1, 3, 20, 1, 16, torch.float32, "cpu")
    out = flash_attn_func(q, k, v, causal=True)
    first_row = flash_attn_func(q[:, :1], k[:, :18], v[:, :18], causal=False)
    torch.testing.assert_close(out[:, :1], first_row, atol=1e-5, rtol=1e-5)
    last_row = flash_attn_func(q[:, 2:], k, v, causal=False)
    torch.testing.assert_close(out[:, 2:], last_row, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("poisoned_allocations")
def test_custom_softmax_scale_matches_reference():
    q, k, v = make_qkv(1, 30, 30, 2, 32, torch.float16, "cpu")
    out = flash_attn_func(q, k, v, softmax_scale=0.3, causal=True)
    ref, _ = attention_reference(q, k, v, softmax_scale=0.3, causal=True)
    assert_close_to_reference("out", out, ref, attention_same_dtype(q, k, v, 0.3, causal=True))


def test_reference_softmax_scale_default_is_inverse_sqrt_headdim():
    q, k, v = make_qkv(1, 5, 5, 1, 16, torch.float32, "cpu")
    a, _ = attention_reference(q, k, v)
    b, _ = attention_reference(q, k, v, softmax_scale=1 / math.sqrt(16))
    torch.testing.assert_close(a, b)


def test_packed_variants_equal_unpacked():
    qkv = torch.randn(2, 33, 3, 2, 32, dtype=torch.float16, requires_grad=True)
    out_packed = flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (qkv[:, :, i].detach().clone().requires_grad_() for i in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out_packed, out, atol=0, rtol=0)
    dout = torch.randn_like(out)
    out_packed.backward(dout)
    out.backward(dout)
    torch.testing.assert_close(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2), atol=0, rtol=0)

    kv = torch.stack([k.detach(), v.detach()], dim=2)
    torch.testing.assert_close(flash_attn_kvpacked_func(q.detach(), kv, causal=True), out.detach(),
                               atol=0, rtol=0)


def test_block_config_does_not_change_the_result():
    q, k, v = make_qkv(1, 50, 50, 1, 32, torch.float32, "cpu")
    out_a, lse_a = flash_attn_forward(q, k, v, 0.2, True, FwdConfig(16, 16, 4, 1))
    out_b, lse_b = flash_attn_forward(q, k, v, 0.2, True, FwdConfig(64, 32, 4, 1))
    torch.testing.assert_close(out_a, out_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_a, lse_b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 5), (5, 0), (0, 0)])
def test_zero_length_sequences(seqlen_q, seqlen_k):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 2, 16, torch.float16, "cpu", requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (2, 2, seqlen_q)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))  # vacuous when seqlen_q == 0
    out.sum().backward()
    assert all(g is not None and torch.all(g == 0) for g in (q.grad, k.grad, v.grad))


def test_backward_passes_no_gradient_on_when_out_gets_none():
    """With set_materialize_grads(False) an upstream node that returns no gradient for `out`
    reaches the backward as None, which it passes on as no gradients."""
    assert FlashAttnFunc.backward(None, None, None) == (None,) * 4  # one per forward input


def test_inference_call_skips_autograd_and_matches_the_training_call(monkeypatch):
    """With no input needing a gradient the forward runs without FlashAttnFunc (its apply is
    host time an inference call does not need): same out and lse, no autograd graph."""
    q, k, v = make_qkv(1, 40, 33, 2, 16, torch.float32, "cpu", requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    applied = []
    real, real_c = FlashAttnFunc.apply, ops._apply_flash_attn
    monkeypatch.setattr(FlashAttnFunc, "apply", lambda *a: applied.append(1) or real(*a))
    monkeypatch.setattr(ops, "_apply_flash_attn", lambda *a: applied.append(1) or real_c(*a))
    for inputs, grad_mode in (((q.detach(), k.detach(), v.detach()), True), ((q, k, v), False)):
        with torch.set_grad_enabled(grad_mode):
            out2, lse2, _ = flash_attn_func(*inputs, causal=True, return_attn_probs=True)
        assert out2.grad_fn is None and not out2.requires_grad
        assert torch.equal(out2, out.detach()) and torch.equal(lse2, lse)
    assert not applied
    flash_attn_func(q, k, v, causal=True)  # a training call does apply (the spies can see it)
    assert applied == [1]


def test_training_call_applies_the_function_without_its_python_wrapper():
    """A training call enters autograd.Function's C entry point directly (ops._apply_flash_attn):
    the same node as FlashAttnFunc.apply makes (FlashAttnFuncBackward), and the same out and
    gradients, bit for bit. Under a functorch transform the wrapper's own route is taken, which
    rejects the transform by name as before (the Function defines no setup_context)."""
    q, k, v = make_qkv(1, 24, 20, 2, 16, torch.float32, "cpu", requires_grad=True)
    dout = torch.randn_like(q)
    results = []
    for apply in (ops._apply_flash_attn, FlashAttnFunc.apply):
        out, _ = apply(q, k, v, (16 ** -0.5, True, DENSE, None, None, False))
        assert type(out.grad_fn).__name__ == "FlashAttnFuncBackward"
        results.append((out.detach(), *torch.autograd.grad(out, (q, k, v), dout)))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert torch.equal(flash_attn_func(q, k, v, causal=True).detach(), results[0][0])
    with pytest.raises(RuntimeError, match="functorch transforms"):
        torch.func.grad(lambda q: flash_attn_func(q, k, v, causal=True).sum())(q.detach())


def test_autograd_materialises_no_gradient_for_lse(monkeypatch):
    """The non-differentiable lse gets no zero-filled gradient (an allocation and a fill per
    backward): the backward sees None for it, and the gradient of out still arrives."""
    seen = []
    real = FlashAttnFunc.backward

    def spy(ctx, dout, dlse):
        seen.append((dout is None, dlse is None))
        return real(ctx, dout, dlse)

    monkeypatch.setattr(FlashAttnFunc, "backward", staticmethod(spy))
    q, k, v = make_qkv(1, 20, 20, 1, 16, torch.float32, "cpu", requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert not lse.requires_grad
    out.sum().backward()
    assert seen == [(False, True)]
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def check_compiled_equals_eager(device: str, backend: str) -> None:
    """torch.compile (fullgraph) of a call traces one fa2::_fwd op and, in its backward, one fa2::bwd
    (kernels/ops.py's _TracedAttention): the same kernels as an eager call, so out and the gradients
    agree bit for bit."""
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    q, k, v = make_qkv(2, 70, 53, 2, 32, dtype, device, requires_grad=True)
    dout = torch.randn_like(q)

    def attend(q, k, v):
        return flash_attn_func(q, k, v, causal=True)

    traced = []

    def recording(graph_module, example_inputs):  # the graph's calls and its subgraphs' (an autograd.Function's)
        traced.extend(str(node.target) for module in graph_module.modules() if isinstance(module, torch.fx.GraphModule)
                      for node in module.graph.nodes if node.op == "call_function")
        return torch._dynamo.lookup_backend(backend)(graph_module, example_inputs)

    compiled = torch.compile(attend, backend=recording, fullgraph=True)
    results = []
    for fn in (compiled, attend):
        out = fn(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)
    assert [target for target in traced if "fa2" in target] == ["fa2._fwd", "fa2.bwd"], traced


def test_compiled_call_equals_eager():
    check_compiled_equals_eager("cpu", "aot_eager")  # Inductor's CPU backend needs a C++ toolchain


def test_training_step_reduces_the_loss():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 2, 16)
    proj = torch.nn.Linear(16, 3 * 16)
    opt = torch.optim.SGD(proj.parameters(), lr=0.5)
    target = torch.randn(2, 16, 2, 16)
    losses = []
    for _ in range(3):
        q, k, v = proj(x).chunk(3, dim=-1)
        loss = (flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
                - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------------------------------
# GPU: the same checks in bf16 and fp16 at real sizes (skipped without CUDA).
# ---------------------------------------------------------------------------------------
# The shapes the Hopper table sends to the Gluon kernels (head dims 96 and 128 from 1k keys, 64 from
# 1k, causal 4k, on 192 query rows: 6144 on their grid, 4096 and 8192 off it; causal ones packed, as
# 192 rows are not whole 128-key blocks).
GLUON_SHAPES = [(2, 1024, 1024, 3, 128), (1, 4096, 4096, 2, 128), (4, 2048, 2048, 1, 128),
                (1, 16384, 16384, 1, 128), (2, 4096, 4096, 3, 64), (1, 8192, 8192, 2, 64), (1, 6144, 6144, 2, 64),
                (2, 2048, 2048, 3, 96), (1, 4096, 4096, 2, 96)]  # 96: two head-dim sections


@pytest.mark.gpu
def test_gpu_checked_shapes_do_not_let_a_bad_call_through():
    """check_qkv remembers CUDA inputs that passed; a call differing in dtype, device-side shape
    or head count is still checked and rejected with its message."""
    q, k, v = make_qkv(1, 64, 64, 4, 32, torch.bfloat16, "cuda")
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v)  # the remembered inputs
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attn_func(q, k.half(), v)
    with pytest.raises(ValueError, match="must divide q heads"):
        flash_attn_func(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match="same shape"):
        flash_attn_func(q, k, v[:, :32])


def skip_unless_hopper(what: str) -> None:
    if not configs.on_hopper(torch.device("cuda")):
        pytest.skip(f"{what} is compiled for Hopper (sm_90) only")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=shape_id)
@pytest.mark.usefixtures("poisoned_allocations")
def test_gpu_forward_matches_reference(shape, causal, dtype):
    check_forward(*shape, causal, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", GLUON_SHAPES, ids=shape_id)
@pytest.mark.usefixtures("poisoned_allocations")
def test_gpu_hopper_gluon_forward_matches_reference(shape, causal, dtype):
    """The Gluon forward (kernels/flash_attn_hopper.py), which the Hopper table takes at head dim
    128 from 1k keys and 64 from 1k (causal 4k) on 192 query rows, against float64: several batches
    and heads, both causal modes; the dense kernel where the lengths are whole query and key blocks
    (and causal, whole key blocks a query block), else its varlen kernel on the batch rows."""
    skip_unless_hopper("the Gluon forward")
    q = torch.empty(shape[0], shape[1], shape[3], shape[4], dtype=dtype, device="cuda")
    config = configs.default_fwd_config(shape[4], causal, q.device)
    rows, block_n = dispatch.fwd_gluon_rows(config), config.hopper_gluon_block_n
    on_grid = shape[1] % rows == 0 and shape[1] % block_n == 0 and not (causal and rows % block_n)
    assert fwd_memory_path(config, q, q, q, q, causal) == (GluonPath.DENSE if on_grid else GluonPath.PACKED)
    check_forward(*shape, causal, dtype, "cuda")
    # the Gluon kernel ran: a build error would have sent the call to Triton with only a warning
    assert not dispatch.gluon_unavailable, dispatch.gluon_unavailable


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 3000, 3000, 3, 128), (1, 2048, 8192, 2, 128), (2, 2100, 1500, 2, 128),
                                   (3, 1100, 1100, 2, 128), (1, 4500, 4500, 2, 64), (2, 2100, 3000, 3, 96)],
                         ids=shape_id)
@pytest.mark.usefixtures("poisoned_allocations")
def test_gpu_dense_calls_off_the_grid_on_the_gluon_varlen_kernels(shape, causal, dtype):
    """Dense calls off the dense Gluon kernels' grid (lengths not a multiple of 128, fewer or more
    queries than keys, so that with causal the first rows see no key) on the Gluon varlen kernels,
    each batch row a packed sequence: forward (out and logsumexp in the dense layout) and backward
    (the varlen dK/dV kernel with dQ fused, at head dims 64, 96 and 128) against float64."""
    skip_unless_hopper("the Gluon varlen kernels")
    batch, seqlen_q, seqlen_k, heads, headdim = shape
    q = torch.empty(batch, seqlen_q, heads, headdim, dtype=dtype, device="cuda")
    k = torch.empty(batch, seqlen_k, heads, headdim, dtype=dtype, device="cuda")
    config = configs.default_fwd_config(headdim, causal, q.device)
    assert fwd_memory_path(config, q, k, k, q, causal) == dispatch.GluonPath.PACKED
    assert dispatch.bwd_dkdv_path(configs.default_bwd_config(headdim, q.device), q, k, k, q) == dispatch.GluonPath.PACKED
    check_forward(*shape, causal, dtype, "cuda")
    check_backward(*shape, causal, dtype, "cuda")
    assert not dispatch.gluon_unavailable, dispatch.gluon_unavailable


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 1024, 1024, 2, 64), (1, 2048, 2048, 2, 128),
                                   (1, 4096, 4096, 1, 128), (1, 1000, 1000, 1, 256), (2, 1024, 1024, 2, 256),
                                   (1, 777, 1500, 2, 96), (1, 1500, 777, 2, 59),
                                   # padded to 256 with descriptor loads: ragged both ways
                                   (1, 777, 1500, 2, 192), (1, 1500, 777, 2, 160)],
                         ids=shape_id)
@pytest.mark.usefixtures("poisoned_allocations")
def test_gpu_backward_matches_reference(shape, causal, dtype):
    check_backward(*shape, causal, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fused_dq", [True, False], ids=["fused-dq", "dq-kernel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", GLUON_SHAPES, ids=shape_id)
@pytest.mark.usefixtures("poisoned_allocations")
def test_gpu_hopper_gluon_dkdv_matches_reference(shape, causal, dtype, fused_dq, monkeypatch):
    """The backward with the Gluon dK/dV kernel (kernels/flash_attn_hopper.py), with dQ fused (at
    head dim 128 each consumer computes half of every step's columns, at 64 and 96 the consumers
    take turns by step) and without, by a config, against float64. The Triton dK/dV kernel must not
    run; the Triton dQ kernel must run exactly where dQ is not fused."""
    skip_unless_hopper("the Gluon dK/dV kernel")
    dkdv, dq = spy_backward_kernels(monkeypatch)
    gluon_calls = []
    gluon_plan = flash_attn_hopper.backward_dkdv_hopper_plan

    def counted(*args, **kwargs):  # a plan made for this call's shape (the config is in the plan's key)
        gluon_calls.append(args[0].shape)
        return gluon_plan(*args, **kwargs)

    monkeypatch.setattr(flash_attn_hopper, "backward_dkdv_hopper_plan", counted)
    config = dataclasses.replace(configs.default_bwd_config(shape[4], torch.device("cuda")),
                                 hopper_gluon_min_keys=1024, hopper_gluon_fused_dq=fused_dq)
    check_backward(*shape, causal, dtype, "cuda", bwd_config=config)
    assert len(gluon_calls) == 1 and not dkdv.launches and len(dq.launches) == (0 if fused_dq else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 1024, 1024, 2, 64), (1, 4096, 4096, 2, 128), (1, 1100, 4200, 2, 128),
                                   (1, 1500, 777, 2, 96)], ids=shape_id)
@pytest.mark.usefixtures("poisoned_allocations")
def test_gpu_backward_with_fused_dq_matches_reference(shape, causal, dtype, monkeypatch):
    """dQ fused into the dK/dV kernel (TMA reduce-adds into a float32 accumulator on Hopper,
    element-wise atomics elsewhere; the CPU tests run the atomic form): ragged lengths both ways
    (the descriptor drops rows past seqlen_q), a head dim padded to 128, both causal modes."""
    dkdv, dq = spy_backward_kernels(monkeypatch)
    fusing = dataclasses.replace(configs.default_bwd_config(shape[4], torch.device("cuda")), fused_dq_min_rows=1,
                                 hopper_gluon_min_keys=0)  # the Triton dK/dV kernel, not the Gluon one
    check_backward(*shape, causal, dtype, "cuda", bwd_config=fusing)
    expected = 2 if configs.on_hopper(torch.device("cuda")) else 1
    assert [launch["FUSED_DQ"] for launch in dkdv.launches] == [expected] and not dq.launches


@pytest.mark.gpu
@pytest.mark.parametrize("fusing", ["table", "triton-fused-dq"])
def test_gpu_backward_is_deterministic_at_real_size(fusing):
    """deterministic=True (the dQ kernel, no atomics), with configs that would fuse dQ otherwise
    (on Hopper the table's Gluon dK/dV kernel at head dim 128 from 1k keys; the Triton dK/dV kernel
    with fused_dq_min_rows): five backward passes at a size that spans many programs agree bit for
    bit."""
    q, k, v = make_qkv(2, 2048, 2048, 8, 128, torch.bfloat16, "cuda", requires_grad=True)
    dout = torch.randn_like(q)
    table = configs.default_bwd_config(128, q.device)
    fusing = table if fusing == "table" else dataclasses.replace(table, fused_dq_min_rows=1, hopper_gluon_min_keys=0)

    def grads():
        out = flash_attn_func(q, k, v, causal=True, deterministic=True, bwd_config=fusing)
        return torch.autograd.grad(out, (q, k, v), dout)

    first = grads()
    for _ in range(4):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))


@pytest.mark.gpu
def test_gpu_compiled_call_equals_eager():
    check_compiled_equals_eager("cuda", "inductor")


def test_within_twice_the_error_is_flash_attns_criterion():
    from harness.accuracy import within_twice_the_error

    def vec(*values):
        return torch.tensor(values, dtype=torch.float64)

    ref, yardstick = vec(0, 0, 0, 0), vec(0, 0.1, 0, 0)  # the yardstick's max error: 0.1
    assert within_twice_the_error(vec(0.19, 0, 0, 0), ref, yardstick, 0.0) == (True, 0.19, 0.1)
    assert not within_twice_the_error(vec(0, 0, 0, 0.21), ref, yardstick, 0.0)[0]
    assert within_twice_the_error(vec(0, 0, 0, 0.21), ref, yardstick, 0.02)[0]  # eps
    assert not within_twice_the_error(vec(float("nan"), 0, 0, 0), ref, yardstick, 1.0)[0]
    assert not within_twice_the_error(vec(float("inf"), 0, 0, 0), ref, yardstick, 1.0)[0]
