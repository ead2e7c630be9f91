"""Test set-up. Without a GPU, the Triton kernels run in Triton's CPU interpreter, which
must be switched on before any `@triton.jit` function is decorated, so this happens here,
before the test modules import `kernels`."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """`gpu` and `perf` tests need CUDA: skip them, saying why, when there is none. A module
    that sets INTERPRETER_TESTS = True holds small-shape checks written for Triton's CPU
    interpreter (CPU tensors, exact fp32 dots): on a CUDA machine its unmarked tests are
    skipped, and its `gpu` tests run the same checks at real sizes instead."""
    for item in items:
        if HAS_CUDA and getattr(item.module, "INTERPRETER_TESTS", False) and "gpu" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason="interpreter test: the `gpu` tests of this module cover "
                                                    "the same checks on a CUDA machine"))
        for marker in ("gpu", "perf"):
            if not HAS_CUDA and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: run `pytest -m {marker}` on a GPU machine"))


@pytest.fixture(autouse=True)
def _gpu_memory_released(request):
    """A `gpu` test's tensors go back to the GPU when it ends, not to its process's caching
    allocator: pytest-xdist's workers share the card, and a worker holding the gigabytes of its
    last large test would leave the others out of memory."""
    yield
    if HAS_CUDA and "gpu" in request.keywords:
        torch.cuda.empty_cache()


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
