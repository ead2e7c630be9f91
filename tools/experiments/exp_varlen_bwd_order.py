"""The order of the varlen dK/dV kernel's programs, on the H200: the grid's own against a
longest-first order.

The Gluon varlen dK/dV kernel (kernels/flash_attn_hopper.py) runs one program per (key block,
sequence x kv head), the grid's rows sequence-major: a packed batch's longest sequence, whose
causal key block 0 has the most query steps, may start last and run alone at the end. A
longest-processing-time order (as FA4's scheduler orders tiles) starts the longest query
sequences first (a device-side sort of the lengths, read by the kernel from a table) and key block
0 of several kv heads together. `flash_attn_hopper.VARLEN_BWD_ORDER` chooses: None (the grid's
order, the production kernel), or (sorted, group).

    python tools/experiments/exp_varlen_bwd_order.py --out DIR      # DIR/varlen_bwd_order.csv

First each order's gradients against the float64 reference (6 random lengths 1-1500 with an empty
sequence, GQA 8/2, head dim 128, bf16, causal and not): within 2x the grid order's error; then
per case `harness.features.measure`'s `do_bench` of the whole backward, rounds interleaved. Rows
in the decisions format, written as they are measured; an order that fails the check is a row
'wrong' and is not timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_varlen_bwd_order.py, bf16, head dim 128, do_bench of the backward"
ORDERS = {"grid order": None, "the table, the grid's order": (False, 1), "longest first": (True, 1),
          "4 kv heads x-major": (False, 4), "longest first, 4 kv heads x-major": (True, 4)}


def set_order(order) -> None:
    from kernels import flash_attn_hopper

    flash_attn_hopper.VARLEN_BWD_ORDER = order


def check(order, device) -> tuple[bool, str]:
    import torch

    import kernels
    from baselines.reference import attention_reference_varlen
    from harness.accuracy import _relative_error as err

    ok, notes = True, []
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 1500, (6,), generator=gen).tolist()
    lengths[2] = 0
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    for causal in (False, True):
        q = torch.randn(sum(lengths), 8, 128, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(sum(lengths), 2, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        grads = {}
        for name, value in (("grid order", None), ("order", order)):
            set_order(value)
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            kernels.flash_attn_varlen_func(*x, cu, cu, max(lengths), max(lengths), causal=causal).backward(do)
            grads[name] = [t.grad for t in x]
        x64 = [t.double().requires_grad_() for t in (q, k, v)]
        ref, _ = attention_reference_varlen(*x64, cu, cu, causal=causal)
        ref.backward(do.double())
        for i, grad in enumerate(("dq", "dk", "dv")):
            got, yardstick = err(grads["order"][i], x64[i].grad), err(grads["grid order"][i], x64[i].grad)
            good = bool(torch.isfinite(grads["order"][i]).all()) and got <= 2 * yardstick + 1e-4
            ok &= good
            notes.append(f"{grad} causal={causal} {got:.2e} (grid order {yardstick:.2e})")
    set_order(None)
    return ok, "; ".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the orders (interleaved)")
    args = parser.parse_args()
    import torch

    from harness.features import Case, measure
    from reports.decisions import DecisionWriter

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    suite = tuple(torch.randint(512, 4097, (8,), generator=gen).tolist())  # the features suite's batch
    wide = tuple(torch.randint(512, 8193, (12,), generator=gen).tolist())
    cases = {"8 seqs 512-4k 16/16h causal": Case("varlen", "varlen", 8, max(suite), 16, 16, lengths=suite),
             "12 seqs 512-8k 32/8h causal": Case("varlen", "varlen", 12, max(wide), 32, 8, lengths=wide),
             "8 seqs 512-4k 16/16h full": Case("varlen", "varlen", 8, max(suite), 16, 16, causal=False,
                                               lengths=suite)}
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / "varlen_bwd_order.csv", TOOL) as writer:
        orders = {}
        for name, order in ORDERS.items():
            ok, notes = (True, "the yardstick") if order is None else check(order, device)
            writer.write(name, "check against float64", "ok" if ok else "wrong", float(ok),
                         tool=f"{TOOL}; {notes}"[:600])
            print(f"{name:36s} {'ok' if ok else 'WRONG'}: {notes}", flush=True)
            if ok:
                orders[name] = order
        for _ in range(args.repeats):
            for column, case in cases.items():
                for name, order in orders.items():
                    set_order(order)
                    row = measure(case, "ours", "bwd", device, torch.bfloat16)
                    writer.write(name, column, "ms", row.get("ms", float("nan")))
                    print(f"{column:30s} {name:36s} {row.get('ms', float('nan')):.3f} ms {row.get('status')}",
                          flush=True)
    set_order(None)


if __name__ == "__main__":
    main()
