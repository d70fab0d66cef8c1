"""The one place that imports Transformer Engine, and the one place tests replace it.

TE is optional. Importing it can fail in more ways than ``ImportError``: with TE wheels next to a
CPU-only torch, ``import transformer_engine`` raises ``RuntimeError`` ("cudnn shared object not
found"). Every failure therefore means "TE is not available", never a crash of megatron.core.

Every TE-backed module reads ``te``, ``HAVE_TE`` and :func:`is_te_min_version` from this module at
call time (``te_import.te.pytorch...``), never a copy bound at import, so a test that sets
``te_import.te`` / ``te_import.HAVE_TE`` (tests/unit_tests/extensions/fake_te.py) changes what
every TE path sees, version checks included. ``te`` and ``HAVE_TE`` are resolved on first access,
so importing this module imports nothing.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import warnings
from types import ModuleType
from typing import Any, Optional

from packaging.version import Version

# The first TE release with each feature this package uses (docs/te-paths.md).
TE_OPS_MIN_VERSION = "1.13.0"  # te.pytorch.ops activations
TE_CACHE_QUANTIZED_INPUT_MIN_VERSION = "2.3.0"  # cache_quantized_input= on the activation ops
TE_SILU_MIN_VERSION = "2.8.0"  # te.pytorch.ops.SiLU
TE_GROUPED_OPS_MIN_VERSION = "2.14.0"  # the row-scaled (Scaled*) ops of the grouped MLPs
TE_CLAMPED_GLU_MIN_VERSION = "2.17.0.dev0"  # ClampedSwiGLU / ScaledClampedQGeGLU
TE_SITU_GLU_MIN_VERSION = "2.20.0"  # SiTUGLU / ScaledSiTUGLU

# The one install hint every message about a missing TE gives (the TE errors, the audit).
TE_INSTALL_HINT = "pip install 'transformer-engine[pytorch]'"


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


class TEPlaceholder:
    """Stands in for ``transformer_engine`` (and anything under it) when TE is unusable.

    Attribute access yields more placeholders, so references such as ``te.pytorch.ops`` resolve;
    calling one raises ``ImportError`` with the install command.
    """

    __version__ = "0.0.0"

    def __init__(self, qualname: str = "transformer_engine"):
        self._qualname = qualname

    def __getattr__(self, name: str) -> TEPlaceholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return TEPlaceholder(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        raise ImportError(
            f"{self._qualname} needs Transformer Engine, which cannot be imported here (not "
            f"installed, or unusable with this torch build). Install it with: {TE_INSTALL_HINT}"
        )

    def __repr__(self) -> str:
        return f"<unavailable {self._qualname}>"


def __getattr__(name: str) -> Any:
    # ``te`` and ``HAVE_TE`` are bound here on first access; a test's setattr replaces them.
    if name in ("te", "HAVE_TE"):
        module = te_module()
        globals().setdefault("te", module if module is not None else TEPlaceholder())
        globals().setdefault("HAVE_TE", module is not None)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _current(name: str) -> Any:
    namespace = globals()
    return namespace[name] if name in namespace else __getattr__(name)


def have_te() -> bool:
    """Whether Transformer Engine's PyTorch API is available (the ``HAVE_TE`` in force)."""
    return bool(_current("HAVE_TE"))


@functools.cache
def _installed_te_version() -> Version:
    for dist in ("transformer-engine", "transformer_engine"):
        try:
            return Version(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            continue
    return Version("0.0.0")


def te_version() -> Version:
    """The version of the ``te`` in force; without TE, the installed distribution's (or 0.0.0).

    Reading the distribution's metadata works where importing TE fails (CPU-only torch).
    """
    module = _current("te")
    if have_te() and getattr(module, "__version__", None) is not None:
        return Version(str(module.__version__))
    return _installed_te_version()


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether the TE in force is at least ``version`` (strictly newer without equality)."""
    if check_equality:
        return te_version() >= Version(version)
    return te_version() > Version(version)


def require_te(what: str, min_version: Optional[str] = None) -> None:
    """Raises unless TE is importable (ImportError) and at least ``min_version`` (RuntimeError)."""
    if not have_te():
        raise ImportError(
            f"{what} requires Transformer Engine, which cannot be imported here (not installed, "
            f"or unusable with this torch build). Install it with: {TE_INSTALL_HINT}"
        )
    if min_version is not None and not is_te_min_version(min_version):
        raise RuntimeError(
            f"{what} requires Transformer Engine >= {min_version}, found {te_version()}. "
            f"Upgrade with: pip install --upgrade 'transformer-engine[pytorch]>={min_version}'"
        )
