"""Compile the FA2 kernels for sm_90 on a machine without a GPU and read the compiler's report.

Triton compiles for a named target without a device, and its package carries ptxas, so the
questions to answer before running on a GPU (does it compile, is wgmma there, how many
registers, any spills) are answered here:

    python tools/compile_check_sm90.py                  # the production table, hdim 64/128/256
    python tools/compile_check_sm90.py --hdim 256 --bwd 64,32,128,32,8,2
    python tools/compile_check_sm90.py --hopper-gluon     # the Gluon kernels (kernels/hopper/)
    python tools/compile_check_sm90.py --bank-conflicts   # the Gluon backward's shared-memory accesses
    python tools/compile_check_sm90.py --decode           # the split-KV decoding kernels (kernels/decode.py)

Prints one line per kernel (and per memory path the forward config can take): the block config,
shared memory, registers and spill bytes (for the Gluon kernels also the spills and fills each
consumer loop runs a step, `loop_spills`: the ones a step pays); `--out FILE` writes the same lines to FILE, and
`--dump-ptx DIR` writes each compiled kernel's PTX to DIR, one file per report line (named after
the line's kernel and config), e.g. to diff a refactor's generated code against its base.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import BwdConfig, FwdConfig
from kernels.backward import _flash_bwd_dkdv_kernel, _flash_bwd_dq_kernel
from kernels.configs import HOPPER_BWD_CONFIGS, HOPPER_FWD_CONFIGS, hopper_fwd_config, padded_headdim
from kernels.dispatch import FWD_MEMORY_PATHS
from kernels.forward import _flash_fwd_kernel

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
NVDISASM = PTXAS.with_name("nvdisasm")
TARGET = GPUTarget("cuda", 90, 32)
PTX_DIR: Path | None = None  # --dump-ptx: where each compiled kernel's PTX is written
PIN_FAILURES: list[str] = []  # pinned forwards whose softmax does not run under P~ V (gluon_report)


def dump_ptx(name: str, ptx: str) -> None:
    """Write `ptx` to PTX_DIR (when set) as NAME.ptx, NAME the report's words joined by '_'."""
    if PTX_DIR is not None:
        stem = re.sub(r"[^A-Za-z0-9.=]+", "_", name).rstrip("_")
        (PTX_DIR / f"{stem}.ptx").write_text(ptx)


def signature(kernel, constexprs: dict, dtype: str) -> dict:
    """Argument types by the kernels' naming convention: capitalised names are tensors
    (LSE and Delta float32), *scale float32, the rest int32; the forward's Q, K, V and Out are
    host-made 2D tensor descriptors on its TMA path 2."""
    host_blocks = {}
    if constexprs.get("TMA") == FWD_MEMORY_PATHS.index("tma-host"):
        rows = {"Q": "BLOCK_M", "Out": "BLOCK_M", "K": "BLOCK_N", "V": "BLOCK_N"}
        host_blocks = {name: f"tensordesc<{dtype}[{constexprs[block]},{constexprs['BLOCK_D']}]>"
                       for name, block in rows.items()}
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in host_blocks:
            types[name] = host_blocks[name]
        elif name in ("LSE", "Delta") or (name == "DQ" and constexprs.get("FUSED_DQ")):  # DQ: the accumulator
            types[name] = "*fp32"
        elif name[0].isupper():
            types[name] = f"*{dtype}"
        elif "scale" in name:
            types[name] = "fp32"
        else:
            types[name] = "i32"
    return types


