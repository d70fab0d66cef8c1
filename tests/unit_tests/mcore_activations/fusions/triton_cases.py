"""The device parameters the Triton kernel tests share (not a test module)."""

import os

import pytest
import torch

from tests.unit_tests.activation_catalog import SPECS

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton_here = pytest.mark.skipif(
    not (CUDA or INTERPRETED), reason="Triton needs a GPU or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if CUDA else "cpu"
# The checks that are not already part of the large GPU matrix run on both: CPU under the
# interpreter (CI) and, in the GPU tier (``-m gpu``), compiled on the GPU.
BOTH = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET unset")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GATED = sorted(name for name, spec in SPECS.items() if spec.gated)
