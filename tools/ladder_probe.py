"""Probe the ablation ladder (kernels/fa_ladder.py) on a GPU: is each rung right, does its
generated code do what its name says, and how fast is it in the paper's two settings.

    PYTHONUNBUFFERED=1 python3 tools/ladder_probe.py --out probe 2>&1 | tee probe.log
    python3 tools/ladder_probe.py --compile-only   # no GPU needed: compile for sm_90, print code facts

Sections, in this order (each row is written to the `--out` folder as soon as it exists):
1. code facts per rung (probe_code.csv): the mma layouts of the compiled kernel's TTGIR
   (versionMajor 2 = mma.sync, 3 = wgmma; warpsPerCTA [1, W] = warps split the keys,
   [W, 1] = the query rows), shared-memory allocations in TTGIR, registers, spills, and
   instruction counts in the SASS (static counts in the binary, not executed counts: those
   come from Nsight Compute, `runner.py --ablation all --ncu`). `--compile-only` compiles the same launches for sm_90 on a
   machine without a GPU (registers and spills then come from `cuobjdump -res-usage`).
2. timings (probe_timings.csv): settings A (batch 8) and B (batch 1), fp16, causal, head dim
   128, seqlen 2048, 16 heads, `triton.testing.do_bench` median and p20/p80, rungs 0-4 next to
   SDPA's FLASH_ATTENTION (the FA2 CUDA kernel) and cuDNN backends, in interleaved rounds;
   then alternative tiles per rung, timed once, to justify the table in kernels/fa_ladder.py.
3. correctness (probe_correctness.csv): each rung against the float64 reference in bf16 and
   fp16, causal and not, ragged lengths, head dims 32-256: the error must be at most twice
   PyTorch's same-dtype error (plus a small epsilon) and the logsumexp must agree.
4. launch overhead (probe_overhead.csv), setting B, whose kernels are the shortest: the host
   time of one call (enqueued behind a sleeping GPU, so it is host time alone), do_bench's
   median, and do_bench_cudagraph's (CUDA graph replay: no host launch cost), for each rung
   through `Rung.forward` (what the runner times) and through a prepared launch.
A short table is printed last.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ablations.ladder import RUNGS
from baselines.flops import attention_flops, tflops_per_second
from baselines.reference import attention_reference, attention_same_dtype
from kernels import fa_ladder
from kernels.configs import default_fwd_config
from kernels.fa_ladder import (
    LADDER,
    FwdConfig,
    ladder_block_d,
    logsumexp_from_stats,
    plan_ladder_forward,
    warp_split,
)
from kernels.forward import _flash_fwd_kernel, flash_attn_forward

SETTINGS = {"A": 8, "B": 1}  # batch; 16 heads, head dim 128, seqlen 2048, fp16, causal, forward
HEADS, HDIM, SEQLEN = 16, 128, 2048
ROUNDS = 3
# Alternative tiles timed once per setting (the defaults are in fa_ladder.HOPPER_LADDER_CONFIGS).
CANDIDATES = {
    0: [FwdConfig(64, 128, 8, 2), FwdConfig(64, 128, 4, 2), FwdConfig(32, 128, 4, 1)],
    1: [FwdConfig(64, 128, 8, 1), FwdConfig(64, 128, 4, 2), FwdConfig(32, 128, 4, 1)],
    2: [FwdConfig(64, 128, 8, 2), FwdConfig(64, 128, 4, 1), FwdConfig(32, 128, 4, 2)],
    3: [FwdConfig(128, 64, 8, 2), FwdConfig(128, 64, 4, 3), FwdConfig(128, 32, 4, 2)],
}
# (dtype, causal, head dim, seqlen_q, seqlen_k): bf16 and fp16, ragged, both length orders
CHECKS = [
    (torch.bfloat16, True, 128, 1000, 1000), (torch.float16, False, 128, 1000, 1000),
    (torch.float16, True, 64, 1000, 1537), (torch.bfloat16, False, 64, 1000, 1000),
    (torch.float16, True, 128, 1537, 1000), (torch.float16, True, 256, 1000, 1000),
    (torch.bfloat16, False, 256, 777, 1000), (torch.float16, True, 32, 1000, 1000),
    (torch.bfloat16, True, 96, 800, 1200),
]
ABS_EPS = {torch.float16: 1e-3, torch.bfloat16: 4e-3}
SASS_OPS = ("HMMA", "HGMMA", "MUFU.EX2", "FFMA", "FMUL", "FADD", "BAR", "STS", "LDS", "LDSM",
            "LDGSTS", "STL", "LDL", "SHFL")
OUT = Path(os.environ.get("OUT", "."))


# --------------------------------------------------------------------------------------
# Code facts
# --------------------------------------------------------------------------------------
def sass_counts(cubin: bytes) -> dict[str, int]:
    """Static count of each SASS opcode family in SASS_OPS (MUFU.EX2 apart from other MUFU)."""
    from triton.tools.disasm import get_sass

    counts = collections.Counter()
    for line in get_sass(cubin).splitlines():
        match = re.match(r"^\S*\t(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if not match:
            continue
        opcode = match.group(1)
        family = "MUFU.EX2" if opcode.startswith("MUFU.EX2") else opcode.split(".")[0]
        if family in SASS_OPS:
            counts[family] += 1
    return {f"sass_{op}": counts.get(op, 0) for op in SASS_OPS}


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local bytes per thread) from `cuobjdump -res-usage` (used without a GPU)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", text).group(1))
    stack = int(re.search(r"STACK:(\d+)", text).group(1))
    return regs, stack


def code_facts(compiled) -> dict:
    ttgir = compiled.asm["ttgir"]
    layouts = sorted(set(re.findall(r"#ttg\.nvidia_mma<\{versionMajor = (\d+), versionMinor = \d+, "
                                    r"warpsPerCTA = \[([\d, ]+)\]", ttgir)))
    facts = {
        "mma": "; ".join(f"v{major} [{warps}]" for major, warps in layouts),
        "ttgir_local_alloc": ttgir.count("ttg.local_alloc"),
        "ttgir_convert_layout": ttgir.count("ttg.convert_layout"),
        "shared_bytes": compiled.metadata.shared,
    }
    if torch.cuda.is_available():
        facts["regs"], facts["spills"] = compiled.n_regs, compiled.n_spills
    else:
        facts["regs"], stack = resource_usage(compiled.asm["cubin"])
        facts["spills"] = stack // 4  # as triton's n_spills: local bytes / 4
    facts.update(sass_counts(compiled.asm["cubin"]))
    return facts


def compile_for_sm90(launch):
    """Compile a rung's launch for sm_90 without a GPU, specialised as the runtime would
    (pointers and multiples of 16 marked divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = launch.kernel
    values = dict(zip(kernel.arg_names, launch.args)) | launch.meta
    pointer_types = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = pointer_types[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int):
            signature[param.name] = "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32"
    with fa_ladder._mma_sync_only():
        return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": launch.meta["num_warps"],
                                       "num_stages": launch.meta["num_stages"]})


