"""The host path of flash_attn_with_kvcache (kernels/decode.py), in Triton's CPU interpreter: a
CUDA call's argument checks are kept per shape (`_CHECKED`) and its device values (cache
lengths, block tables) are checked at the first call of a shape only, so a decode step neither
synchronises with the device nor repeats the checks. Here CPU calls are made to take that path
(`_cacheable`), and give the results of the path that checks every call."""

from __future__ import annotations

import pytest
import torch

from kernels import decode
from kernels.decode import flash_attn_with_kvcache

INTERPRETER_TESTS = True
HEADDIM = 16


@pytest.fixture
def cached(monkeypatch):
    """CPU calls keep their checks as CUDA calls do; a fresh cache of checked calls."""
    monkeypatch.setattr(decode, "_cacheable", lambda q: True)
    monkeypatch.setattr(decode, "_CHECKED", decode.PlanCache())


@pytest.fixture
def syncs(monkeypatch):
    """Counts the device-to-host reads a call makes (tolist, item, cpu, numpy)."""
    count = {"n": 0}
    for name in ("tolist", "item", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return count


def _step_inputs(page_size=0):
    """A decode step: q, caches (contiguous or paged), one new token, rotary tables, lengths."""
    batch, capacity = 3, 48
    if page_size:
        k_cache = torch.randn(batch * capacity // page_size + 2, page_size, 2, HEADDIM)
        table = torch.randperm(k_cache.shape[0])[:batch * capacity // page_size].reshape(batch, -1).to(torch.int32)
    else:
        k_cache, table = torch.randn(batch, capacity, 2, HEADDIM), None
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, 1, 4, HEADDIM)
    k, v = torch.randn(batch, 1, 2, HEADDIM), torch.randn(batch, 1, 2, HEADDIM)
    angle = torch.rand(capacity, HEADDIM // 4) * 6.3
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "rotary_cos": torch.cos(angle),
            "rotary_sin": torch.sin(angle), "cache_seqlens": torch.tensor([5, 0, 30], dtype=torch.int32),
            "block_table": table, "causal": True, "return_softmax_lse": True}


def _steps(inputs, count):
    """`count` decode steps on copies of the caches: each step's (out, lse) and the final caches."""
    inputs = {**inputs, "k_cache": inputs["k_cache"].clone(), "v_cache": inputs["v_cache"].clone(),
              "cache_seqlens": inputs["cache_seqlens"].clone()}
    results = []
    for _ in range(count):
        results.append(flash_attn_with_kvcache(**inputs))
        inputs["cache_seqlens"] += 1  # in place, as a generation loop advances its lengths
    return results, inputs["k_cache"], inputs["v_cache"]


@pytest.mark.parametrize("page_size", [0, 16])
def test_kept_checks_give_the_checked_paths_results(page_size, monkeypatch):
    inputs = _step_inputs(page_size)
    expected = _steps(inputs, 3)
    monkeypatch.setattr(decode, "_cacheable", lambda q: True)
    monkeypatch.setattr(decode, "_CHECKED", decode.PlanCache())
    got = _steps(inputs, 3)
    assert len(decode._CHECKED) == 1  # one shape, checked once
    for (out, lse), (out_ref, lse_ref) in zip(got[0], expected[0]):
        assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])


@pytest.mark.usefixtures("cached")
def test_a_repeated_call_reads_nothing_back_from_the_device(syncs):
    """The first call of a shape checks the device values (one read); later steps read nothing."""
    inputs = _step_inputs(16)
    flash_attn_with_kvcache(**inputs)
    assert syncs["n"] == 1
    syncs["n"] = 0
    for _ in range(3):
        flash_attn_with_kvcache(**inputs)
        flash_attn_with_kvcache(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                                cache_seqlens=inputs["cache_seqlens"], block_table=inputs["block_table"])
    assert syncs["n"] == 1  # the second form's first call only


@pytest.mark.usefixtures("cached")
def test_a_new_shape_or_scalar_is_checked_again():
    inputs = _step_inputs()
    flash_attn_with_kvcache(**inputs)
    with pytest.raises(ValueError, match="window_size sides must be >= -1"):
        flash_attn_with_kvcache(**inputs, window_size=(-2, 0))
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0"):  # a new batch: its values are read
        flash_attn_with_kvcache(**{**inputs, "q": inputs["q"][:2], "k": inputs["k"][:2], "v": inputs["v"][:2],
                                   "k_cache": inputs["k_cache"][:2], "v_cache": inputs["v_cache"][:2],
                                   "cache_seqlens": torch.tensor([3, -1], dtype=torch.int32)})
    assert len(decode._CHECKED) == 1  # a call that failed its checks is not kept: a repeat is checked again


def test_eager_calls_skip_the_dispatcher(monkeypatch):
    """Eager calls run the ops' implementations directly; torch.ops.fa2 is for traced calls."""
    called = []
    for name in ("rotary", "kvcache_append", "fwd_kvcache"):
        original = getattr(decode._EAGER_OPS, name)

        def spy(*args, _original=original, _name=name):
            called.append(_name)
            return _original(*args)

        monkeypatch.setattr(decode._EAGER_OPS, name, spy)
    flash_attn_with_kvcache(**_step_inputs())
    assert called == ["rotary", "kvcache_append", "fwd_kvcache"]


def test_the_attention_is_planned_once_per_shape(monkeypatch):
    """Repeated decode steps reuse one launch plan; another batch size plans anew."""
    monkeypatch.setattr(decode, "_ATTEND_PLANS", decode.PlanCache())
    inputs = _step_inputs(16)
    _steps(inputs, 3)
    assert len(decode._ATTEND_PLANS) == 1
    flash_attn_with_kvcache(inputs["q"][:2], inputs["k_cache"], inputs["v_cache"],
                            cache_seqlens=inputs["cache_seqlens"][:2], block_table=inputs["block_table"][:2])
    assert len(decode._ATTEND_PLANS) == 2
