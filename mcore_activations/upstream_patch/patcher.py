"""The undo log and report lines every target patcher writes through, and what they share.

A target patcher is a function ``patch_<target>(patcher)`` that replaces or wraps the upstream
objects of one place (the MLP, the shared experts, ...) through :meth:`Patcher.set`, which
remembers what was there, and names each in the report with :meth:`Patcher.record`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any, Optional

from mcore_activations.activation_spec import ActivationSpec, UnsupportedActivationError
from mcore_activations.upstream_fingerprints import Capabilities
from mcore_activations.upstream_patch.report import PatchedObject, PatchReport
from mcore_activations.upstream_patch.upstream import TE_MODULE, Upstream

_MISSING = object()


class Patcher:
    """One application of the patch: its upstream, its undo log and its report lines.

    Args:
        upstream: The installed upstream, already checked.
    """

    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self._undo: list[tuple[Any, str, Any]] = []
        self._patched: list[PatchedObject] = []
        self._skipped: list[tuple[str, str]] = []

    @property
    def capabilities(self) -> Capabilities:
        """What the installed upstream's own code does (``upstream_fingerprints.CAPABILITIES``)."""
        return self.upstream.capabilities

    def set(self, owner, name: str, value) -> None:
        """Sets ``owner.name`` to ``value``, remembering what :meth:`undo` restores.

        For a class, only its own ``__dict__`` entry counts: an inherited attribute is deleted
        again on undo, not copied onto the class.
        """
        if isinstance(owner, type):
            self._undo.append((owner, name, owner.__dict__.get(name, _MISSING)))
        else:
            self._undo.append((owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def record(self, target: str, action: str, reason: str) -> None:
        """Adds one report line: ``target`` (``module:qualname``) was ``action``-ed, and why."""
        self._patched.append(PatchedObject(target, action, reason))

    def skip(self, target: str, reason: str) -> None:
        """Adds one skipped line: ``target`` is absent from this installation, and why."""
        self._skipped.append((target, reason))

    def undo(self) -> None:
        """Restores every object set through this patcher, the last first."""
        for owner, name, old in reversed(self._undo):
            if old is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._undo.clear()

    def report(self) -> PatchReport:
        """What was patched and skipped so far, for the user."""
        return PatchReport(
            upstream=f"{self.upstream.description} ({self.upstream.label})",
            patched=tuple(self._patched),
            skipped=tuple(self._skipped),
        )


# ------------------------------------------------------------- shared by the target patchers


def layer_spec(layer, glu_interleave_size: Optional[int] = None) -> ActivationSpec:
    """The activation spec of an upstream layer's config."""
    return ActivationSpec.from_config(layer.config, glu_interleave_size=glu_interleave_size)


def refuse(path: str, spec: ActivationSpec, reason: str, alternative: str):
    """Raises :class:`UnsupportedActivationError` for ``spec`` on ``path``."""
    raise UnsupportedActivationError(path, spec, reason, alternative)


def te_class(name: str):
    """Upstream's Transformer Engine class ``name``, or None where TE did not import."""
    module = sys.modules.get(TE_MODULE)
    return getattr(module, name, None) if module is not None else None


def is_te_instance(layer, class_name: str) -> bool:
    """Whether ``layer`` is an instance of upstream's TE class ``class_name``."""
    cls = te_class(class_name)
    return isinstance(cls, type) and isinstance(layer, cls)


def wrap_init(original: Callable, after: Callable[[Any], None]) -> Callable:
    """``original`` (an ``__init__``), then ``after(self)``."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        after(self)

    return __init__
