"""The one-tile warp-split pair (kernels/ladder_warp_split.py): Gluon has no CPU interpreter, so
the CPU test compiles the three variants for sm_90 and checks what tells them apart (fewer CTA
barriers with warps along the query rows); the GPU tests run them against the float64 reference."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from baselines.reference import attention_reference, attention_same_dtype
from tests.attention_checks import assert_close_to_reference, make_qkv

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ("split-q", "split-k-p", "split-k-o")


def test_the_three_splits_compile_for_sm90_and_split_q_synchronises_least():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = ("import json; from kernels.ladder_warp_split import compile_facts_sm90 as f; "
            f"print(json.dumps({{s: f(s, 64, True) for s in {SPLITS!r}}}))")
    facts = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                      cwd=ROOT, check=True).stdout.splitlines()[-1])
    for split, fact in facts.items():
        assert fact["mma_sync"] > 0 and fact["registers"], (split, fact)
    assert facts["split-q"]["barriers"] < facts["split-k-p"]["barriers"], facts
    assert facts["split-q"]["shared_bytes"] < facts["split-k-o"]["shared_bytes"], facts  # FA1's partial-O buffer


def test_one_tile_pair_refuses_what_it_does_not_cover(device):
    from kernels.ladder_warp_split import one_tile_forward

    q, k, v = make_qkv(1, 128, 128, 1, 64, torch.float16, device)
    with pytest.raises(ValueError, match="split must be one of"):
        one_tile_forward(q, k, v, split="split-x")
    if device == "cpu":
        with pytest.raises(ValueError, match="no CPU interpreter"):
            one_tile_forward(q, k, v, split="split-q")
        return
    with pytest.raises(ValueError, match="whole blocks of 64"):
        one_tile_forward(q[:, :100], k[:, :100], v[:, :100], split="split-q")
    with pytest.raises(ValueError, match="head dim"):
        one_tile_forward(*make_qkv(1, 128, 128, 1, 32, torch.float16, device), split="split-q")


@pytest.mark.gpu
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("dtype, headdim, causal", [(torch.float16, 64, True), (torch.bfloat16, 64, False),
                                                    (torch.bfloat16, 128, True), (torch.float16, 128, False)])
def test_one_tile_split_matches_reference_on_gpu(split, dtype, headdim, causal):
    from kernels.ladder_warp_split import one_tile_forward

    q, k, v = make_qkv(2, 1024, 1024, 3, headdim, dtype, "cuda")
    out = one_tile_forward(q, k, v, causal, split=split)
    ref, _ = attention_reference(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close_to_reference(split, out, ref, attention_same_dtype(q, k, v, causal=causal))
