"""Fused bias + GELU (tanh approximation), the upstream megatron.core API on shared kernels."""

from __future__ import annotations

import torch

from mcore_activations.activation_spec import ActivationKind, ActivationSpec
from mcore_activations.fusions.fused_activation import (
    activation_backward,
    activation_forward,
    save_and_forward,
    saved_backward,
)

GELU_TANH = ActivationSpec(ActivationKind.GELU_TANH)


def bias_gelu(bias, y):
    """``gelu_tanh(y + bias)`` (bias-first, as upstream)."""
    return activation_forward(GELU_TANH, y, bias=bias)


def bias_gelu_back(g, bias, y):
    """Gradient of :func:`bias_gelu` w.r.t. ``y`` (also the unreduced bias gradient)."""
    return activation_backward(GELU_TANH, g, y, bias=bias)[0]


class GeLUFunction(torch.autograd.Function):
    """GELU (tanh approximation) of ``input + bias``."""

    @staticmethod
    def forward(ctx, input, bias):
        """Forward; ``bias`` is required."""
        if bias is None:
            raise ValueError("bias_gelu_impl requires a bias; use F.gelu for a bias-free GELU.")
        return save_and_forward(ctx, GELU_TANH, input, bias, None)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradients for input and bias."""
        dx, dbias, _ = saved_backward(ctx, grad_output)
        return dx, dbias


bias_gelu_impl = GeLUFunction.apply
