"""Fused (bias) SwiGLU: the upstream megatron.core API, on compile-safe kernels.

Every function here computes through :mod:`megatron.core.fusions.activation_kernels`, so plain,
clamped (DeepSeek-V4), weighted (MoE) and SiTU-GLU (Kimi-K3) SwiGLU share one implementation.
Layout: the gate is the first half of the last dim, the linear part the second half.

Numerics differ from upstream in one deliberate way: all math runs in float32 and is cast back to
the input dtype (upstream's unclamped SwiGLU computes in the input dtype). Results are therefore
closer to the float64 reference; the clamped variants were already float32 upstream.

Compile safety: ``clamp_value`` arguments are Python floats in the API. They are converted to a
float32 tensor before reaching compiled code, so a new value never reuses code compiled for an
earlier one (upstream issue #6918). ``clamped_swiglu`` and ``clamped_swiglu_back`` keep the
``_torchdynamo_orig_callable`` attribute of a ``torch.compile`` wrapper, pointing at their eager
twins.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from mcore_activations.activation_spec import (
    ActivationKind,
    ActivationSpec,
    check_clamps_exclusive,
)
from mcore_activations.fusions.fused_activation import (
    activation_backward,
    activation_forward,
    check_impl_input,
    fused_activation,
    save_and_forward,
    saved_backward,
)
from mcore_activations.kernel_params import scalar_argument

SWIGLU = ActivationSpec(ActivationKind.SILU, gated=True)


def swiglu_spec(
    clamp_value: Optional[float] = None,
    gate_clamp_scale: Optional[float] = None,
    linear_clamp_scale: Optional[float] = None,
) -> ActivationSpec:
    """The SwiGLU variant selected by the fused-SwiGLU keyword arguments.

    Args:
        clamp_value: DeepSeek-V4 clamp ``c``; as upstream, applied only when ``c > 0``.
        gate_clamp_scale: SiTU-GLU gate scale ``s_g``.
        linear_clamp_scale: SiTU-GLU linear scale ``s_l`` (requires ``gate_clamp_scale``).

    Raises:
        TypeError: an argument that is not a real number (named in the message).
        ValueError: for a clamp combined with tanh scales, a linear scale without a gate scale,
            or a non-finite / non-positive scale.
    """
    clamp_value = scalar_argument("clamp_value", clamp_value)
    gate_clamp_scale = scalar_argument("gate_clamp_scale", gate_clamp_scale)
    linear_clamp_scale = scalar_argument("linear_clamp_scale", linear_clamp_scale)
    if clamp_value is not None and math.isnan(clamp_value):
        raise ValueError(
            "clamp_value=nan is not a clamp; pass None (or, as upstream, a value <= 0) for none."
        )
    clamp = clamp_value if clamp_value is not None and clamp_value > 0 else None
    check_clamps_exclusive(clamp, gate_clamp_scale, ("clamp_value", "gate_clamp_scale"))
    if linear_clamp_scale is not None and gate_clamp_scale is None:
        raise ValueError(
            f"linear_clamp_scale={linear_clamp_scale!r} requires gate_clamp_scale (SiTU-GLU)."
        )
    if clamp is None and gate_clamp_scale is None:
        return SWIGLU
    return ActivationSpec(
        ActivationKind.SILU,
        gated=True,
        clamp_value=clamp,
        gate_tanh_scale=gate_clamp_scale,
        linear_tanh_scale=linear_clamp_scale,
    )


def _clamped_spec(clamp_value) -> ActivationSpec:
    # The explicit ``clamped_*`` functions always clamp; the spec rejects c <= 0 or non-finite c.
    clamp = scalar_argument("clamp_value", clamp_value)
    if clamp is None:
        raise TypeError("clamp_value must be a real number, got None.")
    return ActivationSpec(ActivationKind.SILU, gated=True, clamp_value=clamp)


# --------------------------------------------------------------------------- forward functions
def swiglu(y):
    """``silu(y1) * y2``."""
    return activation_forward(SWIGLU, y)


def bias_swiglu(y, bias):
    """``swiglu(y + bias)``."""
    return activation_forward(SWIGLU, y, bias=bias)


def weighted_swiglu(y, weights):
    """``swiglu(y) * weights`` (one weight per row), in ``y.dtype``."""
    return activation_forward(SWIGLU, y, probs=weights)


def _clamped_swiglu_eager(y, clamp_value):
    return activation_forward(_clamped_spec(clamp_value), y, eager=True)


def clamped_swiglu(y, clamp_value):
    """``silu(min(y1, c)) * clamp(y2, -c, c)`` computed in float32, in ``y.dtype``."""
    return activation_forward(_clamped_spec(clamp_value), y)


clamped_swiglu._torchdynamo_orig_callable = _clamped_swiglu_eager


def bias_clamped_swiglu(y, bias, clamp_value):
    """``clamped_swiglu(y + bias, clamp_value)``."""
    return activation_forward(_clamped_spec(clamp_value), y, bias=bias)


def clamped_weighted_swiglu(y, weights, clamp_value):
    """``clamped_swiglu(y, clamp_value) * weights``, in ``y.dtype``."""
    return activation_forward(_clamped_spec(clamp_value), y, probs=weights)


# -------------------------------------------------------------------------- backward functions
def swiglu_back(g, y):
    """Gradient of :func:`swiglu` w.r.t. ``y``."""
    return activation_backward(SWIGLU, g, y)[0]


def bias_swiglu_back(g, y, bias):
    """Gradient of :func:`bias_swiglu` w.r.t. ``y`` (equal to the unreduced bias gradient)."""
    return activation_backward(SWIGLU, g, y, bias=bias)[0]


def weighted_swiglu_back(g, y, weights):
    """Gradients of :func:`weighted_swiglu`: ``(dy, dweights)``."""
    dx, _, dw = activation_backward(SWIGLU, g, y, probs=weights)
    return dx, dw


def _clamped_swiglu_back_eager(g, y, clamp_value):
    return activation_backward(_clamped_spec(clamp_value), g, y, eager=True)[0]


def clamped_swiglu_back(g, y, clamp_value):
    """Gradient of :func:`clamped_swiglu`; clamp masks are inclusive at ``c``."""
    return activation_backward(_clamped_spec(clamp_value), g, y)[0]


clamped_swiglu_back._torchdynamo_orig_callable = _clamped_swiglu_back_eager


def bias_clamped_swiglu_back(g, y, bias, clamp_value):
    """Gradient of :func:`bias_clamped_swiglu` w.r.t. ``y``."""
    return activation_backward(_clamped_spec(clamp_value), g, y, bias=bias)[0]


def clamped_weighted_swiglu_back(g, y, weights, clamp_value):
    """Gradients of :func:`clamped_weighted_swiglu`: ``(dy, dweights)``."""
    dx, _, dw = activation_backward(_clamped_spec(clamp_value), g, y, probs=weights)
    return dx, dw


# ---------------------------------------------------------------------------- autograd Functions
class BiasSwiGLUFunction(torch.autograd.Function):
    """SwiGLU of ``input + bias`` (clamped when ``clamp_value > 0``)."""

    @staticmethod
    def forward(ctx, input, bias, fp8_input_store, cpu_offload_input, clamp_value=None):
        """See :func:`bias_swiglu_impl`."""
        spec = swiglu_spec(clamp_value)
        return save_and_forward(ctx, spec, input, bias, None, fp8_input_store, cpu_offload_input)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradients for input and bias (the bias gradient is reduced over rows)."""
        dx, dbias, _ = saved_backward(ctx, grad_output)
        return dx, dbias, None, None, None


