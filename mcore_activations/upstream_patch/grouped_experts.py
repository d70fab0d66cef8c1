"""Target patcher: upstream's grouped experts compute the spec, or refuse it at construction.

``TEGroupedMLP.__init__`` is wrapped to attach the layer's spec and refuse what its chosen path
would compute wrongly: the op-fuser path builds one Transformer Engine op from a fixed list, the
fused-bias path fuses only SwiGLU and quick-GEGLU. Where upstream's fused-bias branch drops the
SwiGLU clamp (``Capabilities.grouped_fused_swiglu_drops_clamp``), the layer's forward hands its
spec to that call instead.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
from collections.abc import Callable

import torch

from mcore_activations.activation_spec import ActivationKind, ActivationSpec
from mcore_activations.fusions import in_place
from mcore_activations.fusions.kernel_plan import KernelPlan
from mcore_activations.upstream_fingerprints import Capabilities
from mcore_activations.upstream_patch.patcher import Patcher, layer_spec, refuse, wrap_init
from mcore_activations.upstream_patch.upstream import EXPERTS_MODULE, Upstream

# The TEGroupedMLP whose forward runs in this thread. Where upstream's fused branch calls
# weighted_bias_swiglu_impl without the layer's clamp, the call made during the layer's forward
# is answered with the layer's whole spec instead (_make_grouped_weighted_swiglu).
RUNNING_GROUPED_MLP: contextvars.ContextVar = contextvars.ContextVar("running_grouped_mlp")


def _check_grouped_ops_choice(capabilities: Capabilities, spec: ActivationSpec, path: str) -> None:
    """Refuses a spec whose op upstream's grouped-MLP op builder would pick wrongly."""
    offset = spec.linear_offset
    if spec.kind == ActivationKind.SILU and spec.gated and spec.is_plain:
        return  # ScaledSwiGLU
    if capabilities.grouped_ops_clamped_swiglu and spec.kind == ActivationKind.SILU and spec.gated:
        if spec.clamp_value is not None and not offset and spec.gate_tanh_scale is None:
            return  # ScaledClampedQGeGLU(alpha=1, limit=c, glu_linear_offset=0)
    if spec.kind == ActivationKind.QUICK_GELU and spec.gated:
        if spec.clamp_value == 7.0 and offset == 1.0:
            return  # TE's defaults, which upstream always uses
    if spec.kind == ActivationKind.SQUARED_RELU and not spec.gated and spec.is_plain:
        return  # ScaledSReLU
    refuse(
        path,
        spec,
        "upstream's grouped-MLP op builder does not pass this activation's clamp, offset or "
        "scale to Transformer Engine (it would silently compute another function)",
        "Set use_transformer_engine_op_fuser=False: the unfused TEGroupedMLP computes it.",
    )


def _check_fused_bias_path(upstream: Upstream, layer, spec: ActivationSpec, path: str) -> None:
    """Refuses a spec upstream's fused-bias branch of ``TEGroupedMLP`` cannot compute."""
    if not (spec.gated and spec.kind in (ActivationKind.SILU, ActivationKind.QUICK_GELU)):
        refuse(
            path,
            spec,
            "upstream's TEGroupedMLP fuses only SwiGLU and quick-GEGLU (it raises at the "
            "first forward otherwise)",
            "Set bias_activation_fusion=False: its unfused activation computes it.",
        )
    if (
        upstream.capabilities.grouped_fused_swiglu_drops_clamp
        and spec.kind == ActivationKind.SILU
        and spec.clamp_value is not None
        and getattr(layer, "activation_recompute", False)
    ):
        # The layer's forward hands its spec to the fused call; a recompute re-runs that call in
        # the backward, outside the forward (_make_grouped_weighted_swiglu).
        refuse(
            path,
            spec,
            f"megatron-core {upstream.key}'s TEGroupedMLP calls the fused SwiGLU without the "
            "clamp, and with moe_act recompute the patch cannot hand it the layer's clamp",
            "Leave 'moe_act' out of recompute_modules, or set bias_activation_fusion=False "
            "(its unfused activation computes the clamp exactly).",
        )