def report(kernel, constexprs: dict, num_warps: int, num_stages: int, dtype: str = "bf16") -> str:
    compiled = triton.compile(ASTSource(kernel, signature(kernel, constexprs, dtype), constexprs),
                              target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    ptxas = subprocess.run([str(PTXAS), "-v", "-arch=sm_90a", f.name, "-o", os.devnull],
                           capture_output=True, text=True, check=True)
    os.unlink(f.name)
    registers = re.search(r"Used (\d+) registers", ptxas.stderr)
    spills = re.search(r"(\d+) bytes spill stores", ptxas.stderr)
    ptx = compiled.asm["ptx"]
    dump_ptx(f"{kernel.fn.__name__} {constexprs}", ptx)
    mma = ("tma+" if "cp.async.bulk.tensor" in ptx else "") + ("wgmma" if "wgmma" in ptx else "mma.sync")
    mma += "+tma-reduce" if "cp.reduce.async.bulk.tensor" in ptx else ""  # the fused dQ's adds
    path = f" {FWD_MEMORY_PATHS[constexprs['TMA']]:10s}" if kernel is _flash_fwd_kernel else ""
    if kernel is _flash_bwd_dkdv_kernel:
        path = f" {'fused dQ' if constexprs['FUSED_DQ'] else 'dK/dV only':10s}"
    return (f"{kernel.fn.__name__:24s}{path} M{constexprs['BLOCK_M']:<4d} N{constexprs['BLOCK_N']:<4d} "
            f"w{num_warps} s{num_stages}  {mma:16s} smem {compiled.metadata.shared:6d} B  "
            f"regs {registers.group(1) if registers else '?':>3s}  spill stores "
            f"{spills.group(1) if spills else '?'} B")


def gluon_descriptor_type(rows: int, headdim: int, dtype: str = "bf16") -> str:
    """The signature type of a host-made Gluon tensor descriptor of [rows, headdim] tiles, with the
    shared-memory layout the launchers give it (NVMMASharedLayout.get_default_for)."""
    from triton.experimental.gluon import language as gl

    element = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for([rows, headdim], element)
    return f"tensordesc<{dtype}[{rows},{headdim}],{layout!r}>"


def dq_descriptor_type(tail: bool = False) -> str:
    """The signature type of the fused dQ's float32 accumulator descriptor, with the box and layout
    the backward's plans give it (its 64 x 64 tiles in register order, one [16, 256] box each;
    `tail`: head dim 96's 64 x 32 tiles, [8, 256] boxes)."""
    from kernels import flash_attn_hopper as hopper

    rows, cols = hopper.DQ_TAIL_REGISTER_BOX if tail else hopper.DQ_REGISTER_BOX
    return f"tensordesc<fp32[{rows},{cols}],{hopper._fp32_tile_layout_unswizzled()!r}>"


def backward_section_signature(headdim: int, fused_dq: bool, dtype: str) -> dict:
    """The dK/dV kernels' fourteen descriptor arguments' types: q, k, v, do, dk, dv tiles of the
    first head-dim section and dQ's accumulator (without the fused dQ, dK's in its place), then of
    the tail (flash_attn_hopper.head_sections; wide_bwd_sections at the wide head dims), or the
    logsumexp's pointer in their place where there is none (as the launches pass them)."""
    from kernels import flash_attn_hopper as hopper

    sections = (hopper.wide_bwd_sections(headdim) if headdim in hopper.WIDE_BWD_HEAD_DIMS
                else hopper.head_sections(headdim))
    rows = {"q": hopper.BWD_BLOCK_M, "k": hopper.BWD_BLOCK_N // 2, "v": hopper.BWD_BLOCK_N // 2,
            "do": hopper.BWD_BLOCK_M, "dk": hopper.BWD_BLOCK_N // 2, "dv": hopper.BWD_BLOCK_N // 2}

    def section(width: int, tail: bool) -> dict:
        tiles = {name: gluon_descriptor_type(r, width, dtype) for name, r in rows.items()}
        return {**tiles, "dq": dq_descriptor_type(tail) if fused_dq else tiles["dk"]}

    first = {f"{name}_desc": t for name, t in section(sections[0], False).items()}
    tail = section(sections[-1], True) if len(sections) == 2 else dict.fromkeys(first, "*fp32")
    return {**first, **{f"{name.removesuffix('_desc')}_tail_desc": t for name, t in zip(first, tail.values())}}


def assembled(compiled, name: str, sass: bool = False) -> tuple[str, subprocess.CompletedProcess, str]:
    """A compiled kernel's PTX (dumped under `name`), ptxas's verbose report of it for sm_90a and,
    with `sass`, its machine code as nvdisasm lists it ('' without)."""
    ptx = compiled.asm["ptx"]
    dump_ptx(name, ptx)
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin_path = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        ptx_path.write_text(ptx)
        ptxas = subprocess.run([str(PTXAS), "-v", "-arch=sm_90a", str(ptx_path), "-o", str(cubin_path)],
                               capture_output=True, text=True, check=True)
        listing = (subprocess.run([str(NVDISASM), "-c", str(cubin_path)], capture_output=True, text=True,
                                  check=True).stdout if sass else "")
    return ptx, ptxas, listing


def sass_instructions(listing: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """nvdisasm's listing read once for the checks below: its instructions as (address, text up to
    the `;`), in order, and each label's (`.L_x_N`) address, the instruction after it."""
    instructions, labels, pending = [], {}, []
    for line in listing.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        found = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*)", line)
        if found:
            address = int(found.group(1), 16)
            labels.update({name: address for name in pending})
            pending = []
            instructions.append((address, found.group(2).strip()))
    return instructions, labels


def exp2_under_pv(listing: str) -> int:
    """Of a Gluon forward's machine code, the fewest exp2 (MUFU.EX2) any consumer's key loop runs
    between its wait for S_j (`WARPGROUP.DEPBAR.LE gsb0, 0x1`: block j-1's P~ V still in flight)
    and its wait for that P~ V (`... 0x0`): the softmax FA3's Algorithm 2 overlaps with P~ V. ptxas
    may move the second wait above the softmax (FwdConfig.hopper_gluon_pin_softmax keeps it below)."""
    texts = [text for _, text in sass_instructions(listing)[0]]
    counts = []
    for i, text in enumerate(texts):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in text:
            count = 0
            for later in texts[i + 1:]:
                if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in later:
                    break
                count += "MUFU.EX2" in later
            counts.append(count)
    return min(counts, default=0)


def loop_spills(listing: str) -> list[int]:
    """Of a kernel's machine code (nvdisasm's listing), the local-memory spills and fills (STL, LDL)
    inside each innermost loop that issues wgmma (HGMMA): the key or query-step loops of the consumer
    warpgroups, in address order. A loop is a branch back to an earlier label; the branches after
    the kernel's last EXIT (ptxas's out-of-line retries of mbarrier waits) are not loops. Spills
    elsewhere (a prologue, an epilogue) run once a tile; these run every step."""
    instructions, labels = sass_instructions(listing)
    end = max((address for address, text in instructions if re.search(r"\bEXIT\b", text)), default=0)
    loops = set()
    for address, text in instructions:
        branch = re.search(r"\bBRA\b.*\((\.L_x_\d+)\)", text)
        if branch and address < end and labels.get(branch.group(1), address) < address:
            start = labels[branch.group(1)]
            if any("HGMMA" in other for at, other in instructions if start <= at <= address):
                loops.add((start, address))
    innermost = [loop for loop in loops
                 if not any(other != loop and loop[0] <= other[0] and other[1] <= loop[1] for other in loops)]
    return [sum(1 for at, text in instructions if start <= at <= stop and re.search(r"\b(LDL|STL)", text))
            for start, stop in sorted(innermost)]


def gluon_report(label: str, kernel, signature: dict, constexprs: dict, options: dict | None = None,
                 block_n: int | None = None) -> str:
    """A Gluon kernel of kernels/hopper/ compiled for sm_90: shared memory, spills (ptxas), and
    what makes it fast: warp specialisation (setmaxnreg), a wgmma left in flight (wait_group 1),
    TMA loads; for a forward (`block_n`: its keys a block), the exp2 its softmax runs under P~ V
    (`exp2_under_pv`); last, the spills and fills each consumer loop runs a step (`loop_spills`).
    A forward built with PIN_SOFTMAX must run all of a block's there (a thread's block_n / 2
    scores at least): one that does not is added to PIN_FAILURES."""
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {name: signature[name] for name in kernel.arg_names}  # in the kernel's order
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs), target=TARGET,
                              options=options or {"num_warps": 4, "maxnreg": 168})
    name = f"{kernel.fn.__name__} {label}"
    ptx, ptxas, listing = assembled(compiled, name, sass=True)
    spills = re.search(r"(\d+) bytes spill stores", ptxas.stderr)
    waits = sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)))
    serialised = " wgmma serialised (ptxas C7512)" if "C7512" in ptxas.stderr else ""
    serialised += " tma-reduce" if "cp.reduce.async.bulk.tensor" in ptx else ""
    # the fused dQ's hand-over to the writer warp (bwd._dq_full): consumers arrive, the writer waits
    if re.search(r"bar\.arrive %r\d+, 160;", ptx) and re.search(r"bar\.sync %r\d+, 160;", ptx):
        serialised += " dq-writer"
    under_pv = ""
    if block_n is not None:
        exp2 = exp2_under_pv(listing)
        under_pv = f"  exp2 under P V {exp2}"
        if constexprs.get("PIN_SOFTMAX") and exp2 < block_n // 2:
            PIN_FAILURES.append(f"{name}: {exp2} exp2 under P V, fewer than {block_n // 2}")
    return (f"{name} smem {compiled.metadata.shared} B  "
            f"spill stores {spills.group(1) if spills else '?'} B  warp-specialised "
            f"{'yes' if 'setmaxnreg' in ptx else 'no'}  tma {'yes' if 'cp.async.bulk.tensor' in ptx else 'no'}  "
            f"wgmma wait_group values {' '.join(waits)}{serialised}{under_pv}"
            f"  loop spills {' '.join(map(str, loop_spills(listing))) or '-'}")


