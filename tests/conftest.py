"""Test set-up. Without a GPU, the Triton kernels run in Triton's CPU interpreter, which
must be switched on before any `@triton.jit` function is decorated, so this happens here,
before the test modules import `kernels`."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device, not in CI)")


def pytest_collection_modifyitems(config, items):
    """`gpu` and `perf` tests need CUDA: skip them, saying why, when there is none."""
    for item in items:
        for marker in ("gpu", "perf"):
            if not HAS_CUDA and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: run `pytest -m {marker}` on a GPU machine"))


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
