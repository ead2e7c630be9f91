"""Host time per compiled call: fa2::fwd's registered autograd against an autograd.Function over
fa2::_fwd (kernels/ops.py's _TracedAttention), in one process, taking turns with SDPA flash.

Each variant is `torch.compile(fullgraph=True)` of one causal bf16 attention call:

- 'fa2::fwd, autograd registered': the op called directly, as the public functions' traced path
  did before: the compiled graph calls fa2::fwd, whose Python autograd kernel (register_autograd's)
  runs in front of the implementation at every call, grad mode off or not;
- 'autograd.Function over fa2::_fwd': `kernels.flash_attn_func`, whose traced path is now
  _TracedAttention: Dynamo traces the Function, the graph calls fa2::_fwd (no autograd kernel) and,
  in the backward, fa2::bwd;
- 'SDPA flash': F.scaled_dot_product_attention on its FLASH_ATTENTION backend.

Both of ours run the same implementation and kernels (before timing, the outputs, dK and dV are
compared bit for bit, dQ within the reordering of the fused dQ's atomic adds). Calls are harness/host_overhead.py's ('fwd': no autograd graph;
'fwd_bwd': forward and backward, on PyTorch's default engine thread), timed by its
interleaved_host_ms (`--calls` calls behind one GPU sleep per turn). Rows (decision format,
microseconds per call, one per variant, cell and round) go to OUT/traced_autograd.csv as they
are measured.

    python tools/experiments/exp_traced_autograd.py --out reports/h200/decisions
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's packages, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_host_launch_paths import host_experiment

from harness.host_overhead import attention_fn, call_fn, interleaved_host_ms

# (batch, heads, seqlen, hdim): the host table's shapes whose compiled calls the host bounds (at
# 8 x 16 x 2048 x 128 the kernels outlast the harness's GPU sleep, and the turns time the GPU)
SHAPES = ((1, 16, 1024, 128), (1, 32, 512, 64), (4, 8, 1024, 64))
MODES = ("fwd", "fwd_bwd")
OP = "fa2::fwd, autograd registered"
FUNCTION = "autograd.Function over fa2::_fwd"
SDPA = "SDPA flash"


def op_call(q, k, v):
    """fa2::fwd called as the traced path called it (causal, the default scale and configs)."""
    return torch.ops.fa2.fwd(q, k, v, None, None, 0, 0, q.shape[-1] ** -0.5, True, -1, -1, 0.0, None, 0.0, None,
                             False, "", "")[0]


def check_identical(variants: dict, q, k, v, dout) -> None:
    """Each of ours compiled gives the same output, dK and dV bit for bit, and dQ within the
    reordering of the fused dQ's atomic adds."""
    results = []
    for name in (OP, FUNCTION):
        q.grad = k.grad = v.grad = None
        out = variants[name](q, k, v)
        out.backward(dout)
        results.append((out, q.grad, k.grad, v.grad))
    q.grad = k.grad = v.grad = None
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 if name == "dq" else 0, msg=f"{OP!r} and {FUNCTION!r}: {name}")


def main() -> None:
    args, record = host_experiment(__doc__, "traced_autograd.csv",
                                   "tools/experiments/exp_traced_autograd.py, torch.compile(fullgraph=True), causal bf16")
    from tqdm import tqdm

    for batch, heads, seqlen, hdim in tqdm(SHAPES, desc="shapes"):
        torch._dynamo.reset()  # one shape's compilations at a time (Dynamo's recompile limit)
        q, k, v = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        variants = {OP: torch.compile(op_call, fullgraph=True),
                    FUNCTION: torch.compile(attention_fn("fa2", True), fullgraph=True),
                    SDPA: torch.compile(attention_fn("sdpa-flash", True), fullgraph=True)}
        check_identical(variants, q, k, v, dout)
        turns = {(f"{mode.replace('_', '+')} {batch}x{heads}x{seqlen}x{hdim}", name): call_fn(fn, mode, q, k, v, dout)
                 for mode in MODES for name, fn in variants.items()}

        interleaved_host_ms(turns, args.calls, args.rounds, after_turn=record)


if __name__ == "__main__":
    main()
