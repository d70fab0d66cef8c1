"""Fused GEGLU (tanh GELU) and quick-GEGLU: the upstream megatron.core API on shared kernels.

GEGLU here is the tanh approximation of GELU, as upstream's fused GEGLU and Transformer Engine's
GEGLU op compute it. Quick-GEGLU is ``quick_gelu(gate) * (linear + linear_offset)`` with
``quick_gelu(x) = x * sigmoid(1.702 x)``; with ``clamp_value`` (gpt-oss: 7) the gate is clamped
to ``<= c`` and the linear half to ``[-c, c]`` before the offset is added.

All math runs in float32 (results in the input dtype). ``linear_offset`` and ``clamp_value``
reach compiled code as a float32 tensor, never as Python floats (docs/compile-safety.md).
"""

from __future__ import annotations

import torch

from mcore_activations.activation_spec import (
    QUICK_GELU_ALPHA,
    ActivationKind,
    ActivationSpec,
    register_activation_callable,
)
from mcore_activations.fusions.fused_activation import (
    activation_backward,
    activation_forward,
    check_impl_input,
    fused_activation,
    save_and_forward,
    saved_backward,
)
from mcore_activations.jit import jit_fuser
from mcore_activations.kernel_params import scalar_argument

GEGLU = ActivationSpec(ActivationKind.GELU_TANH, gated=True)


def quick_geglu_spec(linear_offset=0.0, clamp_value=None) -> ActivationSpec:
    """Quick-GEGLU with a linear offset and an optional clamp (gpt-oss: offset 1, clamp 7).

    Raises:
        TypeError: ``linear_offset`` or ``clamp_value`` is not a real number.
        ValueError: the clamp is not finite and greater than zero, or the offset not finite.
    """
    linear_offset = scalar_argument("linear_offset", linear_offset)
    if linear_offset is None:
        raise TypeError("linear_offset must be a real number, got None.")
    clamp_value = scalar_argument("clamp_value", clamp_value)
    return ActivationSpec(
        ActivationKind.QUICK_GELU, gated=True, linear_offset=linear_offset, clamp_value=clamp_value
    )


# ------------------------------------------------------------------------------------- GEGLU
def geglu(y):
    """``gelu_tanh(y1) * y2``."""
    return activation_forward(GEGLU, y)


def bias_geglu(bias, y):
    """``geglu(y + bias)`` (note upstream's bias-first argument order)."""
    return activation_forward(GEGLU, y, bias=bias)


def geglu_back(g, y):
    """Gradient of :func:`geglu` w.r.t. ``y``."""
    return activation_backward(GEGLU, g, y)[0]


def bias_geglu_back(g, y, bias):
    """Gradient of :func:`bias_geglu` w.r.t. ``y``."""
    return activation_backward(GEGLU, g, y, bias=bias)[0]


class BiasGeGLUFunction(torch.autograd.Function):
    """GEGLU of ``input + bias``."""

    @staticmethod
    def forward(ctx, input, bias):
        """See :func:`bias_geglu_impl`."""
        return save_and_forward(ctx, GEGLU, input, bias, None)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradients for input and bias."""
        dx, dbias, _ = saved_backward(ctx, grad_output)
        return dx, dbias


class GeGLUFunction(torch.autograd.Function):
    """GEGLU of ``input``."""

    @staticmethod
    def forward(ctx, input):
        """See :func:`bias_geglu_impl`."""
        return save_and_forward(ctx, GEGLU, input, None, None)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradient for input."""
        return saved_backward(ctx, grad_output)[0]


def bias_geglu_impl(input, bias, *, in_place_backward=None):
    """Fused GEGLU (tanh GELU) of ``input (+ bias)``; ``[N|s,b, 2F] -> [N|s,b, F]``.

    ``in_place_backward`` (keyword only): write the input gradient over ``input`` in the
    backward; None: the process default (see ``fused_activation``).
    """
    check_impl_input(input)
    return fused_activation(input, GEGLU, bias=bias, in_place_backward=in_place_backward)


# -------------------------------------------------------------------------------- quick-GEGLU
@jit_fuser
def quick_gelu(y: torch.Tensor) -> torch.Tensor:
    """``y * sigmoid(1.702 y)``. The identity MLP and config compare ``activation_func`` with."""
    return y * torch.sigmoid(QUICK_GELU_ALPHA * y)


