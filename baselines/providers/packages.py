"""Providers from optional packages, each available only where its package imports and a
tiny call runs: FlashAttention-4 (flash-attn-4, CuTe DSL), the flash-attn packages (FA2,
FA3), FlashInfer and xformers. Their availability says which package to install or why
its kernels do not run here."""

from __future__ import annotations

import functools
import importlib
import itertools
import json
from collections.abc import Callable

import torch

from baselines.providers.core import (
    MAX_HEADDIM,
    Provider,
    Spec,
    UnsupportedInput,
    any_input,
    first,
    half_only,
    min_arch,
    one_line,
    optional_cuda_package,
    package_version,
    probe_call,
    register,
)

# --------------------------------------------------------------------------------------
# FlashAttention-4 (flash_attn.cute): Hopper (sm_90) and Blackwell (sm_100/sm_110) kernels
# --------------------------------------------------------------------------------------
FA4_DISTRIBUTION = "flash-attn-4"
FA4_ARCH_MAJORS = (9, 10, 11)  # interface.py: sm_90 and sm_100/sm_110 have its fwd and bwd kernels
FA4_HEADDIM_ALIGN = 8  # 16 bytes of fp16/bf16 (interface.py _validate_head_dims)


def fa4_arch(capability: tuple[int, int]) -> str | None:
    major, minor = capability
    if major not in FA4_ARCH_MAJORS:
        return (f"FA4 has forward and backward kernels for sm_90 (Hopper) and sm_100/sm_110 (Blackwell) "
                f"only; this GPU is sm_{major}{minor}")
    return None


def fa4_headdim_reason(hdim: int, arch_major: int | None) -> str | None:
    """FA4's head-dim limits (flash_attn/cute/interface.py `_validate_head_dims`): multiples of 8
    from 8 to 256 on sm_90; on sm_100/sm_110 8..128, or 256."""
    if hdim % FA4_HEADDIM_ALIGN or not FA4_HEADDIM_ALIGN <= hdim <= MAX_HEADDIM:
        return f"FA4 takes head dims that are multiples of {FA4_HEADDIM_ALIGN} from 8 to {MAX_HEADDIM}, not {hdim}"
    if arch_major in (10, 11) and 128 < hdim < 256:
        return f"FA4 on sm_100/sm_110 takes head dims up to 128, or 256, not {hdim}"
    return None


def cuda_arch_major() -> int | None:
    return torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else None


def fa4_input_reason(dtype: str, hdim: int) -> str | None:
    """Why FA4 refuses inputs of `dtype` and head dim `hdim` on this GPU, or None."""
    if dtype not in ("fp16", "bf16"):
        return f"FA4 takes fp16/bf16 inputs only, not {dtype}"
    return fa4_headdim_reason(hdim, cuda_arch_major())


def fa4_supports(spec: Spec) -> str | None:
    return fa4_input_reason(spec.dtype, spec.hdim)


def fa4_forward(q, k, v, causal, softmax_scale):
    """flash_attn.cute.flash_attn_func returns (out, lse); its fourth positional parameter is
    `qv` (MLA), so the scale and the mask go by keyword. num_splits=1 (no split-KV: sm_90
    asserts on more)."""
    from flash_attn.cute import flash_attn_func

    return first(flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, num_splits=1))


def _fa4_config(_spec: Spec) -> str:
    return json.dumps({"package": FA4_DISTRIBUTION, "version": package_version(FA4_DISTRIBUTION),
                       "nvidia-cutlass-dsl": package_version("nvidia-cutlass-dsl"), "num_splits": 1,
                       "jit": "CuTe DSL compiles per (head dim, causal, dtype) in the untimed first call"})


register(Provider(
    name="fa4", label="FA4 (flash-attn-4, CuTe DSL)", forward=fa4_forward,
    availability=optional_cuda_package("flash_attn.cute", FA4_DISTRIBUTION, probe_call(fa4_forward), fa4_arch),
    supports=fa4_supports,
    # CuTe DSL names a kernel `kernel_` + its function and arguments mangled, the kernel object's module
    # and class first: kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at_...
    # The regexes take the main classes, not ...ForwardCombine, ...BackwardPreprocess/Postprocess around them
    kernel_regex="FlashAttentionForwardSm[0-9]+", bwd_kernel_regex="FlashAttentionBackwardSm[0-9]+",
    config=_fa4_config,
))


# --------------------------------------------------------------------------------------
# flash-attn packages: FA2 (flash_attn), FA3 (flash_attn_interface, Hopper)
# --------------------------------------------------------------------------------------
def _package_forward(module: str):
    def forward(q, k, v, causal, softmax_scale):
        return first(importlib.import_module(module).flash_attn_func(q, k, v, softmax_scale=softmax_scale,
                                                                     causal=causal))

    return forward


