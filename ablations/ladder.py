"""The FA1 -> FA2 ablation ladder as data: the rungs, the studies that pick two of them, and
the paper's two settings (docs/architecture.md).

Rungs 0-3 are one Triton kernel family (kernels/fa_ladder.py, its docstring explains how each
technique is expressed); neighbouring rungs share tiles' area, warps and stages, so each step
is one section of the FA2 paper. Rung 4 is beyond the paper and changes several things at
once: the production Triton FA2 kernel (kernels/forward.py's
_flash_fwd_kernel: wgmma, tuned tiles; TMA loads at head dim 128, with host-made descriptors at
settings A and B). The Gluon forward that flash_attn_func takes on Hopper at head dim 128 from 1k
keys (kernels/flash_attn_hopper.py) is not a rung: rung 4 switches it off. Rung 4's launches go
through kernels/launch.py's cache (a shape's compiled kernel launched directly after its first
call), rungs 0-3 through Triton's JIT; that is host time only, which the ablation's CUDA-graph
timing (`--cuda-graph`) leaves out.
Every rung is a forward pass (their gradients come from the FA2 backward,
`kernels.backward.flash_attn_backward`); the backward ladder (kernels/ladder_backward.py) and the
reviewers' studies are ablations/reviewers.py's parts. Kernels are
imported when a rung first runs, so this module imports without Triton's JIT (the runner
switches on the interpreter before that, and the report needs only these tables).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rung:
    index: int
    name: str  # provider name in baselines.providers
    label: str  # plot label
    technique: str  # what this rung adds to the one before, with the paper's section
    forward: Callable  # (q, k, v, causal, softmax_scale) -> out, flash-attn layout (B, S, H, D)
    kernel_regex: str  # Nsight Compute kernel-name regex of its forward kernel


def _ladder_forward(index: int) -> Callable:
    def forward(q, k, v, causal, softmax_scale):
        from kernels.fa_ladder import ladder_forward

        return ladder_forward(q, k, v, softmax_scale, causal, rung=index)[0]

    return forward


def _hopper_forward(q, k, v, causal, softmax_scale):
    """The production Triton forward (_flash_fwd_kernel) with its block table, kept off the Gluon
    forward (kernels/flash_attn_hopper.py) that the table now takes at head dim 128 from 1k
    keys: rung 4 stays the kernel it was measured as."""
    from dataclasses import replace

    from kernels import configs, forward
    from kernels.fa_ladder import check_ladder_inputs

    config = replace(configs.default_fwd_config(q.shape[3], causal, q.device), hopper_gluon_min_keys=0)
    return forward.flash_attn_forward(q, k, v, check_ladder_inputs(q, k, v, softmax_scale), causal, config)[0]


RUNGS: list[Rung] = [
    Rung(0, "rung0-fa1", "0: FA1 algorithm",
         "FA1 (Dao et al. 2022, Alg. 1): K/V-outer loops, O/l/m in HBM, split-K warps",
         _ladder_forward(0), "_ladder_kv_outer_kernel"),
    Rung(1, "rung1-fewer-nonmatmul", "1: + fewer non-matmul FLOPs",
         "FA2 Sec. 3.1: unnormalised O, one 1/l, logsumexp, exp2, diagonal-only causal mask",
         _ladder_forward(1), "_ladder_kv_outer_kernel"),
    Rung(2, "rung2-seq-parallel", "2: + sequence parallelism",
         "FA2 Sec. 3.2: grid over (query blocks, batch x heads), Q-outer loops, O/l/m on chip",
         _ladder_forward(2), "_ladder_q_outer_kernel"),
    Rung(3, "rung3-split-q", "3: + split-Q warps (FA2)",
         "FA2 Sec. 3.3: warps split the query rows, no inter-warp exchange",
         _ladder_forward(3), "_ladder_q_outer_kernel"),
    Rung(4, "rung4-hopper", "4: beyond the paper: several changes (production FA2)",
         "beyond the paper: several changes at once, not one technique's gain: the production kernel's "
         "wgmma (MMA v3), its tuned tiles and stages, the softmax scale folded into one FMA, causal "
         "programs launched longest-first, and TMA loads (host-made descriptors in settings A and B)",
         _hopper_forward, "_flash_fwd_kernel"),
]

# Each study runs the rungs that one technique separates ('all': the whole ladder).
STUDIES: dict[str, list[int]] = {
    "all": [0, 1, 2, 3, 4],
    "fewer-nonmatmul": [0, 1],
    "seq-parallel": [1, 2],
    "warp-partitioning": [2, 3],
    "hopper": [3, 4],
}

# The paper's ablation settings (the authors' A100 ablation of the three techniques, from the paper's public
# review discussion; ablations/paper_a100.csv).
SETTINGS: dict[str, dict] = {
    "A": {"mode": "fwd", "causal": True, "hdim": 128, "seqlen": 2048, "batch": 8, "heads": 16, "dtype": "fp16"},
    "B": {"mode": "fwd", "causal": True, "hdim": 128, "seqlen": 2048, "batch": 1, "heads": 16, "dtype": "fp16"},
}
