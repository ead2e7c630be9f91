"""Named targets that regenerate each committed result from scratch on a GPU.

`python runner.py --reproduce TARGET [--out DIR]` runs the target's runner commands in order
into one folder (default results/reproduce/<target>/), the later ones with --resume, so that
the folder ends up with the rows, the tables and the plots of reports/<gpu>/<folder>/.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.plan import REVIEWER_PARTS

PAPER_PROVIDERS = ("fa2,sdpa-flash,sdpa-cudnn,sdpa-efficient,pytorch,xformers-cutlass,flash-attn,"
                   "flash-attn-3")
# the strongest peers (FA4, cuDNN) and the compilers (Inductor, FlexAttention), measured next to ours
PEER_PROVIDERS_FP16 = "fa2,fa4,sdpa-flash,sdpa-cudnn"
PEER_PROVIDERS = PEER_PROVIDERS_FP16 + ",torch-compile,flex-attention"
TRAIN_PROVIDERS = "pytorch,sdpa-flash,sdpa-cudnn,fa2,fa4"


@dataclass(frozen=True)
class Target:
    folder: str  # under reports/: <gpu>/<folder>
    what: str
    steps: tuple[tuple[str, ...], ...]  # runner arguments of each step, without --out


TARGETS = {
    "paper": Target(
        "h200/paper", "the paper's Figures 4-7 in bf16: every provider, then 3 repeats at 512 and 1k",
        (("--suite", "paper", "--dtype", "bf16", "--providers", PAPER_PROVIDERS),
         ("--suite", "paper", "--dtype", "bf16", "--providers", "fa2,sdpa-flash,sdpa-cudnn", "--seqlens",
          "512,1024", "--repeats", "3"))),
    "paper-fp16": Target(
        "h200/paper_fp16", "the paper's figures in fp16 for our kernel, official FA2 and cuDNN",
        (("--suite", "paper", "--dtype", "fp16", "--providers", "fa2,sdpa-flash,sdpa-cudnn"),
         ("--suite", "paper", "--dtype", "fp16", "--providers", "fa2,sdpa-flash,sdpa-cudnn", "--seqlens",
          "512,1024", "--repeats", "3"))),
    "peers": Target(
        "h200/paper_fa4", "the paper's whole sweep with the strongest peers and the compilers in one run: our kernels, FA4, "
        "cuDNN, the official FA2 kernel, eager attention under torch.compile and FlexAttention (bf16)",
        (("--suite", "paper", "--dtype", "bf16", "--providers", PEER_PROVIDERS),)),
    "peers-fp16": Target(
        "h200/paper_fa4_fp16", "the paper's whole sweep in fp16: our kernels, FA4, cuDNN and the official FA2 kernel",
        (("--suite", "paper", "--dtype", "fp16", "--providers", PEER_PROVIDERS_FP16),)),
    "features": Target(
        "h200/features", "the features suite: GQA, windows, packed variable lengths, ALiBi, softcap against their peers",
        (("--suite", "features"),)),
    "decode": Target(
        "h200/decode", "the decode suite: split-KV against the decode peers over batch x cache length",
        (("--suite", "decode"),)),
    "decode-eager": Target(
        "h200/decode_eager", "the decode suite timed eagerly (do_bench, host time included): ours and cuDNN",
        (("--suite", "decode", "--eager", "--providers", "sdpa-cudnn"),)),
    "coverage": Target(
        "h200/coverage", "the coverage suite: the shapes a model meets, ours against FA4, cuDNN and the official FA2 "
        "kernel, with the kernel that served each of our rows",
        (("--suite", "coverage"),)),
    "train": Target(
        "h100/train", "the training suite: GPT-3 1.3B and 2.7B at 2k and 8k context with each attention provider (the "
        "paper's Table 1 on one GPU), the longest context in 60 GiB, the loss curves",
        (("--suite", "train", "--train-parts", "table", "--models", "gpt3-1.3b,gpt3-2.7b", "--contexts", "2048,8192",
          "--providers", TRAIN_PROVIDERS, "--steps", "3", "--warmup-steps", "2"),
         ("--suite", "train", "--train-parts", "search,parity", "--providers", TRAIN_PROVIDERS))),
    "reviewers": Target(
        "h200/reviewers", "the reviewers' studies one part at a time, fp16, with counters (then `python -m ablations."
        "reviewers --decode-rows DECODE_CSV --out DIR` adds the decode suite's rows)",
        tuple(("--ablation", part, "--dtype", "fp16") for part in REVIEWER_PARTS)),
    "ablation": Target(
        "h200/ablation", "the FA1 -> FA2 ladder with its peers (CUDA-graph timing; the reviewers' studies have their own "
        "target), then the ladder's Nsight Compute counters",
        (("--ablation", "all", "--ladder-only", "--repeats", "2", "--hdims", "128", "--seqlens", "1024,4096,16384",
          "--cuda-graph", "--no-ncu"),
         ("--ablation", "all", "--settings-only", "--ncu-only"))),
    "counters": Target(
        "h200/counters_fwd_gluon", "Nsight Compute counters of our Hopper forward and cuDNN's at head dim 128, 4k",
        (("--suite", "paper", "--ncu-only", "--providers", "fa2,sdpa-cudnn", "--modes", "fwd", "--hdims",
          "128", "--seqlens", "4096", "--dtype", "bf16"),)),
    "baseline": Target(
        "h200/regression", "the regression baseline CI compares with (saved to reports/h200/regression/baseline.json)",
        (("--quick", "--providers", "fa2,fa4,sdpa-flash", "--dtype", "bf16", "--repeats", "3", "--save-baseline"),)),
}


def help_text() -> str:
    lines = ["reproduce targets (each regenerates one folder of reports/<gpu>/):"]
    for name, target in TARGETS.items():
        lines.append(f"  {name:<11} {target.what} (reports/{target.folder}/)")
        for step in target.steps:
            lines.append(f"      runner.py {' '.join(step)}")
    return "\n".join(lines)


def steps(name: str, out: str, extra: list[str]) -> list[list[str]]:
    """The runner argument lists of target `name` writing into `out`; `extra` (e.g. -v) is
    added to every step, --resume to every step after the first."""
    target = TARGETS[name]
    return [[*step, "--out", out, *extra, *(["--resume"] if index else [])]
            for index, step in enumerate(target.steps)]
