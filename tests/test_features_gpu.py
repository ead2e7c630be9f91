"""flash-attn's training features on a CUDA GPU at real sizes, bf16 and fp16: GQA/MQA, sliding
windows, packed variable lengths, softcap, ALiBi, dropout, forward and backward against the
float64 reference with flash-attn's criterion (tests/test_features.py states it), plus what
only a GPU shows: dropout inside a captured CUDA graph and bit-identical backwards at size."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baselines.reference import attention_reference
from kernels import dispatch, flash_attn_func
from kernels.checks import Features
from kernels.configs import default_bwd_config, default_fwd_config
from tests.attention_checks import poisoned_allocations  # noqa: F401
from tests.test_features import check_dense, check_varlen

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,kv_heads,headdim,causal", [
    (2, 1024, 1024, 16, 4, 128, True),
    (1, 1000, 1500, 8, 1, 64, False),   # MQA, ragged, sq < sk
    (1, 2048, 777, 8, 2, 96, True),     # sq > sk: the first rows see no key
    (2, 3000, 3000, 8, 2, 128, True),   # off the 128-row grid: the Gluon varlen kernels, batch rows packed
    (1, 2048, 8192, 8, 2, 128, True),   # 2k queries on 8k keys: the same
])
def test_gpu_gqa(batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, causal, dtype):
    check_dense(batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, dtype, causal=causal, device="cuda")


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen_q,seqlen_k,headdim,window,causal", [
    (2048, 2048, 128, (256, 0), True),
    (1000, 1500, 128, (100, 50), False),
    (1500, 1000, 64, (-1, 200), False),
    (1024, 1024, 256, (300, -1), True),
])
def test_gpu_sliding_window(seqlen_q, seqlen_k, headdim, window, causal, dtype):
    check_dense(1, seqlen_q, seqlen_k, 4, 2, headdim, dtype, causal=causal, window=window, device="cuda")


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_softcap_with_gqa(dtype):
    """A cap of 0.5 against scores of about unit size: the cap is active everywhere."""
    check_dense(2, 1024, 1024, 8, 2, 128, dtype, causal=True, softcap=0.5, device="cuda")


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_batch,causal", [(False, True), (True, False)])
def test_gpu_alibi(per_batch, causal, dtype):
    slopes = torch.rand((2, 8) if per_batch else (8,), device="cuda") * 0.1
    check_dense(2, 1024, 1100, 8, 8, 64, dtype, causal=causal, alibi=slopes, device="cuda")


def _case_features(spec: dict) -> Features:
    """The Features a case's flash_attn_func keywords (causal, window, softcap, alibi) make, as
    dispatch reads them (causal bounds the window's right side)."""
    window = spec.get("window", (-1, -1))
    return Features(window_left=window[0], window_right=-1 if spec["causal"] else window[1],
                    softcap=spec.get("softcap", 0.0), alibi_slopes=spec.get("alibi"))


def assert_dropout_close(got, want, dtype) -> None:
    """out, dq, dk, dv against the float64 reference under the same keep-mask: each within a
    dtype's tolerance of the reference's scale (bf16 3e-2, fp16 4e-3)."""
    tol = {torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = (g.double() - w).abs().max().item()
        assert err < tol * max(1.0, w.abs().max().item()), f"{name}: {err:.3e}"


GLUON_FEATURE_CASES = {
    "gqa-causal": {"heads": 16, "kv_heads": 4, "causal": True},
    "mqa": {"heads": 8, "kv_heads": 1, "causal": False},
    "window-causal": {"causal": True, "window": (300, 0)},
    "window-two-sided": {"causal": False, "window": (200, 100)},
    "window-right-only": {"causal": False, "window": (-1, 150)},
    "window-left-only-gqa": {"heads": 8, "kv_heads": 2, "causal": False, "window": (129, -1)},
    "softcap-causal": {"causal": True, "softcap": 0.5},
    "softcap-gqa": {"heads": 8, "kv_heads": 2, "causal": False, "softcap": 2.0},
    "alibi-causal": {"causal": True, "alibi": "heads"},
    "alibi-per-batch": {"causal": False, "alibi": "batch"},
    "alibi-window-causal": {"causal": True, "window": (256, 0), "alibi": "heads"},
    # causal ALiBi without a window or softcap: its key term by the S matmul (hopper/fwd.py),
    # with V's 2-stage ring at head dim 128 and the shared 3-stage release at 64 (from 4096 keys)
    "alibi-causal-gqa-per-batch": {"heads": 8, "kv_heads": 2, "causal": True, "alibi": "batch"},
    "alibi-causal-d64": {"causal": True, "alibi": "heads", "headdim": 64, "batch": 1, "seqlen": 4096},
    "softcap-window-gqa": {"heads": 8, "kv_heads": 4, "causal": True, "window": (512, 0), "softcap": 1.0},
}


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(GLUON_FEATURE_CASES))
def test_gpu_gluon_kernels_serve_gqa_windows_softcap_and_alibi(case, dtype):
    """Head dim 128 (64 from 4096 keys), equal lengths of whole 128-row blocks from 1k keys: on an
    H100/H200 these calls take the Gluon forward and the Gluon dK/dV kernel with dQ fused
    (asserted, so a change of rule cannot quietly test the Triton kernels instead), and match
    the float64 reference."""
    spec = dict(GLUON_FEATURE_CASES[case])
    heads, kv_heads = spec.pop("heads", 4), spec.pop("kv_heads", 4)
    batch, seqlen, headdim = spec.pop("batch", 2), spec.pop("seqlen", 1024), spec.pop("headdim", 128)
    alibi = spec.pop("alibi", None)
    if alibi is not None:  # BLOOM's slopes for 8 heads are 2^-1 .. 2^-8; a few of that size
        shape = (batch, heads) if alibi == "batch" else (heads,)
        spec["alibi"] = torch.rand(shape, device="cuda") * 0.25
    like_q = torch.empty(batch, seqlen, heads, headdim, device="cuda", dtype=dtype)
    like_k = torch.empty(batch, seqlen, kv_heads, headdim, device="cuda", dtype=dtype)
    features = _case_features(spec)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    fwd_cfg = default_fwd_config(headdim, spec["causal"], like_q.device)
    assert dispatch.fwd_memory_path(fwd_cfg, like_q, like_k, like_k, like_q, spec["causal"],
                                    features) == dispatch.GluonPath.DENSE
    assert dispatch.bwd_dkdv_path(default_bwd_config(headdim, like_q.device), like_q, like_k, like_k, like_q,
                                  features) == dispatch.GluonPath.DENSE
    check_dense(batch, seqlen, seqlen, heads, kv_heads, headdim, dtype, device="cuda", **spec)
    assert dispatch.gluon_unavailable == "", dispatch.gluon_unavailable


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["gqa-causal", "mqa", "window-causal", "window-two-sided", "softcap-gqa",
                                  "alibi-causal", "off-grid-causal", "cross-causal", "three-heads"])
