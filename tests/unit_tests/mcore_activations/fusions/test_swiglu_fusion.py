"""The upstream fused-SwiGLU API: signatures, dispatch semantics and numerics."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from mcore_activations.fusions.activation_ops import use_compiled_kernels
from megatron.core.fusions import fused_bias_swiglu as sw
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.activation_catalog import SPECS
from tests.unit_tests.tolerances import assert_close_to_reference

SIGNATURES = {
    "bias_swiglu_impl": [
        "input",
        "bias",
        "fp8_input_store",
        "cpu_offload_input",
        "clamp_value",
        "gate_clamp_scale",
        "linear_clamp_scale",
    ],
    "weighted_bias_swiglu_impl": [
        "input",
        "bias",
        "weights",
        "fp8_input_store",
        "clamp_value",
        "gate_clamp_scale",
        "linear_clamp_scale",
    ],
    "clamped_swiglu": ["y", "clamp_value"],
    "clamped_swiglu_back": ["g", "y", "clamp_value"],
    "bias_clamped_swiglu": ["y", "bias", "clamp_value"],
    "clamped_weighted_swiglu": ["y", "weights", "clamp_value"],
    "clamped_weighted_swiglu_back": ["g", "y", "weights", "clamp_value"],
    "bias_clamped_swiglu_back": ["g", "y", "bias", "clamp_value"],
    "swiglu": ["y"],
    "bias_swiglu": ["y", "bias"],
    "weighted_swiglu": ["y", "weights"],
    "swiglu_back": ["g", "y"],
    "bias_swiglu_back": ["g", "y", "bias"],
    "weighted_swiglu_back": ["g", "y", "weights"],
}


# The fused entry points add one keyword-only option; every upstream call binds as before.
KEYWORD_ONLY = {
    "bias_swiglu_impl": ["in_place_backward"],
    "weighted_bias_swiglu_impl": ["in_place_backward"],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_upstream_signatures(name):
    params = inspect.signature(getattr(sw, name)).parameters.values()
    keyword_only = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [p.name for p in params if p.kind is not p.KEYWORD_ONLY] == SIGNATURES[name]
    assert keyword_only == KEYWORD_ONLY.get(name, [])


def test_orig_callable_is_the_eager_twin():
    for fn in (sw.clamped_swiglu, sw.clamped_swiglu_back):
        eager = fn._torchdynamo_orig_callable
        assert list(inspect.signature(eager).parameters) == SIGNATURES[fn.__name__]
    y, g = torch.randn(6, 16) * 3, torch.randn(6, 8)
    eager_out = sw.clamped_swiglu._torchdynamo_orig_callable(y, 1.0)
    torch.testing.assert_close(eager_out, sw.clamped_swiglu(y, 1.0), rtol=1e-6, atol=1e-6)
    eager_back = sw.clamped_swiglu_back._torchdynamo_orig_callable(g, y, 1.0)
    torch.testing.assert_close(eager_back, sw.clamped_swiglu_back(g, y, 1.0), rtol=1e-6, atol=1e-6)


def test_specialize_float_is_left_alone():
    # Upstream's reproducer asserts this after importing the module.
    assert torch._dynamo.config.specialize_float is False


def _ref(name, y, bias=None, weights=None):
    spec = SPECS[name]
    return spec.reference(y, bias=bias, probs=weights)


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_and_backward_functions(dtype, use_compile):
    y = (torch.randn(9, 24) * 3).to(dtype)
    b = torch.randn(24).to(dtype)
    w = torch.rand(9, 1).to(dtype)
    g = torch.randn(9, 12).to(dtype)
    c = SPECS["swiglu_clamp"].clamp_value
    with use_compiled_kernels(use_compile):
        cases = {
            "swiglu": (sw.swiglu(y), _ref("swiglu", y)),
            "bias_swiglu": (sw.bias_swiglu(y, b), _ref("swiglu", y, b)),
            "weighted_swiglu": (sw.weighted_swiglu(y, w), _ref("swiglu", y, weights=w)),
            "clamped_swiglu": (sw.clamped_swiglu(y, c), _ref("swiglu_clamp", y)),
            "bias_clamped_swiglu": (sw.bias_clamped_swiglu(y, b, c), _ref("swiglu_clamp", y, b)),
            "clamped_weighted_swiglu": (
                sw.clamped_weighted_swiglu(y, w, c),
                _ref("swiglu_clamp", y, weights=w),
            ),
        }
        for name, (got, ref) in cases.items():
            assert got.dtype == dtype, name
            assert_close_to_reference(got, ref, dtype, name)

        def ref_grads(name, bias=None, weights=None):
            yr = y.double().requires_grad_()
            wr = weights.double().requires_grad_() if weights is not None else None
            _ref(name, yr, bias, wr).backward(g.double())
            return yr.grad, (wr.grad if wr is not None else None)

        assert_close_to_reference(
            sw.swiglu_back(g, y), ref_grads("swiglu")[0], dtype, "swiglu_back"
        )
        assert_close_to_reference(
            sw.bias_swiglu_back(g, y, b), ref_grads("swiglu", b)[0], dtype, "bias_swiglu_back"
        )
        assert_close_to_reference(
            sw.clamped_swiglu_back(g, y, c), ref_grads("swiglu_clamp")[0], dtype, "clamped_back"
        )
        assert_close_to_reference(
            sw.bias_clamped_swiglu_back(g, y, b, c),
            ref_grads("swiglu_clamp", b)[0],
            dtype,
            "bias_clamped_back",
        )
        for fn, args, name in (
            (sw.weighted_swiglu_back, (g, y, w), "swiglu"),
            (sw.clamped_weighted_swiglu_back, (g, y, w, c), "swiglu_clamp"),
        ):
            dx, dw = fn(*args)
            rdx, rdw = ref_grads(name, weights=w)
            assert dw.dtype == w.dtype
            assert_close_to_reference(dx, rdx, dtype, f"{fn.__name__} dx")
            assert_close_to_reference(dw, rdw, dtype, f"{fn.__name__} dw")


@pytest.mark.parametrize("shape", [(10, 32), (5, 2, 32)], ids=["2d", "3d"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_bias_swiglu_impl_clamp(shape, with_bias):
    x = (torch.randn(shape) * 3).requires_grad_()
    b = torch.randn(32, requires_grad=True) if with_bias else None
    with use_compiled_kernels(False):
        out = sw.bias_swiglu_impl(x, b, clamp_value=1.5)
    assert out.shape == (*shape[:-1], 16)
    assert_close_to_reference(out, _ref("swiglu_clamp", x.detach(), b), torch.float32)


def test_clamp_none_or_nonpositive_is_unclamped():
    x = torch.randn(8, 32) * 3
    with use_compiled_kernels(False):
        plain = sw.bias_swiglu_impl(x, None)
        for c in (None, 0.0, -1.0):
            assert torch.equal(sw.bias_swiglu_impl(x, None, clamp_value=c), plain)
        assert not torch.equal(sw.bias_swiglu_impl(x, None, clamp_value=1.0), plain)


def test_situ_keywords():
    x = (torch.randn(8, 32) * 4).requires_grad_()
    with use_compiled_kernels(False):
        out = sw.bias_swiglu_impl(x, None, gate_clamp_scale=2.0, linear_clamp_scale=3.0)
        gate_only = sw.weighted_bias_swiglu_impl(x, None, torch.ones(8, 1), gate_clamp_scale=2.0)
    assert_close_to_reference(out, _ref("situ_glu", x.detach()), torch.float32)
    assert_close_to_reference(gate_only, _ref("situ_glu_gate_only", x.detach()), torch.float32)


def test_invalid_keyword_combinations():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="mutually exclusive"):
        sw.bias_swiglu_impl(x, None, clamp_value=1.0, gate_clamp_scale=2.0)
    with pytest.raises(ValueError, match="requires gate_clamp_scale"):
        sw.bias_swiglu_impl(x, None, linear_clamp_scale=2.0)
    with pytest.raises(ValueError, match="gate_tanh_scale must be finite"):
        sw.bias_swiglu_impl(x, None, gate_clamp_scale=float("nan"))
    with pytest.raises(ValueError, match="clamp_value must be finite"):
        sw.clamped_swiglu(x, float("inf"))
    with pytest.raises(NotImplementedError, match="Bias is not supported for weighted swiglu"):
        sw.weighted_bias_swiglu_impl(x, torch.zeros(8), torch.ones(4, 1))
    with pytest.raises(ValueError, match="2-D or 3-D"):
        sw.bias_swiglu_impl(torch.randn(8), None)


def test_weighted_matches_unweighted_times_weights():
    x = torch.randn(6, 16) * 3
    w = torch.rand(6, 1)
    with use_compiled_kernels(False):
        weighted = sw.weighted_bias_swiglu_impl(x, None, w, clamp_value=1.0)
        unweighted = sw.bias_swiglu_impl(x, None, clamp_value=1.0)
    torch.testing.assert_close(weighted, unweighted * w)


def test_autograd_functions_upstream_arity():
    x = (torch.randn(4, 8) * 3).requires_grad_()
    b = torch.randn(8, requires_grad=True)
    w = torch.rand(4, 1, requires_grad=True)
    with use_compiled_kernels(False):
        sw.BiasSwiGLUFunction.apply(x, b, False, False, 1.0).sum().backward()
        sw.SwiGLUFunction.apply(x, False, False, None).sum().backward()
        sw.WeightedSwiGLUFunction.apply(x, w, False, 1.0).sum().backward()
    assert b.grad.shape == b.shape and w.grad.shape == w.shape


# Rule 12 of TransformerConfig.__post_init__, with upstream's message fragments.
def _swiglu_config(**kwargs):
    base = dict(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        activation_func=F.silu,
        gated_linear_unit=True,
        num_moe_experts=2,
        moe_router_topk=2,
        add_bias_linear=False,
    )
    base.update(kwargs)
    return TransformerConfig(**base)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(activation_func_clamp_value=0.0), "greater than zero"),
        (dict(activation_func_clamp_value=-1.0), "greater than zero"),
        (dict(activation_func_clamp_value=float("nan")), "greater than zero"),
        (dict(activation_func_clamp_value=float("inf")), "greater than zero"),
        (
            dict(activation_func_clamp_value=1.0, glu_linear_offset=1.0),
            "glu_linear_offset must be zero",
        ),
        (dict(activation_func_clamp_value=1.0, num_moe_experts=None), "only supported with MoE"),
        (
            dict(activation_func_clamp_value=1.0, use_te_activation_func=True),
            "use_te_activation_func must be False",
        ),
    ],
)
def test_swiglu_clamp_config_rules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _swiglu_config(**kwargs)


def test_swiglu_clamp_config_valid():
    assert _swiglu_config(activation_func_clamp_value=7.0).activation_func_clamp_value == 7.0
