"""Version checks for torch and Transformer Engine (megatron.core.utils re-exports them)."""

from __future__ import annotations

import torch
from packaging.version import Version as PkgVersion

from mcore_activations import te_import


def get_torch_version() -> PkgVersion:
    """Returns the installed torch version as a ``packaging`` Version."""
    return PkgVersion(str(torch.__version__))


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether torch is at least ``version`` (strictly newer when ``check_equality`` is False)."""
    if check_equality:
        return get_torch_version() >= PkgVersion(version)
    return get_torch_version() > PkgVersion(version)


def get_te_version() -> PkgVersion:
    """Returns the Transformer Engine version in force, or ``0.0.0`` when TE is absent.

    Read by the TE import seam (``te_import.te_version``): the imported TE's ``__version__``, else
    the installed distribution's metadata, which works where importing TE fails (CPU-only torch).
    """
    return te_import.te_version()


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether the installed Transformer Engine is at least ``version``."""
    return te_import.is_te_min_version(version, check_equality)
