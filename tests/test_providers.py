"""The provider registry: names, availability reasons, and that the CPU-usable providers
compute flash-attn's function (bottom-right causal) or refuse with a reason. The peers that
need a GPU and a package (FA4, FlashInfer, xformers) are checked here through fake modules:
their argument mapping and layouts, not their kernels (gpu_scripts run those)."""

import json
import math
import re
import sys
import types
from typing import ClassVar

import pytest
import torch

from baselines import providers as registry
from baselines.providers import (
    RUNG_NAMES,
    Spec,
    UnsupportedInput,
    builtin,
    compiled,
    core,
    decode,
    get_provider,
    packages,
    rungs,
    unavailable_reason,
)
from baselines.reference import attention_reference

HAS_CUDA = torch.cuda.is_available()
CONTRACT_NAMES = ("fa2", "pytorch", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math", "torch-compile",
                  "flex-attention", "fa4", "flash-attn", "flash-attn-3", "flashinfer", "xformers-cutlass",
                  "xformers-flash", "fa1", *RUNG_NAMES)
CPU_PROVIDERS = ("fa2", "pytorch", "sdpa-math")
CUDA_ONLY = ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "torch-compile", "flex-attention", "fa4", "flash-attn",
             "flash-attn-3", "flashinfer", "xformers-cutlass", "xformers-flash")


def _inputs(seqlen_q, seqlen_k, device, dtype=torch.float16, seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, seqlen_q, 2, 32, generator=generator, device=device, dtype=dtype)
    k, v = (torch.randn(1, seqlen_k, 2, 32, generator=generator, device=device, dtype=dtype) for _ in range(2))
    return q, k, v


def test_registry_has_every_contract_name_once_and_get_provider_returns_it():
    for name in CONTRACT_NAMES:
        provider = get_provider(name)
        assert provider.name == name
        assert provider.label and provider.label != ""
    assert len(set(registry.PROVIDERS)) == len(registry.PROVIDERS)


def test_unknown_provider_error_names_it_and_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown provider 'no-such-kernel'.*sdpa-flash"):
        get_provider("no-such-kernel")


def assert_sentence(reason, who):
    """A reason a reader can act on: one line of several words, not an empty or bare token."""
    assert isinstance(reason, str), (who, reason)
    assert "\n" not in reason and reason == reason.strip(), (who, reason)
    assert len(reason.split()) >= 3 and len(reason) <= 400, (who, reason)


def test_every_provider_is_available_or_says_why_in_a_sentence():
    for provider in registry.PROVIDERS.values():
        reason = unavailable_reason(provider)
        if reason is not None:
            assert_sentence(reason, provider.name)


@pytest.mark.skipif(HAS_CUDA, reason="checks the availability seen without a GPU")
def test_without_cuda_only_interpreter_and_pytorch_providers_are_available():
    for name in CPU_PROVIDERS:
        assert unavailable_reason(get_provider(name)) is None, name
    for name in CUDA_ONLY:
        assert unavailable_reason(get_provider(name)) == registry.NEEDS_CUDA, name


def test_rungs_are_unavailable_with_the_import_error_when_the_ladder_does_not_import(monkeypatch):
    rungs.ladder_rungs.cache_clear()
    monkeypatch.setitem(sys.modules, "ablations.ladder", None)  # makes `import ablations.ladder` fail
    try:
        for name in ("fa1", *RUNG_NAMES):
            reason = unavailable_reason(get_provider(name))
            assert reason is not None and "ablations.ladder" in reason and "Error" in reason, (name, reason)
    finally:
        rungs.ladder_rungs.cache_clear()


def test_a_raising_availability_check_becomes_the_reason():
    def broken():
        raise OSError("driver went away")

    provider = registry.Provider(name="x", label="x", forward=lambda *a: None, availability=broken)
    assert "driver went away" in unavailable_reason(provider)


