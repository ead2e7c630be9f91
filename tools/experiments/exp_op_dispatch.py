"""What calling an op costs the host, by how it is registered: `torch.library.custom_op` against
torch.library's schema API (`Library.define` + `impl` + `register_fake` + `register_autograd`,
how kernels/ops.py registers `fa2::fwd` and `fa2::bwd`), on the CPU alone (no GPU needed).

Two pairs of stand-in ops with fa2::fwd's and fa2::bwd's schemas whose bodies only allocate their
outputs (torch.empty_like: next to nothing, and no output aliases an input), registered each way
with the same fake and autograd functions. Per registration, microseconds per op call:

- 'eager, no autograd': `torch.ops.<ns>.fwd.default(...)` under torch.no_grad;
- 'eager, autograd': the same with an input that requires grad (the autograd layer's forward);
- 'compiled forward': `torch.compile(fullgraph=True)` of ten chained forward calls, under
  torch.no_grad, per op call;
- 'compiled forward + backward': the same with `.backward()`, per forward-and-backward op pair.

Each kind is timed in interleaved rounds (median). Rows in the decisions format (row: the
registration, column: the call kind, unit us), written as they are measured.

    python tools/experiments/exp_op_dispatch.py --out DIR      # DIR/op_dispatch.csv
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_op_dispatch.py, CPU only, stand-in ops with fa2::fwd's and fa2::bwd's schemas"
CHAIN = 10  # op calls per compiled call


def register(namespace: str, how: str):
    """The stand-in fwd/bwd pair in `namespace`, registered `how` ('custom_op' or 'schema'); returns
    what keeps the registrations alive."""
    import torch

    import kernels.ops  # noqa: F401 -- registers fa2::fwd and fa2::bwd, whose schemas the stand-ins copy

    def fwd_body(q, *args):
        return torch.empty_like(q), torch.empty_like(q)

    def bwd_body(dout, q, k, v, *args):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    fwd_fake, bwd_fake = fwd_body, bwd_body  # they allocate, as fakes do

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:3], *output)
        ctx.mark_non_differentiable(output[1])

    def backward(ctx, dout, _):
        q, k, v, out, lse = ctx.saved_tensors
        grads = getattr(torch.ops, namespace).bwd(dout, q, k, v, out, lse, None, None, 0, 0, 1.0, True, -1, -1, 0.0,
                                                  None, 0.0, None, False, "")
        return (*grads, *(None,) * 15)

    fwd_schema = torch.ops.fa2.fwd.default._schema
    bwd_schema = torch.ops.fa2.bwd.default._schema
    if how == "custom_op":  # the schema without its name: "(Tensor q, ...) -> (Tensor, Tensor)"
        fwd = torch.library.custom_op(f"{namespace}::fwd", mutates_args=(),
                                      schema="(" + str(fwd_schema).split("(", 1)[1])(fwd_body)
        bwd = torch.library.custom_op(f"{namespace}::bwd", mutates_args=(),
                                      schema="(" + str(bwd_schema).split("(", 1)[1])(bwd_body)
        fwd.register_fake(fwd_fake)
        bwd.register_fake(bwd_fake)
        fwd.register_autograd(backward, setup_context=setup_context)
        keep = (fwd, bwd)
    else:
        lib = torch.library.Library(namespace, "DEF")
        for schema, body, fake in ((fwd_schema, fwd_body, fwd_fake), (bwd_schema, bwd_body, bwd_fake)):
            lib.define(str(schema).split("::", 1)[1])
            name = schema.name.split("::", 1)[1]
            for key in ("CPU", "CUDA"):
                lib.impl(name, body, key)
            torch.library.register_fake(f"{namespace}::{name}", fake, lib=lib)
        torch.library.register_autograd(f"{namespace}::fwd", backward, setup_context=setup_context, lib=lib)
        keep = (lib,)
    return keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    import torch

    from reports.decisions import DecisionWriter

    registrations = {"torch.library.custom_op": "custom_op", "torch.library schema API (kernels/ops.py)": "schema"}
    q = torch.randn(1, 8, 2, 16)
    leaf = q.clone().requires_grad_()
    gradient = torch.ones_like(q)
    calls = {}
    keep = []
    for i, (label, how) in enumerate(registrations.items()):
        namespace = f"op_dispatch_{i}"
        keep.append(register(namespace, how))
        op = getattr(torch.ops, namespace).fwd.default

        def one(x, op=op):
            return op(x, x, x, None, None, 0, 0, 1.0, True, -1, -1, 0.0, None, 0.0, None, False, "", "")[0]

        def chain(x, one=one):
            for _ in range(CHAIN):
                x = one(x)
            return x

        compiled = torch.compile(chain, fullgraph=True)

        def no_grad(call):
            def run():
                with torch.no_grad():
                    call()
            return run

        calls[label] = {
            "eager, no autograd": (no_grad(lambda one=one: one(q)), 1),
            "eager, autograd": (lambda one=one: one(leaf), 1),
            "compiled forward": (no_grad(lambda compiled=compiled: compiled(leaf)), CHAIN),
            "compiled forward + backward": (lambda compiled=compiled: compiled(leaf).backward(gradient), CHAIN),
        }
    times = {(label, kind): [] for label in calls for kind in calls[label]}
    for call in (c for kinds in calls.values() for c, _ in kinds.values()):
        for _ in range(20):  # compile and warm up
            call()
    for _ in range(args.rounds):
        for label, kinds in calls.items():
            for kind, (call, per) in kinds.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times[(label, kind)].append((time.perf_counter() - start) / args.calls / per * 1e6)
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / "op_dispatch.csv", TOOL) as writer:
        for (label, kind), values in times.items():
            writer.write(label, kind, "us", statistics.median(values))
            print(f"{label:44s} {kind:30s} {statistics.median(values):8.2f} us", flush=True)


if __name__ == "__main__":
    main()
