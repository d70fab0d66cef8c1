"""Patches an installed upstream megatron-core: every MLP path computes its configured activation.

``patch_megatron_core()`` is the one call a training script adds (or ``MCORE_ACTIVATIONS_PATCH=1``
for scripts nobody edits; see ``mcore_activations.autopatch``). It

1. reads the installed megatron-core's version and refuses one it does not know;
2. checks that every upstream function and class it touches has the source it was written
   against (``upstream_fingerprints``), and refuses otherwise, naming each difference;
3. replaces upstream's fused activation entry points with this package's compile-safe ones (a
   clamp or offset reaches compiled code as a tensor, never as a Python float), in their module
   and in every upstream module that imported them by name;
4. makes each MLP class decide its activation once, at construction, from one
   :class:`ActivationSpec` (``activation_path``; ``te_lowering`` for Transformer Engine ops), so
   the layer computes exactly the configured activation or raises
   :class:`UnsupportedActivationError` when it is built;
5. returns a :class:`PatchReport` naming every replaced object. ``unpatch_megatron_core()``
   restores the originals.

Steps 3 and 4 are one target patcher per upstream place (:data:`TARGET_PATCHERS`, in
``mcore_activations.upstream_patch``), each writing its own report lines and undo entries; what
differs between the known upstream versions is data beside their fingerprints.

Patch before building the model: then an activation no path computes fails at construction. A
layer built before the patch decides at its first forward (or first op build) instead. What is
patched, and why, is listed in docs/using-with-megatron-lm.md.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

from mcore_activations.fusions import fc2_chunks, in_place, output_recompute
from mcore_activations.patch_env import ENV_VAR
from mcore_activations.upstream_patch.entry_points import (
    FUSION_MODULES,
    fusion_names,
    patch_entry_points,
)
from mcore_activations.upstream_patch.grouped_experts import patch_grouped_experts
from mcore_activations.upstream_patch.mlp import patch_mlp
from mcore_activations.upstream_patch.patcher import Patcher
from mcore_activations.upstream_patch.report import PatchedObject, PatchReport
from mcore_activations.upstream_patch.shared_experts import patch_shared_experts
from mcore_activations.upstream_patch.te_fused import patch_te_fused
from mcore_activations.upstream_patch.upstream import (
    METHOD_TARGETS,
    UnsupportedUpstreamError,
    check_upstream,
    identify_upstream,
    installed_upstream,
    is_standalone_fork,
    source_fingerprint,
)

__all__ = [
    "ENV_VAR",
    "FUSION_MODULES",
    "METHOD_TARGETS",
    "PatchReport",
    "PatchedObject",
    "TARGET_PATCHERS",
    "UnsupportedUpstreamError",
    "check_upstream",
    "fusion_names",
    "installed_upstream",
    "is_standalone_fork",
    "patch_megatron_core",
    "patch_report",
    "source_fingerprint",
    "unpatch_megatron_core",
]

# In order: the entry points first, so that the MLP classes' patches wrap the fixed ones.
TARGET_PATCHERS = (
    patch_entry_points,
    patch_mlp,
    patch_shared_experts,
    patch_grouped_experts,
    patch_te_fused,
)

_lock = threading.Lock()
# The process-default options a patch call may set: keyword -> (checker, setter). Their defaults
# before the first patch call that set them are kept in _state[keyword] and restored by the
# unpatch (absent when no patch call set them).
_OPTIONS = {
    "in_place_backward": (in_place.check_option, in_place.set_in_place_backward),
    "recompute_output": (output_recompute.check_option, output_recompute.set_recompute_output),
    "fc2_chunks": (fc2_chunks.check_option, fc2_chunks.set_fc2_chunks),
}
_state: dict[str, Any] = {"report": None, "patcher": None}


def patch_megatron_core(
    in_place_backward: Optional[bool] = None,
    recompute_output: Optional[bool] = None,
    fc2_chunks: Optional[int] = None,
) -> PatchReport:
    """Patches the installed upstream megatron-core (idempotent); returns what it patched.

    The options set a process default (docs/performance.md, "Low-memory backward"): True or
    False sets it, also on a call that finds the patch in force; None (the default) keeps the
    one chosen by the environment or an earlier call (off unless set).
    :func:`unpatch_megatron_core` restores the defaults this call replaced.

    Args:
        in_place_backward: The fused activations' backward writes the input gradient over the
            saved fc1 output instead of a new buffer (``MCORE_ACTIVATIONS_IN_PLACE_BACKWARD``).
            Layers whose config makes it unsafe (activation offloading, ``moe_act`` recompute,
            CUDA graphs) are refused when built.
        recompute_output: ``MLP`` layers on the fused path free the activation's output once
            fc2 has run and recompute it before fc2's backward
            (``MCORE_ACTIVATIONS_RECOMPUTE_OUTPUT``).
        fc2_chunks: ``MLP`` layers run the activation and fc2 on this many row blocks of fc1's
            output, so that with both options above the backward holds one block's activation
            output and gradient at a time (``MCORE_ACTIVATIONS_FC2_CHUNKS``; 1: off). Layers it
            cannot serve (sequence-parallel fc2, FP8, either option off) are refused when built.

    Returns:
        The report of the patch in force: the same object on every call until
        :func:`unpatch_megatron_core`.

    Raises:
        TypeError: ``in_place_backward`` or ``recompute_output`` is not True, False or None;
            ``fc2_chunks`` is not a positive int or None.
        ValueError: ``fc2_chunks`` is below 1.
        UnsupportedUpstreamError: The installed megatron-core is unknown or modified; nothing
            was patched.
    """
    requested = {
        "in_place_backward": in_place_backward,
        "recompute_output": recompute_output,
        "fc2_chunks": fc2_chunks,
    }
    for name, value in requested.items():
        _OPTIONS[name][0](value)
    with _lock:
        for name, value in requested.items():
            if value is not None:
                _state.setdefault(name, _OPTIONS[name][1](value))
        if _state["report"] is not None:
            return _state["report"]
        try:
            patcher = Patcher(identify_upstream())
            try:
                for patch_target in TARGET_PATCHERS:
                    patch_target(patcher)
            except Exception:
                patcher.undo()
                raise
        except Exception:
            _restore_option_defaults()
            raise
        _state.update(report=patcher.report(), patcher=patcher)
        return _state["report"]


def unpatch_megatron_core() -> None:
    """Restores every object :func:`patch_megatron_core` replaced (no-op when not patched).

    A layer built while patched then runs upstream's own forward again, computing what upstream
    computes for its config, until the next :func:`patch_megatron_core` gives it the fixed path
    back. The options' process defaults return to what they were before a patch call set them.
    """
    with _lock:
        if _state["patcher"] is not None:
            _state["patcher"].undo()
        _state.update(report=None, patcher=None)
        _restore_option_defaults()


def _restore_option_defaults() -> None:
    for name, (_, setter) in _OPTIONS.items():
        if name in _state:
            setter(_state.pop(name))


def patch_report() -> Optional[PatchReport]:
    """The report of the patch in force, or None."""
    return _state["report"]