# the forward's run-time feature arguments; the dK/dV kernels' add dropout's
FWD_FEATURE_SIGNATURE = {"kv_group": "i32", "window_left": "i32", "window_right": "i32", "softcap_log2": "fp32",
                         "Alibi": "*fp32", "stride_alibi_b": "i32"}
BWD_FEATURE_SIGNATURE = {**FWD_FEATURE_SIGNATURE, "RngSeed": "*i64", "dropout_p": "fp32"}


def feature_label(flags: dict) -> str:
    return "".join(f" {name.lower()}" for name, on in flags.items() if on)


def hopper_gluon_report(causal: bool, dtype: str = "bf16", headdim: int = 128, block_n: int | None = None,
                        block_m: int | None = None, schedule: dict | None = None, **flags: bool) -> str:
    """The Gluon forward (kernels/hopper/fwd.py) compiled for sm_90 as forward_hopper_plan launches
    it, with the table's hopper_gluon_block_n, hopper_gluon_block_m and key-loop schedule
    (flash_attn_hopper.forward_schedule) unless `block_n`, `block_m`, `schedule` (a dict of its
    constexprs set) are given; `flags`: its WINDOW, SOFTCAP and ALIBI constexprs."""
    from kernels import flash_attn_hopper as hopper

    config = hopper_fwd_config(headdim, causal)
    block_n = block_n or config.hopper_gluon_block_n
    block_m = block_m or config.hopper_gluon_block_m
    schedule = {**hopper.forward_schedule(config), **(schedule or {})}
    if any(flags.values()) or (causal and block_m % block_n):  # what takes the dense kernel then (dispatch.fwd_gluon_rows)
        block_m = hopper.BLOCK_M
    label = feature_label({name: flags.get(name, False) for name in hopper.GLUON_FEATURE_FLAGS})
    sections = hopper.head_sections(headdim)
    # GROUP_SHIFT (the causal launch order, fwd_group_shift) 0 unless the schedule sets it
    constexprs = {"CAUSAL": causal, "GROUP_SHIFT": 0,
                  **hopper.forward_constexprs(causal, headdim, flags, block_n, block_m, schedule),
                  "HEAD_SPLIT": len(sections) == 2}  # as launched
    options = {name: constexprs.pop(name) for name in ("num_warps", "maxnreg")}
    signature = {**section_signature(sections, block_n, dtype), "LSE": "*fp32", "num_heads": "i32", "num_rows": "i32",
                 "seqlen": "i32",
                 "qk_scale": "fp32", **FWD_FEATURE_SIGNATURE, **{name: "constexpr" for name in constexprs}}
    tiles = f" {block_m}x{block_n} x {constexprs['STAGES']}/{constexprs['V_STAGES']}" + schedule_label(schedule)
    return gluon_report(f"d{headdim} causal={causal!s:5s} {dtype}{label}{tiles}",
                        hopper._flash_fwd_hopper_kernel, signature, constexprs, options, block_n)


