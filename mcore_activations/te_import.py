"""The one place that imports Transformer Engine.

TE is optional. Importing it can fail in more ways than ``ImportError``: with TE wheels next to a
CPU-only torch, ``import transformer_engine`` raises ``RuntimeError`` ("cudnn shared object not
found"). Every failure therefore means "TE is not available", never a crash of megatron.core.
"""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType
from typing import Optional

# The first TE release with each feature this package uses (docs/te-paths.md).
TE_OPS_MIN_VERSION = "1.13.0"  # te.pytorch.ops activations
TE_CACHE_QUANTIZED_INPUT_MIN_VERSION = "2.3.0"  # cache_quantized_input= on the activation ops
TE_SILU_MIN_VERSION = "2.8.0"  # te.pytorch.ops.SiLU
TE_GROUPED_OPS_MIN_VERSION = "2.14.0"  # the row-scaled (Scaled*) ops of the grouped MLPs
TE_CLAMPED_GLU_MIN_VERSION = "2.17.0.dev0"  # ClampedSwiGLU / ScaledClampedQGeGLU
TE_SITU_GLU_MIN_VERSION = "2.20.0"  # SiTUGLU / ScaledSiTUGLU


@functools.cache
def te_module() -> Optional[ModuleType]:
    """Returns ``transformer_engine`` with its PyTorch API loaded, or None when unusable."""
    # TE warns on every import when JAX is installed too; this project only uses the PyTorch API.
    os.environ.setdefault("NVTE_FRAMEWORK", "pytorch")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import transformer_engine
            import transformer_engine.pytorch  # noqa: F401
            import transformer_engine.pytorch.fp8  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means TE is unusable here
        return None
    return transformer_engine


def have_te() -> bool:
    """Whether Transformer Engine's PyTorch API imports on this machine."""
    return te_module() is not None
