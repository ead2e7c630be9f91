"""The kernels inside torch.compile, CUDA graphs and torch.export: one opaque custom op each way.

CPU tests run the real ops in Triton's interpreter (small fp16 shapes); the `gpu` tests compile a
GPT block forward and backward in bf16 at a real size, with and without CUDA graphs.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from baselines.reference import attention_reference
from kernels.ops import config_json

INTERPRETER_TESTS = True  # unmarked tests run in Triton's interpreter (tests/conftest.py)


def _qkv(batch, seqlen, heads, headdim, dtype, device, requires_grad=True):
    return [torch.randn(batch, seqlen, heads, headdim, dtype=dtype, device=device, requires_grad=requires_grad)
            for _ in range(3)]


def _fwd_op_args(q, k, v, causal=True, scale=0.25):
    return (q, k, v, None, None, 0, 0, scale, causal, -1, -1, 0.0, None, 0.0, None, False, "", "")


class Block(nn.Module):
    """A GPT block: pre-norm attention through flash_attn_func, then an MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):  # (B, N, C)
        batch, seqlen, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, seqlen, 3, self.heads, dim // self.heads)  # (B, N, 3, H, D)
        y = kernels.flash_attn_qkvpacked_func(qkv, causal=True)  # (B, N, H, D)
        x = x + self.proj(y.reshape(batch, seqlen, dim))
        return x + self.mlp(self.norm2(x))


@pytest.mark.parametrize("op", ["fwd", "_fwd"])  # _fwd: fwd without autograd, for the traced path
def test_fwd_op_passes_opcheck(op):
    q, k, v = _qkv(2, 40, 2, 32, torch.float16, "cpu", requires_grad=False)
    torch.library.opcheck(getattr(torch.ops.fa2, op).default, _fwd_op_args(q, k, v))


def test_bwd_op_passes_opcheck():
    q, k, v = _qkv(1, 33, 2, 16, torch.float16, "cpu", requires_grad=False)
    out, lse = torch.ops.fa2.fwd(*_fwd_op_args(q, k, v))
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.fa2.bwd.default, (dout, q, k, v, out, lse, None, None, 0, 0, 0.25, True,
                                                      -1, -1, 0.0, None, 0.0, None, True, ""))


def test_op_and_eager_autograd_give_identical_results():
    q, k, v = _qkv(2, 37, 2, 32, torch.float16, "cpu")
    out_eager = kernels.flash_attn_func(q, k, v, softmax_scale=0.25, causal=True)
    grads_eager = torch.autograd.grad(out_eager.float().square().sum(), (q, k, v))
    out_op, _ = torch.ops.fa2.fwd(*_fwd_op_args(q, k, v))
    grads_op = torch.autograd.grad(out_op.float().square().sum(), (q, k, v))
    assert torch.equal(out_eager, out_op)
    for eager, op in zip(grads_eager, grads_op, strict=True):
        assert torch.equal(eager, op)


def test_fake_op_rejects_what_the_real_op_rejects():
    q, k, v = _qkv(1, 16, 4, 32, torch.float16, "cpu", requires_grad=False)
    short_k = k[..., :16].contiguous()
    mode = torch._subclasses.FakeTensorMode()
    fq, fk = mode.from_tensor(q), mode.from_tensor(short_k)
    with mode, pytest.raises(ValueError, match="head dim"):
        torch.ops.fa2.fwd(*_fwd_op_args(fq, fk, fk))
    with pytest.raises(ValueError, match="head dim"):
        torch.ops.fa2.fwd(*_fwd_op_args(q, k[..., :16], v[..., :16]))


def test_config_overrides_travel_through_the_op():
    q, k, v = _qkv(1, 40, 1, 32, torch.float16, "cpu", requires_grad=False)
    config = kernels.FwdConfig(16, 16, 4, 1)
    args = list(_fwd_op_args(q, k, v))
    args[16] = config_json(config)
    out_op, _ = torch.ops.fa2.fwd(*args)
    assert torch.equal(out_op, kernels.flash_attn_func(q, k, v, softmax_scale=0.25, causal=True, fwd_config=config))


@pytest.mark.slow
def test_fullgraph_compile_of_a_block_matches_eager():
    torch.manual_seed(0)
    block = Block(64, 2).to(torch.float16)
    x = torch.randn(2, 48, 64, dtype=torch.float16, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    y_compiled = compiled(x)
    grad_compiled = torch.autograd.grad(y_compiled.float().sum(), x)[0]
    y_eager = block(x)
    grad_eager = torch.autograd.grad(y_eager.float().sum(), x)[0]
    torch.testing.assert_close(y_compiled, y_eager, rtol=0, atol=0)
    torch.testing.assert_close(grad_compiled, grad_eager, rtol=0, atol=0)


@pytest.mark.slow
def test_inductor_fullgraph_compile_of_attention_matches_eager():
    q, k, v = _qkv(1, 33, 2, 32, torch.float16, "cpu")

    def attention_loss(q, k, v):
        return kernels.flash_attn_func(q * 0.5, k, v, causal=True).float().square().sum()

    loss = torch.compile(attention_loss, fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    loss_eager = attention_loss(q, k, v)
    grads_eager = torch.autograd.grad(loss_eager, (q, k, v))
    torch.testing.assert_close(loss, loss_eager)
    for got, want in zip(grads, grads_eager, strict=True):
        torch.testing.assert_close(got, want)


def test_compiled_calls_given_one_tensor_twice_match_eager():
    """Dynamo traces no autograd.Function given one tensor twice: flash_attn_func(x, x, x) and the
    packed varlen function (one cu_seqlens for queries and keys) take fa2::fwd itself, and compile
    with fullgraph=True to what eager computes, bit for bit, forward and backward."""
    x = torch.randn(1, 33, 2, 16, dtype=torch.float16, requires_grad=True)
    qkv = torch.randn(40, 3, 2, 16, dtype=torch.float16, requires_grad=True)
    cu_seqlens = torch.tensor([0, 17, 40], dtype=torch.int32)
    calls = ((lambda x: kernels.flash_attn_func(x, x, x, causal=True), x),
             (lambda qkv: kernels.flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, 23, causal=True), qkv))
    for call, t in calls:
        traced = []

        def recording(graph_module, example_inputs, traced=traced):  # the graph's calls and its subgraphs'
            traced.extend(str(node.target) for module in graph_module.modules()
                          if isinstance(module, torch.fx.GraphModule)
                          for node in module.graph.nodes if node.op == "call_function")
            return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)

        torch._dynamo.reset()
        compiled = torch.compile(call, backend=recording, fullgraph=True)(t)
        assert [target for target in traced if "fa2" in target] == ["fa2.fwd"], traced
        eager = call(t)
        assert torch.equal(compiled, eager)
        dout = torch.randn_like(eager)
        assert torch.equal(torch.autograd.grad(compiled, t, dout)[0], torch.autograd.grad(eager, t, dout)[0])


