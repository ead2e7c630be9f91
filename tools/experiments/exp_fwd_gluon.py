"""Two Hopper forwards written in Gluon (Triton's lower-level language), against Triton 3.6's
`tl.dot` forward, which waits for every wgmma group at once and keeps its warps in lockstep
(docs/performance.md, "Gluon forward with FlashAttention-3's warp layout"):

- one partition (`_gluon_fwd_kernel` below, 8 warps): FA3's Algorithm 2 order in each warpgroup,

      for each key block j:
          issue S_j = Q K_j^T                      (async wgmma)
          issue O += P_{j-1} V_{j-1}                (async wgmma)
          wait until one group is left: S_j is done, P_{j-1} V_{j-1} may still run
          softmax of S_j -> P_j, rescale factor     (runs under the P V matmul)
          wait for P_{j-1} V_{j-1}; O *= rescale
          refill the freed K/V stage (TMA, mbarriers; a CTA-wide barrier first)

- warp-specialised (kernels/flash_attn_hopper.py, written here first and measured at 6cef64c,
  then moved there with new names and comments: the same PTX instructions, one comparison placed
  earlier): a loader warp and two consumer warpgroups of 64 rows running that loop, synchronised
  by mbarriers only.

128-row query blocks, 128-key blocks, host-made 2D descriptors over (batch * seqlen, heads *
head dim). Scope: equal query and key lengths in whole blocks, head dim 64 or 128, causal or not.

    python tools/experiments/exp_fwd_gluon.py --compile-only    # sm_90 compiler report, no GPU
    python tools/experiments/exp_fwd_gluon.py --check bf16      # on the GPU: float64 reference
    python tools/experiments/exp_fwd_gluon.py --time bf16       # on the GPU: TFLOPs/s with peers
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.flash_attn_hopper import _softmax_step  # FA2 Alg. 1 line 9, shared with the production kernel


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, stage, block, kv_row0, col0, n_blocks,
             BLOCK_N: gl.constexpr):
    """TMA loads of key block `block` into ring stage `stage` (none past the last block)."""
    needed = block < n_blocks
    row = kv_row0 + block * BLOCK_N
    mbarrier.expect(k_bar.index(stage), k_desc.block_type.nbytes, pred=needed)
    tma.async_copy_global_to_shared(k_desc, [row, col0], k_bar.index(stage), k_smem.index(stage), pred=needed)
    mbarrier.expect(v_bar.index(stage), v_desc.block_type.nbytes, pred=needed)
    tma.async_copy_global_to_shared(v_desc, [row, col0], v_bar.index(stage), v_smem.index(stage), pred=needed)


@gluon.jit
def _gluon_fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, num_heads, seqlen, qk_scale,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    if CAUSAL:  # longest programs first
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    start_m = pid_m * BLOCK_M
    q_row = b * seqlen + start_m
    kv_row0 = b * seqlen
    col0 = h * HEAD_DIM
    if CAUSAL:
        n_blocks = (start_m + BLOCK_M) // BLOCK_N
    else:
        n_blocks = seqlen // BLOCK_N

    # wgmma layouts: warps split the query rows (each warpgroup owns BLOCK_M / 2 rows)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(stage), count=1)
        mbarrier.init(v_bar.index(stage), count=1)

    # line 4: load Q_i; the first STAGES key blocks
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, col0], q_bar, q_smem)
    for stage in gl.static_range(STAGES):
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, stage, stage, kv_row0, col0, n_blocks, BLOCK_N)

    offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_init = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    # key block 0: S_0 and its softmax
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_init, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, 0, n_blocks, BLOCK_N, CAUSAL)

    for block in range(1, n_blocks):
        slot = block % STAGES
        prev = (block - 1) % STAGES
        # line 8 for block j, then line 10's P V for block j - 1, both in flight
        mbarrier.wait(k_bar.index(slot), (block // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_init, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(prev), ((block - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        # S_j done (one group, P_{j-1} V_{j-1}, may still run): its softmax overlaps that matmul
        s = warpgroup_mma_wait(1, deps=[s_tok])
        p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, block, n_blocks, BLOCK_N, CAUSAL)
        acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])
        acc = acc * gl.convert_layout(alpha, o_row_layout)[:, None]
        # every warp is done with stage `prev`: refill it with block j - 1 + STAGES
        gl.thread_barrier()
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, prev, block - 1 + STAGES, kv_row0, col0,
                 n_blocks, BLOCK_N)

    # line 10 for the last block
    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_bar.index(last), ((n_blocks - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    acc_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])

    # lines 12-15: O = diag(l)^-1 O, L = m + log(l) (natural log, m in log2 units)
    out = acc / gl.convert_layout(l_i, o_row_layout)[:, None]
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + pid_bh.to(gl.int64) * seqlen + offs_m, lse)
    gl.thread_barrier()  # every warpgroup is done reading Q: its buffer stages O
    q_smem.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, col0], q_smem)
    tma.store_wait(pendings=0)
    mbarrier.invalidate(q_bar)
    for stage in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(stage))
        mbarrier.invalidate(v_bar.index(stage))


def gluon_forward_ws(q, k, v, softmax_scale: float, causal: bool, stages: int = 3, poison: bool = False):
    """The warp-specialised kernel: kernels/flash_attn_hopper.py's (written here first and measured
    at 6cef64c, moved there at 91833d5), launched with `stages` K/V stages."""
    from kernels import flash_attn_hopper as hopper

    batch, seqlen, heads, _ = q.shape
    out = torch.full_like(q, float("nan")) if poison else torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen, device=q.device, dtype=torch.float32)
    hopper.flash_attn_forward_hopper(q, k, v, out, lse, softmax_scale, causal, stages)
    return out, lse


BLOCK_M = BLOCK_N = 128


def gluon_forward(q, k, v, softmax_scale: float, causal: bool, stages: int = 2, poison: bool = False):
    """The one-partition kernel, on the production module's 2D descriptors (_row_descriptor)."""
    from kernels import flash_attn_hopper as hopper

    batch, seqlen, heads, d = q.shape
    out = torch.full_like(q, float("nan")) if poison else torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen, device=q.device, dtype=torch.float32)
    grid = (seqlen // BLOCK_M, batch * heads)
    _gluon_fwd_kernel[grid](hopper._row_descriptor(q, BLOCK_M), hopper._row_descriptor(k, BLOCK_N),
                            hopper._row_descriptor(v, BLOCK_N), hopper._row_descriptor(out, BLOCK_M), lse,
                            heads, seqlen, softmax_scale * hopper.LOG2E, HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                            STAGES=stages, CAUSAL=causal, num_warps=8)
    return out, lse


def _ptxas_report(compiled, name: str) -> str:
    import subprocess

    from compile_check_sm90 import PTXAS

    ptx = compiled.asm["ptx"]
    path = Path(f"/tmp/{name}.ptx")
    path.write_text(ptx)
    ptxas = subprocess.run([str(PTXAS), "-v", "-arch=sm_90a", str(path), "-o", os.devnull],
                           capture_output=True, text=True, check=True)
    registers = re.search(r"Used (\d+) registers", ptxas.stderr)
    spills = re.search(r"(\d+) bytes spill stores", ptxas.stderr)
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)
    # the innermost key loop: the shortest label..branch-back body that issues wgmma
    bodies = []
    for label in re.finditer(r"^(\$L__BB\d+_\d+):", ptx, flags=re.MULTILINE):
        back = re.compile(r"bra(?:\.uni)?\s+" + re.escape(label.group(1)) + ";").search(ptx, label.end())
        if back and "wgmma.commit_group" in ptx[label.end():back.start()]:
            bodies.append(ptx[label.end():back.start()])
    loop = min(bodies, key=len) if bodies else ""
    cta_barriers = len(re.findall(r"bar\.sync\s+0;", loop))
    group_barriers = len(re.findall(r"bar\.sync\s+\d+,\s*128;", loop))
    setmaxnreg = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx)})
    return (f"smem {compiled.metadata.shared} B, regs {registers.group(1) if registers else '?'}, spill stores "
            f"{spills.group(1) if spills else '?'} B, wgmma waits in order {' '.join(waits)}"
            + (f", setmaxnreg {setmaxnreg}" if setmaxnreg else "")
            + f"; key loop: {cta_barriers} CTA-wide barriers, {group_barriers} warpgroup barriers")


