"""Target patcher: upstream's shared experts compute the spec, or refuse it at construction.

The overlapped ``SharedExpertMLP`` runs fc1 and the activation on a side stream in its own
method, which is replaced by one that computes the layer's spec. ``FusedSharedExpertMLP`` builds
one hard-coded Transformer Engine op; its validation is wrapped to refuse every activation that
op does not compute.
"""

from __future__ import annotations

import functools
import importlib

import torch

from mcore_activations.activation_spec import ActivationKind
from mcore_activations.upstream_fingerprints import Capabilities
from mcore_activations.upstream_patch.mlp import mlp_activate
from mcore_activations.upstream_patch.patcher import Patcher, layer_spec, refuse
from mcore_activations.upstream_patch.upstream import SHARED_MODULE


def _make_shared_fc1_forward_and_act(shared_module):
    state = shared_module.SharedExpertState

    def linear_fc1_forward_and_act(self, overlapped_comm_output=None):
        """Shared-expert fc1 and activation on the side stream (mcore_activations)."""
        with torch.cuda.stream(self.stream):
            intermediate, bias = self.linear_fc1(self.cached_fc1_input)
            self.cached_fc1_input = None
            intermediate = mlp_activate(self, intermediate, bias, None)
            self.cached_fc2_input = intermediate
        if overlapped_comm_output is not None and overlapped_comm_output.grad_fn is not None:
            # As upstream: order the backward so the dispatcher's communication launches first.
            target = overlapped_comm_output.grad_fn._sequence_nr() - 1
            shared_module.set_tensor_grad_fn_sequence_sr(intermediate, target)
            self.cached_fc2_input = shared_module._BackwardStreamWait.apply(
                intermediate, self.stream
            )

    return shared_module.overlap_state_check(state.PRE_FORWARD_COMM_DONE, state.FC1_FORWARD_DONE)(
        linear_fc1_forward_and_act
    )


def _check_fused_shared_expert(capabilities: Capabilities):
    def after(layer) -> None:
        spec = layer_spec(layer)
        plain_swiglu = spec.kind == ActivationKind.SILU and spec.gated and spec.is_plain
        clamped_swiglu = (
            capabilities.shared_expert_ops_clamped_swiglu
            and spec.kind == ActivationKind.SILU
            and spec.gated
            and spec.clamp_value is not None
            and not spec.linear_offset
            and spec.gate_tanh_scale is None
        )
        if not (plain_swiglu or clamped_swiglu):
            built = (
                "ScaledSwiGLU or a clamped SwiGLU"
                if capabilities.shared_expert_ops_clamped_swiglu
                else "ScaledSwiGLU only"
            )
            refuse(
                type(layer).__name__,
                spec,
                f"upstream's FusedSharedExpertMLP builds {built}, whatever else is configured",
                "Set use_grouped_gemm_for_shared_expert=False: SharedExpertMLP computes it.",
            )

    return after


def patch_shared_experts(patcher: Patcher) -> None:
    """Replaces the overlapped fc1-and-activation; wraps the fused class's validation."""
    shared = importlib.import_module(SHARED_MODULE)
    patcher.set(
        shared.SharedExpertMLP,
        "linear_fc1_forward_and_act",
        _make_shared_fc1_forward_and_act(shared),
    )
    patcher.record(
        f"{SHARED_MODULE}:SharedExpertMLP.linear_fc1_forward_and_act",
        "replaced",
        "the overlapped shared expert computes the spec",
    )
    fused_shared = getattr(shared, "FusedSharedExpertMLP", None)
    if fused_shared is None:
        return
    original = fused_shared._validate_fused_grouped_swiglu
    after = _check_fused_shared_expert(patcher.capabilities)

    @functools.wraps(original)
    def validate(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        after(self)
        return result

    patcher.set(fused_shared, "_validate_fused_grouped_swiglu", validate)
    patcher.record(
        f"{SHARED_MODULE}:FusedSharedExpertMLP._validate_fused_grouped_swiglu",
        "wrapped",
        "refuses activations its hard-coded op does not compute",
    )