for _name, _label, _module, _probed_module, _distribution, _regex, _bwd_regex, _min_major in (
    # FA4's wheel makes `flash_attn` a namespace package holding only `cute`: FA2's own module is probed
    ("flash-attn", "FA2 official CUDA (flash-attn package)", "flash_attn", "flash_attn.flash_attn_interface",
     "flash-attn", "flash_fwd", "flash_bwd", 8),
    ("flash-attn-3", "FA3 (flash-attn Hopper package)", "flash_attn_interface", "flash_attn_interface",
     "flash-attn-3 (flash-attention/hopper)", "FlashAttnFwd|flash_fwd", "FlashAttnBwd|flash_bwd", 9),
):
    _forward = _package_forward(_module)
    register(Provider(
        name=_name, label=_label, forward=_forward,
        availability=optional_cuda_package(_probed_module, _distribution, probe_call(_forward), min_arch(_min_major)),
        supports=half_only, kernel_regex=_regex, bwd_kernel_regex=_bwd_regex,
    ))


# --------------------------------------------------------------------------------------
# FlashInfer prefill (forward only: FlashInfer has no attention backward)
# --------------------------------------------------------------------------------------
FLASHINFER_DISTRIBUTION = "flashinfer-python"
FLASHINFER_HEADDIMS = (64, 128, 256)  # the head dims its prefill kernels are instantiated for
FLASHINFER_WORKSPACE_BYTES = 128 * 2**20  # its documented recommendation for split-k partials


@functools.cache
def flashinfer_workspace(device: str) -> torch.Tensor:
    """One float workspace per device, shared by the planned wrappers (they run one at a time);
    zeroed, as FlashInfer's decode wrapper asks for its first use."""
    return torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


@functools.lru_cache(maxsize=16)
def _flashinfer_prefill_wrapper(q_lengths: tuple[int, ...], k_lengths: tuple[int, ...], heads: int, kv_heads: int,
                                hdim: int, causal: bool, softmax_scale: float | None, window_left: int,
                                softcap: float, dtype: torch.dtype, device: str):
    """A BatchPrefillWithRaggedKVCacheWrapper planned for one batch of sequence lengths. Planning
    (host-side scheduling) happens once per shape, outside the timed region, as a serving loop
    plans once per batch for all its layers."""
    import flashinfer

    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(flashinfer_workspace(device), "NHD")
    qo_indptr, kv_indptr = (torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
                            for lengths in (q_lengths, k_lengths))
    # FlashInfer's causal mask is bottom-right aligned (append attention), as flash-attn's; its
    # window_left keeps keys j >= i - window_left (flash-attn's window_size[0]), -1 none
    wrapper.plan(qo_indptr, kv_indptr, heads, kv_heads, hdim, causal=causal, sm_scale=softmax_scale,
                 window_left=window_left, logits_soft_cap=softcap or None, q_data_type=dtype, kv_data_type=dtype)
    return wrapper


def flashinfer_ragged_forward(q, k, v, q_lengths: tuple[int, ...], k_lengths: tuple[int, ...], causal: bool,
                              softmax_scale: float | None, window_left: int = -1, softcap: float = 0.0):
    """Packed sequences without padding, flash-attn's varlen layout: q (sum(q_lengths), H, D),
    k and v (sum(k_lengths), Hkv, D), Hkv dividing H (GQA); the lengths as host tuples, so no
    timed call copies them from the GPU. Forward only."""
    if len(q_lengths) != len(k_lengths) or q.shape[0] != sum(q_lengths) or k.shape[0] != sum(k_lengths):
        raise ValueError(f"q ({q.shape[0]} rows) and k ({k.shape[0]} rows) must pack q_lengths and k_lengths, "
                         f"one length per sequence in each; got {len(q_lengths)} and {len(k_lengths)} lengths")
    wrapper = _flashinfer_prefill_wrapper(tuple(q_lengths), tuple(k_lengths), q.shape[1], k.shape[1], q.shape[2],
                                          causal, softmax_scale, window_left, softcap, q.dtype, str(q.device))
    return wrapper.run(q, k, v)


def flashinfer_forward(q, k, v, causal, softmax_scale):
    batch, seqlen_q, heads, hdim = q.shape  # (B, S, H, D), packed as (B * S, H, D): a view
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    out = flashinfer_ragged_forward(q.reshape(batch * seqlen_q, heads, hdim), k.reshape(batch * seqlen_k, kv_heads, hdim),
                                    v.reshape(batch * seqlen_k, kv_heads, hdim), (seqlen_q,) * batch,
                                    (seqlen_k,) * batch, causal, softmax_scale)
    return out.view(batch, seqlen_q, heads, hdim)