def compile_report() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT / "tools"))
    from compile_check_sm90 import TARGET, gluon_descriptor_type
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels import flash_attn_hopper

    def desc(rows, d):
        return gluon_descriptor_type(rows, d)

    print(f"sm_90, Gluon forwards, 128x128 blocks; triton {triton.__version__}")
    for d in (128, 64):
        for stages in (2, 3):
            for causal in (False, True):
                scalars = {"LSE": "*fp32", "num_heads": "i32", "seqlen": "i32", "qk_scale": "fp32"}
                one = {"q_desc": desc(128, d), "k_desc": desc(128, d), "v_desc": desc(128, d), "o_desc": desc(128, d),
                       **scalars, "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                       "STAGES": "constexpr", "CAUSAL": "constexpr", "num_warps": "constexpr"}
                ws = {"q_desc": desc(64, d), "k_desc": desc(128, d), "v_desc": desc(128, d), "o_desc": desc(64, d),
                      **scalars, "STAGES": "constexpr", "CAUSAL": "constexpr"}
                variants = (
                    ("one-partition", _gluon_fwd_kernel, one,
                     {"HEAD_DIM": d, "BLOCK_M": 128, "BLOCK_N": 128, "STAGES": stages, "CAUSAL": causal, "num_warps": 8},
                     {"num_warps": 8}),
                    ("warp-specialised", flash_attn_hopper._flash_fwd_hopper_kernel, ws,
                     {"STAGES": stages, "CAUSAL": causal}, {"num_warps": 4, "maxnreg": 168}),
                )
                for name, kernel, signature, constexprs, options in variants:
                    label = f"{name:16s} d{d} stages {stages} causal {causal!s:5s}"
                    try:
                        compiled = triton.compile(GluonASTSource(kernel, signature, constexprs), target=TARGET,
                                                  options=options)
                    except Exception as exc:  # noqa: BLE001 -- a compiler failure is the answer for this variant
                        print(f"{label}: does not compile: {str(exc)[-400:]}")
                        continue
                    print(f"{label}: {_ptxas_report(compiled, f'gluon_{name}_d{d}_s{stages}_{int(causal)}')}")


def check(dtype_name: str, variants: tuple[str, ...] = ("ws", "one")) -> None:
    """Gluon forwards against the float64 reference (NaN-poisoned output, fresh random inputs)."""
    from baselines.reference import attention_reference

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    for name, forward in (("ws", gluon_forward_ws), ("one", gluon_forward)):
        if name not in variants:
            continue
        for d in (128, 64):
            for stages in (2, 3):
                for causal in (False, True):
                    torch.manual_seed(d + stages + causal)
                    q, k, v = (torch.randn(2, 1024, 3, d, device="cuda", dtype=dtype) for _ in range(3))
                    scale = d ** -0.5
                    out, lse = forward(q, k, v, scale, causal, stages, poison=True)
                    ref, ref_lse = attention_reference(q, k, v, scale, causal)
                    err = ((out.double() - ref).norm() / ref.norm()).item()
                    lse_err = (lse.double() - ref_lse).abs().max().item()
                    ok = not torch.isnan(out).any().item() and err < 2e-2 and lse_err < 1e-3
                    print(f"check {name} {dtype_name} d{d} stages {stages} causal {causal!s:5s}: rel err {err:.2e}, "
                          f"lse max err {lse_err:.1e}, NaN rows {int(torch.isnan(out).any(-1).sum())} -> "
                          f"{'ok' if ok else 'WRONG'}", flush=True)


def load_previous_forward(path: Path):
    """A previous version of kernels/flash_attn_hopper.py (e.g. `git show fd7e67e:kernels/flash_attn_hopper.py
    > previous_flash_attn_hopper.py`), called through its own launcher
    (`flash_attn_forward_hopper`, at its own STAGES), for a same-run A/B. It is imported
    from the file, so its kernel compiles as it was then."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("previous_flash_attn_hopper", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def forward(q, k, v, softmax_scale, causal):
        batch, seqlen, heads, _ = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, seqlen, device=q.device, dtype=torch.float32)
        module.flash_attn_forward_hopper(q, k, v, out, lse, softmax_scale, causal)
        return out, lse

    return forward


def time_all(dtype_name: str, out_csv: Path, previous: Path | None = None,
             shapes: tuple[tuple[int, tuple[int, ...]], ...] = ((128, (1024, 2048, 4096, 8192, 16384)),
                                                               (64, (4096, 16384)))) -> None:
    """TFLOPs/s of the Gluon forwards (warp-specialised at 2 and 3 stages, one partition at 3),
    the production forward (`fa2`: the Gluon kernel where the table takes it), the Triton
    forward (`fa2-triton`: the table's config with the Gluon kernel switched off), SDPA flash and
    SDPA cuDNN, same process, paper shapes (hidden 2048, batch = 16384 / seqlen) for each
    (head dim, seqlens) of `shapes`."""
    from dataclasses import replace

    import pandas as pd

    from baselines.flops import attention_flops, tflops_per_second
    from baselines.providers import get_provider
    from harness.timing import benchmark
    from kernels.configs import default_fwd_config
    from kernels.forward import flash_attn_forward

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    device = torch.device("cuda")
    rows = []
    previous_forward = load_previous_forward(previous) if previous else None
    for d, seqlens in shapes:
        for seqlen in seqlens:
            batch, heads = 16384 // seqlen, 2048 // d
            q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype) for _ in range(3))
            scale = d ** -0.5
            for causal in (False, True):
                calls = {
                    **({"gluon-ws-previous": partial(previous_forward, q, k, v, scale, causal)} if previous else {}),
                    "gluon-ws-s2": partial(gluon_forward_ws, q, k, v, scale, causal, 2),
                    "gluon-ws-s3": partial(gluon_forward_ws, q, k, v, scale, causal, 3),
                    "gluon-s3": partial(gluon_forward, q, k, v, scale, causal, 3),
                    "fa2": partial(flash_attn_forward, q, k, v, scale, causal),
                    "fa2-triton": partial(flash_attn_forward, q, k, v, scale, causal,
                                          replace(default_fwd_config(d, causal, device), hopper_gluon_min_keys=0)),
                    "sdpa-flash": partial(get_provider("sdpa-flash").forward, q, k, v, causal, scale),
                    "sdpa-cudnn": partial(get_provider("sdpa-cudnn").forward, q, k, v, causal, scale),
                }
                flops = attention_flops(batch, heads, seqlen, seqlen, d, causal, "fwd")
                for name, fn in calls.items():
                    ms = benchmark(fn, device).ms
                    rows.append({"provider": name, "mode": "fwd", "dtype": dtype_name, "hdim": d, "seqlen": seqlen,
                                 "causal": causal, "ms": ms, "tflops": tflops_per_second(flops, ms),
                                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                 "triton": triton.__version__, "git_commit": os.environ.get("GIT_COMMIT", "")})
                    pd.DataFrame(rows).to_csv(out_csv, index=False)
                line = {r["provider"]: r["tflops"] for r in rows[-len(calls):]}
                print(f"{dtype_name} d{d} s{seqlen:<5d} causal={causal!s:5s} " + "  ".join(
                    f"{n} {t:5.0f}" for n, t in line.items()) + "  /cudnn: " + "  ".join(
                    f"{n} {line[n] / line['sdpa-cudnn']:.3f}" for n in line if n.startswith(("gluon", "fa2"))),
                    flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--check", choices=["bf16", "fp16"], help="correctness only, this dtype")
    parser.add_argument("--time", choices=["bf16", "fp16"], help="timing only, this dtype")
    parser.add_argument("--variants", nargs="+", choices=["ws", "one"], default=["ws", "one"],
                        help="which Gluon forwards --check runs")
    parser.add_argument("--previous", type=Path, metavar="PY",
                        help="with --time: also time this earlier copy of kernels/flash_attn_hopper.py "
                             "(as gluon-ws-previous, through its own launcher)")
    parser.add_argument("--hdims", type=int, nargs="+", choices=[64, 128], default=[128, 64],
                        help="with --time: head dims (default: 128 at 1k-16k, 64 at 4k and 16k)")
    parser.add_argument("--seqlens", type=int, nargs="+", help="with --time: these seqlens at every head dim")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")),
                        help="folder for the rows (default: $OUT, else the current folder)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compile_only:
        compile_report()
    elif args.check:
        check(args.check, tuple(args.variants))
    elif args.time:
        default_seqlens = {128: (1024, 2048, 4096, 8192, 16384), 64: (4096, 16384)}
        shapes = tuple((d, tuple(args.seqlens) if args.seqlens else default_seqlens[d]) for d in args.hdims)
        time_all(args.time, args.out / f"exp_fwd_gluon_{args.time}.csv", args.previous, shapes)
    else:
        parser.error("give --compile-only, --check DTYPE or --time DTYPE")


if __name__ == "__main__":
    main()