@pytest.mark.parametrize("headdim", [64, 96])
def test_gpu_gluon_backward_adds_dq_in_turns_at_head_dims_64_and_96(headdim, case, dtype):
    """Head dims 64 and 96 (two head-dim sections, 64 + 32) on the Gluon dK/dV kernels with dQ
    fused (at 64 a config asks for it from 1k keys; 96 takes the head-dim-128 entry's): the
    consumers take turns by query step, each computing every other step's whole dQ (at 96 a
    64- and a 32-column tile), so the step counts that are odd (a window's, a packed row's) and
    GQA's steps over the group's q heads must each reach the accumulator once: dense features,
    dense calls off the grid (the varlen kernel, batch rows packed) and three heads (at 96 rows of
    288 columns: the cast's 32-column tiles), against float64, on the Gluon kernels (asserted)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    spec = dict(GLUON_FEATURE_CASES.get(case, {}))
    heads, kv_heads = spec.pop("heads", 3 if case == "three-heads" else 4), spec.pop("kv_heads", None)
    kv_heads = kv_heads or heads
    seqlen_q, seqlen_k = {"off-grid-causal": (1500, 1500), "cross-causal": (1100, 2300)}.get(case, (1024, 1024))
    spec.setdefault("causal", case.endswith("causal"))
    if spec.pop("alibi", None) is not None:
        spec["alibi"] = torch.rand(heads, device="cuda") * 0.25
    like_q = torch.empty(2, seqlen_q, heads, headdim, device="cuda", dtype=dtype)
    like_k = torch.empty(2, seqlen_k, kv_heads, headdim, device="cuda", dtype=dtype)
    features = _case_features(spec)
    config = default_bwd_config(headdim, like_q.device)
    if headdim == 64:
        config = dataclasses.replace(config, hopper_gluon_min_keys=1024, hopper_gluon_fused_dq=True)
    gluon = dispatch.GluonPath.PACKED if seqlen_q % 128 or seqlen_q != seqlen_k else dispatch.GluonPath.DENSE
    assert dispatch.bwd_dkdv_path(config, like_q, like_k, like_k, like_q, features) == gluon
    assert dispatch.bwd_gluon_fuses_dq(config, headdim)
    check_dense(2, seqlen_q, seqlen_k, heads, kv_heads, headdim, dtype, device="cuda", bwd_config=config, **spec)
    assert dispatch.gluon_unavailable == "", dispatch.gluon_unavailable


# (batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, causal, keys a block) on 192 query rows
THREE_CONSUMER_CASES = {
    "d64-dense": (2, 3072, 3072, 3, 3, 64, False, 128),  # whole 192-row and 128-key blocks: the dense kernel
    "d64-causal-gqa": (2, 2048, 2048, 4, 2, 64, True, 128),  # the varlen kernel on the batch rows
    "d64-full-packed": (1, 2048, 2048, 2, 2, 64, False, 128),  # 2048 rows: 10 programs of 192 and one of 128
    "d64-off-grid-causal": (2, 1500, 1500, 2, 2, 64, True, 128),
    "d64-cross-causal": (1, 1100, 2300, 2, 2, 64, True, 128),  # the first rows see no key
    "d96-dense-causal": (2, 2112, 2112, 3, 3, 96, True, 64),  # 11 blocks of 192 rows, 64 keys
    "d96-dense-full": (1, 3072, 3072, 2, 2, 96, False, 64),
    "d96-off-grid-full": (2, 1300, 1300, 2, 1, 96, False, 64),
}


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(THREE_CONSUMER_CASES))
def test_gpu_gluon_forward_on_192_query_rows(case, dtype):
    """The Gluon forwards with three consumer warpgroups (FwdConfig.hopper_gluon_block_m = 192, FA3's
    tile at head dims 64 and 96): the dense kernel where the lengths are whole 192-row and key blocks
    (and causal, whole key blocks a query block), else its varlen variant on the batch rows, which
    also takes the query rows past a sequence's end in a program's last consumers (asserted: the
    path; no Gluon build error), and packed sequences; out, logsumexp and gradients against float64."""
    batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, causal, block_n = THREE_CONSUMER_CASES[case]
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    # one program a tile: a persistent grid takes 128 rows causal (dispatch.fwd_gluon_rows)
    config = dataclasses.replace(default_fwd_config(headdim, causal, torch.device("cuda")), hopper_gluon_min_keys=1024,
                                 hopper_gluon_block_m=192, hopper_gluon_block_n=block_n,
                                 hopper_gluon_persistent_below_keys=0)
    like_q = torch.empty(batch, seqlen_q, heads, headdim, device="cuda", dtype=dtype)
    like_k = torch.empty(batch, seqlen_k, kv_heads, headdim, device="cuda", dtype=dtype)
    dense = (seqlen_q == seqlen_k and seqlen_q % 192 == 0 and seqlen_q % block_n == 0
             and not (causal and 192 % block_n))
    assert dispatch.fwd_memory_path(config, like_q, like_k, like_k, like_q, causal) == (
        dispatch.GluonPath.DENSE if dense else dispatch.GluonPath.PACKED)
    check_dense(batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, dtype, causal=causal, device="cuda",
                fwd_config=config)
    if case == "d64-causal-gqa":  # packed sequences, one empty and one of a single row
        check_varlen([1500, 0, 700, 2100, 1], [1100, 300, 700, 2100, 1], 4, 2, headdim, dtype, device="cuda",
                     causal=causal, fwd_config=config)
    assert dispatch.gluon_unavailable == "", dispatch.gluon_unavailable


def _check_forward_with_fields(batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, dtype, causal, paths,
                               window=(-1, -1), softcap=0.0, **fields):
    """A Gluon forward config field on one call: the table's config from 1024 keys with `fields` set,
    the call's path asserted one of `paths` (dispatch.GluonPath), then out, logsumexp and gradients
    against float64 (check_dense) and no Gluon build error."""
    config = dataclasses.replace(default_fwd_config(headdim, causal, torch.device("cuda")), hopper_gluon_min_keys=1024,
                                 **fields)
    like_q = torch.empty(batch, seqlen_q, heads, headdim, device="cuda", dtype=dtype)
    like_k = torch.empty(batch, seqlen_k, kv_heads, headdim, device="cuda", dtype=dtype)
    features = _case_features({"causal": causal, "window": window, "softcap": softcap})
    assert dispatch.fwd_memory_path(config, like_q, like_k, like_k, like_q, causal, features) in paths
    check_dense(batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, dtype, causal=causal, window=window,
                softcap=softcap, device="cuda", fwd_config=config)
    assert dispatch.gluon_unavailable == "", dispatch.gluon_unavailable


# (batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, causal, window, query rows a program, in turns)
PINGPONG_CASES = {
    "d128-full": (2, 2048, 2048, 3, 3, 128, False, (-1, -1), 128, True),
    "d128-causal-gqa": (2, 2048, 2048, 4, 2, 128, True, (-1, -1), 128, True),
    "d128-window": (2, 2048, 2048, 2, 2, 128, True, (300, 0), 128, True),  # the features' kernel
    "d128-off-grid-causal": (2, 1500, 1500, 2, 2, 128, True, (-1, -1), 128, True),  # varlen, batch rows packed
    "d64-three-full": (1, 3072, 3072, 2, 2, 64, False, (-1, -1), 192, True),  # three consumers in a ring
    "d64-three-causal": (2, 2048, 2048, 2, 2, 64, True, (-1, -1), 192, True),
    "d96-full": (2, 2048, 2048, 3, 3, 96, False, (-1, -1), 128, True),  # two head-dim sections, 64 + 32
    "d96-off-grid-causal": (2, 1500, 1500, 2, 1, 96, True, (-1, -1), 128, True),
    "d192-full": (1, 2048, 2048, 2, 2, 192, False, (-1, -1), 128, True),  # 64-key blocks, 128 + 64
    "d256-causal": (1, 2048, 2048, 2, 2, 256, True, (-1, -1), 128, True),
    # the consumers in no fixed order, as the table has them above head dim 128 only
    "d64-three-full-free-order": (1, 3072, 3072, 2, 2, 64, False, (-1, -1), 192, False),
    "d128-causal-free-order": (2, 2048, 2048, 2, 2, 128, True, (-1, -1), 128, False),
}


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(PINGPONG_CASES))
@pytest.mark.parametrize("pin_softmax", [False, True])
def test_gpu_gluon_forward_with_consumers_in_turns(case, dtype, pin_softmax):
    """FwdConfig.hopper_gluon_pingpong (the consumer warpgroups issue their matmuls in turns, a ring
    of mbarriers, as FA3's and FA4's warp-scheduler barriers order them) on the dense, features and
    varlen Gluon forwards, two and three consumers, and without it at head dims where the table sets
    it, each with and without FwdConfig.hopper_gluon_pin_softmax (the row sums stored to shared
    memory under a predicate never true, before P~ V's wait): out, logsumexp and gradients against float64 (a turn passed out
    of order would deadlock or race, not only slow down), on the Gluon kernel."""
    batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, causal, window, rows, in_turns = PINGPONG_CASES[case]
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    _check_forward_with_fields(batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, dtype, causal,
                               (dispatch.GluonPath.DENSE, dispatch.GluonPath.PACKED), window=window,
                               hopper_gluon_block_m=rows, hopper_gluon_pingpong=in_turns,
                               hopper_gluon_pin_softmax=pin_softmax)


# (batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, causal, window, softcap)
Q_IN_REGISTERS_CASES = {
    "d192-full": (1, 2048, 2048, 2, 2, 192, False, (-1, -1), 0.0),  # two head-dim sections, 128 + 64
    "d192-causal-gqa": (2, 2048, 2048, 4, 2, 192, True, (-1, -1), 0.0),
    "d192-off-grid-causal": (2, 1500, 1500, 2, 1, 192, True, (-1, -1), 0.0),  # varlen, batch rows packed
    "d192-window-softcap": (1, 2048, 2048, 2, 2, 192, True, (300, 0), 30.0),  # the features' kernel
    "d96-full": (2, 2048, 2048, 3, 3, 96, False, (-1, -1), 0.0),  # 64 + 32
    "d96-off-grid-causal": (2, 1500, 1500, 2, 1, 96, True, (-1, -1), 0.0),
}


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(Q_IN_REGISTERS_CASES))
def test_gpu_gluon_forward_with_q_in_registers(case, dtype):
    """FwdConfig.hopper_gluon_q_in_registers (each consumer loads its Q tile into registers once
    and every S matmul reads it from there) on the dense, features and varlen Gluon forwards, one
    and two head-dim sections: out, logsumexp and gradients against float64, on the Gluon kernel."""
    batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, causal, window, softcap = Q_IN_REGISTERS_CASES[case]
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    _check_forward_with_fields(batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, dtype, causal,
                               (dispatch.GluonPath.DENSE, dispatch.GluonPath.PACKED), window=window, softcap=softcap,
                               hopper_gluon_q_in_registers=True)


# (batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, causal, window, softcap, query rows a program): more
# tiles than an H100 or H200 has SMs, so each persistent program runs several, of unequal lengths where causal
PERSISTENT_CASES = {
    "d64-three-off-grid-full": (4, 1500, 1500, 8, 8, 64, False, (-1, -1), 0.0, 192),  # varlen kernel, two Q buffers
    "d64-three-full": (2, 3072, 3072, 8, 4, 64, False, (-1, -1), 0.0, 192),  # dense, GQA
    "d64-causal": (2, 2048, 2048, 8, 8, 64, True, (-1, -1), 0.0, 192),  # dense on 128 rows (causal), two Q buffers
    "d64-off-grid-causal": (4, 1500, 1500, 8, 8, 64, True, (-1, -1), 0.0, 128),  # varlen, batch rows packed
    "d64-cross-causal": (2, 1100, 2300, 8, 8, 64, True, (-1, -1), 0.0, 128),  # some rows see no key
    "d96-full": (2, 2048, 2048, 8, 8, 96, False, (-1, -1), 0.0, 128),  # two head-dim sections, two Q buffers
    "d128-causal-gqa": (2, 2048, 2048, 8, 2, 128, True, (-1, -1), 0.0, 128),  # one Q buffer
    "d128-window-softcap": (2, 2048, 2048, 8, 8, 128, True, (300, 0), 30.0, 128),  # the features' kernel
    "d192-causal": (2, 2048, 2048, 8, 8, 192, True, (-1, -1), 0.0, 128),  # 64-key blocks, Q in registers
    "d256-full": (2, 2048, 2048, 8, 8, 256, False, (-1, -1), 0.0, 128),
}


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(PERSISTENT_CASES))
def test_gpu_gluon_forward_on_a_persistent_grid(case, dtype):
    """A persistent grid (FwdConfig.hopper_gluon_persistent_below_keys above the call's keys: one
    program an SM, each running tiles in rounds, its K/V rings and Q buffers carried from one tile to
    the next) on the dense, features and varlen Gluon forwards, two and three consumers (causal
    calls take two), one and two Q buffers, every head dim: out, logsumexp and gradients against
    float64 (a ring phase or a Q buffer carried wrongly from a tile to the next would read a stale
    tile, race or deadlock), on the Gluon kernel; packed sequences too, one of them empty."""
    batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, causal, window, softcap, rows = PERSISTENT_CASES[case]
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    _check_forward_with_fields(batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, dtype, causal,
                               (dispatch.GluonPath.DENSE, dispatch.GluonPath.PACKED), window=window, softcap=softcap,
                               hopper_gluon_block_m=rows, hopper_gluon_persistent_below_keys=1 << 30)
    if case in ("d64-three-off-grid-full", "d128-causal-gqa"):
        config = dataclasses.replace(default_fwd_config(headdim, causal, torch.device("cuda")),
                                     hopper_gluon_min_keys=1024, hopper_gluon_block_m=rows,
                                     hopper_gluon_persistent_below_keys=1 << 30)
        check_varlen([1500, 0, 700, 2100, 1, 1800] * 4, [1100, 300, 700, 2100, 1, 1800] * 4, heads, kv_heads, headdim,
                     dtype, device="cuda", causal=causal, fwd_config=config)
        assert dispatch.gluon_unavailable == "", dispatch.gluon_unavailable


# (batch, seqlen, heads, kv_heads, headdim, FwdConfig.hopper_gluon_head_section), causal on the dense Gluon forward
CAUSAL_SECTION_CASES = {
    "d256-groups-of-4": (2, 2048, 8, 8, 256, 4),
    "d128-gqa-l2": (3, 2048, 4, 2, 128, "l2"),  # 12 rows: groups of 4 (the largest power of two dividing them)
    "d128-gqa-table": (4, 1024, 4, 2, 128, 8),  # the tables' 8
    "d128-grid-order": (2, 2048, 4, 4, 128, 1),  # each row's blocks in turn
    "d96-groups-of-2": (1, 3072, 6, 6, 96, 2),  # two head-dim sections
}


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CAUSAL_SECTION_CASES))
def test_gpu_gluon_causal_forward_in_launch_groups(case, dtype):
    """FwdConfig.hopper_gluon_head_section on the causal Gluon forward: the programs renumbered so that
    groups of (batch x head) rows start longest first together (fwd_tiles._fwd_program's GROUP_SHIFT; a
    renumbering that lost or repeated a program would leave poisoned rows or write one twice): out,
    logsumexp and gradients against float64, on the dense kernel (asserted), MHA and GQA."""
    batch, seqlen, heads, kv_heads, headdim, section = CAUSAL_SECTION_CASES[case]
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    _check_forward_with_fields(batch, seqlen, seqlen, heads, kv_heads, headdim, dtype, True, (dispatch.GluonPath.DENSE,),
                               hopper_gluon_head_section=section)


# (query lengths, key lengths, heads, kv_heads, headdim, FwdConfig.hopper_gluon_head_section, GROUP_SHIFT),
# causal on the varlen Gluon forward; one length: a dense batch of that many rows of it, off the
# 128-row grid (dispatch.GluonPath.PACKED)
CAUSAL_SECTION_VARLEN_CASES = {
    # 32 rows in groups of 8 (the tables'); sequences shorter than the longest's query blocks
    # leave programs that return at once
    "varlen-groups-of-8": ([1500, 700, 2000, 129, 1024, 4096, 300, 2500], None, 4, 2, 128, 8, 3),
    # 48 rows, "l2" (a row's K and V at the longest sequence's keys: 16 in groups), more queries than keys
    # (the first rows see no key), an empty query and an empty key sequence; two head-dim sections
    "varlen-l2-ragged-keys": ([1500, 0, 700, 2000, 129, 1024], [1100, 300, 700, 2048, 0, 1024], 8, 2, 96, "l2", 4),
    "packed-5x3000-groups-of-4": ([3000] * 5, None, 4, 4, 128, 8, 2),  # 20 rows: groups of 4
    "packed-3x1500-gqa": ([1500] * 3, None, 6, 2, 128, 8, 1),  # 18 rows: groups of 2
}


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CAUSAL_SECTION_VARLEN_CASES))
def test_gpu_gluon_causal_varlen_forward_in_launch_groups(case, dtype, monkeypatch):
    """FwdConfig.hopper_gluon_head_section on the causal varlen Gluon forward, packed sequences and
    a dense call off the grid: the programs renumbered so that groups of (sequence x head) rows start
    longest first together (fwd_tiles._fwd_program's GROUP_SHIFT, the launch's asserted; a renumbering
    that lost or repeated a program would leave poisoned rows or write one twice): out, logsumexp
    and gradients against float64, on the varlen kernel (asserted)."""
    from kernels import flash_attn_hopper as hopper

    lengths_q, lengths_k, heads, kv_heads, headdim, section, group_shift = CAUSAL_SECTION_VARLEN_CASES[case]
    lengths_k = lengths_k or lengths_q
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    shifts = []  # the GROUP_SHIFT the forward's launches took
    genuine_shift = hopper.fwd_group_shift

    def shift(*args):
        shifts.append(genuine_shift(*args))
        return shifts[-1]

    monkeypatch.setattr(hopper, "fwd_group_shift", shift)
    config = dataclasses.replace(default_fwd_config(headdim, True, torch.device("cuda")), hopper_gluon_min_keys=1024,
                                 hopper_gluon_head_section=section)
    if len(set(lengths_q)) == 1:  # a dense batch
        like_q = torch.empty(len(lengths_q), lengths_q[0], heads, headdim, device="cuda", dtype=dtype)
        like_k = torch.empty(len(lengths_q), lengths_k[0], kv_heads, headdim, device="cuda", dtype=dtype)
        assert dispatch.fwd_memory_path(config, like_q, like_k, like_k, like_q, True) == dispatch.GluonPath.PACKED
        check_dense(len(lengths_q), lengths_q[0], lengths_k[0], heads, kv_heads, headdim, dtype, causal=True,
                    device="cuda", fwd_config=config)
    else:
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                      for lengths in (lengths_q, lengths_k))
        features = Features(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q),
                            max_seqlen_k=max(lengths_k))
        like_q = torch.empty(sum(lengths_q), heads, headdim, device="cuda", dtype=dtype)
        like_k = torch.empty(sum(lengths_k), kv_heads, headdim, device="cuda", dtype=dtype)
        assert dispatch.fwd_memory_path(config, like_q, like_k, like_k, like_q, True,
                                        features) == dispatch.GluonPath.DENSE
        check_varlen(lengths_q, lengths_k, heads, kv_heads, headdim, dtype, device="cuda", causal=True,
                     fwd_config=config)
    assert dispatch.gluon_unavailable == "", dispatch.gluon_unavailable
    assert shifts and set(shifts) == {group_shift}, shifts


GLUON_WIDE_HEAD_CASES = {
    "full": {"causal": False},
    "causal": {"causal": True, "batch": 1, "seqlen": 4096},
    "gqa-causal": {"heads": 8, "kv_heads": 2, "causal": True},
    "window-two-sided": {"causal": False, "window": (200, 100)},
    "window-causal": {"causal": True, "window": (300, 0)},
    "softcap-causal": {"causal": True, "softcap": 0.5},
    "alibi-causal": {"causal": True, "alibi": True},  # the key term by matmul: 3 K and 2 V blocks beside its tile
    "alibi-full": {"causal": False, "alibi": True},
    "off-grid-causal": {"causal": True, "seqlen": 1500},  # the varlen kernel, batch rows packed
    "off-grid-full": {"causal": False, "seqlen": 1500},
    "cross-causal": {"causal": True, "seqlen": 1100, "seqlen_k": 2300},  # the first rows see no key
}


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(GLUON_WIDE_HEAD_CASES))
@pytest.mark.parametrize("headdim", [96, 192, 256])
def test_gpu_gluon_forward_at_head_dims_96_192_and_256(headdim, case, dtype):
    """Head dims 96 and 192 (two head-dim sections each: 64 + 32, 128 + 64) and 256 on the Gluon
    forwards, 192 and 256 in the table's 64-key blocks (FwdConfig.hopper_gluon_block_n: two key
    blocks per 128-row query block, both masked on the diagonal): dense, GQA, windows, softcap,
    ALiBi, and calls off the grid on the varlen kernel, against float64 (out, the logsumexp
    through the backward's use of it, and the gradients: at 96, and at 192 and 256 without a feature,
    from the Gluon backward, else from the Triton one), on the Gluon forward (asserted)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    spec = dict(GLUON_WIDE_HEAD_CASES[case])
    heads, kv_heads = spec.pop("heads", 4), spec.pop("kv_heads", 4)
    batch, seqlen = spec.pop("batch", 2), spec.pop("seqlen", 1024)
    seqlen_k = spec.pop("seqlen_k", seqlen)
    if spec.pop("alibi", None):
        spec["alibi"] = torch.rand(heads, device="cuda") * 0.25
    like_q = torch.empty(batch, seqlen, heads, headdim, device="cuda", dtype=dtype)
    like_k = torch.empty(batch, seqlen_k, kv_heads, headdim, device="cuda", dtype=dtype)
    features = _case_features(spec)
    config = default_fwd_config(headdim, spec["causal"], like_q.device)
    assert config.hopper_gluon_block_n == (128 if headdim == 96 else 64)
    gluon = dispatch.GluonPath.PACKED if seqlen % 128 or seqlen != seqlen_k else dispatch.GluonPath.DENSE
    assert dispatch.fwd_memory_path(config, like_q, like_k, like_k, like_q, spec["causal"], features) == gluon
    check_dense(batch, seqlen, seqlen_k, heads, kv_heads, headdim, dtype, device="cuda", **spec)
    assert dispatch.gluon_unavailable == "", dispatch.gluon_unavailable


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dq_first", [None, False], ids=["dq-first", "dq-last"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,seqlen,heads,kv_heads,causal", [
    (2, 1024, 3, 3, False), (1, 4096, 2, 2, True), (2, 2048, 8, 2, True), (1, 1024, 4, 1, False)],
    ids=["full", "causal", "gqa-causal", "mqa"])