class SwiGLUFunction(torch.autograd.Function):
    """SwiGLU of ``input`` (clamped when ``clamp_value > 0``)."""

    @staticmethod
    def forward(ctx, input, fp8_input_store, cpu_offload_input, clamp_value=None):
        """See :func:`bias_swiglu_impl`."""
        spec = swiglu_spec(clamp_value)
        return save_and_forward(ctx, spec, input, None, None, fp8_input_store, cpu_offload_input)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradient for input."""
        return saved_backward(ctx, grad_output)[0], None, None, None


class WeightedSwiGLUFunction(torch.autograd.Function):
    """SwiGLU of ``input`` times per-row ``weights`` (clamped when ``clamp_value > 0``)."""

    @staticmethod
    def forward(ctx, input, weights, fp8_input_store, clamp_value=None):
        """See :func:`weighted_bias_swiglu_impl`."""
        spec = swiglu_spec(clamp_value)
        return save_and_forward(ctx, spec, input, None, weights, fp8_input_store)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradients for input and weights."""
        dx, _, dw = saved_backward(ctx, grad_output)
        return dx, dw, None, None


# ------------------------------------------------------------------------------- entry points
def bias_swiglu_impl(
    input,
    bias,
    fp8_input_store=False,
    cpu_offload_input=False,
    clamp_value=None,
    gate_clamp_scale=None,
    linear_clamp_scale=None,
    *,
    in_place_backward=None,
):
    """Fused SwiGLU of ``input (+ bias)`` with optional clamp or SiTU-GLU scales.

    Args:
        input: ``[N, 2F]`` or ``[s, b, 2F]``.
        bias: ``[2F]`` or None.
        fp8_input_store: Save the input in fp8 e4m3 for backward.
        cpu_offload_input: Tag saved tensors for activation offloading.
        clamp_value: DeepSeek-V4 clamp, applied when ``> 0``.
        gate_clamp_scale: SiTU-GLU gate scale ``s_g``.
        linear_clamp_scale: SiTU-GLU linear scale ``s_l``.
        in_place_backward: Write the input gradient over ``input`` in the backward (keyword
            only; None: the process default, see ``fused_activation``).

    Returns:
        ``[N, F]`` or ``[s, b, F]`` in ``input.dtype``.
    """
    check_impl_input(input)
    spec = swiglu_spec(clamp_value, gate_clamp_scale, linear_clamp_scale)
    return fused_activation(
        input,
        spec,
        bias=bias,
        fp8_input_store=fp8_input_store,
        cpu_offload_input=cpu_offload_input,
        in_place_backward=in_place_backward,
    )


def weighted_bias_swiglu_impl(
    input,
    bias,
    weights,
    fp8_input_store=False,
    clamp_value=None,
    gate_clamp_scale=None,
    linear_clamp_scale=None,
    *,
    in_place_backward=None,
):
    """Fused SwiGLU times per-row ``weights`` ``[N, 1]`` (MoE router probabilities).

    ``in_place_backward`` (keyword only): as in :func:`bias_swiglu_impl`.

    Raises:
        NotImplementedError: if ``bias`` is not None (as upstream).
    """
    check_impl_input(input)
    if bias is not None:
        raise NotImplementedError("Bias is not supported for weighted swiglu fusion")
    spec = swiglu_spec(clamp_value, gate_clamp_scale, linear_clamp_scale)
    return fused_activation(
        input,
        spec,
        probs=weights,
        fp8_input_store=fp8_input_store,
        in_place_backward=in_place_backward,
    )
