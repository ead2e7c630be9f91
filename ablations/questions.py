"""The reviewers' questions the studies answer, quoted with who asked and where.

The quotes are from the public review discussion of the FlashAttention-2 paper (OpenReview,
ICLR 2024 submission "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", Tri Dao), where reviewers are anonymous; the two questions the paper itself
raises cite its sections (arXiv 2307.08691). `question` is the rows' `question` column.
"""

from __future__ import annotations

from dataclasses import dataclass

REVIEW = "OpenReview discussion of FlashAttention-2 (ICLR 2024 submission), anonymous reviewer"
PAPER = "FlashAttention-2 (Dao, 2023, arXiv 2307.08691)"


@dataclass(frozen=True)
class Question:
    question: str  # the rows' `question` column
    title: str
    quote: str
    asked_by: str
    answered_then: str  # the authors' answer at the time, '' when none was given
    part: str  # the `--ablation` part whose rows answer it ('' when another suite's rows do)


QUESTIONS: tuple[Question, ...] = (
    Question("warp-split-one-tile", "Split-K versus split-Q at one tile",
             "we split Q across 4 warps while keeping K and V accessible by all warps ... This reduces shared "
             "memory reads/writes and yields speedup",
             f"{PAPER}, Sec. 3.3", "", "warp-split"),
    Question("backward-ladder", "The three techniques in the backward pass",
             "Similarly for the backward pass, we choose to partition the warps to avoid the 'split-K' scheme. "
             "However, it still requires some synchronization", f"{PAPER}, Sec. 3.3 (and Sec. 3.1.2, 3.2 for the other two techniques)", "",
             "backward"),
    Question("block-size-tuning", "Block-size tuning", "what is the performance impact of tuning block sizes?",
             REVIEW, "on the order of 5%", "tuning"),
    Question("fa1-causal-skip", "Causal block skipping in FA1", "is skipping blocks applied to FlashAttention?",
             REVIEW, "yes", "fa1-causal-skip"),
    Question("occupancy", "Occupancy",
             "what definition of occupancy ... whether any measurement has been made", REVIEW, "", "occupancy"),
    Question("smem-vs-sync", "Shared memory versus synchronisation", "unclear which of those matters most",
             REVIEW, "", "smem-vs-sync"),
    Question("triton-vs-cutlass", "The FA/FA-2 gap with cutlass and in Triton",
             "why are the gaps between FA/FA-2 different with cutlass versus in Triton?", REVIEW, "",
             "triton-vs-cutlass"),
    Question("decode-fa1-cudagraph-compilers", "FA1 in decoding, CUDA graphs and compilers",
             "why is FlashAttention missing in Figure 5? ... do the PyTorch benchmarks use CUDA graphs? ... the "
             "authors do not consider compilers", REVIEW, "", ""),
)
BY_QUESTION = {q.question: q for q in QUESTIONS}
