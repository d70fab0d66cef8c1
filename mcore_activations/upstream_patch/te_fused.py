"""Target patcher: Transformer Engine's fused MLP classes build the lowering of the layer's spec.

``TEFusedMLP`` asks for its activation op in a method or, where upstream builds it in the
module-level ``_make_te_ops_activation`` (``Capabilities.te_activation_op_method`` false), in a
function that takes no layer: the layer is handed over while its ``_make_fused_impl`` runs.
Either way the answer is the layer's :func:`~mcore_activations.te_lowering.plan_te_activation`,
built at construction by ``mlp.attach_mlp_activation``. ``TEActivationOp`` becomes this package's
lowering too, and ``TEFusedMLP.forward`` refuses a per-token scale its op sequence would drop.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
from collections.abc import Callable

from mcore_activations.upstream_patch.mlp import attach_mlp_activation
from mcore_activations.upstream_patch.patcher import Patcher
from mcore_activations.upstream_patch.upstream import TE_MODULE

# The TE fused MLP whose op sequence is being built in this thread (a module-level
# _make_te_ops_activation has no `self`, so the layer is handed over through this variable).
BUILDING_TE_FUSED_MLP: contextvars.ContextVar = contextvars.ContextVar("building_te_fused_mlp")


def _planned_activation_op(layer):
    if not hasattr(layer, "_mcore_te_activation"):
        attach_mlp_activation(layer)  # a layer built before the patch: lower now
    return layer._mcore_te_activation.build()


def _make_activation_op(self, activation_func, gated_linear_unit, cache_quantized_input):
    """TEFusedMLP's activation op (a method upstream): the lowering of the layer's spec."""
    del activation_func, gated_linear_unit, cache_quantized_input  # the spec holds all of it
    return _planned_activation_op(self)


def _wrap_make_fused_impl(original: Callable) -> Callable:
    @functools.wraps(original)
    def _make_fused_impl(self):
        token = BUILDING_TE_FUSED_MLP.set(self)
        try:
            return original(self)
        finally:
            BUILDING_TE_FUSED_MLP.reset(token)

    return _make_fused_impl


def _make_te_ops_activation(activation_func, gated_linear_unit, cache_quantized_input):
    """Upstream's module-level TE activation-op builder, answered by the layer's lowering."""
    layer = BUILDING_TE_FUSED_MLP.get(None)
    if layer is not None:
        return _planned_activation_op(layer)
    from mcore_activations.te_lowering import _make_te_ops_activation as plain_lowering

    return plain_lowering(activation_func, gated_linear_unit, cache_quantized_input)


def _wrap_te_fused_forward(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        if kwargs.get("per_token_scale") is not None:
            raise ValueError(
                f"{type(self).__name__} got per_token_scale, which its Transformer Engine op "
                "sequence cannot apply (upstream dropped it silently). Use MLP or SequentialMLP "
                "for experts weighted per token."
            )
        return original(self, hidden_states, *args, **kwargs)

    return forward


def _te_activation_op_new(cls, config):
    from mcore_activations.te_lowering import TEActivationOp

    return TEActivationOp.__new__(TEActivationOp, config)


def patch_te_fused(patcher: Patcher) -> None:
    """The TE fused classes' activation ops become the lowering; skipped where TE is absent."""
    te_module = importlib.import_module(TE_MODULE)
    te_fused = getattr(te_module, "TEFusedMLP", None)
    if te_fused is None:
        patcher.skip(f"{TE_MODULE}:TEFusedMLP and TEActivationOp", "TE is not importable")
        return
    if patcher.capabilities.te_activation_op_method:
        patcher.set(te_fused, "_make_activation_op", _make_activation_op)
        patcher.record(f"{TE_MODULE}:TEFusedMLP._make_activation_op", "replaced", "TE lowering")
    else:
        patcher.set(te_fused, "_make_fused_impl", _wrap_make_fused_impl(te_fused._make_fused_impl))
        patcher.set(te_module, "_make_te_ops_activation", _make_te_ops_activation)
        patcher.record(f"{TE_MODULE}:_make_te_ops_activation", "replaced", "TE lowering")
    patcher.set(te_fused, "forward", _wrap_te_fused_forward(te_fused.forward))
    patcher.record(f"{TE_MODULE}:TEFusedMLP.forward", "wrapped", "refuses per_token_scale")
    patcher.set(te_module.TEActivationOp, "__new__", _te_activation_op_new)
    patcher.record(f"{TE_MODULE}:TEActivationOp.__new__", "replaced", "TE lowering")
