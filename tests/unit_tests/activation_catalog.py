"""The activations every test parametrizes over, as config kwargs and as ActivationSpecs.

One entry per activation the project supports; clamp values are small enough that inputs with
std ~3 hit them on a large fraction of elements.
"""

from __future__ import annotations

import torch.nn.functional as F

from megatron.core import activations
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer.activation_spec import ActivationSpec

# name -> TransformerConfig activation kwargs
CONFIGS = {
    "swiglu": dict(activation_func=F.silu, gated_linear_unit=True),
    "swiglu_clamp": dict(
        activation_func=F.silu, gated_linear_unit=True, activation_func_clamp_value=1.5
    ),
    "situ_glu": dict(
        activation_func=F.silu,
        gated_linear_unit=True,
        activation_func_tanh_clamp_scale=2.0,
        activation_func_tanh_clamp_scale_linear=3.0,
    ),
    "situ_glu_gate_only": dict(
        activation_func=F.silu, gated_linear_unit=True, activation_func_tanh_clamp_scale=2.0
    ),
    "geglu": dict(activation_func=activations.fast_gelu, gated_linear_unit=True),
    "geglu_erf": dict(activation_func=F.gelu, gated_linear_unit=True),
    "geglu_clamp": dict(
        activation_func=activations.fast_gelu,
        gated_linear_unit=True,
        activation_func_clamp_value=2.0,
    ),
    "reglu": dict(activation_func=F.relu, gated_linear_unit=True),
    "quick_geglu_gpt_oss": dict(
        activation_func=quick_gelu,
        gated_linear_unit=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=2.5,
    ),
    "quick_geglu_offset": dict(
        activation_func=quick_gelu, gated_linear_unit=True, glu_linear_offset=1.0
    ),
    "gelu": dict(activation_func=F.gelu),
    "fast_gelu": dict(activation_func=activations.fast_gelu),
    "fast_gelu_tanh": dict(
        activation_func=activations.fast_gelu, activation_func_tanh_clamp_scale=1.5
    ),
    "silu": dict(activation_func=F.silu),
    "silu_tanh": dict(activation_func=F.silu, activation_func_tanh_clamp_scale=1.5),
    "relu": dict(activation_func=F.relu),
    "relu_tanh": dict(activation_func=F.relu, activation_func_tanh_clamp_scale=1.5),
    "squared_relu": dict(activation_func=activations.squared_relu),
    "squared_relu_tanh": dict(
        activation_func=activations.squared_relu, activation_func_tanh_clamp_scale=2.0
    ),
    "quick_gelu": dict(activation_func=quick_gelu),
    "quick_gelu_tanh": dict(activation_func=quick_gelu, activation_func_tanh_clamp_scale=1.5),
}

NEEDS_MOE = {"swiglu_clamp"}  # config rule: the SwiGLU clamp is MoE-only


class _Fields:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def spec_of(name: str, glu_interleave_size=None) -> ActivationSpec:
    """The ActivationSpec of catalogue entry ``name``."""
    return ActivationSpec.from_config(
        _Fields(**CONFIGS[name]), glu_interleave_size=glu_interleave_size
    )


SPECS = {name: spec_of(name) for name in CONFIGS}
GATED = [name for name, spec in SPECS.items() if spec.gated]