def cfg_text(cfg) -> str:
    return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}" if cfg else ""


def make_qkv(batch, seqlen_q, seqlen_k, heads, hdim, dtype, device):
    """Fresh random inputs, flash-attn layout (batch, seqlen, heads, headdim)."""
    return (torch.randn(batch, seqlen_q, heads, hdim, dtype=dtype, device=device),
            torch.randn(batch, seqlen_k, heads, hdim, dtype=dtype, device=device),
            torch.randn(batch, seqlen_k, heads, hdim, dtype=dtype, device=device))


def compile_only() -> None:
    """Section 1 without a GPU, for every rung and head dim the tables name."""
    # check_attention_inputs takes CPU tensors only under the interpreter; the kernels were
    # decorated at import, before this, so they stay compilable JIT functions.
    os.environ["TRITON_INTERPRET"] = "1"
    rows = []
    for hdim in (64, 128, 256):
        q, k, v = make_qkv(1, SEQLEN, SEQLEN, HEADS, hdim, torch.float16, "cpu")
        for rung in range(len(LADDER)):
            for cfg in [fa_ladder.HOPPER_LADDER_CONFIGS.get((rung, ladder_block_d(hdim)))] + (
                    CANDIDATES[rung] if hdim == HDIM else []):
                if cfg is None:
                    continue
                _, _, launch = plan_ladder_forward(q, k, v, None, True, rung=rung, config=cfg)
                start = time.time()
                facts = code_facts(compile_for_sm90(launch))
                rows.append(dict(rung=rung, hdim=hdim, config=cfg_text(cfg),
                                 rule=warp_split(cfg.block_m, ladder_block_d(hdim)),
                                 compile_s=round(time.time() - start, 1), **facts))
                print(pd.DataFrame(rows[-1:]).to_string(index=False, header=len(rows) == 1), flush=True)
    pd.DataFrame(rows).to_csv(OUT / "probe_code_sm90_cpu.csv", index=False)