def schedule_label(schedule: dict) -> str:
    """The forward's key-loop constexprs set (flash_attn_hopper.forward_schedule), for a report line."""
    return "".join(f" {name.lower().replace('_', ' ')}" + ("" if value is True else f" {value}")
                   for name, value in schedule.items() if value and (name, value) != ("Q_BUFFERS", 1))


def hopper_gluon_varlen_report(causal: bool, dtype: str = "bf16", headdim: int = 128, block_n: int | None = None,
                               block_m: int | None = None, schedule: dict | None = None) -> str:
    """The Gluon forward over packed variable lengths (kernels/hopper/fwd_varlen.py) for sm_90, with the
    table's hopper_gluon_block_n, hopper_gluon_block_m and schedule unless `block_n`, `block_m`,
    `schedule` are given (as hopper_gluon_report's, GROUP_SHIFT too)."""
    from kernels import flash_attn_hopper as hopper

    config = hopper_fwd_config(headdim, causal)
    block_n = block_n or config.hopper_gluon_block_n
    block_m = block_m or config.hopper_gluon_block_m
    # GROUP_SHIFT (the causal launch order, fwd_group_shift) 0 unless the schedule sets it
    schedule = {**hopper.forward_schedule(config), "GROUP_SHIFT": 0, "Q_BUFFERS": 1, "PERSISTENT": False,
                **(schedule or {})}
    stages, v_stages = hopper.forward_stages(headdim, block_n, block_m=block_m, q_buffers=schedule["Q_BUFFERS"])
    options = hopper.forward_launch_options(block_m)
    consumers = options.pop("CONSUMERS")
    sections = hopper.head_sections(headdim)
    signature = {**section_signature(sections, block_n, dtype), "Out": f"*{dtype}", "LSE": "*fp32", "CuSeqQ": "*i32",
                 "CuSeqK": "*i32", "num_heads": "i32", "num_rows": "i32", "num_m": "i32", "stride_lse_h": "i32", "stride_lse_b": "i32", "stride_o": "i32", "qk_scale": "fp32",
                 "kv_group": "i32", "STAGES": "constexpr", "V_STAGES": "constexpr", "CAUSAL": "constexpr",
                 "HEAD_SPLIT": "constexpr", "CONSUMERS": "constexpr", **{name: "constexpr" for name in schedule}}
    return gluon_report(f"d{headdim} causal={causal!s:5s} {dtype} varlen {block_m}x{block_n} x {stages}/{v_stages}"
                        f"{schedule_label(schedule)}",
                        hopper._flash_fwd_hopper_varlen_kernel, signature,
                        {"STAGES": stages, "V_STAGES": v_stages, "CAUSAL": causal, "HEAD_SPLIT": len(sections) == 2,
                         "CONSUMERS": consumers, **schedule}, options, block_n)


