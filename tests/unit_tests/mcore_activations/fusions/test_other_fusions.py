"""Upstream GEGLU / quick-GEGLU / GELU / squared-ReLU fusion APIs and activations.py."""

import pytest
import torch

from mcore_activations.fusions.activation_ops import use_compiled_kernels
from megatron.core import activations as act
from megatron.core.fusions import fused_bias_geglu as gg
from megatron.core.fusions import fused_bias_gelu as ge
from megatron.core.fusions import fused_weighted_squared_relu as sq
from megatron.core.transformer.activation_spec import ActivationKind, ActivationSpec
from tests.unit_tests.activation_catalog import SPECS
from tests.unit_tests.tolerances import assert_close_to_reference

DTYPES = [torch.float32, torch.bfloat16]


def _grads(fn, *inputs, grad):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return out, [t.grad if t is not None else None for t in leaves]


def _compare(fn, ref_fn, inputs, dtype, grad, what):
    out, grads = _grads(fn, *inputs, grad=grad)
    ref, ref_grads = _grads(
        ref_fn, *[t.double() if t is not None else None for t in inputs], grad=grad.double()
    )
    assert out.dtype == dtype
    assert_close_to_reference(out, ref, dtype, f"{what} out")
    for i, (got, exp) in enumerate(zip(grads, ref_grads)):
        if exp is not None:
            assert got.dtype == inputs[i].dtype, f"{what} grad {i} dtype"
            assert_close_to_reference(got, exp, dtype, f"{what} grad {i}")


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_geglu_impls(dtype, use_compile):
    x = (torch.randn(7, 2, 24) * 3).to(dtype)
    b = torch.randn(24).to(dtype)
    g = torch.randn(7, 2, 12)
    spec = SPECS["geglu"]
    with use_compiled_kernels(use_compile):
        _compare(
            gg.bias_geglu_impl,
            lambda x, b: spec.reference(x, b, dtype=x.dtype),
            (x, b),
            dtype,
            g,
            "bias_geglu_impl",
        )
        _compare(
            lambda x: gg.bias_geglu_impl(x, None),
            lambda x: spec.reference(x, dtype=x.dtype),
            (x,),
            dtype,
            g,
            "geglu_impl",
        )


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("clamp", [None, 2.5])
def test_weighted_bias_quick_geglu_impl(clamp, dtype, use_compile):
    x = (torch.randn(11, 32) * 3).to(dtype)
    b = (torch.randn(32) * 0.3).to(dtype)
    w = torch.rand(11, 1).to(dtype)
    g = torch.randn(11, 16)
    spec = ActivationSpec(
        ActivationKind.QUICK_GELU, gated=True, linear_offset=1.0, clamp_value=clamp
    )

    def ours(x, b, w):
        return gg.weighted_bias_quick_geglu_impl(x, b, w, linear_offset=1.0, clamp_value=clamp)

    with use_compiled_kernels(use_compile):
        _compare(
            ours,
            lambda x, b, w: spec.reference(x, b, w, dtype=x.dtype),
            (x, b, w),
            dtype,
            g,
            "weighted_bias_quick_geglu_impl",
        )


def test_quick_geglu_functions():
    x = torch.randn(5, 16) * 3
    w = torch.rand(5, 1)
    g = torch.randn(5, 8)
    spec = ActivationSpec(ActivationKind.QUICK_GELU, gated=True, linear_offset=0.5)
    with use_compiled_kernels(False):
        assert_close_to_reference(gg.quick_geglu(x, 0.5), spec.reference(x), torch.float32)
        assert_close_to_reference(
            gg.weighted_quick_geglu(x, w, 0.5), spec.reference(x, probs=w), torch.float32
        )
        xr = x.double().requires_grad_()
        spec.reference(xr).backward(g.double())
        assert_close_to_reference(gg.quick_geglu_back(g, x, 0.5), xr.grad, torch.float32)
        dx, db, dw = gg.weighted_bias_quick_geglu_back(g, x, torch.zeros(16), w, 0.5)
        assert torch.equal(dx, db) and dw.shape == w.shape
        # The 0-d tensor offset form of upstream's Functions.
        out = gg.WeightedQuickGeGLUFunction.apply(x, w, False, torch.tensor(0.5))
        assert_close_to_reference(out, spec.reference(x, probs=w), torch.float32)
    assert torch.allclose(gg.quick_gelu(x), x * torch.sigmoid(1.702 * x))


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
def test_bias_gelu_impl_is_tanh_gelu(use_compile):
    x = torch.randn(6, 10) * 3
    b = torch.randn(10)
    g = torch.randn(6, 10)
    spec = ActivationSpec(ActivationKind.GELU_TANH)
    with use_compiled_kernels(use_compile):
        _compare(
            ge.bias_gelu_impl,
            lambda x, b: spec.reference(x, b, dtype=x.dtype),
            (x, b),
            torch.float32,
            g,
            "bias_gelu_impl",
        )
        with pytest.raises(ValueError, match="requires a bias"):
            ge.bias_gelu_impl(x, None)
        assert_close_to_reference(ge.bias_gelu(b, x), spec.reference(x, b), torch.float32)


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("scale", [None, 2.0])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_weighted_squared_relu_impl(weighted, scale, use_compile):
    x = torch.randn(9, 20) * 3
    w = torch.rand(9, 1) if weighted else None
    g = torch.randn(9, 20)
    spec = ActivationSpec(ActivationKind.SQUARED_RELU, gate_tanh_scale=scale)

    def ours(x, w):
        return sq.weighted_squared_relu_impl(x, w, clamp_scale=scale)

    with use_compiled_kernels(use_compile):
        _compare(
            ours,
            lambda x, w: spec.reference(x, probs=w, dtype=x.dtype),
            (x, w),
            torch.float32,
            g,
            "weighted_squared_relu_impl",
        )


def test_squared_relu_tanh_identity():
    # (s*tanh(relu(x)/s))**2 == relu(s*tanh(x/s))**2: both orders of the soft clamp agree.
    x = torch.randn(100, dtype=torch.float64) * 5
    s = 2.0
    assert torch.allclose(
        (s * torch.tanh(torch.relu(x) / s)) ** 2, torch.relu(s * torch.tanh(x / s)) ** 2
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_functions(dtype):
    x = (torch.randn(8, 12) * 4).to(dtype)
    g = torch.randn(8, 12)
    s = 1.5
    _compare(
        lambda x: act.tanh_soft_clamp(x, s),
        lambda x: s * torch.tanh(x / s),
        (x,),
        dtype,
        g,
        "tanh_soft_clamp",
    )
    _compare(
        lambda x: act.situ(x, s),
        lambda x: s * torch.tanh(x / s) * torch.sigmoid(x),
        (x,),
        dtype,
        g,
        "situ",
    )
    spec = ActivationSpec(
        ActivationKind.SILU,
        gated=True,
        gate_tanh_scale=2.0,
        linear_tanh_scale=3.0,
        linear_offset=0.5,
    )
    _compare(
        lambda x: act.situ_glu(x, 2.0, 3.0, 0.5),
        lambda x: spec.reference(x, dtype=x.dtype),
        (x,),
        dtype,
        g[:, :6],
        "situ_glu",
    )
    torch.testing.assert_close(act.squared_relu(x), torch.relu(x) ** 2)
    torch.testing.assert_close(
        act.fast_gelu(x.float()), torch.nn.functional.gelu(x.float(), approximate="tanh")
    )
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite and greater than zero"):
            act.tanh_soft_clamp(x, bad)
