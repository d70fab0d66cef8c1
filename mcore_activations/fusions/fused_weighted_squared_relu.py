"""Fused squared ReLU with per-token weights (MoE experts), optionally tanh soft-clamped.

``weighted_squared_relu_impl(x, w, clamp_scale=s)`` computes ``(s * tanh(relu(x) / s))**2 * w``,
which equals ``relu(s * tanh(x / s))**2 * w`` (tanh is odd and increasing). ``clamp_scale``
reaches compiled code as a float32 tensor.
"""

from __future__ import annotations

import torch

from mcore_activations.activation_spec import ActivationKind, ActivationSpec
from mcore_activations.fusions.fused_activation import (
    activation_backward,
    activation_forward,
    check_impl_input,
    fused_activation,
    save_and_forward,
    saved_backward,
)
from mcore_activations.kernel_params import scalar_argument

SQUARED_RELU = ActivationSpec(ActivationKind.SQUARED_RELU)


def weighted_squared_relu(x, weights):
    """``relu(x)**2 * weights`` in ``x.dtype``."""
    return activation_forward(SQUARED_RELU, x, probs=weights)


def weighted_squared_relu_back(g, x, weights):
    """Gradients of :func:`weighted_squared_relu`: ``(dx, dweights)``."""
    dx, _, dw = activation_backward(SQUARED_RELU, g, x, probs=weights)
    return dx, dw


class WeightedSquaredReLUFunction(torch.autograd.Function):
    """Squared ReLU times per-row weights."""

    @staticmethod
    def forward(ctx, input, weights):
        """See :func:`weighted_squared_relu_impl`."""
        return save_and_forward(ctx, SQUARED_RELU, input, None, weights)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradients for input and weights."""
        dx, _, dw = saved_backward(ctx, grad_output)
        return dx, dw


def weighted_squared_relu_impl(input, weights, clamp_scale=None, *, in_place_backward=None):
    """Fused (optionally tanh soft-clamped) squared ReLU times per-row ``weights``.

    Args:
        input: ``[N, F]`` or ``[s, b, F]``.
        weights: ``[N, 1]`` per-row weights, or None for no weighting.
        clamp_scale: Tanh soft-clamp scale ``s > 0`` or None.
        in_place_backward: Write the input gradient over ``input`` in the backward (keyword
            only; None: the process default, see ``fused_activation``).
    """
    check_impl_input(input)
    clamp_scale = scalar_argument("clamp_scale", clamp_scale)
    spec = ActivationSpec(ActivationKind.SQUARED_RELU, gate_tanh_scale=clamp_scale)
    return fused_activation(input, spec, probs=weights, in_place_backward=in_place_backward)