def _check_grouped_mlp(upstream: Upstream):
    def after(layer) -> None:
        config = layer.config
        k = getattr(config, "moe_mlp_glu_interleave_size", None)
        spec = layer_spec(layer, k)
        layer.activation_spec = spec
        owner = type(layer).__name__
        if owner == "InferenceGroupedMLP" and not spec.is_plain:
            refuse(
                owner,
                spec,
                "upstream's inference MoE kernels (FlashInfer and megatron's own) take no clamp or "
                "offset",
                "Serve this model with TEGroupedMLP or SequentialMLP experts.",
            )
        if getattr(layer, "_with_fused_impl", False):
            path = f"{owner}(use_transformer_engine_op_fuser=True)"
            _check_grouped_ops_choice(upstream.capabilities, spec, path)
        elif (
            config.bias_activation_fusion
            and k is None
            and not isinstance(layer.activation_func, torch.nn.Module)
        ):
            _check_fused_bias_path(upstream, layer, spec, f"{owner}(bias_activation_fusion=True)")
            in_place.check_layer_config(config, owner)
            # What the fused call of _make_grouped_weighted_swiglu needs, derived once.
            layer._mcore_kernel_plan = KernelPlan(spec)

    return after


def _wrap_grouped_forward(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        token = RUNNING_GROUPED_MLP.set(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            RUNNING_GROUPED_MLP.reset(token)

    return forward


def _make_grouped_weighted_swiglu(plain: Callable) -> Callable:
    """``experts.weighted_bias_swiglu_impl`` that computes the running TEGroupedMLP's spec.

    ``fp8_input_store`` is upstream's argument, which it reads from the config at every call.
    """
    from mcore_activations.fusions.fused_activation import (
        fused_activation,
        fused_activation_with_plan,
    )

    @functools.wraps(plain)
    def weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store=False, *args, **kwargs):
        layer = RUNNING_GROUPED_MLP.get(None)
        spec = getattr(layer, "activation_spec", None)
        if spec is None or bias is not None or args or kwargs:
            return plain(input, bias, weights, fp8_input_store, *args, **kwargs)
        plan = getattr(layer, "_mcore_kernel_plan", None)
        if plan is None or plan.spec is not spec:
            # A layer whose config took the fused branch, or whose activation_spec was
            # assigned, after construction.
            return fused_activation(input, spec, probs=weights, fp8_input_store=fp8_input_store)
        return fused_activation_with_plan(
            plan, input, None, weights, fp8_input_store=fp8_input_store
        )

    return weighted_bias_swiglu_impl


def patch_grouped_experts(patcher: Patcher) -> None:
    """Wraps ``TEGroupedMLP.__init__``; where upstream drops the clamp, hands the spec over."""
    experts = importlib.import_module(EXPERTS_MODULE)
    grouped = experts.TEGroupedMLP
    patcher.set(
        grouped, "__init__", wrap_init(grouped.__init__, _check_grouped_mlp(patcher.upstream))
    )
    patcher.record(
        f"{EXPERTS_MODULE}:TEGroupedMLP.__init__",
        "wrapped",
        "refuses activations its fused paths would compute wrongly",
    )
    if not patcher.capabilities.grouped_fused_swiglu_drops_clamp:
        return
    patcher.set(grouped, "forward", _wrap_grouped_forward(grouped.forward))
    patcher.record(
        f"{EXPERTS_MODULE}:TEGroupedMLP.forward",
        "wrapped",
        "hands the layer's spec to its fused SwiGLU call (which drops the clamp)",
    )
    patcher.set(
        experts,
        "weighted_bias_swiglu_impl",
        _make_grouped_weighted_swiglu(experts.weighted_bias_swiglu_impl),
    )
    patcher.record(
        f"{EXPERTS_MODULE}:weighted_bias_swiglu_impl",
        "replaced",
        "computes the running TEGroupedMLP's clamp",
    )
