"""The paper's FLOP count (baselines/flops.py), against values worked out by hand."""

import pytest

from baselines.flops import attention_flops, tflops_per_second


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
