"""Upstream's activation callables, used as ``TransformerConfig.activation_func`` values.

The bottom rung of the activation ladder (docs/activations.md): it imports nothing of the package
but the ``jit_fuser`` decorator and the compile-boundary leaf ``fusions.kernel_params``.
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

from mcore_activations.fusions.kernel_params import params_tensor, tensor_arguments
from mcore_activations.jit import jit_fuser

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
    value = float(scale)
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


@tensor_arguments
@jit_fuser
def _situ_glu(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    # params: [s_g, offset]; float32 math, one rounding, as the fused kernels compute.
    gate, lin = torch.chunk(x.float(), 2, dim=-1)
    s_g = params[0]
    return (s_g * torch.tanh(gate / s_g) * torch.sigmoid(gate) * (lin + params[1])).to(x.dtype)


@tensor_arguments
@jit_fuser
def _situ_glu_scaled(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    # params: [s_g, offset, s_l]: the linear half soft-clamped to (-s_l, s_l) first.
    gate, lin = torch.chunk(x.float(), 2, dim=-1)
    s_g, s_l = params[0], params[2]
    lin = s_l * torch.tanh(lin / s_l)
    return (s_g * torch.tanh(gate / s_g) * torch.sigmoid(gate) * (lin + params[1])).to(x.dtype)


def situ_glu(
    x: torch.Tensor,
    gate_scale: float,
    linear_scale: Optional[float] = None,
    linear_offset: float = 0.0,
) -> torch.Tensor:
    """SiTU-GLU of ``x = [gate, linear]``: ``situ(gate, s_g) * (L + linear_offset)``.

    ``L`` is ``linear_scale * tanh(linear / linear_scale)`` when ``linear_scale`` is set, else the
    linear half itself. Computed in float32, result in ``x.dtype``; differentiable.

    Raises:
        ValueError: a scale is not finite and greater than zero, or the offset is not finite.
    """
    s_g = _checked_scale("gate_scale", gate_scale)
    offset = float(linear_offset)
    if not math.isfinite(offset):
        raise ValueError(f"linear_offset must be finite, got {linear_offset!r}.")
    if linear_scale is None:
        return _situ_glu(x, params_tensor((s_g, offset), x.device))
    s_l = _checked_scale("linear_scale", linear_scale)
    return _situ_glu_scaled(x, params_tensor((s_g, offset, s_l), x.device))
