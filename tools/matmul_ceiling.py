"""The floor of docs/performance.md: the GPU's bf16 matmul rate, one 8192^3 matmul timed by
`triton.testing.do_bench` (median, 25 ms warm-up, 200 ms of calls). Attention at the paper's
sizes is matmul-bound, so no attention kernel runs faster than its matmul FLOPs at this rate.

    python tools/matmul_ceiling.py --out reports/h200
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton.testing

SIZE = 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for matmul_ceiling.txt (default: .)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("matmul_ceiling.py needs a CUDA GPU: the rate is the GPU's")
    a, b = (torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    line = (f"bf16 {SIZE}^3 matmul: {ms:.4f} ms, {2 * SIZE**3 / ms / 1e9:.1f} TFLOP/s, "
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "matmul_ceiling.txt").write_text(line + "\n")


if __name__ == "__main__":
    main()
