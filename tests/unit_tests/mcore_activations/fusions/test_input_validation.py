"""Inputs the kernels would silently compute something else for are refused, with a reason."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_geglu import weighted_bias_quick_geglu_impl
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl, weighted_bias_swiglu_impl
from megatron.core.transformer.activation_spec import ActivationKind, ActivationSpec
from megatron.core.transformer.transformer_config import TransformerConfig


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_non_float_inputs_are_refused(dtype):
    x = torch.ones(4, 8).to(dtype)
    with pytest.raises(TypeError, match=f"input must be float32.*got {dtype}"):
        bias_swiglu_impl(x, None)


def test_non_float_probs_are_refused():
    with pytest.raises(TypeError, match="probs must be float32"):
        weighted_bias_swiglu_impl(torch.randn(4, 8), None, torch.ones(4, 1, dtype=torch.int64))


@pytest.mark.parametrize("weights_shape", [(1, 4), (4, 2), (2, 2)])
def test_weights_must_be_one_per_row(weights_shape):
    # [1, N] has the right element count for N rows, and would once have been accepted.
    with pytest.raises(ValueError, match="one probability per row"):
        weighted_bias_swiglu_impl(torch.randn(4, 8), None, torch.ones(weights_shape))


@pytest.mark.parametrize("width", [7, 0])
def test_gated_width_must_be_even_and_nonzero(width):
    with pytest.raises(ValueError, match=f"got {width}|last dimension is 0"):
        bias_swiglu_impl(torch.randn(4, width), None)


def test_interleaved_width_must_hold_whole_blocks():
    spec = ActivationSpec(ActivationKind.SILU, gated=True, glu_interleave_size=4)
    from megatron.core.fusions.fused_activation import fused_activation

    with pytest.raises(ValueError, match="multiple of 8: got 12"):
        fused_activation(torch.randn(2, 12), spec)


def test_bias_gelu_checks_its_bias():
    with pytest.raises(ValueError, match=r"bias of shape \(3,\) does not match input width 4"):
        bias_gelu_impl(torch.randn(2, 4), torch.randn(3))


def test_nan_clamp_is_an_error_not_no_clamp():
    with pytest.raises(ValueError, match="clamp_value=nan is not a clamp"):
        bias_swiglu_impl(torch.randn(4, 8), None, clamp_value=math.nan)
    with pytest.raises(ValueError, match="clamp_value must be finite"):
        weighted_bias_quick_geglu_impl(
            torch.randn(4, 8), None, torch.ones(4, 1), clamp_value=math.nan
        )


@pytest.mark.parametrize(
    "field, value, in_float32",
    [
        ("gate_tanh_scale", 1e39, "inf"),
        ("gate_tanh_scale", 1e-46, "0.0"),
        ("clamp_value", 1e39, "inf"),
        ("clamp_value", 1e-40, "9.99"),  # subnormal: too small to divide by safely
    ],
)
def test_spec_scalars_must_survive_float32(field, value, in_float32):
    kwargs = {field: value}
    with pytest.raises(ValueError, match=f"is {in_float32}.* in float32"):
        ActivationSpec(ActivationKind.SILU, gated=True, **kwargs)


@pytest.mark.parametrize(
    "fields",
    [
        dict(activation_func_tanh_clamp_scale=1e39),
        dict(activation_func_tanh_clamp_scale=4.0, activation_func_tanh_clamp_scale_linear=1e-46),
        dict(activation_func_clamp_value=1e39, num_moe_experts=2),
    ],
)
def test_config_scalars_must_survive_float32(fields):
    with pytest.raises(ValueError, match="in float32, the precision the activation kernels"):
        TransformerConfig(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=2,
            activation_func=F.silu,
            gated_linear_unit=True,
            **fields,
        )


def test_float32_edge_scales_are_accepted_and_finite():
    spec = ActivationSpec(ActivationKind.SILU, gated=True, gate_tanh_scale=3e38)
    from megatron.core.fusions.fused_activation import fused_activation

    out = fused_activation(torch.zeros(2, 8), spec)
    assert torch.isfinite(out).all()
