"""Fake optional packages for the provider tests: stand-ins for flash_attn.cute (FA4) and
flashinfer that record how the providers call them and compute the answer with the float64
reference, so a test proves the argument mapping and the layouts without a GPU."""

import sys
import types
from typing import ClassVar

import torch

from baselines.providers import packages
from baselines.reference import attention_reference


def assert_sentence(reason, who):
    """A reason a reader can act on: one line of several words, not an empty or bare token."""
    assert isinstance(reason, str), (who, reason)
    assert "\n" not in reason and reason == reason.strip(), (who, reason)
    assert len(reason.split()) >= 3 and len(reason) <= 400, (who, reason)


def fake_gpu(monkeypatch, capability):
    """Availability checks see a CUDA GPU of `capability` (no kernel runs: the import fails first)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: capability)


class Recorder:
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


def install_fake_fa4(monkeypatch):
    """flash_attn.cute with recording flash_attn_func and flash_attn_varlen_func."""
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func, cute.flash_attn_varlen_func = Recorder(), Recorder()
    package = types.ModuleType("flash_attn")
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return cute


class FakePrefillWrapper:
    """flashinfer.BatchPrefillWithRaggedKVCacheWrapper: plan() records, run() computes the
    ragged (packed) attention sequence by sequence from the planned indptrs, with FlashInfer's
    window_left (keys j >= i - window_left) and logits_soft_cap."""

    instances: ClassVar[list] = []

    def __init__(self, workspace, layout):
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.plans = []
        FakePrefillWrapper.instances.append(self)

    def plan(self, qo_indptr, kv_indptr, heads, kv_heads, hdim, **kwargs):
        self.plans.append((qo_indptr.tolist(), kv_indptr.tolist(), heads, kv_heads, hdim, kwargs))

    def run(self, q, k, v):
        qo, kv, *_, kwargs = self.plans[-1]
        assert q.dim() == 3 and q.shape[0] == qo[-1] and k.shape[0] == kv[-1]
        features = {"softmax_scale": kwargs["sm_scale"], "causal": kwargs["causal"],
                    "window_size": (kwargs.get("window_left", -1), -1), "softcap": kwargs.get("logits_soft_cap") or 0.0}
        outs = [attention_reference(q[None, qo[b]:qo[b + 1]], k[None, kv[b]:kv[b + 1]], v[None, kv[b]:kv[b + 1]],
                                    **features)[0][0]
                for b in range(len(qo) - 1)]
        return torch.cat(outs).to(q.dtype)


class FakeDecodeWrapper:
    """flashinfer.BatchDecodeWithPagedKVCacheWrapper: a paged cache of NHD pages; run()
    attends each sequence to its pages, the last one filled to last_page_len."""

    instances: ClassVar[list] = []

    def __init__(self, workspace, layout, use_tensor_cores=False):
        assert layout == "NHD"
        self.plans, self.use_tensor_cores = [], use_tensor_cores
        FakeDecodeWrapper.instances.append(self)

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


class FakeSingleDecode(Recorder):
    """flashinfer.single_decode_with_kv_cache: q (H, D), k and v (S, Hkv, D) in NHD."""

    def __call__(self, q, k, v, **kwargs):
        self.calls.append(((q, k, v), kwargs))
        assert kwargs["kv_layout"] == "NHD" and q.dim() == 2 and k.dim() == 3
        return attention_reference(q[None, None], k[None], v[None], softmax_scale=kwargs["sm_scale"])[0][0, 0].to(q.dtype)


def install_fake_flashinfer(monkeypatch):
    """flashinfer with the two wrappers and the single decode above; FlashInfer's caches cleared
    (the caller clears them again afterwards: `clear_flashinfer_caches`)."""
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithRaggedKVCacheWrapper = FakePrefillWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    module.single_decode_with_kv_cache = FakeSingleDecode()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(packages, "FLASHINFER_WORKSPACE_BYTES", 1024)
    clear_flashinfer_caches()
    FakePrefillWrapper.instances.clear()
    FakeDecodeWrapper.instances.clear()
    return module


def clear_flashinfer_caches():
    for cached in (packages.flashinfer_workspace, packages._flashinfer_prefill_wrapper):
        cached.cache_clear()
