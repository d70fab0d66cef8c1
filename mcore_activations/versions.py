"""Version checks for torch (megatron.core.utils re-exports them).

A bottom rung of the package (imports nothing of it): ``jit`` asks it which decorator to use, and
``activations`` sits on ``jit``. Transformer Engine's version checks belong to the TE import seam
(``te_import.te_version`` / ``te_import.is_te_min_version``), above the spec.
"""

from __future__ import annotations

import torch
from packaging.version import Version as PkgVersion


def get_torch_version() -> PkgVersion:
    """Returns the installed torch version as a ``packaging`` Version."""
    return PkgVersion(str(torch.__version__))


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether torch is at least ``version`` (strictly newer when ``check_equality`` is False)."""
    if check_equality:
        return get_torch_version() >= PkgVersion(version)
    return get_torch_version() > PkgVersion(version)
