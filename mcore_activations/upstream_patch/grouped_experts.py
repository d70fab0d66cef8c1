"""Target patcher: upstream's grouped experts compute the spec, or refuse it at construction.

``TEGroupedMLP.__init__`` is wrapped to attach the layer's spec and refuse what its chosen path
would compute wrongly: the op-fuser path builds one Transformer Engine op from a fixed list, the
fused-bias path fuses only SwiGLU and quick-GEGLU. Where upstream's fused-bias branch drops the
SwiGLU clamp (``Capabilities.grouped_fused_swiglu_drops_clamp``), the layer's forward hands its
spec to that call instead.

``TEGroupedMLP.forward`` is wrapped too: on the fused-bias branch, with the output-recompute or
the fc2-chunks option on at the call, the layer runs this package's forward (fc1, the fused
activation and fc2, as upstream's branch computes them) so that fc2 saves a recipe of its input
and runs on row blocks; everything else is upstream's forward. Settings that forward does not
handle (FP8 and FP4 padding, TE's grouped tensors, fine-grained offloading, the ``moe_act``
recompute, NCCL-EP buffers) keep upstream's forward, and the fc2-chunks option refuses them.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
from collections.abc import Callable
from typing import Optional

import torch

from mcore_activations import activation_path as paths
from mcore_activations.activation_spec import ActivationKind, ActivationSpec
from mcore_activations.fusions import fc2_chunks, in_place, output_recompute
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
            return  # the op fuser's chain runs fc2 once, whatever the fc2-chunks option says
        if (
            config.bias_activation_fusion
            and k is None
            and not isinstance(layer.activation_func, torch.nn.Module)
        ):
            _check_fused_bias_path(upstream, layer, spec, f"{owner}(bias_activation_fusion=True)")
            in_place.check_layer_config(config, owner)
            # What the fused call of _make_grouped_weighted_swiglu needs, derived once.
            layer._mcore_kernel_plan = KernelPlan(spec)
            # No offload_config: upstream's weighted fused calls never tag their saved input
            # for TE's CPU offloading.
            layer._mcore_activation = paths.LayerActivation(
                spec,
                paths.FUSED_KERNEL_PATH,
                layer.activation_func,
                fp8_input_store=bool(config.activation_func_fp8_input_store),
            )
            kept = _upstream_forward_settings(layer)
            layer._mcore_upstream_forward_settings = kept
            layer._mcore_fc2_chunks_conflicts = fc2_chunks.check_layer(
                config, owner, layer._mcore_activation, is_expert=True, layer_conflicts=kept
            )
        else:
            path = "a TE activation module" if config.use_te_activation_func else "unfused"
            if k is not None:
                path += f" (moe_mlp_glu_interleave_size={k})"
            unfused = [
                f"upstream's {path} activation (only its fused-bias branch, "
                "bias_activation_fusion=True, runs this package's forward)"
            ]
            layer._mcore_fc2_chunks_conflicts = fc2_chunks.check_layer(
                config, owner, None, is_expert=True, layer_conflicts=unfused
            )

    return after


def _upstream_forward_settings(layer) -> tuple[str, ...]:
    """The settings of a fused-bias ``TEGroupedMLP`` that only upstream's forward handles."""
    config = layer.config
    found = []
    if config.use_te_activation_func:
        found.append("use_te_activation_func=True (upstream's forward applies activation_func)")
    if config.fp8 or config.fp4:
        found.append("FP8 / FP4 (upstream's forward pads each expert's rows)")
    if getattr(config, "moe_use_grouped_tensor", False):
        found.append("moe_use_grouped_tensor=True (TE's grouped tensors take the whole input)")
    for attribute in ("offload_expert_fc1", "offload_moe_act"):
        if getattr(layer, attribute, False):
            found.append(
                f"fine_grained_activation_offloading of {attribute[len('offload_') :]!r} "
                "(upstream's offload managers own fc1's output)"
            )
    if getattr(layer, "activation_recompute", False):
        found.append("'moe_act' in recompute_modules (upstream's checkpoint of the activation)")
    return tuple(found)


