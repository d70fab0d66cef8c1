"""Version checks for torch and Transformer Engine (megatron.core.utils re-exports them)."""

from __future__ import annotations

import functools
import importlib.metadata

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


@functools.cache
def get_te_version() -> PkgVersion:
    """Returns the installed Transformer Engine version, or ``0.0.0`` when TE is absent.

    The version is read from ``transformer_engine.__version__`` when TE imports, else from the
    installed distribution's metadata (so it works on machines where importing TE fails, e.g.
    CPU-only torch, where ``import transformer_engine`` raises ``RuntimeError``).
    """
    from mcore_activations.te_import import te_module

    te = te_module()
    if te is not None and hasattr(te, "__version__"):
        return PkgVersion(str(te.__version__))
    for dist in ("transformer-engine", "transformer_engine"):
        try:
            return PkgVersion(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            continue
    return PkgVersion("0.0.0")


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether the installed Transformer Engine is at least ``version``."""
    if check_equality:
        return get_te_version() >= PkgVersion(version)
    return get_te_version() > PkgVersion(version)
