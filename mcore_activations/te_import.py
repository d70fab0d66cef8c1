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
