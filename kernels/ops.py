"""The kernels as PyTorch custom ops, so that torch.compile and torch.export see one opaque node.

As flash-attn's own interface does (flash_attn_interface.py, 2.7+): PyTorch ops `fa2::fwd` and
`fa2::bwd`, a fake (meta) implementation of each that allocates exactly what the real one
returns after the same argument checks (kernels/checks.py), and autograd registered on
`fa2::fwd` whose backward calls `fa2::bwd`. Block-size overrides travel as JSON strings (an op's
schema takes no dataclasses).

They are defined with torch.library's schema API (`Library.define` and `impl` for the CPU and
CUDA keys, `register_fake`, `register_autograd`) rather than `torch.library.custom_op`, whose
per-call Python layers (the aliasing checks of the inputs and outputs around the kernel) every
call through the op pays, a compiled graph's included (docs/performance.md has the two
registrations' host times).

Eager calls skip the dispatcher's round trip (`FlashAttnFunc` calls the same implementations
directly): host time is what short calls wait on. Under torch.compile and torch.export tracing
(`tracing()`), the public functions call the ops instead, as flash-attn's interface does: an
autograd.Function (`_TracedAttention`, fa2::fwd's own autograd) over `fa2::_fwd`, fa2::fwd without
an autograd kernel, so that a compiled graph's calls do not pass through the Python autograd
kernel that register_autograd puts in front of an op; torch.export's trace calls fa2::fwd.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import torch
from torch import Tensor

from .backward import flash_attn_backward
from .checks import DENSE, Features, check_call
from .configs import BwdConfig, FwdConfig
from .forward import flash_attn_forward


def config_json(config: FwdConfig | BwdConfig | None) -> str:
    """A config as the ops take it: '' for the default table."""
    return "" if config is None else json.dumps(dataclasses.asdict(config))


@functools.lru_cache(maxsize=64)
def _fwd_config(text: str) -> FwdConfig | None:
    return FwdConfig(**json.loads(text)) if text else None


@functools.lru_cache(maxsize=64)
def _bwd_config(text: str) -> BwdConfig | None:
    return BwdConfig(**json.loads(text)) if text else None


def tracing(t: Tensor) -> bool:
    """Whether this call is being traced (torch.compile, torch.export, make_fx on fake tensors)."""
    return torch.compiler.is_compiling() or isinstance(t, torch._subclasses.FakeTensor)


def _features(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right, softcap,
              alibi_slopes, dropout_p, rng_seed, causal) -> Features:
    if causal:  # causal is the window's right side (0)
        window_right = -1
    if (cu_seqlens_q is None and window_left < 0 and window_right < 0 and not softcap and alibi_slopes is None
            and not dropout_p):
        return DENSE
    return Features(window_left, window_right, softcap, alibi_slopes, dropout_p, rng_seed,
                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def _lse_shape(q: Tensor, features: Features) -> tuple[int, ...]:
    """(batch, heads, seqlen_q); packed varlen: (heads, total_q), flash-attn's layouts."""
    if features.varlen:
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


_LIB = torch.library.Library("fa2", "FRAGMENT")  # kernels/decode.py defines its ops in the namespace too
_FWD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
               "SymInt max_seqlen_k, float softmax_scale, bool causal, SymInt window_left, SymInt window_right, "
               "float softcap, Tensor? alibi_slopes, float dropout_p, Tensor? rng_seed, bool deterministic, "
               "str fwd_config, str bwd_config) -> (Tensor, Tensor)")
# as custom_op tags its ops (opcheck in tests/test_compile.py)
_LIB.define("fwd" + _FWD_SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))
# fa2::fwd without an autograd kernel, which the public functions' traced path wraps in an
# autograd.Function (`_TracedAttention`): a compiled graph's call to it skips the Python autograd
# kernel that register_autograd puts in front of fa2::fwd (host time per call)
_LIB.define("_fwd" + _FWD_SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
            "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, bool causal, "
            "SymInt window_left, SymInt window_right, float softcap, Tensor? alibi_slopes, float dropout_p, "
            "Tensor? rng_seed, bool deterministic, str bwd_config) -> (Tensor, Tensor, Tensor)",
            tags=(torch.Tag.pt2_compliant_tag,))


def fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
        max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
        window_right: int, softcap: float, alibi_slopes: Tensor | None, dropout_p: float,
        rng_seed: Tensor | None, deterministic: bool, fwd_config: str, bwd_config: str) -> tuple[Tensor, Tensor]:
    """Forward: (out like q, lse float32). `deterministic` and `bwd_config` are kept for the
    backward that autograd registers below."""
    features = _features(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right,
                         softcap, alibi_slopes, dropout_p, rng_seed, causal)
    check_call(q, k, v, causal, features)
    return flash_attn_forward(q, k, v, softmax_scale, causal, _fwd_config(fwd_config), features)


def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
              window_right, softcap, alibi_slopes, dropout_p, rng_seed, deterministic, fwd_config, bwd_config):
    features = _features(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right,
                         softcap, alibi_slopes, dropout_p, rng_seed, causal)
    check_call(q, k, v, causal, features)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty(_lse_shape(q, features), dtype=torch.float32)


def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor | None,
        cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
        window_left: int, window_right: int, softcap: float, alibi_slopes: Tensor | None, dropout_p: float,
        rng_seed: Tensor | None, deterministic: bool, bwd_config: str) -> tuple[Tensor, Tensor, Tensor]:
    """Backward: (dq, dk, dv) like q, k, v."""
    features = _features(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right,
                         softcap, alibi_slopes, dropout_p, rng_seed, causal)
    return flash_attn_backward(dout, q, k, v, out, lse, softmax_scale, causal, _bwd_config(bwd_config),
                               deterministic, features)


def _bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
              window_left, window_right, softcap, alibi_slopes, dropout_p, rng_seed, deterministic, bwd_config):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


for _name, _impl, _fake in (("fwd", fwd, _fwd_fake), ("_fwd", fwd, _fwd_fake), ("bwd", bwd, _bwd_fake)):
    for _key in ("CPU", "CUDA"):  # CPU: Triton's interpreter
        _LIB.impl(_name, _impl, _key)
    torch.library.register_fake(f"fa2::{_name}", _fake, lib=_LIB)


_BWD_INPUTS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
               "window_left", "window_right", "softcap", "alibi_slopes", "dropout_p", "rng_seed", "deterministic")


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap, alibi, p, seed, det, _, bwd_cfg = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi, seed)
    ctx.scalars = (max_q, max_k, scale, causal, left, right, softcap, p, det, bwd_cfg)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dlse):
    if dout is None:
        return (None,) * 18
    q, k, v, out, lse, cu_q, cu_k, alibi, seed = ctx.saved_tensors
    max_q, max_k, scale, causal, left, right, softcap, p, det, bwd_cfg = ctx.scalars
    dq, dk, dv = torch.ops.fa2.bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, left, right,
                                   softcap, alibi, p, seed, det, bwd_cfg)
    return (dq, dk, dv) + (None,) * 15


torch.library.register_autograd("fa2::fwd", _backward, setup_context=_setup_context, lib=_LIB)


class _TracedAttention(torch.autograd.Function):
    """fa2::fwd's autograd (the same setup_context and backward) over fa2::_fwd, for the public
    functions' traced path: Dynamo traces the Function, and the compiled graph calls fa2::_fwd and
    fa2::bwd, neither with a Python autograd kernel in front (a compiled call, forward and
    backward, costs the host less). torch.export's trace takes fa2::fwd itself (`attention`), and
    so do calls given one tensor twice, which Dynamo refuses to trace through a Function
    (`flash_attn_func(x, x, x)`, or one cu_seqlens tensor for queries and keys, as the packed varlen
    functions and self-attention calls pass it)."""

    @staticmethod
    def forward(ctx, *args):  # ctx first: Dynamo's no-grad trace of forward(*args) with setup_context fails
        output = torch.ops.fa2._fwd(*args)
        _setup_context(ctx, args, output)
        return output

    backward = staticmethod(_backward)


