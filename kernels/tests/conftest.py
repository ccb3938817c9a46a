"""Shared test setup: Triton runs in its CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined,
i.e. before ``paged.kernels.triton_ops`` is imported; conftest runs first.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()

# Devices the Triton tests run on: the interpreter on CPU always, CUDA when present.
TRITON_DEVICES = [
    pytest.param("cpu", id="interp"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")],
    ),
]


@pytest.fixture(params=TRITON_DEVICES)
def triton_device(request: pytest.FixtureRequest) -> str:
    """Device for Triton kernel tests (CPU = TRITON_INTERPRET=1)."""
    device: str = request.param
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    return device


@pytest.fixture
def xfail_bf16_interp(request: pytest.FixtureRequest) -> Callable[[str, torch.dtype], None]:
    """Call with (device, dtype): marks bf16 in the interpreter as a strict expected failure.

    TOOLING.md: the interpreter does bf16 arithmetic on raw bits, so results are
    wrong there; bf16 is checked for real on a GPU only.
    """

    def apply(device: str, dtype: torch.dtype) -> None:
        if device == "cpu" and dtype == torch.bfloat16:
            request.applymarker(
                pytest.mark.xfail(strict=True, reason="Triton interpreter computes bf16 wrongly")
            )

    return apply


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