@pytest.mark.parametrize("grad_mode", ["no_grad", "no_grad, inputs without grad", "inputs without grad"])
def test_compiled_inference_call_matches_eager(grad_mode):
    """An inference call compiled with fullgraph=True (under no_grad with inputs that require grad,
    as a model's eval loop runs; under no_grad or with grad enabled on inputs that do not) equals
    eager, bit for bit."""
    q, k, v = _qkv(1, 33, 2, 16, torch.float16, "cpu", requires_grad=grad_mode == "no_grad")

    def attention(q, k, v):
        return kernels.flash_attn_func(q, k, v, causal=True)

    with torch.set_grad_enabled(not grad_mode.startswith("no_grad")):
        compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)(q, k, v)
        assert torch.equal(compiled, attention(q, k, v))


def test_inference_forward_exports():
    q, k, v = _qkv(1, 32, 2, 16, torch.float16, "cpu", requires_grad=False)

    class Attention(nn.Module):
        def forward(self, q, k, v):
            return kernels.flash_attn_func(q, k, v, causal=True)

    program = torch.export.export(Attention(), (q, k, v))
    assert any(node.target == torch.ops.fa2.fwd.default for node in program.graph.nodes)
    reference, _ = attention_reference(q, k, v, causal=True)
    assert (program.module()(q, k, v).double() - reference).abs().max() < 2e-3
    # the exported node is fa2::fwd, whose registered autograd differentiates the exported module
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    out = program.module()(*x)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, x, dout)
    want = torch.autograd.grad(kernels.flash_attn_func(*x, causal=True), x, dout)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# GPU: a GPT block at a real size, bf16
# ---------------------------------------------------------------------------------------------
def _gpt_block_grads(module, x):
    y = module(x)
    (grad,) = torch.autograd.grad(y.float().square().mean(), x)
    return y, grad


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_compiled_gpt_block_matches_eager(mode):
    torch.manual_seed(0)
    block = Block(1024, 8).to("cuda", torch.bfloat16)
    x = torch.randn(4, 1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True, mode=None if mode == "default" else mode)
    for _ in range(3):  # CUDA graphs record on a later call than the first
        y_compiled, grad_compiled = _gpt_block_grads(compiled, x)
    y_eager, grad_eager = _gpt_block_grads(block, x)
    # Inductor fuses the block's other ops differently from eager: bf16 rounding, not attention
    torch.testing.assert_close(y_compiled, y_eager, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad_compiled, grad_eager, rtol=5e-2, atol=1e-3)


@pytest.mark.gpu
def test_gpu_compiled_attention_is_one_node_and_exact():
    """Attention alone compiled: the op runs the same kernels, so outputs are bit-identical."""
    q, k, v = _qkv(2, 2048, 16, 128, torch.bfloat16, "cuda")

    def attention(q, k, v):
        return kernels.flash_attn_func(q, k, v, causal=True)

    compiled = torch.compile(attention, fullgraph=True)
    out = compiled(q, k, v)
    assert torch.equal(out, attention(q, k, v))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    grads_eager = torch.autograd.grad(attention(q, k, v), (q, k, v), dout)
    for got, want in zip(grads, grads_eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-2)  # the fused dQ's atomics reorder sums


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_matches_eager():
    q, k, v = _qkv(1, 1024, 16, 128, torch.bfloat16, "cuda", requires_grad=False)
    expected = kernels.flash_attn_func(q, k, v, causal=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.flash_attn_func(q, k, v, causal=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    assert torch.equal(out, kernels.flash_attn_func(q, k, v, causal=True))
    assert not torch.equal(out, expected)


def test_block_uses_sdpa_shape_conventions():
    """The test block's attention equals SDPA's causal attention on the same projections."""
    torch.manual_seed(0)
    block = Block(32, 2)
    x = torch.randn(1, 24, 32)
    qkv = block.qkv(block.norm1(x)).view(1, 24, 3, 2, 16)
    q, k, v = qkv.unbind(2)
    ours = kernels.flash_attn_func(q, k, v, causal=True)
    sdpa = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(ours, sdpa, rtol=1e-4, atol=1e-4)