def _exporting() -> bool:
    """Whether torch.export is tracing: its flag, read as a global (torch 2.11's Dynamo folds
    `torch.compiler.is_exporting()` to True under torch.compile too). An exported graph holds
    fa2::fwd, whose registered autograd differentiates the exported module."""
    return getattr(torch.compiler, "_is_exporting_flag", False)


def _repeats_a_tensor(*args) -> bool:
    """Whether one tensor is among `args` twice (`is`: what Dynamo can tell while tracing)."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    return any(a is b for i, a in enumerate(tensors) for b in tensors[i + 1:])


class FlashAttnFunc(torch.autograd.Function):
    """Eager autograd over the same implementations as the ops (no dispatcher round trip)."""

    @staticmethod
    def forward(ctx, q, k, v, params):
        softmax_scale, causal, features, fwd_config, bwd_config, deterministic = params
        check_call(q, k, v, causal, features)
        out, lse = flash_attn_forward(q, k, v, softmax_scale, causal, fwd_config, features)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (softmax_scale, causal, bwd_config, deterministic, features)
        ctx.mark_non_differentiable(lse)
        # lse has no gradient: do not have autograd allocate and zero one for it per backward
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # an upstream node returned no gradient for out (none is materialised)
            return None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        softmax_scale, causal, bwd_config, deterministic, features = ctx.args
        dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, softmax_scale, causal, bwd_config,
                                         deterministic, features)
        return dq, dk, dv, None


def attention(q, k, v, softmax_scale: float, causal: bool, features: Features, fwd_config: FwdConfig | None,
              bwd_config: BwdConfig | None, deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out, lse) with autograd: the ops when traced (_TracedAttention), FlashAttnFunc when eager, and the forward
    alone when no input needs a gradient (an inference call skips autograd.Function's apply)."""
    if tracing(q):
        f = features
        args = (q, k, v, f.cu_seqlens_q, f.cu_seqlens_k, f.max_seqlen_q, f.max_seqlen_k, softmax_scale, causal,
                f.window_left, f.window_right, f.softcap, f.alibi_slopes, f.dropout_p, f.rng_seed, deterministic,
                config_json(fwd_config), config_json(bwd_config))
        if _exporting() or _repeats_a_tensor(*args):
            return torch.ops.fa2.fwd(*args)
        return _TracedAttention.apply(*args)
    if not (torch.is_grad_enabled() and (getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False)
                                         or getattr(v, "requires_grad", False))):
        check_call(q, k, v, causal, features)
        return flash_attn_forward(q, k, v, softmax_scale, causal, fwd_config, features)
    params = (softmax_scale, causal, features, fwd_config, bwd_config, deterministic)
    if torch._C._are_functorch_transforms_active() or any(map(_is_functorch_wrapped, (q, k, v))):
        return FlashAttnFunc.apply(q, k, v, params)  # vmap, grad, ... or their tensors: autograd.Function's route
    # the call's constants travel as one tuple: apply inspects every argument it is given
    return _apply_flash_attn(q, k, v, params)


# `FlashAttnFunc.apply` without its Python wrapper (torch/autograd/function.py's Function.apply),
# which binds default arguments where setup_context is defined (it is not here) and maps every
# argument through functorch's `unwrap_dead_wrappers` (a pytree walk) before calling this C
# entry point; with no functorch transform active and no functorch tensor among q, k and v, as
# `attention` checks, the wrapper calls it with the same arguments.
_C_APPLY = torch._C._FunctionBase.__dict__.get("apply")  # a torch without it: the wrapper's route
_apply_flash_attn = FlashAttnFunc.apply if _C_APPLY is None else _C_APPLY.__get__(None, FlashAttnFunc)
_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
