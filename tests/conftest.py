"""Test setup. Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be set before any kernel
module is imported, so it is set here, at the top of the first file pytest loads."""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# The device tensors live on for kernel tests: cuda on the GPU, cpu under the interpreter.
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


def pytest_collection_modifyitems(config, items):
    """GPU-only tests are declared with the `gpu` marker and skip here, once, with the reason."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (no torch.cuda device on this machine); runs on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
