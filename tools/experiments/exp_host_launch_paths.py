"""Host time per eager call by launch path, in one process, the paths taking turns with SDPA flash.

The switches of kernels/launch.py and kernels/ops.py are read at each call, so one process can
time every path against SDPA's FLASH_ATTENTION backend in interleaved rounds (the host's speed
drifts between runs by more than the differences measured here):

- 'Python runner, Function.apply': launch.C_LAUNCH off, each kept kernel launched by its compiled
  kernel's Python runner (what every launch did while the C path's hook check never held), and
  autograd.Function.apply's Python wrapper;
- 'C launcher and C apply, Triton's descriptor wrapper': Triton's C launcher called directly, the plans' host
  descriptors made as Python objects and expanded by Triton's wrapper around that launcher;
- 'C launcher and C apply, descriptors encoded at each launch': launch.DESCRIPTOR_EXPANSION (the library's
  default).

The committed rows (reports/h200/decisions/host_launch_paths.csv) also hold a fourth path of ours,
'C launcher and C apply, encodings kept by address': each descriptor position kept the encodings it made by
tensor address, a cache since removed (the commit the rows name has it; it did not pay).

All but the first enter autograd.Function's C apply directly (ops._apply_flash_attn). Calls are
harness/host_overhead.py's ('fwd': no autograd graph; 'bwd': one recorded forward's backward;
'fwd_bwd': both; the backward on PyTorch's default engine thread), causal, bf16, timed by its
interleaved_host_ms (each `--calls` calls behind one GPU sleep per turn). Rows (decision format, microseconds per call, one per path,
cell and round) go to OUT/host_launch_paths.csv as they are measured.

    python tools/experiments/exp_host_launch_paths.py --out reports/h200/decisions
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from tune_fa2 import CsvRows

from harness.host_overhead import attention_fn, call_fn, interleaved_host_ms
from kernels import launch, ops
from kernels.ops import FlashAttnFunc

SHAPES = ((1, 16, 1024, 128), (1, 32, 512, 64), (4, 8, 1024, 64), (8, 16, 2048, 128))  # (batch, heads, seqlen, hdim)
MODES = ("fwd", "bwd", "fwd_bwd")
C_APPLY = ops._apply_flash_attn
# path label -> (C launcher, C apply, descriptor expansion)
PATHS = {
    "ours: Python runner, Function.apply": (False, False, False),
    "ours: C launcher and C apply, Triton's descriptor wrapper": (True, True, False),
    "ours: C launcher and C apply, descriptors encoded at each launch": (True, True, True),
}
DEFAULT = "ours: C launcher and C apply, descriptors encoded at each launch"
SDPA = "SDPA flash"


def use_path(c_launch: bool, c_apply: bool, expansion: bool) -> None:
    launch.C_LAUNCH, launch.DESCRIPTOR_EXPANSION = c_launch, expansion
    ops._apply_flash_attn = C_APPLY if c_apply else FlashAttnFunc.apply


def host_experiment(description: str, csv_name: str, tool: str):
    """A host experiment's command line (--out, --rounds, --calls) and its rows: (args, record),
    `record(turn, ms)` writing turn (column, row)'s microseconds per call to OUT/csv_name as it is
    measured, the tool column `tool` with the calls a turn, the GPU and torch appended."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")),
                        help=f"folder for {csv_name} (default: $OUT, else the current folder)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=40, help="calls per turn, behind one GPU sleep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: host time per call is measured there")
    args.out.mkdir(parents=True, exist_ok=True)
    commit = os.environ.get("GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True,
        cwd=ROOT).stdout.strip()
    tool = f"{tool}, {args.calls} calls a turn, {torch.cuda.get_device_name()}, torch {torch.__version__}"
    rows = CsvRows(args.out / csv_name, lambda r: f"  {r['column']:24s} {r['row']:56s} {r['value']:8.1f} us")

    def record(turn, ms):
        rows(row=turn[1], column=turn[0], unit="us", value=ms * 1e3, tool=tool, git_commit=commit)

    return args, record


def main() -> None:
    args, record = host_experiment(__doc__, "host_launch_paths.csv",
                                   "tools/experiments/exp_host_launch_paths.py, causal bf16")
    from tqdm import tqdm

    fa2, sdpa = attention_fn("fa2", True), attention_fn("sdpa-flash", True)
    try:
        for batch, heads, seqlen, hdim in tqdm(SHAPES, desc="shapes"):
            q, k, v = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn_like(q)
            turns = {}  # (column, row) -> (switches or None for SDPA, call)
            for mode in MODES:
                column = f"{mode.replace('_', '+')} {batch}x{heads}x{seqlen}x{hdim}"
                turns[column, SDPA] = None, call_fn(sdpa, mode, q, k, v, dout)
                for label, switches in PATHS.items():
                    use_path(*switches)
                    turns[column, label] = switches, call_fn(fa2, mode, q, k, v, dout)

            def before_turn(turn, turns=turns):
                if turns[turn][0]:
                    use_path(*turns[turn][0])

            # the harness's rounds (its warm-up call of each path makes the shape's plans)
            interleaved_host_ms({turn: fn for turn, (_, fn) in turns.items()}, args.calls, args.rounds,
                                before_turn, record)
    finally:
        use_path(*PATHS[DEFAULT])


if __name__ == "__main__":
    main()