def _grouped_activation(layer) -> paths.LayerActivation:
    activation = layer._mcore_activation
    if activation.spec is not layer.activation_spec:
        # activation_spec was assigned after construction; the layer computes what it names.
        activation = layer._mcore_activation = activation.with_spec(layer.activation_spec)
    return activation


# Upstream's TEGroupedMLP.forward parameters, in order (0.19.2 and main).
_FORWARD_PARAMETERS = (
    "permuted_local_hidden_states",
    "tokens_per_expert",
    "permuted_probs",
    "output_buffer",
    "grad_input_buffer",
)


def _own_forward_arguments(layer, args, kwargs) -> Optional[tuple]:
    """``(hidden_states, tokens_per_expert, probs)`` when this call of a patched
    ``TEGroupedMLP`` runs :func:`_low_memory_forward`; None when upstream's forward runs it."""
    activation = getattr(layer, "_mcore_activation", None)
    conflicts = getattr(layer, "_mcore_fc2_chunks_conflicts", ())
    if fc2_chunks.fc2_chunks() > 1 and conflicts and torch.is_grad_enabled():
        # Upstream's forward would run in one piece without a word.
        fc2_chunks.refuse_late(type(layer).__name__, conflicts)
    if activation is None or getattr(layer, "_mcore_upstream_forward_settings", ()):
        return None
    if not (fc2_chunks.fc2_chunks() > 1 or output_recompute.resolve(activation.recompute_output)):
        return None
    if len(args) > len(_FORWARD_PARAMETERS) or set(kwargs) - set(_FORWARD_PARAMETERS):
        return None  # a call upstream's forward answers (with its own error)
    bound = dict(zip(_FORWARD_PARAMETERS, args))
    if set(bound) & set(kwargs):
        return None
    bound |= kwargs
    if bound.get("output_buffer") is not None or bound.get("grad_input_buffer") is not None:
        return None  # NCCL-EP's zero-copy buffers: upstream's forward says what they allow
    try:
        return tuple(bound[name] for name in _FORWARD_PARAMETERS[:3])
    except KeyError:
        return None


def _low_memory_forward(layer, hidden_states, tokens_per_expert, probs):
    """Upstream's fused-bias branch of ``TEGroupedMLP.forward`` (no padding, offloading or
    recompute, which :func:`_upstream_forward_settings` leaves to upstream), with fc2 saving a
    recipe of its input and running on row blocks (``fusions.fc2_chunks``)."""
    config = layer.config
    if isinstance(tokens_per_expert, torch.Tensor):
        tokens_per_expert = tokens_per_expert.tolist()
    splits = list(tokens_per_expert)
    probs = probs.unsqueeze(-1)
    if config.moe_apply_probs_on_input:
        assert config.moe_router_topk == 1, (
            "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
        )
        # The probabilities scale the input instead; the activation's weights become ones.
        hidden_states = (probs * hidden_states).to(hidden_states.dtype)
        probs = torch.ones_like(probs)
    fc1_output, bias = layer.linear_fc1(hidden_states, splits)
    output, output_bias = fc2_chunks.activation_and_fc2(
        _grouped_activation(layer),
        layer.linear_fc2,
        fc1_output,
        bias,
        probs,
        layer.activation_func,
        conflicts=layer._mcore_fc2_chunks_conflicts,
        owner=type(layer).__name__,
        tokens_per_expert=splits,
    )
    return layer._apply_bias(output, output_bias, splits, probs), None


def _wrap_grouped_forward(original: Callable, hands_spec_over: bool) -> Callable:
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        own = _own_forward_arguments(self, args, kwargs)
        if own is not None:
            return _low_memory_forward(self, *own)
        if not hands_spec_over:
            return original(self, *args, **kwargs)
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
    drops_clamp = patcher.capabilities.grouped_fused_swiglu_drops_clamp
    patcher.set(grouped, "forward", _wrap_grouped_forward(grouped.forward, drops_clamp))
    why = "runs fc2 on a recipe and row blocks when the memory options ask"
    if drops_clamp:
        why = f"hands the layer's spec to its fused SwiGLU call (which drops the clamp); {why}"
    patcher.record(f"{EXPERTS_MODULE}:TEGroupedMLP.forward", "wrapped", why)
    if not drops_clamp:
        return
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
