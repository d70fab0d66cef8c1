"""Upstream's activation callables, used as ``TransformerConfig.activation_func`` values.

The bottom rung of the activation ladder (docs/activations.md): it imports nothing of the package
but the ``jit_fuser`` decorator and the compile-boundary leaf ``kernel_params``.
``ActivationSpec`` classifies an ``activation_func`` by identity (``squared_relu`` is squared
ReLU, ``fast_gelu`` the tanh GELU, ``quick_gelu`` quick-GELU), so these objects must stay the
ones a config holds.

Functions with a scale argument take it as a Python float and pass it to compiled code as a
float32 tensor (docs/compile-safety.md).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from mcore_activations.jit import jit_fuser
from mcore_activations.kernel_params import (
    params_tensor,
    scalar_argument,
    tensor_arguments,
)

# The constants of the approximations below, named once for the whole package.
QUICK_GELU_ALPHA = 1.702  # quick_gelu: x * sigmoid(1.702 x)
GELU_TANH_COEF = 0.044715  # fast_gelu: the cubic term inside tanh
SQRT_2_OVER_PI = 0.7978845608028654  # fast_gelu: sqrt(2 / pi)


@jit_fuser
def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)**2``."""
    return torch.pow(F.relu(x), 2)


@jit_fuser
def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)``."""
    return x * torch.sigmoid(QUICK_GELU_ALPHA * x)


@jit_fuser
def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + GELU_TANH_COEF * x * x * x)))


@tensor_arguments
@jit_fuser
def _tanh_soft_clamp(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # float32 math: tanh saturates at |x/s| > ~9 in bf16 precision otherwise.
    s = scale[0]
    return (s * torch.tanh(x.float() / s)).to(x.dtype)


@tensor_arguments
@jit_fuser
def _situ(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale[0]
    xf = x.float()
    return (s * torch.tanh(xf / s) * torch.sigmoid(xf)).to(x.dtype)


def _checked_scale(name: str, scale) -> float:
    value = scalar_argument(name, scale)
    if value is None:
        raise TypeError(f"{name} must be a real number, got None.")
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"{name} must be finite and greater than zero, got {scale!r}.")
    return value


def _scale_tensor(name: str, scale, device) -> torch.Tensor:
    return params_tensor((_checked_scale(name, scale),), device)


def tanh_soft_clamp(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Soft clamp ``scale * tanh(x / scale)`` into ``(-scale, scale)``, computed in float32."""
    return _tanh_soft_clamp(x, _scale_tensor("scale", scale, x.device))


def situ(x: torch.Tensor, scale: float) -> torch.Tensor:
    """SiTU: ``scale * tanh(x / scale) * sigmoid(x)`` (the sigmoid takes the raw input)."""
    return _situ(x, _scale_tensor("scale", scale, x.device))


def situ_glu(
    x: torch.Tensor,
    gate_scale: float,
    linear_scale: Optional[float] = None,
    linear_offset: float = 0.0,
) -> torch.Tensor:
    """SiTU-GLU of ``x = [gate, linear]``: ``situ(gate, s_g) * (L + linear_offset)``.

    ``L`` is ``tanh_soft_clamp(linear, linear_scale)`` when ``linear_scale`` is set, else the
    linear half itself. Composed of :func:`situ` and :func:`tanh_soft_clamp` (float32 math each,
    results in ``x.dtype``); differentiable.

    Raises:
        ValueError: a scale is not finite and greater than zero, or the offset is not finite.
    """
    offset = float(linear_offset)
    if not math.isfinite(offset):
        raise ValueError(f"linear_offset must be finite, got {linear_offset!r}.")
    gate, linear = torch.chunk(x, 2, dim=-1)
    if linear_scale is not None:
        linear = tanh_soft_clamp(linear, linear_scale)
    return situ(gate, gate_scale) * (linear + offset if offset else linear)