# --------------------------------------------------------------------------------------
# GPU sections
# --------------------------------------------------------------------------------------
def bench(fn) -> tuple[float, float, float]:
    """(p20, median, p80) in ms."""
    import triton.testing

    p20, p50, p80 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.2, 0.5, 0.8])
    return p20, p50, p80


def providers(q, k, v):
    """{name: (fn, compiled-kernel getter or None)} for the timed providers."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    scale = q.shape[-1] ** -0.5
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views for SDPA
    table = {}
    for rung in range(len(LADDER)):
        launch = plan_ladder_forward(q, k, v, scale, True, rung=rung)[2]
        table[f"rung{rung}"] = (launch.run, launch.run)
    table["rung4"] = (lambda: rung4_forward(q, k, v, scale, True), None)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return run

    table["sdpa-flash"] = (sdpa(SDPBackend.FLASH_ATTENTION), None)
    table["sdpa-cudnn"] = (sdpa(SDPBackend.CUDNN_ATTENTION), None)
    return table


def rung4_forward(q, k, v, scale, causal):
    """Rung 4 as the ablation runs it (ablations.ladder): the Triton kernel with the Hopper table,
    off the Gluon forward that the table takes at head dim 128 from 1k keys."""
    from dataclasses import replace

    config = replace(default_fwd_config(q.shape[3], causal, q.device), hopper_gluon_min_keys=0)
    return flash_attn_forward(q, k, v, scale, causal, config)


def latest_compiled(jit_fn):
    """The compiled kernel a JIT function launched last (for rung 4, whose launcher does not
    return it)."""
    caches = jit_fn.device_caches[torch.cuda.current_device()][0]
    return list(caches.values())[-1]


def timing_section(timings: list, code: list, deadline: float) -> None:
    for round_index in range(ROUNDS):
        for setting, batch in SETTINGS.items():
            torch.manual_seed(round_index)
            q, k, v = make_qkv(batch, SEQLEN, SEQLEN, HEADS, HDIM, torch.float16, "cuda")
            flops = attention_flops(batch, HEADS, SEQLEN, SEQLEN, HDIM, True, "fwd")
            for name, (fn, get_compiled) in providers(q, k, v).items():
                try:
                    p20, ms, p80 = bench(fn)
                    row = {"setting": setting, "provider": name, "round": round_index, "status": "ok", "ms": ms,
                           "ms_p20": p20, "ms_p80": p80, "tflops": tflops_per_second(flops, ms)}
                except Exception as exc:  # noqa: BLE001 -- a provider that fails is a row with its reason
                    row = {"setting": setting, "provider": name, "round": round_index,
                           "status": f"error: {type(exc).__name__}: {exc}"[:300]}
                timings.append(row)
                if round_index == 0 and setting == "A":
                    compiled = get_compiled() if get_compiled else (
                        latest_compiled(_flash_fwd_kernel) if name == "rung4" else None)
                    if compiled is not None:
                        code.append(dict(provider=name, hdim=HDIM, config=cfg_text(_config_of(name)),
                                         **code_facts(compiled)))
                        save(code, "probe_code.csv")
            save(timings, "probe_timings.csv")
            if time.time() > deadline:
                print(f"time budget reached after round {round_index}", flush=True)
                return


def _config_of(name: str):
    if name.startswith("rung") and int(name[4:]) < len(LADDER):
        return fa_ladder.default_ladder_config(int(name[4:]), HDIM, torch.device("cuda"))
    return None


def candidates_section(timings: list, code: list, deadline: float) -> None:
    for setting, batch in SETTINGS.items():
        q, k, v = make_qkv(batch, SEQLEN, SEQLEN, HEADS, HDIM, torch.float16, "cuda")
        flops = attention_flops(batch, HEADS, SEQLEN, SEQLEN, HDIM, True, "fwd")
        for rung, configs in CANDIDATES.items():
            for cfg in configs:
                if time.time() > deadline:
                    print("time budget reached in the candidates", flush=True)
                    return
                name = f"rung{rung} {cfg_text(cfg)}"
                try:
                    launch = plan_ladder_forward(q, k, v, None, True, rung=rung, config=cfg)[2]
                    compiled = launch.run()
                    p20, ms, p80 = bench(launch.run)
                    timings.append({"setting": setting, "provider": name, "round": 0, "status": "ok", "ms": ms,
                                    "ms_p20": p20, "ms_p80": p80, "tflops": tflops_per_second(flops, ms)})
                    if setting == "A":
                        code.append(dict(provider=name, hdim=HDIM, config=cfg_text(cfg), **code_facts(compiled)))
                except Exception as exc:  # noqa: BLE001 -- a config that fails is a row with its reason
                    timings.append({"setting": setting, "provider": name, "round": 0,
                                    "status": f"error: {type(exc).__name__}: {exc}"[:300]})
                save(timings, "probe_timings.csv")
                save(code, "probe_code.csv")


def correctness_section(checks: list, code: list, deadline: float) -> None:
    for dtype, causal, hdim, seqlen_q, seqlen_k in CHECKS:
        torch.manual_seed(hdim + seqlen_q)
        q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, hdim, dtype, "cuda")
        ref_out, ref_lse = attention_reference(q, k, v, causal=causal)
        same_err = (attention_same_dtype(q, k, v, causal=causal).double() - ref_out).abs().max().item()
        bound = 2 * same_err + ABS_EPS[dtype]
        for rung in range(len(LADDER) + 1):
            if time.time() > deadline:
                print("time budget reached in the correctness checks", flush=True)
                return
            row = {"rung": rung, "dtype": str(dtype).removeprefix("torch."), "causal": causal, "hdim": hdim,
                   "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "bound": bound}
            try:
                if rung == len(LADDER):
                    out, lse = rung4_forward(q, k, v, hdim ** -0.5, causal)
                else:
                    out, stats, launch = plan_ladder_forward(q, k, v, None, causal, rung=rung)
                    compiled = launch.run()
                    lse = logsumexp_from_stats(stats)
                    if hdim != HDIM and dtype == torch.float16 and causal:
                        cfg = fa_ladder.default_ladder_config(rung, hdim, q.device)
                        code.append(dict(provider=f"rung{rung}", hdim=hdim, config=cfg_text(cfg),
                                         **code_facts(compiled)))
                err = (out.double() - ref_out).abs().max().item()
                finite = torch.isfinite(ref_lse)
                lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
                lse_inf_ok = torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
                ok = err <= bound and lse_err < 1e-3 and lse_inf_ok and not out.isnan().any().item()
                row.update(status="ok" if ok else "wrong", max_err=err, lse_err=lse_err, lse_inf_ok=lse_inf_ok)
            except Exception as exc:  # noqa: BLE001 -- a failing check is a row with its reason
                row.update(status=f"error: {type(exc).__name__}: {exc}"[:300])
            checks.append(row)
            save(checks, "probe_correctness.csv")
            save(code, "probe_code.csv")


def overhead_section(overhead: list, deadline: float) -> None:
    import triton.testing

    q, k, v = make_qkv(SETTINGS["B"], SEQLEN, SEQLEN, HEADS, HDIM, torch.float16, "cuda")
    scale = HDIM ** -0.5
    paths = {f"{rung.name} via Rung.forward": (lambda r=rung: r.forward(q, k, v, True, scale)) for rung in RUNGS}
    paths |= {f"rung{rung} prepared launch": plan_ladder_forward(q, k, v, scale, True, rung=rung)[2].run
              for rung in range(len(LADDER))}
    paths |= {name: fn for name, (fn, _) in providers(q, k, v).items() if name.startswith("sdpa")}
    calls = 200
    for name, fn in paths.items():
        if time.time() > deadline:
            print("time budget reached in the overhead section", flush=True)
            return
        row = {"path": name}
        try:
            fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)  # keep the GPU busy: the loop below measures host time only
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            row["host_us_per_call"] = (time.perf_counter() - start) / calls * 1e6
            torch.cuda.synchronize()
            row["do_bench_ms"] = bench(fn)[1]
            row["cudagraph_ms"] = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
            row["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 -- a path that cannot be timed is a row with its reason
            row["status"] = f"error: {type(exc).__name__}: {exc}"[:300]
        overhead.append(row)
        save(overhead, "probe_overhead.csv")


def save(rows: list, name: str) -> None:
    if rows:
        pd.DataFrame(rows).to_csv(OUT / name, index=False)


def summary(timings: list, checks: list, code: list, overhead: list) -> None:
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 30)
    pd.set_option("display.max_colwidth", 60)
    if code:
        cols = ["provider", "hdim", "config", "mma", "regs", "spills", "shared_bytes", "ttgir_local_alloc",
                "sass_HMMA", "sass_HGMMA", "sass_MUFU.EX2", "sass_BAR", "sass_STS", "sass_LDS", "sass_LDSM"]
        print("\n== code facts (static SASS counts)")
        print(pd.DataFrame(code)[cols].to_string(index=False))
    if checks:
        df = pd.DataFrame(checks)
        print(f"\n== correctness: {(df.status == 'ok').sum()} ok of {len(df)}")
        bad = df[df.status != "ok"]
        if len(bad):
            print(bad.to_string(index=False))
    if timings:
        df = pd.DataFrame(timings)
        ok = df[df.status == "ok"]
        table = ok.groupby(["setting", "provider"], sort=False).agg(
            ms=("ms", "median"), tflops=("tflops", "median"), tflops_min=("tflops", "min"),
            tflops_max=("tflops", "max"), rounds=("round", "count")).reset_index()
        for setting, batch in SETTINGS.items():
            part = table[table.setting == setting].copy()
            main = part[~part.provider.str.contains(" ")]
            gains = main.set_index("provider").tflops
            part["gain_vs_prev_rung"] = [
                gains[name] / gains[f"rung{int(name[4:]) - 1}"]
                if name.startswith("rung") and " " not in name and name != "rung0" and f"rung{int(name[4:]) - 1}"
                in gains else float("nan") for name in part.provider]
            print(f"\n== setting {setting}: batch {batch}, {HEADS} heads, hdim {HDIM}, "
                  f"seqlen {SEQLEN}, fp16, causal, forward")
            print(part.drop(columns="setting").to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        failed = df[df.status != "ok"]
        if len(failed):
            print("\nfailed timings:")
            print(failed[["setting", "provider", "status"]].to_string(index=False))
    if overhead:
        print(f"\n== launch overhead, setting B ({SETTINGS['B']} x {HEADS} heads): host time per call, "
              "do_bench and CUDA-graph medians")
        print(pd.DataFrame(overhead).to_string(index=False, float_format=lambda x: f"{x:.3f}"))


def main() -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile-only", action="store_true",
                        help="no GPU: compile every rung for sm_90 and write probe_code_sm90_cpu.csv")
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="stop starting new work after this many seconds (default 270)")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["timings", "correctness", "candidates", "overhead"])
    parser.add_argument("--out", type=Path, default=OUT,
                        help="folder for the rows (default: $OUT, else the current folder)")
    args = parser.parse_args()
    OUT = args.out
    OUT.mkdir(parents=True, exist_ok=True)
    if args.compile_only:
        compile_only()
        return
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --compile-only for the code facts")
    import triton

    start = time.time()
    deadline = start + args.budget_s
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} (CUDA {torch.version.cuda}) | "
          f"triton {triton.__version__}", flush=True)
    timings, checks, code, overhead = [], [], [], []
    sections = {
        "timings": lambda: timing_section(timings, code, deadline),
        "correctness": lambda: correctness_section(checks, code, deadline),
        "candidates": lambda: candidates_section(timings, code, deadline),
        "overhead": lambda: overhead_section(overhead, deadline),
    }
    for section, run in sections.items():
        if section in args.skip:
            continue
        t0 = time.time()
        run()
        print(f"-- {section} done in {time.time() - t0:.0f} s", flush=True)
    summary(timings, checks, code, overhead)
    print(f"\ntotal {time.time() - start:.0f} s; files in {OUT}")


if __name__ == "__main__":
    main()
