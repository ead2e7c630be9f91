"""Providers that need no optional package: the project's FA2 kernel, PyTorch eager (the
paper's "PyTorch" baseline) and PyTorch's scaled_dot_product_attention pinned to each of
its backends (SDPA flash is the official FA2 CUDA kernel vendored into PyTorch)."""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import asdict

import torch

from baselines.providers.core import (
    Provider,
    Spec,
    UnsupportedInput,
    any_input,
    check_causal_lengths,
    cuda_available,
    everywhere,
    half_only,
    register,
    triton_supports,
)
from baselines.reference import attention_same_dtype

# --------------------------------------------------------------------------------------
# The project's FA2 kernel
# --------------------------------------------------------------------------------------
# A forward block config that replaces the table's for every fa2 measurement of this process
# (runner.py --fa2-fwd-config): how CI shows that a slowed kernel is flagged as a regression
# without touching the kernel's code.
_fa2_fwd_override = None


def override_fa2_fwd_config(config) -> None:
    """Use `config` (a kernels FwdConfig, or None for the table) for fa2's forward."""
    global _fa2_fwd_override
    _fa2_fwd_override = config


def _fa2_forward(q, k, v, causal, softmax_scale):
    from kernels import flash_attn_func

    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, fwd_config=_fa2_fwd_override)


def _fa2_config(spec: Spec) -> str:
    from kernels import configs, dispatch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fwd = _fa2_fwd_override or configs.default_fwd_config(spec.hdim, spec.causal, device)
    # the sweep's inputs: contiguous (batch, seqlen, heads, hdim) tensors at aligned addresses,
    # stood in for by a meta tensor (address 0) of the same shape, dtype and strides
    like = torch.empty(spec.batch, spec.seqlen, spec.heads, spec.hdim, dtype=spec.torch_dtype, device="meta")
    path = dispatch.fwd_memory_path(fwd, like, like, like, like, spec.causal)
    config = {"fwd": asdict(fwd), "fwd_memory_path": path, "fwd_overridden": _fa2_fwd_override is not None}
    if spec.mode != "fwd":
        bwd = configs.default_bwd_config(spec.hdim, device)
        # which dK/dV kernel: the Triton one, or the Gluon one ('gluon-ws', head dim 128 on Hopper);
        # and whether it adds dQ itself (atomics) instead of the dQ kernel
        dkdv_path = dispatch.bwd_dkdv_path(bwd, like, like, like, like)
        # the varlen kernel a dense call off the grid takes ('gluon-ws-packed') always adds dQ
        fuses = (dispatch.bwd_gluon_fuses_dq(bwd, spec.hdim) if dkdv_path == dispatch.GluonPath.DENSE
                 else dkdv_path == dispatch.GluonPath.PACKED or dispatch.bwd_fuses_dq(bwd, spec.seqlen))
        config.update(bwd=asdict(bwd), bwd_dkdv_path=dkdv_path, bwd_fuses_dq=fuses)
    return json.dumps(config, sort_keys=True)


register(Provider(
    name="fa2", label="FA2 (this repo, Triton)", forward=_fa2_forward,
    availability=everywhere, supports=triton_supports,
    # the forward is _flash_fwd_kernel, or the Gluon _flash_fwd_hopper_kernel (head dims 64, 96, 128,
    # 192 and 256 on Hopper; its varlen variant for lengths off the 128-row grid); the backward's dK/dV kernel
    # _flash_bwd_dkdv_kernel, or on Hopper from 1k keys _flash_bwd_dkdv_hopper_kernel (head dims 64, 96
    # and 128; the varlen variant off the grid) or _flash_bwd_dkdv_hopper_wide_kernel (head dim 192)
    kernel_regex="_flash_fwd(_hopper)?(_varlen)?_kernel",
    bwd_kernel_regex="_flash_bwd_dkdv(_hopper)?(_varlen|_wide)?_kernel",
    config=_fa2_config,
))


# --------------------------------------------------------------------------------------
# PyTorch eager: the paper's "PyTorch" baseline (matmul, mask, softmax in fp32, matmul)
# --------------------------------------------------------------------------------------
def pytorch_forward(q, k, v, causal, softmax_scale):
    return attention_same_dtype(q, k, v, softmax_scale=softmax_scale, causal=causal)


register(Provider(
    name="pytorch", label="PyTorch eager (matmul + softmax)", forward=pytorch_forward,
    availability=everywhere, kernel_regex="gemm|softmax", bwd_kernel_regex="gemm|softmax",
))


# --------------------------------------------------------------------------------------
# PyTorch scaled_dot_product_attention, pinned to one backend each
# --------------------------------------------------------------------------------------
# How SDPA says that the pinned backend does not take the input (CUDA / CPU dispatch).
SDPA_REFUSALS = ("No available kernel", "No viable backend for scaled_dot_product_attention")


def sdpa_call(backend_name: str, qt, kt, vt, **kwargs):
    """SDPA on (B, H, S, D) views pinned to `backend_name`; a backend refusing the input
    raises UnsupportedInput with SDPA's own explanation (which it gives in warnings)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call():
        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, **kwargs)

    try:
        return call()
    except RuntimeError as exc:
        if not any(refusal in str(exc) for refusal in SDPA_REFUSALS):
            raise
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with contextlib.suppress(RuntimeError):
                call()
        why = "; ".join(str(w.message) for w in caught) or str(exc)
        raise UnsupportedInput(f"SDPA {backend_name} refuses this input: {why}") from exc


def sdpa_forward(backend_name: str):
    def forward(q, k, v, causal, softmax_scale):
        check_causal_lengths(q, k, causal, f"SDPA {backend_name}")
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views
        return sdpa_call(backend_name, qt, kt, vt, is_causal=causal, scale=softmax_scale).transpose(1, 2)

    return forward


# SDPA's efficient backend is xformers' cutlass kernel (fmha_cutlassF/B), upstreamed into PyTorch
SDPA_EFFICIENT_LABEL = "xformers' cutlass kernel (in PyTorch SDPA)"
SDPA_BACKENDS = (
    # name, label, backend, forward kernel regex, backward kernel regex, CUDA only
    ("sdpa-flash", "FA2 official CUDA (SDPA flash)", "FLASH_ATTENTION", "flash_fwd", "flash_bwd", True),
    ("sdpa-efficient", SDPA_EFFICIENT_LABEL, "EFFICIENT_ATTENTION", "fmha_cutlassF",
     "fmha_cutlassB", True),
    ("sdpa-cudnn", "cuDNN (SDPA cudnn)", "CUDNN_ATTENTION", "cudnn", "cudnn", True),
    ("sdpa-math", "PyTorch SDPA math", "MATH", "gemm|softmax", "gemm|softmax", False),
)
for _name, _label, _backend, _regex, _bwd_regex, _cuda_only in SDPA_BACKENDS:
    register(Provider(
        name=_name, label=_label, forward=sdpa_forward(_backend),
        availability=cuda_available if _cuda_only else everywhere,
        supports=half_only if _backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION") else any_input,
        kernel_regex=_regex, bwd_kernel_regex=_bwd_regex,
    ))