def section_signature(sections: tuple, block_n: int, dtype: str) -> dict:
    """The forwards' eight descriptor arguments' types: q, k, v and o tiles of the first head-dim
    section, then of the tail (flash_attn_hopper.head_sections), or the logsumexp's pointer in
    their place where there is none (as the launch passes it)."""
    from kernels import flash_attn_hopper as hopper

    rows = {"q": hopper.BLOCK_M // 2, "k": block_n, "v": block_n, "o": hopper.BLOCK_M // 2}
    first = {f"{name}_desc": gluon_descriptor_type(r, sections[0], dtype) for name, r in rows.items()}
    tail = {f"{name}_tail_desc": gluon_descriptor_type(r, sections[-1], dtype) if len(sections) == 2 else "*fp32"
            for name, r in rows.items()}
    return {**first, **tail}


def hopper_gluon_bwd_report(causal: bool, dtype: str = "bf16", headdim: int = 128, fused_dq: bool = False,
                            dropout: bool = False, **flags: bool) -> str:
    """The Gluon dK/dV kernel (kernels/hopper/bwd.py) compiled for sm_90, with dQ fused (TMA
    reduce-adds into a float32 accumulator) or not, in the schedule the table's config gives it
    (backward_dkdv_hopper_plan); `flags` as hopper_gluon_report's, `dropout` its DROPOUT."""
    from kernels import flash_attn_hopper as hopper

    flags = {name: flags.get(name, False) for name in hopper.GLUON_FEATURE_FLAGS}
    schedule = {"DQ_FIRST": fused_dq and hopper.dq_first(HOPPER_BWD_CONFIGS[128], 1, flags, headdim),
                "HEAD_SPLIT": len(hopper.head_sections(headdim)) == 2}
    stats = f"tensordesc<fp32[1,{hopper.BWD_BLOCK_M}],{hopper._stats_layout()!r}>"
    signature = {**backward_section_signature(headdim, fused_dq, dtype), "LSE": stats, "Delta": stats,
                 "num_heads": "i32", "seqlen": "i32", "softmax_scale": "fp32", "qk_scale": "fp32",
                 **BWD_FEATURE_SIGNATURE, "STAGES": "constexpr", "CAUSAL": "constexpr", "FUSED_DQ": "constexpr",
                 "DROPOUT": "constexpr", **{name: "constexpr" for name in flags},
                 **{name: "constexpr" for name in schedule}}
    label = (f"d{headdim} causal={causal!s:5s} {dtype}" + (" fused dQ" if fused_dq else "")
             + feature_label({**flags, "DROPOUT": dropout}))
    return gluon_report(label, hopper._flash_bwd_dkdv_hopper_kernel, signature,
                        {"STAGES": hopper.BWD_STAGES, "CAUSAL": causal, "FUSED_DQ": fused_dq, "DROPOUT": dropout,
                         **flags, **schedule})


def hopper_gluon_wide_bwd_report(causal: bool, dtype: str = "bf16", headdim: int = 192,
                                 dq_first: bool | None = None) -> str:
    """The Gluon dK/dV kernel for wide heads (kernels/hopper/bwd_wide.py: dQ fused, no feature)
    compiled for sm_90 as backward_dkdv_hopper_plan launches it, in the schedule the table's config
    gives it (flash_attn_hopper.dq_first) unless `dq_first` (its DQ_FIRST) is given."""
    from kernels import flash_attn_hopper as hopper

    if dq_first is None:
        no_features = {name: False for name in hopper.GLUON_FEATURE_FLAGS}
        dq_first = hopper.dq_first(HOPPER_BWD_CONFIGS[padded_headdim(headdim)], 1, no_features, headdim)
    stats = f"tensordesc<fp32[1,{hopper.BWD_BLOCK_M}],{hopper._stats_layout()!r}>"
    wide = hopper.wide_bwd_constexprs(headdim)
    # the dQ accumulator's pointer where bwd.py's kernel takes dropout's seed
    signature = {**backward_section_signature(headdim, True, dtype), "LSE": stats, "Delta": stats,
                 "num_heads": "i32", "seqlen": "i32", "softmax_scale": "fp32", "qk_scale": "fp32",
                 **FWD_FEATURE_SIGNATURE, "DQAccum": "*fp32", "dropout_p": "fp32", "STAGES": "constexpr",
                 "CAUSAL": "constexpr", "DQ_FIRST": "constexpr", **dict.fromkeys(wide, "constexpr")}
    label = "".join(f", {name.lower().replace('_', ' ')}" for name, on in wide.items() if on)
    return gluon_report(f"d{headdim} causal={causal!s:5s} {dtype} fused dQ" + (", dQ first" if dq_first else "") + label,
                        hopper._flash_bwd_dkdv_hopper_wide_kernel, signature,
                        {"STAGES": hopper.BWD_STAGES, "CAUSAL": causal, "DQ_FIRST": dq_first, **wide})


def hopper_gluon_varlen_bwd_report(causal: bool, dtype: str = "bf16", headdim: int = 128,
                                   key_grid: str = "longest") -> str:
    """The Gluon dK/dV kernel with dQ fused over packed variable lengths (kernels/hopper/bwd_varlen.py),
    compiled for sm_90, its key blocks in `key_grid` ("longest", the "auto" grid's choice at the
    features suite's lengths; "packed" scans VARLEN_SCAN_LANES lanes of cu_seqlens)."""
    from kernels import flash_attn_hopper as hopper

    head_split = len(hopper.head_sections(headdim)) == 2
    signature = {**backward_section_signature(headdim, True, dtype), "DK": f"*{dtype}", "DV": f"*{dtype}",
                 "LSE": "*fp32", "Delta": "*fp32", "CuSeqQ": "*i32", "CuSeqK": "*i32", "num_heads": "i32",
                 "total_q": "i32", "stride_dk": "i32", "stride_dv": "i32", "softmax_scale": "fp32",
                 "qk_scale": "fp32", "kv_group": "i32", "batch": "i32", "STAGES": "constexpr",
                 "CAUSAL": "constexpr", "SCAN": "constexpr", "HEAD_SPLIT": "constexpr"}
    return gluon_report(f"d{headdim} causal={causal!s:5s} {dtype} fused dQ varlen, {key_grid} grid",
                        hopper._flash_bwd_dkdv_hopper_varlen_kernel, signature,
                        {"STAGES": hopper.BWD_STAGES, "CAUSAL": causal, "HEAD_SPLIT": head_split,
                         "SCAN": hopper.VARLEN_SCAN_LANES if key_grid == "packed" else 0})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--fwd", metavar="BM,BN,WARPS,STAGES[,TMA[,MIN_KEYS,HOST_MIN_KEYS,HOST_BELOW_KEYS]]",
                        help="forward config (default: the table's), FwdConfig's fields in order; each memory "
                             "path it can take is compiled")
    parser.add_argument("--bwd", metavar="M1,N1,M2,N2,WARPS,STAGES[,DQ_WARPS,DQ_STAGES,QUERY_MAJOR,TMA,FUSED_DQ_MIN_ROWS]",
                        help="backward config (default: the table's)")
    parser.add_argument("--hopper-gluon", action="store_true",
                        help="compile the Gluon kernels (kernels/hopper/: the forwards, the dK/dV kernels, "
                             "the dQ casts) instead")
    parser.add_argument("--decode", action="store_true",
                        help="compile the split-KV decoding kernels (kernels/decode_kernels.py) as "
                             "flash_attn_with_kvcache launches them on a GPU instead")
    parser.add_argument("--bank-conflicts", action="store_true",
                        help="Triton's bank-conflict count of the Gluon backward's shared-memory accesses")
    parser.add_argument("--out", type=Path, metavar="FILE", help="also write the report to this file")
    parser.add_argument("--dump-ptx", type=Path, metavar="DIR", help="write each compiled kernel's PTX to DIR")
    args = parser.parse_args()
    if args.dump_ptx:
        global PTX_DIR
        PTX_DIR = args.dump_ptx
        PTX_DIR.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    if args.bank_conflicts:
        bank_conflict_report(emit)
    elif args.decode:
        decode_report(emit)
    elif args.hopper_gluon:
        from kernels import flash_attn_hopper as hopper
        from kernels.hopper import dq_cast

        narrow = [d for d in hopper.BWD_HEAD_DIMS if d not in hopper.WIDE_BWD_HEAD_DIMS]  # bwd.py's
        for report_fn, head_dims in ((hopper_gluon_report, hopper.FWD_HEAD_DIMS),
                                     (hopper_gluon_bwd_report, narrow),
                                     (hopper_gluon_varlen_report, hopper.FWD_HEAD_DIMS),
                                     (hopper_gluon_wide_bwd_report, hopper.WIDE_BWD_HEAD_DIMS)):
            for headdim in head_dims:
                for causal in (False, True):
                    emit(report_fn(causal, headdim=headdim))
        for headdim in narrow:
            for causal in (False, True):
                emit(hopper_gluon_bwd_report(causal, headdim=headdim, fused_dq=True))
                if headdim in hopper.VARLEN_BWD_HEAD_DIMS:
                    for key_grid in ("longest", "packed"):
                        emit(hopper_gluon_varlen_bwd_report(causal, headdim=headdim, key_grid=key_grid))
        for kernel in (dq_cast._dq_rows_from_register_tiles_kernel, dq_cast._dq_rows_from_padded_register_tiles_kernel):
            for cols in (64, 32):
                emit(dq_cast_report(kernel, cols))
        # the score modifications and the sliding window (kernels/features.py), as the features suite runs them
        for flag in hopper.GLUON_FEATURE_FLAGS:
            for causal in (False, True):
                emit(hopper_gluon_report(causal, **{flag: True}))
                emit(hopper_gluon_bwd_report(causal, fused_dq=True, **{flag: True}))
        # causal programs started longest first across groups of 4 rows (FwdConfig.hopper_gluon_head_section),
        # dense and varlen
        for headdim in (128, 256):
            emit(hopper_gluon_report(True, headdim=headdim, schedule={"GROUP_SHIFT": 2}))
        emit(hopper_gluon_varlen_report(True, headdim=128, schedule={"GROUP_SHIFT": 2}))
        # the persistent grid (hopper_gluon_persistent_below_keys: the tiles' loop, fwd_tiles.py `_rounds`) with a
        # second Q buffer (the next tile's Q loads while a tile runs), where it fits beside the rings: head dims
        # 64 (the table's 192 rows) and 96
        for headdim in (64, 96):
            for causal in (False, True):
                emit(hopper_gluon_report(causal, headdim=headdim, schedule={"Q_BUFFERS": 2, "PERSISTENT": True}))
                emit(hopper_gluon_varlen_report(causal, headdim=headdim,
                                                schedule={"Q_BUFFERS": 2, "PERSISTENT": True}))
        # the forward on 192 query rows (three consumer warpgroups: FwdConfig.hopper_gluon_block_m)
        # in 64-key blocks at head dims 96 and 128 (the tiles flash_attn_hopper.three_consumer_refusal
        # lets through), dense and varlen; head dim 64's table takes them in FA3's 128-key blocks
        # (built above)
        for headdim, block_n in ((96, 64), (128, 64)):
            for causal in (False, True):
                if not causal or 192 % block_n == 0:  # else causal takes the varlen kernel
                    emit(hopper_gluon_report(causal, headdim=headdim, block_n=block_n, block_m=192))
                emit(hopper_gluon_varlen_report(causal, headdim=headdim, block_n=block_n, block_m=192))
        # the softmax not pinned under P V (FwdConfig.hopper_gluon_pin_softmax off), as the table
        # has it at head dims 64, 192 and 256: ptxas then moves P V's wait above it (exp2 under P V)
        emit(hopper_gluon_report(False, headdim=128, schedule={"PIN_SOFTMAX": False}))
        # the consumers in no fixed order (FwdConfig.hopper_gluon_pingpong off), which the table takes
        # above head dim 128 only: three consumers at 64, two at 128
        emit(hopper_gluon_report(False, headdim=64, block_m=192, schedule={"PINGPONG": False}))
        emit(hopper_gluon_report(True, headdim=128, schedule={"PINGPONG": False}))
        # dropout on the dK/dV kernel (BwdConfig.hopper_gluon_dropout, the table's) at head dims 128, 96 and 64
        for causal in (False, True):
            for headdim in (128, 96, 64):
                emit(hopper_gluon_bwd_report(causal, headdim=headdim, fused_dq=True, dropout=True))
        # head dim 192's dQ matmuls after dV's and dK's, its tiles written out after them
        # (BwdConfig.hopper_gluon_dq_first=False; the table's None issues them first, built above)
        for causal in (False, True):
            emit(hopper_gluon_wide_bwd_report(causal, dq_first=False))
    else:
        production_report(args, emit)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    if PIN_FAILURES:
        sys.exit("the softmax of a forward built with PIN_SOFTMAX does not run under P V:\n" + "\n".join(PIN_FAILURES))