@pytest.mark.parametrize("headdim", [192, 256])
def test_gpu_gluon_backward_at_head_dims_192_and_256(headdim, batch, seqlen, heads, kv_heads, causal, dtype,
                                                      dq_first):
    """Head dims 192 and 256 on the Gluon dK/dV kernel for wide heads (kernels/hopper/bwd_wide.py:
    64-key blocks, one warpgroup computing S and the first head-dim section of dK and dV, the other
    dP, the second section and dQ (at 256 each warpgroup dQ's columns of its own section, added
    from registers), exchanging P^T and dS^T through shared memory), dense and GQA/MQA,
    against float64, on that kernel (asserted); a deterministic backward keeps the Triton kernels.
    Both orders of the dP warpgroup: the table's (BwdConfig.hopper_gluon_dq_first None: dQ's
    matmuls first, its tiles written out under dV's and dK's) and dQ after them."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    like_q = torch.empty(batch, seqlen, heads, headdim, device="cuda", dtype=dtype)
    like_k = torch.empty(batch, seqlen, kv_heads, headdim, device="cuda", dtype=dtype)
    config = dataclasses.replace(default_bwd_config(headdim, like_q.device), hopper_gluon_dq_first=dq_first)
    assert dispatch.bwd_dkdv_path(config, like_q, like_k, like_k, like_q) == dispatch.GluonPath.DENSE
    assert dispatch.bwd_dkdv_path(config, like_q, like_k, like_k, like_q, deterministic=True) == "triton"
    check_dense(batch, seqlen, seqlen, heads, kv_heads, headdim, dtype, causal=causal, device="cuda",
                bwd_config=config)
    assert dispatch.gluon_unavailable == "", dispatch.gluon_unavailable


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("section", [1, 2, 4, "l2", 1000])
def test_gpu_gluon_backward_in_every_launch_order(section):
    """The Gluon dK/dV kernels' launch order (BwdConfig.hopper_gluon_head_section and
    hopper_gluon_causal_head_section, bwd_grid): each
    pair's key blocks in turn, sections of 2 or of 4 pairs (a width that does not divide 6 pairs
    takes the largest divisor, 3), L2-sized, and every pair together; each must visit every
    (pair, key block) once: the dense GQA backward (6 pairs, causal, with a window, and full) and a
    packed batch (12 pairs) against float64, on the Gluon kernels (asserted, so a Gluon build that
    fails cannot send them to the Triton ones unseen)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    lengths = [1500, 700, 2000, 129, 1024, 300]
    like_q = torch.empty(3, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    like_k = torch.empty(3, 1024, 2, 128, device="cuda", dtype=torch.bfloat16)
    assert dispatch.bwd_dkdv_path(default_bwd_config(128, like_q.device), like_q, like_k, like_k,
                                  like_q) == dispatch.GluonPath.DENSE
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    packed = Features(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    packed_q = torch.empty(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16)
    packed_k = torch.empty(sum(lengths), 2, 128, device="cuda", dtype=torch.bfloat16)
    assert dispatch.hopper_gluon_varlen_bwd_applies(default_bwd_config(128, like_q.device), packed_q, packed_k,
                                                    packed_k, packed_q, packed)
    config = dataclasses.replace(default_bwd_config(128, like_q.device), hopper_gluon_head_section=section,
                                 hopper_gluon_causal_head_section=section)
    check_dense(3, 1024, 1024, 8, 2, 128, torch.bfloat16, device="cuda", causal=True, bwd_config=config)
    check_dense(3, 1024, 1024, 8, 2, 128, torch.bfloat16, device="cuda", causal=False, bwd_config=config)
    check_dense(3, 1024, 1024, 8, 2, 128, torch.bfloat16, device="cuda", causal=True, window=(300, 0),
                bwd_config=config)
    check_varlen(lengths, lengths, 8, 2, 128, torch.bfloat16, device="cuda", causal=True, bwd_config=config)
    assert dispatch.gluon_unavailable == "", dispatch.gluon_unavailable


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dq_first", [False, True], ids=["dq-after-dk", "dq-before-dk"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_gluon_backward_in_each_schedule(dq_first, dtype):
    """The dense Gluon dK/dV kernel with the fused dQ's matmul after dK's or before it
    (BwdConfig.hopper_gluon_dq_first, which the tables leave to the rule), its accumulator's
    register-order tiles put back by dq_from_accumulator; MHA both causal modes, GQA and a window
    against float64, on the Gluon kernel (asserted)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    like_q = torch.empty(2, 1024, 8, 128, device="cuda", dtype=dtype)
    config = dataclasses.replace(default_bwd_config(128, like_q.device), hopper_gluon_dq_first=dq_first)
    assert dispatch.bwd_dkdv_path(config, like_q, like_q, like_q, like_q) == dispatch.GluonPath.DENSE
    for causal in (False, True):
        check_dense(2, 1024, 1024, 8, 8, 128, dtype, device="cuda", causal=causal, bwd_config=config)
    check_dense(2, 1024, 1024, 8, 2, 128, dtype, device="cuda", causal=True, bwd_config=config)
    check_dense(2, 1024, 1024, 8, 2, 128, dtype, device="cuda", causal=True, window=(300, 0), bwd_config=config)
    assert dispatch.gluon_unavailable == "", dispatch.gluon_unavailable


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (128, 0))])
def test_gpu_varlen(causal, window, dtype):
    """Random lengths 1..1500 (one empty query sequence), GQA 8/2, head dim 128."""
    generator = torch.Generator().manual_seed(0)
    lengths_q = torch.randint(1, 1500, (6,), generator=generator).tolist()
    lengths_k = [n if causal else int(m) for n, m in zip(lengths_q, torch.randint(1, 1500, (6,), generator=generator))]
    lengths_q[2] = 0
    check_varlen(lengths_q, lengths_k, 8, 2, 128, dtype, device="cuda", causal=causal, window_size=window)


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim,lengths_q,lengths_k", [
    # sequences shorter and longer than a block, an empty query and an empty key sequence,
    # query lengths above the key lengths (causal: the first rows see no key) and below
    (128, [1500, 0, 700, 2000, 129, 1024], [1100, 300, 700, 2048, 0, 1024]),
    (64, [4200, 300, 17, 4096], [4096, 600, 17, 3000]),
    (96, [1500, 0, 700, 2000, 129, 1024], [1100, 300, 700, 2048, 0, 1024]),  # two head-dim sections
    # one sequence; and many shorter than one 64-row dQ tile, each its own tile in register order,
    # beside one long enough for the Gluon kernels (hopper_gluon_min_keys)
    (128, [2500], [2300]),
    (128, [5, 63, 1, 64, 17, 40, 33, 2, 60, 65, 31, 12, 48, 7, 64, 1, 0, 39, 1100],
     [9, 63, 1, 64, 17, 3, 80, 2, 60, 65, 31, 128, 48, 7, 1, 64, 5, 39, 1030]),
])
@pytest.mark.parametrize("key_grid", ["longest", "packed"], ids=["longest-grid", "packed-grid"])
def test_gpu_gluon_varlen(headdim, lengths_q, lengths_k, causal, dtype, key_grid, monkeypatch):
    """Packed sequences on an H100/H200 take the Gluon varlen forward and the Gluon varlen dK/dV
    kernel with dQ fused (at head dims 64 and 96 its consumers compute dQ in turns; the config fixes the
    Gluon thresholds so that a change of the table cannot quietly test the Triton kernels
    instead; asserted), and match the float64 reference, the logsumexp too; the backward's key
    blocks the longest sequence's for each or every sequence's on one axis
    (BwdConfig.hopper_gluon_varlen_grid, asserted at the launch)."""
    from kernels import flash_attn_hopper as hopper

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    grids = []  # the key grids the backward's launches took
    genuine_grid = hopper.varlen_bwd_grid

    def grid(*args):
        grids.append(genuine_grid(*args))
        return grids[-1]

    monkeypatch.setattr(hopper, "varlen_bwd_grid", grid)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for lengths in (lengths_q, lengths_k))
    features = Features(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q),
                        max_seqlen_k=max(lengths_k))
    like_q = torch.empty(sum(lengths_q), 8, headdim, device="cuda", dtype=dtype)
    like_k = torch.empty(sum(lengths_k), 2, headdim, device="cuda", dtype=dtype)
    assert dispatch.fwd_memory_path(default_fwd_config(headdim, causal, like_q.device), like_q, like_k, like_k,
                                    like_q, causal, features) == dispatch.GluonPath.DENSE
    config = dataclasses.replace(default_bwd_config(headdim, like_q.device), hopper_gluon_varlen_grid=key_grid,
                                 hopper_gluon_min_keys=1024, hopper_gluon_fused_dq=True)
    assert dispatch.hopper_gluon_varlen_bwd_applies(config, like_q, like_k, like_k, like_q, features)
    check_varlen(lengths_q, lengths_k, 8, 2, headdim, dtype, device="cuda", causal=causal, bwd_config=config)
    assert dispatch.gluon_unavailable == "", dispatch.gluon_unavailable
    assert set(grids) == {key_grid}, grids


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen,causal,window", [(1024, True, (-1, -1)), (2048, False, (-1, -1)),
                                                  (1500, True, (-1, -1)), (1024, True, (200, 0))],
                         ids=["dense-causal-gqa", "dense-full-gqa", "off-grid-causal", "window"])
@pytest.mark.parametrize("gluon_backward", [False, True], ids=["triton-bwd", "gluon-bwd"])
def test_gpu_gluon_backward_drops_what_the_triton_forward_drops(seqlen, causal, window, gluon_backward, dtype):
    """Dropout's forward on the Triton kernels (the Gluon forwards have none), its backward on
    the Triton kernels or (BwdConfig.hopper_gluon_dropout, on the grid) the Gluon dK/dV kernel, which
    redraws the forward's keep-mask (kernels/hopper/dropout.py): under the mask `return_attn_probs`
    reports, out and the gradients match float64, dense with GQA, off the grid and with a window. On
    the kernels named (asserted)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 (H100/H200) only")
    config = default_fwd_config(128, causal, torch.device("cuda"))
    bwd_config = dataclasses.replace(default_bwd_config(128, torch.device("cuda")), hopper_gluon_dropout=gluon_backward)
    q, k, v = (torch.randn(2, seqlen, h, 128, device="cuda", dtype=dtype, requires_grad=True) for h in (8, 2, 2))
    dout = torch.randn_like(q)
    features = Features(window_left=window[0], window_right=-1 if causal else window[1], dropout_p=0.15,
                        rng_seed=torch.zeros(2, dtype=torch.int64, device="cuda"))
    assert dispatch.fwd_gluon_path(config, q, k, v, q, causal, features)[1].startswith("dropout: on the Triton forward")
    on_gluon = gluon_backward and seqlen % 128 == 0
    assert dispatch.bwd_dkdv_path(bwd_config, q, k, v, q, features) == (dispatch.GluonPath.DENSE if on_gluon
                                                                          else "triton")
    torch.manual_seed(0)
    out, _, probs = flash_attn_func(q, k, v, dropout_p=0.15, causal=causal, window_size=window, return_attn_probs=True,
                                    fwd_config=config, bwd_config=bwd_config)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = ~torch.signbit(probs)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q64, k64, v64, None, causal, window_size=window, dropout_p=0.15, dropout_keep=keep)[0]
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert_dropout_close((out, *grads), (ref, *ref_grads), dtype)
    assert dispatch.gluon_unavailable == "", dispatch.gluon_unavailable


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backward", ["table", "triton"])
@pytest.mark.parametrize("headdim", [64, 96, 128])
def test_gpu_dropout_matches_the_reference_under_its_own_mask(headdim, backward, dtype):
    """Dropout (GQA, causal): about 1 - p of the visible entries kept, and out and the gradients
    against float64 under the keep-mask `return_attn_probs` reports. With `backward` "table" no config
    is passed (on an H100/H200 the Gluon dK/dV kernel, BwdConfig.hopper_gluon_dropout: 96 in two
    head-dim sections, 64's consumers computing dQ in turns, redrawing the forward's mask); with
    "triton" the Triton kernels on the tiles a dropout call takes without the Gluon one (the features
    table's at 96 and 128). The path is asserted, and that no Gluon build failed over to the Triton kernels."""
    q, k, v = (torch.randn(1, 1024, h, headdim, device="cuda", dtype=dtype, requires_grad=True) for h in (8, 2, 2))
    dout = torch.randn_like(q)
    features = Features(dropout_p=0.15, rng_seed=torch.zeros(2, dtype=torch.int64, device="cuda"))
    table = default_bwd_config(headdim, q.device)
    bwd_config = (dataclasses.replace(default_bwd_config(headdim, q.device, masked_features=True), hopper_gluon_dropout=False)
                  if backward == "triton" else None)
    on_gluon = torch.cuda.get_device_capability() == (9, 0) and (bwd_config or table).hopper_gluon_dropout
    assert dispatch.bwd_dkdv_path(bwd_config or table, q, k, v, q, features) == (
        dispatch.GluonPath.DENSE if on_gluon else "triton")
    torch.manual_seed(0)
    out, _, probs = flash_attn_func(q, k, v, dropout_p=0.15, causal=True, return_attn_probs=True, bwd_config=bwd_config)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = ~torch.signbit(probs)
    visible = torch.ones(1024, 1024, device="cuda").tril().bool()
    assert abs(keep[..., visible].float().mean().item() - 0.85) < 0.01
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q64, k64, v64, None, True, dropout_p=0.15, dropout_keep=keep)[0]
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert_dropout_close((out, *grads), (ref, *ref_grads), dtype)
    assert dispatch.gluon_unavailable == "", dispatch.gluon_unavailable