register_activation_callable(quick_gelu, ActivationKind.QUICK_GELU)


def quick_geglu(y, linear_offset=0.0):
    """``quick_gelu(y1) * (y2 + linear_offset)``."""
    return activation_forward(quick_geglu_spec(linear_offset), y)


def weighted_quick_geglu(y, weights, linear_offset=0.0):
    """``quick_geglu(y, linear_offset) * weights``, in ``y.dtype``."""
    return activation_forward(quick_geglu_spec(linear_offset), y, probs=weights)


def quick_geglu_back(g, y, linear_offset=0.0):
    """Gradient of :func:`quick_geglu` w.r.t. ``y``."""
    return activation_backward(quick_geglu_spec(linear_offset), g, y)[0]


def weighted_quick_geglu_back(g, y, weights, linear_offset=0.0):
    """Gradients of :func:`weighted_quick_geglu`: ``(dy, dweights)``."""
    dx, _, dw = activation_backward(quick_geglu_spec(linear_offset), g, y, probs=weights)
    return dx, dw


def weighted_bias_quick_geglu(y, bias, weights, linear_offset=0.0):
    """``quick_geglu(y + bias, linear_offset) * weights``."""
    return activation_forward(quick_geglu_spec(linear_offset), y, bias=bias, probs=weights)


def weighted_bias_quick_geglu_back(g, y, bias, weights, linear_offset=0.0):
    """Gradients of :func:`weighted_bias_quick_geglu`: ``(dy, dbias, dweights)``.

    As upstream, ``dbias`` is the unreduced ``[N, 2F]`` gradient (equal to ``dy``); autograd
    reduces it over rows when the bias was broadcast.
    """
    dx, _, dw = activation_backward(quick_geglu_spec(linear_offset), g, y, bias=bias, probs=weights)
    return dx, dx, dw


class WeightedQuickGeGLUFunction(torch.autograd.Function):
    """Quick-GEGLU times per-row weights; ``linear_offset`` is a 0-d tensor or float."""

    @staticmethod
    def forward(ctx, input, weights, fp8_input_store, linear_offset):
        """See :func:`weighted_bias_quick_geglu_impl`."""
        spec = quick_geglu_spec(linear_offset)
        return save_and_forward(ctx, spec, input, None, weights, fp8_input_store)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradients for input and weights."""
        dx, _, dw = saved_backward(ctx, grad_output)
        return dx, dw, None, None


class WeightedBiasQuickGeGLUFunction(torch.autograd.Function):
    """Quick-GEGLU of ``input + bias`` times per-row weights."""

    @staticmethod
    def forward(ctx, input, bias, weights, fp8_input_store, linear_offset):
        """See :func:`weighted_bias_quick_geglu_impl`."""
        spec = quick_geglu_spec(linear_offset)
        return save_and_forward(ctx, spec, input, bias, weights, fp8_input_store)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradients for input, bias and weights."""
        dx, dbias, dw = saved_backward(ctx, grad_output)
        return dx, dbias, dw, None, None


def weighted_bias_quick_geglu_impl(
    input,
    bias,
    weights,
    fp8_input_store=False,
    linear_offset=0.0,
    clamp_value=None,
    *,
    in_place_backward=None,
):
    """Fused quick-GEGLU of ``input (+ bias)`` times per-row ``weights`` ``[N, 1]``.

    Unlike upstream, the clamp runs inside the fused kernel (one pass, inclusive masks) instead of
    as separate eager ops; the math is the same.

    Args:
        input: ``[N, 2F]`` or ``[s, b, 2F]``.
        bias: ``[2F]`` or None.
        weights: Per-row weights.
        fp8_input_store: Save the input in fp8 e4m3 for backward.
        linear_offset: Added to the linear half after clamping.
        clamp_value: Optional clamp ``c > 0``.
        in_place_backward: Write the input gradient over ``input`` in the backward (keyword
            only; None: the process default, see ``fused_activation``).
    """
    check_impl_input(input)
    spec = quick_geglu_spec(linear_offset, clamp_value)
    return fused_activation(
        input,
        spec,
        bias=bias,
        probs=weights,
        fp8_input_store=fp8_input_store,
        in_place_backward=in_place_backward,
    )
