"""The paper's FLOP count (baselines/flops.py), against values worked out by hand."""

import pytest

from baselines.flops import (
    attention_flops,
    decode_kv_bytes,
    gigabytes_per_second,
    tflops_per_second,
    training_flops_per_sequence,
)


def test_forward_is_four_b_h_n_squared_d():
    # 4 * 2 * 3 * 100 * 100 * 64 = 15,360,000
    assert attention_flops(2, 3, 100, 100, 64, causal=False) == 15_360_000


def test_causal_halves_and_backward_modes_scale_by_the_matmul_count():
    full = 4 * 8 * 16 * 2048 * 2048 * 128
    assert attention_flops(8, 16, 2048, 2048, 128, causal=True) == full / 2
    assert attention_flops(8, 16, 2048, 2048, 128, causal=False, mode="bwd") == full * 2.5
    assert attention_flops(8, 16, 2048, 2048, 128, causal=True, mode="fwd_bwd") == full / 2 * 3.5


def test_seqlen_q_and_seqlen_k_enter_separately():
    assert attention_flops(1, 1, 10, 30, 16, causal=False) == 4 * 10 * 30 * 16


def test_tflops_from_milliseconds():
    assert tflops_per_second(2e12, 1000.0) == pytest.approx(2.0)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        attention_flops(1, 1, 1, 1, 1, causal=False, mode="backward")


def test_decode_reads_k_and_v_of_the_used_cache_only():
    # 8 sequences of 1000 used slots, 8 kv heads x 128, bf16: 2 * 8000 * 8 * 128 * 2 = 32,768,000
    assert decode_kv_bytes(8 * 1000, 8, 128, 2) == 32_768_000
    assert decode_kv_bytes(0, 8, 128, 2) == 0


def test_decode_bytes_refuse_bad_counts_naming_them():
    with pytest.raises(ValueError, match="kv_heads must be a positive int"):
        decode_kv_bytes(10, 0, 128, 2)
    with pytest.raises(ValueError, match="cached_tokens must be a non-negative int"):
        decode_kv_bytes(-1, 8, 128, 2)


def test_gigabytes_per_second_from_milliseconds():
    assert gigabytes_per_second(4.27e9, 1000.0) == pytest.approx(4.27)


def test_visible_flops_is_the_paper_count_over_the_visible_pairs():
    from baselines.flops import attention_flops, visible_flops

    # a full mask leaves every pair visible: the same count as attention_flops, in every mode
    for mode in ("fwd", "bwd", "fwd_bwd"):
        assert visible_flops(2 * 300 * 500, 3, 64, mode) == attention_flops(2, 3, 300, 500, 64, False, mode)
    with pytest.raises(ValueError, match="mode"):
        visible_flops(10, 1, 16, "decode")


def test_training_flops_by_hand():
    # 6 x 4 tokens x 1000 params = 24000; 12 x 2 layers x 8 wide x 4^2 = 3072
    assert training_flops_per_sequence(params=1000, layers=2, hidden=8, seqlen=4) == 27072.0


def test_training_attention_term_is_three_non_causal_forwards_per_layer():
    """Megatron's attention term counts the backward as twice the forward (3x in all), over the
    full (not causally halved) score matrix: 3 x attention_flops' forward, per layer."""
    layers, heads, headdim, seqlen = 3, 4, 16, 256
    hidden = heads * headdim
    attention = training_flops_per_sequence(1, layers, hidden, seqlen) - 6.0 * seqlen
    assert attention == 3 * layers * attention_flops(1, heads, seqlen, seqlen, headdim, causal=False)


@pytest.mark.parametrize("name", ["params", "layers", "hidden", "seqlen"])
def test_training_flops_refuse_bad_counts_naming_them(name):
    counts = {"params": 10, "layers": 1, "hidden": 8, "seqlen": 4, name: 0}
    with pytest.raises(ValueError, match=name):
        training_flops_per_sequence(**counts)