@pytest.mark.parametrize("name", CPU_PROVIDERS)
@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "causal"), [(48, 48, False), (48, 48, True), (32, 80, True)])
def test_cpu_provider_matches_the_float64_reference(name, seqlen_q, seqlen_k, causal, device):
    provider = get_provider(name)
    q, k, v = _inputs(seqlen_q, seqlen_k, device, seed=seqlen_q + seqlen_k)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if name.startswith("sdpa") and causal and seqlen_q != seqlen_k:
        with pytest.raises(UnsupportedInput, match="top-left"):
            provider.forward(q, k, v, causal, scale)
        return
    out = provider.forward(q, k, v, causal, scale)
    ref, _ = attention_reference(q, k, v, softmax_scale=scale, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3


def test_sdpa_causal_with_unequal_lengths_is_refused_not_computed_top_left(device):
    q, k, v = _inputs(16, 40, device, seed=3)
    with pytest.raises(UnsupportedInput, match="seqlen_q 16 != seqlen_k 40"):
        get_provider("sdpa-math").forward(q, k, v, True, 0.125)


def test_spec_rejects_unknown_mode_dtype_and_sizes_naming_the_field():
    with pytest.raises(ValueError, match="Spec.mode"):
        Spec("forward", False, 64, 128, 1, 2, "fp16")
    with pytest.raises(ValueError, match="Spec.dtype"):
        Spec("fwd", False, 64, 128, 1, 2, "fp8")
    with pytest.raises(ValueError, match="Spec.seqlen"):
        Spec("fwd", False, 64, 0, 1, 2, "fp16")


def test_triton_providers_refuse_bf16_only_in_the_interpreter():
    spec = Spec("fwd", True, 64, 128, 1, 2, "bf16")
    reason = get_provider("fa2").supports(spec)
    assert (reason is None) if HAS_CUDA else ("interpreter" in reason)


def test_rungs_are_forward_only():
    spec = Spec("bwd", True, 64, 128, 1, 2, "fp16")
    for name in ("fa1", *RUNG_NAMES):
        provider = get_provider(name)
        assert not provider.has_backward
        assert "forward only" in provider.supports(spec)


def test_fa2_config_is_the_json_of_its_kernel_config():
    config = json.loads(get_provider("fa2").config(Spec("fwd_bwd", True, 64, 128, 1, 2, "fp16")))
    assert "block_m" in config["fwd"] and "block_m1" in config["bwd"]
    assert config["bwd_dkdv_path"] == "triton" and not config["bwd_fuses_dq"]  # the interpreter's table


@pytest.mark.parametrize(("seqlen", "path"), [(512, "triton"), (1024, "gluon-ws")])
def test_fa2_config_records_the_dkdv_kernel(seqlen, path, monkeypatch):
    """With the Hopper table, the row's config names the dK/dV kernel its rule picks at the
    paper's head-dim-128 shapes: the Gluon one from 1k keys."""
    from kernels import configs

    monkeypatch.setattr(configs, "default_bwd_config", lambda hdim, device: configs.HOPPER_BWD_CONFIGS[hdim])
    config = json.loads(get_provider("fa2").config(Spec("bwd", False, 128, seqlen, 16384 // seqlen, 16, "bf16")))
    assert config["bwd_dkdv_path"] == path
    assert config["bwd_fuses_dq"] == (path == "gluon-ws")  # the Gluon kernel adds dQ; the Triton table's does not


@pytest.mark.parametrize(("hdim", "seqlen", "path"), [(64, 128, "tma-host"), (64, 256, "tma-kernel"),
                                                     (64, 100, "tma-kernel"), (59, 128, "pointer")])
def test_fa2_config_records_the_forwards_memory_path(hdim, seqlen, path):
    """Host descriptors below 256 keys where whole blocks allow them (100 is not a multiple of
    32), in-kernel descriptors otherwise; 59-element fp16 rows are 118 bytes, not a multiple
    of 16: no TMA at all."""
    from kernels import FwdConfig

    registry.override_fa2_fwd_config(FwdConfig(32, 32, 4, 1, tma=True, tma_min_keys=0, tma_host_min_keys=0,
                                               tma_host_below_keys=256))
    try:
        config = json.loads(get_provider("fa2").config(Spec("fwd", False, hdim, seqlen, 1, 2, "fp16")))
    finally:
        registry.override_fa2_fwd_config(None)
    assert config["fwd_memory_path"] == path


def test_flex_attention_refuses_to_time_an_unfused_eager_fallback(device):
    """Dynamo falling back to eager (as at its recompile limit) runs FlexAttention unfused;
    forcing that fallback must raise instead of returning a number to time."""
    q, k, v = _inputs(24, 24, device, dtype=torch.float32, seed=5)
    with torch.compiler.set_stance("force_eager"), pytest.raises(RuntimeError, match="unfused"):
        compiled.flex_forward(q, k, v, True, 0.125)


def test_torch_compile_refuses_to_time_an_eager_fallback(device):
    """torch-compile must time Inductor's code: a call dynamo leaves eager raises instead."""
    q, k, v = _inputs(24, 24, device, dtype=torch.float32, seed=6)
    with torch.compiler.set_stance("force_eager"), pytest.raises(RuntimeError, match="unfused"):
        compiled.torch_compile_forward(q, k, v, False, 0.125)


@pytest.mark.skipif(HAS_CUDA, reason="needs a backend that refuses the input: SDPA efficient on CPU does")
def test_a_backend_refusing_the_input_is_unsupported_with_sdpas_reason():
    q, k, v = _inputs(16, 16, "cpu", seed=7)
    with pytest.raises(UnsupportedInput, match="SDPA EFFICIENT_ATTENTION refuses this input: No viable backend"):
        builtin.sdpa_forward("EFFICIENT_ATTENTION")(q, k, v, False, 0.125)


def test_kernel_regexes_select_the_project_kernels_by_name():
    """Nsight Compute selects kernels by these names: they must match the Triton kernels'."""
    from kernels import backward, flash_attn_hopper, forward

    fa2 = get_provider("fa2")
    assert re.search(fa2.kernel_regex, forward._flash_fwd_kernel.fn.__name__)
    assert re.search(fa2.kernel_regex, flash_attn_hopper._flash_fwd_hopper_kernel.fn.__name__)
    assert not re.search(fa2.kernel_regex, backward._flash_bwd_dkdv_kernel.fn.__name__)
    assert re.search(fa2.bwd_kernel_regex, backward._flash_bwd_dkdv_kernel.fn.__name__)
    assert re.search(fa2.bwd_kernel_regex, flash_attn_hopper._flash_bwd_dkdv_hopper_kernel.fn.__name__)
    assert not re.search(fa2.bwd_kernel_regex, forward._flash_fwd_kernel.fn.__name__)
    assert not re.search(fa2.kernel_regex, flash_attn_hopper._flash_bwd_dkdv_hopper_kernel.fn.__name__)


def test_every_provider_with_a_backward_names_its_backward_kernel():
    from baselines.providers import PROVIDERS

    missing = [p.name for p in PROVIDERS.values() if p.has_backward and not p.bwd_kernel_regex]
    assert not missing, f"providers with a backward but no bwd_kernel_regex: {missing}"


# --------------------------------------------------------------------------------------
# Optional peers without their packages: availability reasons and shape checks
# --------------------------------------------------------------------------------------
def _fake_gpu(monkeypatch, capability):
    """Availability checks see a CUDA GPU of `capability` (no kernel runs: the import fails first)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: capability)


@pytest.mark.parametrize(("module", "make"), [
    ("flash_attn.cute", lambda: packages.optional_cuda_package("flash_attn.cute", "flash-attn-4",
                                                               lambda: None, packages.fa4_arch)),
    ("flashinfer", lambda: packages.optional_cuda_package("flashinfer", "flashinfer-python", lambda: None,
                                                          core.min_arch(8))),
])
def test_a_peer_that_does_not_import_says_which_package_to_install(monkeypatch, module, make):
    _fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    reason = make()()
    assert_sentence(reason, module)
    assert f"`import {module}` failed" in reason and "pip install" in reason


def test_the_registered_fa4_availability_reports_the_failed_import(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    availability = get_provider("fa4").availability
    availability.cache_clear()
    try:
        reason = unavailable_reason(get_provider("fa4"))
    finally:
        availability.cache_clear()
    assert_sentence(reason, "fa4")
    assert "flash-attn-4" in reason and "pip install flash-attn-4" in reason


def test_fa2_package_is_probed_by_its_own_module_not_fa4s_namespace(monkeypatch):
    """FA4's wheel makes `flash_attn` a namespace package holding only `cute`: with FA4 alone
    installed, the flash-attn (FA2) provider must say that FA2's module is missing."""
    _fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # FA4's namespace, no FA2
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    availability = get_provider("flash-attn").availability
    availability.cache_clear()
    try:
        reason = unavailable_reason(get_provider("flash-attn"))
    finally:
        availability.cache_clear()
    assert_sentence(reason, "flash-attn")
    assert "`import flash_attn.flash_attn_interface` failed" in reason and "pip install flash-attn" in reason


@pytest.mark.parametrize(("capability", "usable"), [((8, 0), False), ((8, 9), False), ((9, 0), True),
                                                    ((10, 0), True), ((12, 0), False)])
def test_fa4_needs_hopper_or_blackwell_and_names_this_gpu(capability, usable):
    reason = packages.fa4_arch(capability)
    if usable:
        assert reason is None
    else:
        assert_sentence(reason, capability)
        assert f"sm_{capability[0]}{capability[1]}" in reason and "sm_90" in reason


@pytest.mark.parametrize(("hdim", "dtype", "arch", "refused"), [
    (64, "bf16", 9, None), (128, "fp16", 9, None), (256, "bf16", 9, None), (72, "bf16", 9, None),
    (8, "fp16", 9, None), (192, "bf16", 9, None),
    (59, "bf16", 9, "multiples of 8"), (4, "bf16", 9, "multiples of 8"), (264, "fp16", 9, "multiples of 8"),
    (128, "fp32", 9, "fp16/bf16"),
    (192, "bf16", 10, "up to 128, or 256"), (256, "bf16", 10, None), (128, "bf16", 10, None),
])
def test_fa4_shape_check_refuses_what_it_does_not_support(monkeypatch, hdim, dtype, arch, refused):
    monkeypatch.setattr(packages, "cuda_arch_major", lambda: arch)
    reason = get_provider("fa4").supports(Spec("fwd_bwd", True, hdim, 1024, 2, 4, dtype))
    if refused is None:
        assert reason is None
    else:
        assert_sentence(reason, hdim)
        assert refused in reason


@pytest.mark.parametrize(("spec", "refused"), [
    (Spec("fwd", True, 128, 1024, 2, 4, "bf16"), None),
    (Spec("fwd", False, 64, 1024, 2, 4, "fp16"), None),
    (Spec("bwd", True, 128, 1024, 2, 4, "bf16"), "no attention backward"),
    (Spec("fwd_bwd", True, 128, 1024, 2, 4, "bf16"), "no attention backward"),
    (Spec("fwd", True, 96, 1024, 2, 4, "bf16"), "head dims"),
    (Spec("fwd", True, 128, 1024, 2, 4, "fp32"), "fp16/bf16"),
])
def test_flashinfer_is_forward_only_at_its_head_dims(spec, refused):
    provider = get_provider("flashinfer")
    assert not provider.has_backward
    reason = provider.supports(spec)
    assert reason is None if refused is None else refused in reason


def test_xformers_reason_is_its_own_load_error_on_one_line(monkeypatch):
    """Where xformers' compiled ops were built for another torch, the reason is xformers' own
    message (built for / you have), without its multi-line install advice."""
    message = ("xFormers can't load C++/CUDA extensions. xFormers was built for:\n    PyTorch 2.10.0+cu128 with "
               "CUDA 1208 (you have 2.11.0+cu130)\n    Python  3.12.3 (you have 3.12.3)\n  Please reinstall "
               "xformers (see https://github.com/facebookresearch/xformers#installing-xformers)\n")
    fake_cpp_lib = types.ModuleType("xformers._cpp_lib")
    fake_cpp_lib._cpp_library_load_exception = RuntimeError(message)
    fake_xformers = types.ModuleType("xformers")
    fake_xformers._cpp_lib = fake_cpp_lib
    monkeypatch.setitem(sys.modules, "xformers", fake_xformers)
    monkeypatch.setitem(sys.modules, "xformers._cpp_lib", fake_cpp_lib)
    reason = packages.xformers_cpp_error()
    assert_sentence(reason, "xformers")
    assert "built for: PyTorch 2.10.0+cu128" in reason and "you have 2.11.0+cu130" in reason
    assert "Please reinstall" not in reason


def test_fa4_kernel_regexes_select_its_main_kernels_not_the_small_ones_around_them():
    """FA4's kernels are named after their classes (flash_attn/cute/flash_fwd_sm90.py etc.)."""
    fa4 = get_provider("fa4")
    for main in ("FlashAttentionForwardSm90", "FlashAttentionForwardSm100"):
        assert re.search(fa4.kernel_regex, f"kernel_cutlass_{main}_object_at_0x7f"), main
    for main in ("FlashAttentionBackwardSm90", "FlashAttentionBackwardSm100"):
        assert re.search(fa4.bwd_kernel_regex, f"kernel_cutlass_{main}_object_at_0x7f"), main
    for helper in ("FlashAttentionForwardCombine", "FlashAttentionBackwardPreprocess",
                   "FlashAttentionBackwardPostprocess"):
        assert not re.search(fa4.kernel_regex, helper) and not re.search(fa4.bwd_kernel_regex, helper), helper


# --------------------------------------------------------------------------------------
# FA4's and FlashInfer's argument mapping, through fake modules in sys.modules
# --------------------------------------------------------------------------------------
class _Recorder:
    """Stands in for a package function: records each call, computes attention with the
    float64 reference so the caller's use of the result is checked too."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        q, k, v = args[:3]
        lengths = kwargs.get("seqused_k")
        out, lse = attention_reference(q, k, v, softmax_scale=kwargs.get("softmax_scale"),
                                       causal=kwargs.get("causal", False), seqlens_k=lengths)
        return out.to(q.dtype), lse.float()


def _fake_fa4(monkeypatch):
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func, cute.flash_attn_varlen_func = _Recorder(), _Recorder()
    package = types.ModuleType("flash_attn")
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return cute


@pytest.mark.parametrize("causal", [False, True])
def test_fa4_forward_passes_scale_and_mask_by_keyword_and_returns_the_output(monkeypatch, causal):
    """flash_attn.cute.flash_attn_func(q, k, v, qv=None, ...): a positional scale would land in
    `qv`. The wrapper passes q, k, v positionally, the rest by keyword, and returns `out` of
    the (out, lse) pair."""
    cute = _fake_fa4(monkeypatch)
    q, k, v = _inputs(40, 40, "cpu", seed=11)
    out = get_provider("fa4").forward(q, k, v, causal, 0.2)
    (args, kwargs), = cute.flash_attn_func.calls
    assert len(args) == 3 and all(a is b for a, b in zip(args, (q, k, v), strict=True))
    assert kwargs == {"softmax_scale": 0.2, "causal": causal, "num_splits": 1}
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    ref, _ = attention_reference(q, k, v, softmax_scale=0.2, causal=causal)
    assert torch.equal(out, ref.to(q.dtype))


def test_fa4_config_records_its_version_and_no_split_kv(monkeypatch):
    monkeypatch.setattr(packages, "package_version", {"flash-attn-4": "4.0.0b36", "nvidia-cutlass-dsl": "4.8.1"}.get)
    config = json.loads(get_provider("fa4").config(Spec("fwd", True, 128, 2048, 8, 16, "bf16")))
    assert config["version"] == "4.0.0b36" and config["nvidia-cutlass-dsl"] == "4.8.1" and config["num_splits"] == 1


class _FakePrefillWrapper:
    """flashinfer.BatchPrefillWithRaggedKVCacheWrapper: plan() records, run() computes the
    ragged (packed) attention sequence by sequence from the planned indptrs."""

    instances: ClassVar[list] = []

    def __init__(self, workspace, layout):
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.plans = []
        _FakePrefillWrapper.instances.append(self)

    def plan(self, qo_indptr, kv_indptr, heads, kv_heads, hdim, **kwargs):
        self.plans.append((qo_indptr.tolist(), kv_indptr.tolist(), heads, kv_heads, hdim, kwargs))

    def run(self, q, k, v):
        qo, kv, *_, kwargs = self.plans[-1]
        assert q.dim() == 3 and q.shape[0] == qo[-1] and k.shape[0] == kv[-1]
        outs = [attention_reference(q[None, qo[b]:qo[b + 1]], k[None, kv[b]:kv[b + 1]], v[None, kv[b]:kv[b + 1]],
                                    softmax_scale=kwargs["sm_scale"], causal=kwargs["causal"])[0][0]
                for b in range(len(qo) - 1)]
        return torch.cat(outs).to(q.dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithRaggedKVCacheWrapper = _FakePrefillWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = _FakeDecodeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(packages, "FLASHINFER_WORKSPACE_BYTES", 1024)
    for cached in (packages.flashinfer_workspace, packages._flashinfer_prefill_wrapper):
        cached.cache_clear()
    _FakePrefillWrapper.instances.clear()
    _FakeDecodeWrapper.instances.clear()
    yield module
    for cached in (packages.flashinfer_workspace, packages._flashinfer_prefill_wrapper):
        cached.cache_clear()


@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "causal"), [(24, 24, False), (24, 24, True), (16, 40, True)])
def test_flashinfer_prefill_packs_the_batch_and_plans_once_per_shape(fake_flashinfer, seqlen_q, seqlen_k, causal):
    generator = torch.Generator().manual_seed(seqlen_q * seqlen_k)
    q = torch.randn(3, seqlen_q, 4, 32, generator=generator, dtype=torch.float16)
    k, v = (torch.randn(3, seqlen_k, 2, 32, generator=generator, dtype=torch.float16) for _ in range(2))
    provider = get_provider("flashinfer")
    out = provider.forward(q, k, v, causal, 0.15)
    provider.forward(q, k, v, causal, 0.15)
    (wrapper,) = _FakePrefillWrapper.instances
    (plan,) = wrapper.plans  # planned once: the second call reuses the plan
    qo_indptr, kv_indptr, heads, kv_heads, hdim, kwargs = plan
    assert qo_indptr == [0, seqlen_q, 2 * seqlen_q, 3 * seqlen_q] and kv_indptr == [0, seqlen_k, 2 * seqlen_k,
                                                                                    3 * seqlen_k]
    assert (heads, kv_heads, hdim) == (4, 2, 32) and kwargs["causal"] is causal and kwargs["sm_scale"] == 0.15
    ref, _ = attention_reference(q, k, v, softmax_scale=0.15, causal=causal)
    assert out.shape == q.shape and torch.equal(out, ref.to(q.dtype))


# --------------------------------------------------------------------------------------
# Decode providers
# --------------------------------------------------------------------------------------
POISON = 300.0
DECODE_NAMES = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "pytorch", "torch-compile", "fa4",
                "flashinfer", "xformers-splitk")


def _decode_inputs(batch=3, heads=8, kv_heads=2, hdim=32, cache_len=48, lengths=(5, 48, 17), seed=0):
    """Random q and cache; the slots past each sequence's length hold a large finite poison
    (the contract asks for finite values there: a kernel may load them and multiply by P = 0),
    which would dominate the scores if a decode attended to it."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, heads, hdim, generator=generator, dtype=torch.float16)
    k, v = (torch.randn(batch, cache_len, kv_heads, hdim, generator=generator, dtype=torch.float16)
            for _ in range(2))
    for b, n in enumerate(lengths):
        k[b, n:], v[b, n:] = POISON, -POISON
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


def test_decode_registry_has_every_peer_once_and_says_why_one_is_unavailable():
    assert tuple(decode.DECODE_PROVIDERS) == DECODE_NAMES
    for provider in decode.DECODE_PROVIDERS.values():
        assert decode.get_decode_provider(provider.name) is provider and provider.label
        reason = decode.decode_unavailable_reason(provider)
        if reason is not None:
            assert_sentence(reason, provider.name)
    with pytest.raises(ValueError, match="unknown decode provider 'nope'.*fa4"):
        decode.get_decode_provider("nope")


@pytest.mark.parametrize("name", ["pytorch", "sdpa-math"])
@pytest.mark.parametrize(("kv_heads", "lengths"), [(8, (48, 48, 48)), (2, (5, 48, 17)), (1, (1, 30, 48))])
def test_cpu_decode_matches_the_reference_on_its_cache_lengths(name, kv_heads, lengths):
    q, k, v, cache_seqlens = _decode_inputs(kv_heads=kv_heads, lengths=lengths, seed=kv_heads)
    out = decode.get_decode_provider(name).decode(q, k, v, cache_seqlens)
    ref, _ = attention_reference(q, k, v, seqlens_k=cache_seqlens)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3


def test_decode_reads_new_lengths_after_an_in_place_change():
    """Host copies of the lengths (SDPA's mask) are kept per tensor and version: an in-place
    update of cache_seqlens must be seen, as the next decode step's lengths."""
    q, k, v, cache_seqlens = _decode_inputs(lengths=(5, 30, 17), seed=4)
    k[:, 5:], v[:, 5:] = 0.5, -0.25  # the longer lengths read these slots
    sdpa_math = decode.get_decode_provider("sdpa-math").decode
    sdpa_math(q, k, v, cache_seqlens)
    cache_seqlens.add_(7)
    ref, _ = attention_reference(q, k, v, seqlens_k=cache_seqlens)
    out = sdpa_math(q, k, v, cache_seqlens)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3


@pytest.mark.parametrize(("change", "match"), [
    (lambda q, k, v, n: (q.expand(-1, 2, -1, -1), k, v, n), "q must be"),
    (lambda q, k, v, n: (q, k, v[:, :-1], n), "k_cache and v_cache"),
    (lambda q, k, v, n: (q[:, :, :5], k, v, n), "kv_heads dividing heads"),
    (lambda q, k, v, n: (q, k, v, n.long()), "cache_seqlens must be int32"),
    (lambda q, k, v, n: (q, k.float(), v.float(), n), "share a dtype"),
])
def test_decode_inputs_that_break_the_contract_are_refused_naming_the_argument(change, match):
    with pytest.raises(ValueError, match=match):
        decode.get_decode_provider("pytorch").decode(*change(*_decode_inputs()))


def test_decode_lengths_outside_the_cache_are_refused():
    q, k, v, _ = _decode_inputs()
    with pytest.raises(ValueError, match="cache_seqlens must lie in 1..48"):
        decode.get_decode_provider("sdpa-math").decode(q, k, v, torch.tensor([5, 49, 0], dtype=torch.int32))


@pytest.mark.parametrize(("capability", "num_splits"), [((9, 0), 1), ((10, 0), 0)])
def test_fa4_decode_passes_the_cache_lengths_as_seqused_k_and_no_split_kv_on_hopper(monkeypatch, capability,
                                                                                   num_splits):
    cute = _fake_fa4(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: capability)
    q, k, v, cache_seqlens = _decode_inputs(seed=8)
    out = decode.get_decode_provider("fa4").decode(q, k, v, cache_seqlens, 0.3)
    (args, kwargs), = cute.flash_attn_varlen_func.calls
    assert len(args) == 3 and kwargs["seqused_k"] is cache_seqlens
    assert kwargs["num_splits"] == num_splits and kwargs["causal"] is False and kwargs["softmax_scale"] == 0.3
    ref, _ = attention_reference(q, k, v, softmax_scale=0.3, seqlens_k=cache_seqlens)
    assert torch.equal(out, ref.to(q.dtype))


class _FakeDecodeWrapper:
    """flashinfer.BatchDecodeWithPagedKVCacheWrapper: a paged cache of NHD pages; run()
    attends each sequence to its pages, the last one filled to last_page_len."""

    instances: ClassVar[list] = []

    def __init__(self, workspace, layout, use_tensor_cores=False):
        assert layout == "NHD"
        self.plans, self.use_tensor_cores = [], use_tensor_cores
        _FakeDecodeWrapper.instances.append(self)

    def plan(self, indptr, indices, last_page_len, heads, kv_heads, hdim, page_size, **kwargs):
        self.plans.append((indptr.tolist(), indices.tolist(), last_page_len.tolist(), heads, kv_heads, hdim,
                           page_size, kwargs))

    def run(self, q, paged_kv_cache):
        indptr, indices, last, heads, kv_heads, hdim, page_size, kwargs = self.plans[-1]
        k_pages, v_pages = paged_kv_cache
        assert q.shape[1:] == (heads, hdim) and k_pages.shape[1:] == (page_size, kv_heads, hdim)
        outs = []
        for b in range(len(indptr) - 1):
            pages = indices[indptr[b]:indptr[b + 1]]
            length = (len(pages) - 1) * page_size + last[b]
            k_b, v_b = (t[pages].reshape(-1, kv_heads, hdim)[:length][None] for t in (k_pages, v_pages))
            outs.append(attention_reference(q[b][None, None], k_b, v_b, softmax_scale=kwargs["sm_scale"])[0][0, 0])
        return torch.stack(outs).to(q.dtype)


def test_flashinfer_decode_maps_the_cache_to_one_page_per_sequence_and_plans_once_per_lengths(fake_flashinfer):
    q, k, v, cache_seqlens = _decode_inputs(seed=9)
    flashinfer_decode = decode.get_decode_provider("flashinfer").decode
    out = flashinfer_decode(q, k, v, cache_seqlens)
    flashinfer_decode(q, k, v, cache_seqlens)
    (wrapper,) = _FakeDecodeWrapper.instances
    (plan,) = wrapper.plans
    assert plan[:3] == ([0, 1, 2, 3], [0, 1, 2], [5, 48, 17]) and plan[6] == 48 and wrapper.use_tensor_cores
    ref, _ = attention_reference(q, k, v, seqlens_k=cache_seqlens)
    assert torch.equal(out, ref.to(q.dtype))
    cache_seqlens[0] = 6  # the next step: a new plan for the new lengths
    k[0, 5], v[0, 5] = 0.25, -0.5
    flashinfer_decode(q, k, v, cache_seqlens)
    assert len(_FakeDecodeWrapper.instances) == 2 and _FakeDecodeWrapper.instances[1].plans[0][2] == [6, 48, 17]


def test_xformers_splitk_decode_folds_the_batch_into_a_block_diagonal_bmghk_call(monkeypatch):
    """The wrapper hands xformers q (1, B, Hkv, G, D) and k/v (1, B*S, Hkv, G, D) with a
    block-diagonal padded-keys bias; a fake op that attends by that bias's lengths must give
    the reference's answer, so the layout and the head grouping are xformers' own."""
    calls = []

    class FakeBias:
        @classmethod
        def from_seqlens(cls, q_seqlen, kv_padding, kv_seqlen, device=None):
            bias = cls()
            bias.q_seqlen, bias.kv_padding, bias.kv_seqlen = list(q_seqlen), kv_padding, list(kv_seqlen)
            return bias

    def forward(q5, k5, v5, attn_bias, scale, op):
        calls.append((q5.shape, k5.shape, op))
        outs = []
        for b, length in enumerate(attn_bias.kv_seqlen):
            start = b * attn_bias.kv_padding
            qb = q5[0, b].reshape(1, 1, -1, q5.shape[-1])  # (1, 1, Hkv * G, D)
            kb, vb = (t[0, start:start + length].reshape(1, length, -1, t.shape[-1]) for t in (k5, v5))
            outs.append(attention_reference(qb, kb, vb, softmax_scale=scale)[0].reshape(q5.shape[2:]))
        return torch.stack(outs)[None].to(q5.dtype)

    fmha = types.SimpleNamespace(memory_efficient_attention_forward=forward)
    modules = {"xformers": types.ModuleType("xformers"), "xformers.ops": types.SimpleNamespace(fmha=fmha),
               "xformers.ops.fmha": types.SimpleNamespace(triton_splitk=types.SimpleNamespace(FwOp="splitK")),
               "xformers.ops.fmha.attn_bias": types.SimpleNamespace(BlockDiagonalPaddedKeysMask=FakeBias)}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    q, k, v, cache_seqlens = _decode_inputs(seed=10)
    out = decode.get_decode_provider("xformers-splitk").decode(q, k, v, cache_seqlens)
    (q_shape, k_shape, op), = calls
    assert q_shape == (1, 3, 2, 4, 32) and k_shape == (1, 3 * 48, 2, 4, 32) and op == "splitK"
    ref, _ = attention_reference(q, k, v, seqlens_k=cache_seqlens)
    assert out.shape == q.shape and ((out.double() - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.parametrize(("name", "spec", "refused"), [
    ("fa4", decode.DecodeSpec(8, 32, 8, 128, 8192, "bf16"), None),
    ("fa4", decode.DecodeSpec(8, 32, 8, 100, 8192, "bf16"), "multiples of 8"),
    ("fa4", decode.DecodeSpec(8, 32, 8, 128, 8192, "fp32"), "fp16/bf16"),
    ("flashinfer", decode.DecodeSpec(8, 32, 8, 96, 8192, "bf16"), "head dims"),
    ("xformers-splitk", decode.DecodeSpec(8, 32, 8, 80, 8192, "fp16"), "head dims"),
    ("sdpa-flash", decode.DecodeSpec(1, 32, 32, 512, 8192, "bf16"), "up to 256"),
    ("sdpa-math", decode.DecodeSpec(1, 32, 32, 512, 8192, "fp32"), None),
])
def test_decode_shape_checks_refuse_what_the_kernel_does_not_take(name, spec, refused):
    reason = decode.get_decode_provider(name).supports(spec)
    assert reason is None if refused is None else refused in reason


def test_decode_spec_rejects_kv_heads_that_do_not_divide_heads():
    with pytest.raises(ValueError, match="DecodeSpec.kv_heads"):
        decode.DecodeSpec(1, 32, 6, 128, 1024, "bf16")


# --------------------------------------------------------------------------------------
# The peers' versions in the row environment
# --------------------------------------------------------------------------------------
def test_environment_records_each_peer_version_and_blank_for_an_absent_one(monkeypatch):
    import importlib.metadata

    from reports import environment

    installed = {"flash-attn-4": "4.0.0b36", "nvidia-cutlass-dsl": "4.8.1"}

    def version(distribution):
        if distribution not in installed:
            raise importlib.metadata.PackageNotFoundError(distribution)
        return installed[distribution]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert set(environment.PEER_VERSION_COLUMNS) == {"flash_attn_4", "nvidia_cutlass_dsl", "flashinfer", "xformers"}
    assert environment.ROW_ENV_COLUMNS[:len(environment.ENV_COLUMNS)] == environment.ENV_COLUMNS
    assert set(environment.PEER_VERSION_COLUMNS) <= set(environment.ROW_ENV_COLUMNS)
    captured = environment.capture_environment()
    assert {column: captured[column] for column in environment.PEER_VERSION_COLUMNS} == {
        "flash_attn_4": "4.0.0b36", "nvidia_cutlass_dsl": "4.8.1", "flashinfer": "", "xformers": ""}