def test_gpu_dropout_in_a_cuda_graph_draws_a_new_mask_per_replay():
    """The kernels read (seed, offset) from a tensor that PyTorch's generator fills inside the
    graph: each replay drops other entries, as torch's own dropout does under graphs."""
    q, k, v = (torch.randn(2, 512, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    static_out = torch.empty(2, 512, 4, 64, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        flash_attn_func(q, k, v, dropout_p=0.2).sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, dropout_p=0.2)
        out.sum().backward()
        static_out.copy_(out)
    graph.replay()
    first = static_out.clone()
    graph.replay()
    assert torch.isfinite(first).all() and torch.isfinite(static_out).all()
    assert not torch.equal(first, static_out)


@pytest.mark.parametrize("kw", [{"window_size": (512, 0), "causal": True}, {"dropout_p": 0.1}, {"softcap": 20.0}])
def test_gpu_backward_is_bit_identical_between_runs(kw):
    """GQA's dK/dV are summed on chip in a fixed order: no atomics, nothing varies between runs."""
    q = torch.randn(2, 2048, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2048, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    runs = []
    for _ in range(2):
        torch.manual_seed(1)
        runs.append(torch.autograd.grad(flash_attn_func(q, k, v, deterministic=True, **kw), (q, k, v), dout))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
