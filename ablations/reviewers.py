"""The reviewers' studies: run one part or all of them, keep their rows, write reviewers.md.

    python -m ablations.reviewers all --out results/reviewers          # every part, then the report
    python -m ablations.reviewers backward --out results/reviewers     # one part; rows of others kept
    python -m ablations.reviewers --report-only --out results/reviewers
    python -m ablations.reviewers --decode-rows results/decode/decode.csv --out results/reviewers

`run(name, args, out_dir)` is what `runner.py --ablation NAME` calls. Rows go to
OUT/reviewers.csv (timing) and OUT/reviewers_counters.csv (Nsight Compute); a part's new rows
replace the rows of its question, so parts can be run one at a time into one folder. The report
is rebuilt from the files after every part.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pandas as pd

ROWS_CSV, COUNTERS_CSV, REPORT_MD = "reviewers.csv", "reviewers_counters.csv", "reviewers.md"
TUNING_WARMUP_MS, TUNING_REP_MS = 10, 40  # the tuning part's many candidates use a short clock


def part_names() -> tuple[str, ...]:
    from ablations.parts import PARTS

    return tuple(PARTS)


def _load(path: Path) -> pd.DataFrame:
    empty = pd.DataFrame(columns=["question"])
    if not path.exists():
        return empty
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return empty


def _merge(path: Path, new: pd.DataFrame, question: str) -> pd.DataFrame:
    """The rows in `path` with those of `question` replaced by `new`; written back."""
    old = _load(path)
    old = old[old["question"] != question]
    frames = [frame for frame in (old, new) if len(frame)]
    merged = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["question", *new.columns])
    merged.to_csv(path, index=False)
    return merged


def write_report(out_dir: Path) -> Path:
    from ablations.reviewers_report import write_reviewers_report

    path = out_dir / REPORT_MD
    write_reviewers_report(_load(out_dir / ROWS_CSV), _load(out_dir / COUNTERS_CSV), path)
    return path


def context(args, out_dir: Path):
    """The measuring context from runner-style arguments (dtype, repeats, warmup_ms, rep_ms, ncu)."""
    import torch

    from ablations.measure import Context
    from harness.environment import capture_environment
    from harness.timing import DEFAULT_REP_MS, DEFAULT_WARMUP_MS

    interpreter = not torch.cuda.is_available()
    if interpreter and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("no GPU: set TRITON_INTERPRET=1 before `kernels` is imported to run in Triton's "
                           "interpreter")
    ncu = getattr(args, "ncu", None) not in ("off",) and not interpreter
    if ncu:
        from harness.ncu import ncu_status

        ncu = ncu_status() is None
    dtype = getattr(args, "dtype", "fp16") or "fp16"
    return Context(device=torch.device("cpu" if interpreter else "cuda"), interpreter=interpreter,
                   dtype="fp16" if interpreter else dtype, warmup_ms=getattr(args, "warmup_ms", None) or
                   DEFAULT_WARMUP_MS, rep_ms=getattr(args, "rep_ms", None) or DEFAULT_REP_MS,
                   repeats=getattr(args, "repeats", 1) or 1, out_dir=out_dir, ncu=ncu,
                   environment=capture_environment())


def run(name: str, args, out_dir) -> int:
    """Run part `name` ('all': every part) into `out_dir`; 0 when every part ran (rows of failed
    cells are rows with their status), 1 when a part raised."""
    from dataclasses import replace

    from tqdm import tqdm

    from ablations.measure import frame
    from ablations.parts import PARTS

    if name != "all" and name not in PARTS:
        raise ValueError(f"unknown part {name!r}; parts: all, {', '.join(PARTS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = context(args, out_dir)
    chosen = list(PARTS.values()) if name == "all" else [PARTS[name]]
    exit_code = 0
    bar = tqdm(chosen, desc="reviewers' studies", unit="part")
    for part in bar:
        bar.set_postfix_str(part.name)
        part_ctx = replace(ctx, log=tqdm.write)
        if part.name == "tuning" and not ctx.interpreter:
            part_ctx = replace(part_ctx, warmup_ms=TUNING_WARMUP_MS, rep_ms=TUNING_REP_MS)
        try:
            rows, counters = part.run(part_ctx)
        except Exception as exc:  # noqa: BLE001 -- one broken part leaves the others' rows and the report
            tqdm.write(f"part {part.name} failed: {type(exc).__name__}: {exc}")
            exit_code = 1
            continue
        _merge(out_dir / ROWS_CSV, frame(rows), part.question)
        if counters or part.needs_gpu_counters:
            _merge(out_dir / COUNTERS_CSV, pd.DataFrame(counters), part.question)
        write_report(out_dir)
    tqdm.write(f"reviewers' report: {write_report(out_dir)}")
    return exit_code


DECODE_QUESTION = "decode-fa1-cudagraph-compilers"
# The decode suite's shapes the question is read at, and the providers that answer it: FA1 (the
# ladder's rung 0), our split-KV kernel and without splits, PyTorch eager (CUDA-graph replay, as
# every decode row is timed) and under torch.compile, SDPA's math and fused backends
DECODE_SHAPES = ((1, 65536), (8, 8192), (32, 4096))
DECODE_PROVIDERS = ("fa1-rung0", "ours-splitkv", "ours-nosplit", "pytorch", "torch-compile", "sdpa-math",
                    "sdpa-flash", "sdpa-cudnn")


def import_decode_rows(decode_csv: Path, out_dir: Path) -> Path:
    """The decode suite's rows that answer the question of FA1 in decoding, CUDA graphs and
    compilers (MHA caches, where FA1 runs), as reviewers.csv rows of that question."""
    decode = pd.read_csv(decode_csv)
    shapes = pd.Series(list(zip(decode["batch"], decode["cache_len"]))).isin(DECODE_SHAPES).to_numpy()
    chosen = decode[shapes & (decode["kv_heads"] == decode["heads"]) & decode["provider"].isin(DECODE_PROVIDERS)
                    & (decode["layout"] == "contiguous")]
    rows = pd.DataFrame({
        "question": DECODE_QUESTION, "variant": chosen["provider"], "label": chosen["label"],
        "setting": [f"{b} x {n // 1024}k" for b, n in zip(chosen["batch"], chosen["cache_len"])],
        "mode": "decode", "causal": False, "hdim": chosen["hdim"], "seqlen": chosen["cache_len"],
        "batch": chosen["batch"], "heads": chosen["heads"], "dtype": chosen["dtype"], "repeat": 0,
        "status": chosen["status"], "reason": chosen["reason"].fillna(""), "ms": chosen["ms"],
        "ms_p20": chosen["ms_p20"], "ms_p80": chosen["ms_p80"], "gbps": chosen["gbps"],
        "config": "timed by " + chosen["timing"].astype(str), "interpreter": chosen["interpreter"],
        **{column: chosen[column] for column in ("gpu", "driver", "cuda", "torch", "triton", "git_commit",
                                                 "timestamp")},
    })
    _merge(out_dir / ROWS_CSV, rows, DECODE_QUESTION)
    return write_report(out_dir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ablations.reviewers", description=__doc__.split("\n\n")[0])
    parser.add_argument("part", nargs="?", default="all", help="a part (default: all): " + ", ".join(part_names()))
    parser.add_argument("--out", type=Path, required=True, help="folder for the rows and reviewers.md")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--repeats", type=int, default=1, help="measurements per cell (default: 1)")
    parser.add_argument("--no-ncu", dest="ncu", action="store_const", const="off", default="also",
                        help="no Nsight Compute counters (occupancy and smem-vs-sync then show timing only)")
    parser.add_argument("--report-only", action="store_true", help="rebuild reviewers.md from the rows in --out")
    parser.add_argument("--decode-rows", type=Path, metavar="DECODE_CSV",
                        help="add the decode suite's rows (runner.py --suite decode) that answer the question of "
                             "FA1 in decoding, CUDA graphs and compilers, then rebuild reviewers.md")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.part != "all" and args.part not in part_names():
        build_parser().error(f"part must be all or one of {', '.join(part_names())}, got {args.part!r}")
    if args.repeats < 1:
        build_parser().error(f"--repeats must be >= 1, got {args.repeats}")
    if args.decode_rows:
        print(import_decode_rows(args.decode_rows, args.out))
        return 0
    if args.report_only:
        print(write_report(args.out))
        return 0
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports `kernels`
    return run(args.part, args, args.out)


if __name__ == "__main__":
    sys.exit(main())