def dq_cast_report(kernel, cols: int = 64) -> str:
    """One of the register-order dQ accumulator's casts (kernels/hopper/dq_cast.py) compiled as
    launched (float32 accumulator, bf16 dQ, pointers 16-byte aligned, 4 warps): its global loads
    and stores by width, per thread."""
    from collections import Counter

    types = {"DQAccum": "*fp32", "DQ": "*bf16", "CuSeqQ": "*i32", "softmax_scale": "fp32", "COLS": "constexpr"}
    signature = {name: types.get(name, "i32") for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if signature[name].startswith("*")}
    compiled = triton.compile(ASTSource(kernel, signature, {"COLS": cols}, aligned), target=TARGET,
                              options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    dump_ptx(f"{kernel.fn.__name__}_{cols}", ptx)
    widths = {op: dict(Counter(re.findall(rf"{op}\.global((?:\.v\d)?\.b\d+)", ptx))) for op in ("ld", "st")}
    return (f"{kernel.fn.__name__:44s} {cols} columns  loads {widths['ld']}  stores {widths['st']}  "
            f"smem {compiled.metadata.shared:6d} B")


def decode_report(emit) -> None:
    """The split kernel at head dim 128, bf16, 32 q heads on 8 kv heads, one query token, with the
    constexprs flash_attn_with_kvcache gives it (decode.interleave_splits, decode.kv_addressing):
    contiguous and paged caches (pages of 16 tokens, a block holds four; of 256, a page holds four
    blocks), one split and several, each tile choose_tile takes, a left window; then the combine
    kernel and the append and rotary kernels."""
    import torch

    from kernels import decode
    from kernels.decode_kernels import (
        _fwd_kvcache_combine_kernel,
        _fwd_kvcache_split_kernel,
        _kvcache_append_kernel,
        _rotary_kernel,
    )

    headdim, group, dtype = 128, 4, "bf16"
    floats = {"LSE", "Slopes", "OSplit", "LSplit"}
    for page_size, split, tile, window_left in ((0, False, decode.GPU_CONFIG, -1), (0, True, decode.GPU_CONFIG, -1),
                                                 (0, True, decode.SHALLOW_CONFIG, -1), (0, True, decode.GPU_CONFIG, 4096),
                                                 (16, True, decode.GPU_CONFIG, -1), (256, True, decode.GPU_CONFIG, -1),
                                                 (16, True, decode.SHALLOW_CONFIG, -1), (256, False, decode.GPU_CONFIG, 4096)):
        block_n, num_warps, num_stages = tile
        cache = torch.empty(64, max(page_size, 1), 8, headdim, device="meta")
        constexprs = {"GROUP": group, "HEAD_DIM": headdim, "BLOCK_D": headdim, "BLOCK_M": 16, "BLOCK_N": block_n,
                      "PAGE_SIZE": page_size, "HAS_BATCH_IDX": False, "HAS_LEFT": window_left >= 0,
                      "HAS_RIGHT": False, "HAS_SOFTCAP": False, "HAS_ALIBI": False, "SPLIT": split,
                      "DOT_PRECISION": "tf32", "HAS_LEFTPAD": False,
                      "INTERLEAVE_SPLITS": decode.interleave_splits(page_size > 0, window_left),
                      **decode.kv_addressing(page_size, block_n, tile == decode.SHALLOW_CONFIG, cache, cache)}
        kernel = _fwd_kvcache_split_kernel
        types = {name: "constexpr" if name in constexprs else
                 ("*fp32" if name in floats or (name == "Out" and split) else
                  "*i32" if name in ("SeqlensK", "BatchIdx", "BlockTable", "LeftPad") else f"*{dtype}")
                 if name[0].isupper() else "fp32" if name in ("sm_scale", "softcap") else "i32"
                 for name in kernel.arg_names}
        label = (f"page {page_size} {'split' if split else 'one split'} tile {block_n},{num_warps},{num_stages}"
                 f"{' window' if window_left >= 0 else ''}")
        emit(compiled_report(kernel, types, constexprs, num_warps, num_stages, label))
    rotary = {"HEAD_DIM": headdim, "BLOCK_D": headdim, "ROTARY_HALF": 32, "BLOCK_HALF": 32, "INTERLEAVED": False}
    for kernel, constexprs, num_warps in (
            (_fwd_kvcache_combine_kernel, {"HEAD_DIM": headdim, "BLOCK_D": headdim, "BLOCK_S": 32}, 4),
            (_kvcache_append_kernel, {**rotary, "PAGE_SIZE": 16, "HAS_BATCH_IDX": False}, 1),
            (_rotary_kernel, {**rotary, "STEP": True}, 1)):
        types = {name: "constexpr" if name in constexprs else
                 ("*fp32" if name in ("OutAcc", "LseAcc", "LSE") else
                  "*i32" if name in ("CacheSeqlens", "BatchIdx", "BlockTable", "LeftPad", "Start") else f"*{dtype}")
                 if name[0].isupper() else "i32"
                 for name in kernel.arg_names}
        emit(compiled_report(kernel, types, constexprs, num_warps, 1, ""))


def compiled_report(kernel, types: dict, constexprs: dict, num_warps: int, num_stages: int, label: str) -> str:
    """A Triton kernel compiled for sm_90 with these argument types (pointers 16-byte aligned, ints
    unspecialised): shared memory, registers and spills (ptxas); its PTX dumped under the kernel's
    name and `label`."""
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if types[name].startswith("*")}  # as torch allocates them
    compiled = triton.compile(ASTSource(kernel, types, constexprs, aligned), target=TARGET,
                              options={"num_warps": num_warps, "num_stages": num_stages})
    _, ptxas, _ = assembled(compiled, f"{kernel.fn.__name__} {label}")
    registers = re.search(r"Used (\d+) registers", ptxas.stderr)
    spills = re.search(r"(\d+) bytes spill stores", ptxas.stderr)
    return (f"{kernel.fn.__name__} {label} w{num_warps} s{num_stages}  smem {compiled.metadata.shared:6d} B  "
            f"regs {registers.group(1) if registers else '?':>3s}  spill stores {spills.group(1) if spills else '?'} B")


