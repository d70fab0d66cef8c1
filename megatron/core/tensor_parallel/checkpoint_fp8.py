"""The Transformer Engine FP8 state a checkpointed block ran under, replayed for its recomputation.

A block checkpointed inside TE's FP8 autocast is recomputed during backward, after the autocast
region has closed. Recomputed as it stands, its TE modules would run in higher precision (a
weight kept as FP8 parameters is dequantized into a plain tensor), so the gradient would belong
to other math than the forward's, without any error. The forward therefore records the FP8 state
(:func:`capture`), and the recomputation re-enters it (:func:`recompute_phase`) - disabled if
the forward ran without FP8, even when backward itself runs inside an autocast.

Both phases also run inside TE's ``activation_recompute_forward``: in the forward TE keeps each
module's scaling factors, and in the recomputation it restores them, so delayed scaling
quantizes the recomputation exactly as it quantized the forward (the scales have moved on by
then). Whatever TE itself does with the recomputation's amaxes is TE's own checkpoint's
behaviour too; the recomputation sees the forward's inputs, so they are the forward's amaxes.

Without Transformer Engine :func:`capture` returns None and both phases do nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

from mcore_activations import te_import

__all__ = ["FP8State", "capture", "forward_phase", "recompute_phase"]


@dataclass(frozen=True)
class FP8State:
    """TE's global FP8 autocast state at a block's forward."""

    enabled: bool
    calibrating: bool
    recipe: Any
    group: Any


def _state_manager():
    # TE 2.x keeps it in ``quantization``; earlier versions (and an alias since) in ``fp8``. A TE
    # without it has no FP8 autocast for its modules to read either, so there is nothing to replay.
    pytorch = te_import.te.pytorch
    for module_name in ("quantization", "fp8"):
        manager = getattr(getattr(pytorch, module_name, None), "FP8GlobalStateManager", None)
        if manager is not None:
            return manager
    return None


def capture() -> Optional[FP8State]:
    """The FP8 state in force now, or None without Transformer Engine."""
    if not te_import.have_te():
        return None
    manager = _state_manager()
    if manager is None:
        return None
    enabled = bool(manager.is_fp8_enabled())
    calibrating = bool(manager.is_fp8_calibration())
    # Calibration runs under a recipe too (recording amaxes without quantizing); without it the
    # recomputation's autocast would fall back to TE's default recipe.
    active = enabled or calibrating
    return FP8State(
        enabled=enabled,
        calibrating=calibrating,
        recipe=manager.get_fp8_recipe() if active else None,
        group=manager.get_fp8_group() if active else None,
    )


def _activation_recompute(recompute: bool):
    return te_import.te.pytorch.distributed.activation_recompute_forward(
        activation_recompute=True, recompute_phase=recompute
    )


@contextlib.contextmanager
def forward_phase(state: Optional[FP8State]) -> Iterator[None]:
    """Around the block's first (no-grad) forward: TE keeps what the recomputation needs."""
    if state is None:
        yield
        return
    with _activation_recompute(False):
        yield


def _autocast(state: FP8State):
    pytorch = te_import.te.pytorch
    # Calibration (recording amaxes without quantizing) is rare; pass it only when on.
    calibrating = {"calibrating": True} if state.calibrating else {}
    autocast = getattr(pytorch, "autocast", None)  # TE >= 2.8; fp8_autocast before
    if autocast is not None:
        return autocast(
            enabled=state.enabled,
            recipe=state.recipe,
            amax_reduction_group=state.group,
            **calibrating,
        )
    return pytorch.fp8_autocast(
        enabled=state.enabled, fp8_recipe=state.recipe, fp8_group=state.group, **calibrating
    )


@contextlib.contextmanager
def recompute_phase(state: Optional[FP8State]) -> Iterator[None]:
    """Around the recomputation: the forward's FP8 state, and TE's recompute phase."""
    if state is None:
        yield
        return
    with _autocast(state), _activation_recompute(True):
        yield
