"""GQA/MQA, sliding windows, softcap and ALiBi on the Gluon kernels (kernels/flash_attn_hopper.py)
against the Triton feature kernels, on the H200: the measurements behind `dispatch.fwd_memory_path`
and `dispatch.bwd_dkdv_path` sending these calls to the Gluon kernels (and a softcap's backward
to the Triton ones).

    python tools/experiments/exp_gluon_features.py --out DIR      # DIR/gluon_features.csv

Per case (bf16, head dim 128, causal), in one process: `harness.timing.benchmark` (do_bench's
median) of the forward and of the backward (`torch.autograd.grad` of a kept graph) through
`kernels.flash_attn_func`, once as
dispatched and once with the Gluon kernels switched off (`dispatch.gluon_unavailable` set: every
call then takes the Triton kernels). Rows in the decisions format (row, column, unit, value,
tool, git_commit), written as they are measured.

    python tools/experiments/exp_gluon_features.py --from-log LOG --commit SHA --out DIR

turns the printed lines of an earlier run (the same format, one line per case) into those rows.
The committed rows (reports/h200/decisions/gluon_features.csv) are such a conversion of
decisions/gluon_features.log, printed by this procedure's first form, which took do_bench's mean
(warm-up 25 ms, 100 ms of calls) instead of the median; their `tool` says so.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_gluon_features.py, bf16, head dim 128, causal"
ROWS = (("fwd", "gluon", "Gluon forward"), ("fwd", "triton", "Triton forward"),
        ("bwd", "gluon", "Gluon backward"), ("bwd", "triton", "Triton backward"))
LINE = re.compile(r"^(?P<case>.+?)\s+fwd gluon (?P<fg>[0-9.]+) ms triton (?P<ft>[0-9.]+) \| "
                  r"bwd gluon (?P<bg>[0-9.]+) triton (?P<bt>[0-9.]+)$")


def cases():
    import torch

    slopes = torch.rand(16, device="cuda") * 0.25
    yield "dense causal 2x8k 16h", (2, 8192, 16, 16), {"causal": True}
    yield "alibi causal 2x8k", (2, 8192, 16, 16), {"causal": True, "alibi_slopes": slopes}
    yield "softcap causal 2x8k", (2, 8192, 16, 16), {"causal": True, "softcap": 30.0}
    yield "gqa 32/8 causal 1x8k", (1, 8192, 32, 8), {"causal": True}
    for n in (8192, 16384, 32768):
        yield f"window 4096 causal 1x{n}", (1, n, 16, 16), {"causal": True, "window_size": (4096, 0)}
        yield f"full causal 1x{n}", (1, n, 16, 16), {"causal": True}


def measure(shape, kw) -> dict[tuple[str, str], float]:
    import torch

    import kernels
    from harness.timing import benchmark
    from kernels import dispatch

    batch, seqlen, heads, kv_heads = shape
    q = torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, seqlen, kv_heads, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    times = {}
    saved = dispatch.gluon_unavailable
    for path in ("gluon", "triton"):
        dispatch.gluon_unavailable = saved if path == "gluon" else "switched off to time the Triton kernels"
        kernels.forward._PLANS.clear()
        kernels.backward._PLANS.clear()
        try:
            out = kernels.flash_attn_func(q, k, v, **kw)
            times[("fwd", path)] = benchmark(lambda: kernels.flash_attn_func(q, k, v, **kw), q.device).ms
            times[("bwd", path)] = benchmark(
                lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), q.device).ms
        finally:
            dispatch.gluon_unavailable = saved
    return times


def write_times(writer, case: str, times: dict, tool: str | None = None) -> None:
    for mode, path, label in ROWS:
        writer.write(label, case, "ms", times[(mode, path)], tool)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--from-log", type=Path, help="convert an earlier run's printed lines instead of measuring")
    parser.add_argument("--commit", default=os.environ.get("GIT_COMMIT", ""))
    args = parser.parse_args()
    from reports.decisions import DecisionWriter

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gluon_features.csv"
    if args.from_log:
        with DecisionWriter(path, TOOL, args.commit) as writer:
            for line in args.from_log.read_text().splitlines():
                m = LINE.match(line.strip())
                if m:
                    times = {("fwd", "gluon"): float(m["fg"]), ("fwd", "triton"): float(m["ft"]),
                             ("bwd", "gluon"): float(m["bg"]), ("bwd", "triton"): float(m["bt"])}
                    write_times(writer, m["case"].strip(), times, f"{TOOL}, do_bench means, from {args.from_log.name}")
        return
    with DecisionWriter(path, TOOL, args.commit, append=True) as writer:
        for case, shape, kw in cases():
            times = measure(shape, kw)
            write_times(writer, case, times)
            print(f"{case:28s} fwd gluon {times[('fwd', 'gluon')]:.3f} ms triton {times[('fwd', 'triton')]:.3f} | "
                  f"bwd gluon {times[('bwd', 'gluon')]:.3f} triton {times[('bwd', 'triton')]:.3f}", flush=True)

if __name__ == "__main__":
    main()
