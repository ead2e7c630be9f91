"""The prediction behind exp_launch_order.py, on the CPU: how much longer than a perfect balance a
causal Gluon launch runs in each program order, by list scheduling.

Model: the SMs (--sms) take programs in the order they start (one program per SM at a time: the
Gluon kernels' shared memory allows one), each SM the next program when its last one ends; a
program costs its block count (forward: the key blocks a query block visits; backward: the
64-row query steps a key block sees, times the q heads sharing its kv head), plus --overhead
blocks of prologue and epilogue; a program past a packed sequence's end costs nothing. Printed:
the makespan over the perfect balance (total cost / SMs) per case and order, the orders being
exp_launch_order.py's settings (groups of rows bounded as LAUNCH_GROUP_ROWS bounds them, the
rule's group from launch_group_shift with --l2-mib of L2 cache). Only the order is modelled: not
the L2 reuse a group keeps (the reason groups are bounded), nor memory stalls.

    python tools/experiments/sim_launch_order.py [--sms 132] [--l2-mib 50]
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BLOCK = 128  # the forward's query and key blocks, the backward's key block
STEP = 64  # the backward's query step


def makespan(costs: list[float], sms: int) -> float:
    free_at = [0.0] * sms
    for cost in costs:
        heapq.heappush(free_at, heapq.heappop(free_at) + cost)
    return max(free_at)


def launch_order(grid: list[list[float]], shift: int) -> list[float]:
    """The costs in the order the kernels start them: grid[y][x], groups of 2**shift rows x-major
    (flash_attn_hopper._program_in_launch_order)."""
    rows, group = len(grid), 1 << shift
    return [grid[y][x] for y0 in range(0, rows, group) for x in range(len(grid[0]))
            for y in range(y0, min(rows, y0 + group))]


def grids(overhead: float) -> dict[str, tuple[list[list[float]], int]]:
    """Case -> (costs grid[row][x], bytes of shared operands per row as the launchers count them)."""
    from harness.features import cases as feature_cases

    out = {}
    for mode in ("fwd", "bwd"):
        for variant, batch, seqlen, heads, kv_heads in (("dense", 2, 8192, 16, 16), ("dense", 8, 2048, 16, 16),
                                                        ("dense", 1, 16384, 16, 16), ("gqa", 8, 2048, 32, 8),
                                                        ("gqa", 4, 4096, 32, 8), ("gqa", 2, 8192, 32, 8),
                                                        ("gqa", 1, 16384, 32, 8)):
            group = heads // kv_heads
            blocks = seqlen // BLOCK
            if mode == "fwd":  # query block m (started last block first) visits m + 1 key blocks
                grid = [[blocks - x + overhead for x in range(blocks)] for _ in range(batch * heads)]
                per_row = seqlen * 128 * 2 * 2 // group
            else:  # key block x sees the query steps from its first key on, for each q head of the group
                grid = [[(seqlen - x * BLOCK) / STEP * group + overhead for x in range(blocks)]
                        for _ in range(batch * kv_heads)]
                per_row = seqlen * 128 * (2 * 2 + 4) * group
            out[f"{mode} {variant} {batch}x{seqlen // 1024}k {heads}/{kv_heads}h"] = grid, per_row
        varlen = next(c for c in feature_cases(quick=False) if c.variant == "varlen")
        longest, blocks = max(varlen.lengths), math.ceil(max(varlen.lengths) / BLOCK)
        grid = []
        for length in varlen.lengths:
            for _ in range(varlen.heads):
                if mode == "fwd":
                    grid.append([(math.ceil(length / BLOCK) - x + overhead) if x * BLOCK < length else 0.0
                                 for x in range(blocks)])
                else:
                    grid.append([(math.ceil((length - x * BLOCK // STEP * STEP) / STEP) + overhead)
                                 if x * BLOCK < length else 0.0 for x in range(blocks)])
        bytes_per_row = longest * 128 * (2 * 2 if mode == "fwd" else 2 * 2 + 4)
        out[f"{mode} varlen {len(varlen.lengths)} sequences {varlen.heads}h"] = grid, bytes_per_row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sms", type=int, default=132, help="the H100/H200 SXM count")
    parser.add_argument("--l2-mib", type=float, default=50.0, help="L2 cache for the rule's group")
    parser.add_argument("--overhead", type=float, default=2.0, help="a program's fixed cost, in blocks")
    args = parser.parse_args()
    import torch

    from kernels import flash_attn_hopper as hopper
    from tools.experiments.exp_launch_order import SETTINGS

    hopper._l2_bytes = lambda device: int(args.l2_mib * 2**20)  # no GPU here
    names = list(SETTINGS)
    print(f"{'case':34s} " + " ".join(f"{name:>18s}" for name in names))
    for case, (grid, per_row) in grids(args.overhead).items():
        ideal = sum(map(sum, grid)) / args.sms
        cells = []
        for name in names:
            hopper.LAUNCH_GROUP_ROWS = SETTINGS[name]
            shift = hopper.launch_group_shift(len(grid), per_row, torch.device("cuda"))
            cells.append(f"{makespan(launch_order(grid, shift), args.sms) / ideal:10.3f} (x{1 << shift:>3d})")
        print(f"{case:34s} " + " ".join(f"{cell:>18s}" for cell in cells))


if __name__ == "__main__":
    main()