def bank_conflict_report(emit) -> None:
    """Triton's own count (gl.bank_conflicts: excess shared-memory accesses per wavefront of the
    ld.shared/st.shared instructions it generates) for each register-to-shared access of the Gluon
    dK/dV kernel's query step at head dim 128, with the kernel's layouts, and for the fused dQ's
    float32 tile under each swizzle a TMA descriptor can take."""
    import torch
    from triton._C.libtriton import gluon_ir, ir
    from triton.experimental.gluon import language as gl

    from kernels import flash_attn_hopper as hopper
    from kernels.hopper.shared import DQ_TILE_BASES, _wgmma_layout

    context = ir.context()
    ir.load_dialects(context)
    builder = gluon_ir.GluonOpBuilder(context)
    rows, block_m, headdim = hopper.BWD_BLOCK_N // 2, hopper.BWD_BLOCK_M, 128

    def conflicts(register, shared, shape, bits) -> int:
        return builder.get_shared_bank_conflicts(register._to_ir(builder), shared._to_ir(builder), shape, bits)

    s_layout, acc_layout = _wgmma_layout(block_m), _wgmma_layout(headdim)
    dq_layout = _wgmma_layout(headdim // 2)
    accesses = [
        ("dS^T store (bf16, into the Q tiles' layout)", s_layout, hopper._tile_layout(block_m, headdim, torch.bfloat16),
         [rows, block_m], 16),
        ("L_i, D_i row loads (float32)", s_layout, hopper._stats_layout(), [1, block_m], 32),
        *((f"dQ_i tile store (float32, {f'{width}-byte swizzle' if width else 'no swizzle'})", dq_layout,
           gl.NVMMASharedLayout(swizzle_byte_width=width, element_bitwidth=32, rank=2), [block_m, headdim // 2], 32)
          for width in (0, 32, 64, 128)),
        ("dQ_i tile store (float32, in register order: the kernel's)", dq_layout,
         gl.SharedLinearLayout(offset_bases=[list(b) for b in DQ_TILE_BASES]), [block_m, headdim // 2], 32),
        ("dK_j, dV_j epilogue stores (bf16)", acc_layout, hopper._tile_layout(rows, headdim, torch.bfloat16),
         [rows, headdim], 16),
    ]
    emit("Gluon dK/dV kernel, head dim 128: excess shared-memory accesses per wavefront (Triton's count)")
    for name, register, shared, shape, bits in accesses:
        emit(f"  {name:58s} {conflicts(register, shared, shape, bits)}")


def production_report(args, emit) -> None:
    """The Triton kernels of one (head dim, causal) config each: every forward memory path, dK/dV, dQ."""
    for hdim in args.hdim:
        block_d = padded_headdim(hdim)
        fwd = (FwdConfig(*(int(x) for x in args.fwd.split(","))) if args.fwd
               else HOPPER_FWD_CONFIGS[(block_d, args.causal)])
        bwd = (BwdConfig(*map(int, args.bwd.split(","))) if args.bwd else HOPPER_BWD_CONFIGS[block_d])
        common = {"HEAD_DIM": hdim, "BLOCK_D": block_d, "CAUSAL": args.causal, "EVEN_M": True}
        emit(f"head dim {hdim}:")
        # every memory path the config can take (fwd_memory_path picks one per launch)
        paths = ["pointer"] + (["tma-kernel"] if fwd.tma else [])
        paths += ["tma-host"] if fwd.tma and fwd.tma_host_below_keys else []
        for path in paths:
            emit("  " + report(_flash_fwd_kernel, dict(common, BLOCK_M=fwd.block_m, BLOCK_N=fwd.block_n,
                                                        TMA=FWD_MEMORY_PATHS.index(path)),
                                fwd.num_warps, fwd.num_stages))
        # the dK/dV kernel alone, and with dQ fused (TMA reduce-adds) where the config fuses it
        for fused in (0, 2) if bwd.fused_dq_min_rows else (0,):
            emit("  " + report(_flash_bwd_dkdv_kernel,
                                dict(common, BLOCK_M=bwd.block_m1, BLOCK_N=bwd.block_n1, EVEN_N=True,
                                     QUERY_MAJOR=bwd.query_major, TMA=bwd.tma, FUSED_DQ=fused),
                                bwd.num_warps, bwd.num_stages))
        emit("  " + report(_flash_bwd_dq_kernel, dict(common, BLOCK_M=bwd.block_m2, BLOCK_N=bwd.block_n2,
                                                       TMA=bwd.tma),
                            bwd.dq_warps, bwd.dq_stages))


if __name__ == "__main__":
    main()