def flashinfer_supports(spec: Spec) -> str | None:
    if spec.dtype not in ("fp16", "bf16"):
        return f"FlashInfer takes fp16/bf16 inputs only, not {spec.dtype}"
    if spec.hdim not in FLASHINFER_HEADDIMS:
        return f"FlashInfer's prefill kernels take head dims {FLASHINFER_HEADDIMS}, not {spec.hdim}"
    if spec.mode != "fwd":
        return "forward only: FlashInfer has no attention backward"
    return None


def flashinfer_jit_probe(call: Callable[[], object], what: str) -> Callable[[], None]:
    """`call()` with a build failure said in a few words: FlashInfer JIT-compiles its kernels
    with nvcc on first use, and a failed build's message is mostly the compiler's command line,
    so the reason keeps the lines that name an error."""
    def probe() -> None:
        try:
            call()
            torch.cuda.synchronize()
        except Exception as exc:
            errors = [line.strip() for line in str(exc).splitlines() if "error" in line.lower()]
            if not errors:
                raise
            raise RuntimeError(f"FlashInfer could not JIT-compile its {what} kernel: {'; '.join(errors[:3])}") from exc

    return probe


def flashinfer_prefill_probe() -> None:
    """One bf16 head-dim-128 prefill (compiled with nvcc on a fresh machine, which can take
    minutes): the paper sweep's most common kernel, compiled before any timing."""
    q, k, v = (torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flashinfer_forward(q, k, v, True, None)


def _flashinfer_config(_spec: Spec) -> str:
    return json.dumps({"package": FLASHINFER_DISTRIBUTION, "version": package_version(FLASHINFER_DISTRIBUTION),
                       "wrapper": "BatchPrefillWithRaggedKVCacheWrapper", "backend": "auto",
                       "plan": "once per shape, outside the timed region"})


register(Provider(
    name="flashinfer", label="FlashInfer prefill", forward=flashinfer_forward,
    availability=optional_cuda_package("flashinfer", FLASHINFER_DISTRIBUTION,
                                       flashinfer_jit_probe(flashinfer_prefill_probe, "prefill"), min_arch(8)),
    supports=flashinfer_supports, has_backward=False,
    kernel_regex="Prefill", config=_flashinfer_config,
))


# --------------------------------------------------------------------------------------
# xformers (only when the package imports and its compiled ops load)
# --------------------------------------------------------------------------------------
def _xformers_forward(op_module: str):
    def forward(q, k, v, causal, softmax_scale):
        import xformers.ops as xops
        from xformers.ops.fmha import attn_bias

        op = importlib.import_module(f"xformers.ops.fmha.{op_module}")
        bias = attn_bias.LowerTriangularFromBottomRightMask() if causal else None
        # xformers' layout is flash-attn's: (B, S, H, D)
        try:
            return xops.memory_efficient_attention(q, k, v, attn_bias=bias, scale=softmax_scale,
                                                   op=(op.FwOp, op.BwOp))
        except ValueError as exc:  # xformers' "Operator ... does not support inputs" with its reasons
            raise UnsupportedInput(f"xformers {op_module} refuses this input: {exc}") from exc

    return forward


def xformers_cpp_error() -> str | None:
    """Why xformers' compiled (C++/CUDA) ops did not load, as xformers says it (the torch and
    CUDA it was built for against the ones here), or None when they loaded."""
    from xformers import _cpp_lib

    error = _cpp_lib._cpp_library_load_exception
    return None if error is None else one_line(str(error).split("Please reinstall")[0])


def _xformers_compiled_probe(forward):
    def probe() -> None:
        error = xformers_cpp_error()
        if error is not None:
            raise RuntimeError(error)
        probe_call(forward)()

    return probe


for _name, _label, _op, _regex, _bwd_regex in (
    ("xformers-cutlass", "xformers cutlass", "cutlass", "fmha_cutlassF", "fmha_cutlassB"),
    ("xformers-flash", "xformers flash (FA2 inside xformers)", "flash", "flash_fwd", "flash_bwd"),
):
    _forward = _xformers_forward(_op)
    register(Provider(
        name=_name, label=_label, forward=_forward,
        availability=optional_cuda_package("xformers.ops", "xformers", _xformers_compiled_probe(_forward),
                                           min_arch(0)),
        supports=half_only if _op == "flash" else any_input, kernel_regex=_regex, bwd_kernel_regex=_bwd_regex,
    ))
