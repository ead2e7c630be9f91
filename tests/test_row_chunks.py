"""Calls with more (batch x head) rows than a launch grid's axis takes run in chunks of batch rows
(kernels/row_chunks.py). In Triton's CPU interpreter the grid bound is lowered to a few rows, so
that small calls take the chunked path, and each is checked against float64 (flash-attn's
criterion); on a GPU, calls past the real bound."""

from __future__ import annotations

import itertools

import pytest
import torch

from baselines.reference import attention_reference, attention_same_dtype
from kernels import backward, flash_attn_func, flash_attn_varlen_func, forward, row_chunks
from kernels.dropout import dropout_keep_mask
from tests.attention_checks import assert_close_to_reference, poisoned_allocations  # noqa: F401
from tests.test_features import check_dense, check_varlen, grads

INTERPRETER_TESTS = True


@pytest.fixture
def chunks_counted(monkeypatch):
    """A grid bound of 4 rows, and a list that grows by one per chunk run."""
    for module in (row_chunks, forward, backward):
        monkeypatch.setattr(module, "GRID_ROWS", 4)
    ran = []
    real = row_chunks._chunk_features

    def counted(features, index, start, end):
        ran.append((index, start, end))
        return real(features, index, start, end)

    monkeypatch.setattr(row_chunks, "_chunk_features", counted)
    return ran


def test_row_spans_cover_the_batch_in_chunks_within_the_bound():
    assert row_chunks.row_spans(4, 16383) is None
    assert row_chunks.row_spans(8192, 12) == [(0, 5461), (5461, 8192)]
    spans = row_chunks.row_spans(100_000, 7)
    assert spans[0][0] == 0 and spans[-1][1] == 100_000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert all((end - start) * 7 <= row_chunks.GRID_ROWS for start, end in spans)
    with pytest.raises(ValueError, match="heads"):
        row_chunks.row_spans(2, 70_000)


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("causal", [False, True])
def test_dense_calls_in_chunks_match_the_reference(chunks_counted, causal, monkeypatch):
    """5 batch rows of 2 heads under a bound of 4 rows: chunks of 2, 2 and 1 batch rows, forward
    and backward, each on the dense path (not the features kernels)."""
    feature_calls = []
    real = forward._forward_features
    monkeypatch.setattr(forward, "_forward_features", lambda *args: feature_calls.append(1) or real(*args))
    check_dense(5, 23, 23, 2, 2, 16, torch.float32, causal=causal)
    assert [start for _, start, _ in chunks_counted] == [0, 2, 4] * 2  # forward, then backward
    assert not feature_calls, "a dense call's chunks left the dense path"


@pytest.mark.usefixtures("poisoned_allocations")
def test_gqa_with_per_batch_alibi_in_chunks(chunks_counted):
    """Per-batch ALiBi slopes are sliced with their chunk's batch rows; GQA's dK and dV stay whole."""
    check_dense(3, 19, 19, 4, 2, 16, torch.float32, causal=True, alibi=torch.rand(3, 4) + 0.1)
    assert len(chunks_counted) == 6


@pytest.mark.usefixtures("poisoned_allocations")
def test_packed_sequences_in_chunks(chunks_counted):
    """Packed sequences (one empty) in chunks of 2 sequences of 2 heads."""
    check_varlen([9, 0, 17, 5, 12], [11, 4, 17, 5, 20], 2, 1, 16, torch.float32, causal=True)
    assert [start for _, start, _ in chunks_counted][:3] == [0, 2, 4]


def test_packed_calls_in_chunks_are_refused_under_cuda_graph_capture(chunks_counted, monkeypatch):
    """Their chunks' rows come from cu_seqlens read on the host, which a capture cannot do: a
    clear error naming the argument, not a failed capture."""
    monkeypatch.setattr(row_chunks, "_capturing", lambda t: True)
    q, k, v = (torch.randn(30, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 10, 20, 30], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q: more than 4"):
        flash_attn_varlen_func(q, k, v, cu, cu, 10, 10)


def test_dropout_chunks_draw_masks_of_their_own_that_the_keep_mask_reports(chunks_counted):
    """Identical batch rows: chunks that repeated the first chunk's keep-mask would give rows 0 and
    2 (each its chunk's first) the same output. The keep-mask the API reports is the one the kernels
    drew: the output matches float64 attention under it."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 24, 2, 16).expand(4, -1, -1, -1).contiguous() for _ in range(3))
    out, _, probs = flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
    assert chunks_counted, "the call did not run in chunks"
    assert not torch.equal(out[0], out[2])
    keep = ~torch.signbit(probs)
    ref = attention_reference(q.double(), k.double(), v.double(), None, dropout_p=0.3, dropout_keep=keep,
                              causal=True)[0]
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def test_the_keep_mask_of_a_chunked_call_is_each_chunks_mask(chunks_counted):
    """3 batch rows of 2 heads under a bound of 4 rows: the first 2 rows' mask under the seed, the
    last row's under the offset moved by one (chunk_seed), not the first row's again."""
    seed = torch.tensor([1234, 5], dtype=torch.int64)
    whole = dropout_keep_mask(seed, 0.5, 3, 2, 8, 8)
    first = dropout_keep_mask(seed, 0.5, 2, 2, 8, 8)
    second = dropout_keep_mask(seed + torch.tensor([0, 1]), 0.5, 1, 2, 8, 8)
    assert torch.equal(whole, torch.cat([first, second]))
    assert not torch.equal(second[0], first[0])


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim,seqlen", [(64, 128), (64, 197), (128, 64)])
def test_gpu_calls_past_the_grid_bound(causal, headdim, seqlen):
    """More than 65535 (batch x head) rows (a ViT's large batch), bf16, forward and backward on
    the fast kernels' shapes and off them: the first and last batch rows against float64."""
    batch, heads = 65536 // 8 + 3, 8
    q, k, v = (torch.randn(batch, seqlen, heads, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for rows in (slice(0, 2), slice(batch - 2, batch)):
        inputs = [t[rows] for t in (q, k, v)]
        ref = grads(lambda q, k, v: attention_reference(q, k, v, None, causal=causal)[0],
                    [t.double() for t in inputs], dout[rows].double())
        same = grads(lambda q, k, v: attention_same_dtype(q, k, v, None, causal=causal), inputs, dout[rows])
        for name, g, r, s in zip(("out", "dq", "dk", "dv"), (out[rows], dq[rows], dk[rows], dv[rows]), ref, same):
            assert_close_to_reference(name, g, r, s)
