"""What upstream's fused entry points allow stays allowed, and every entry point checks its inputs.

- An output of a fused entry point is a plain tensor: in-place ops on it work, as upstream's do.
- ``torch.compile(fullgraph=True)`` around an entry point traces without a graph break, and a
  clamp value that changes between calls of a compiled function is never served stale.
- The raw upstream-named functions (``swiglu``, ``geglu``, ``clamped_swiglu``, ...) refuse what
  their kernels would compute wrongly (integer or complex input, odd widths, wrong weights).
- A scalar argument of the wrong type is refused with an error naming the argument.
- The unfused and fused paths agree with the float64 reference at a clamp's edge in every dtype.
"""

from __future__ import annotations

import pytest
import torch

import megatron.core.fusions.fused_bias_geglu as geglu_mod
import megatron.core.fusions.fused_bias_swiglu as swiglu_mod
from mcore_activations.fusions.activation_ops import use_kernel_backend
from megatron.core.fusions.fused_activation import fused_activation
from megatron.core.fusions.fused_bias_gelu import bias_gelu, bias_gelu_impl
from megatron.core.fusions.fused_weighted_squared_relu import (
    weighted_squared_relu,
    weighted_squared_relu_impl,
)
from megatron.core.transformer.activation_spec import (
    ActivationKind,
    ActivationSpec,
    unfused_activation,
)
from tests.unit_tests.tolerances import assert_close_to_reference

SWIGLU = ActivationSpec(ActivationKind.SILU, gated=True)


def _swiglu64(x, clamp=None):
    spec = swiglu_mod.swiglu_spec(clamp)
    return spec.reference(x.double())


# ------------------------------------------------------------------ in-place ops on outputs
IN_PLACE_CASES = {
    "bias_swiglu_impl": lambda x: swiglu_mod.bias_swiglu_impl(x, None),
    "bias_swiglu_impl clamp": lambda x: swiglu_mod.bias_swiglu_impl(x, None, clamp_value=0.5),
    "weighted_bias_swiglu_impl": lambda x: swiglu_mod.weighted_bias_swiglu_impl(
        x, None, torch.ones(x.shape[0] * x.shape[1], 1)
    ),
    "bias_geglu_impl": lambda x: geglu_mod.bias_geglu_impl(x, None),
    # bias_gelu_impl is upstream's autograd Function itself, applied to the 3-D input.
    "bias_gelu_impl": lambda x: bias_gelu_impl(x, torch.zeros(x.shape[-1])),
    "swiglu": swiglu_mod.swiglu,
    "fused_activation": lambda x: fused_activation(x, SWIGLU),
}


@pytest.mark.parametrize("name", list(IN_PLACE_CASES))
def test_in_place_op_on_a_3d_output_works_and_differentiates(name):
    x = torch.randn(3, 2, 8, requires_grad=True)
    out = IN_PLACE_CASES[name](x)
    # Upstream allows this; autograd allows it only if the output is not a view made inside a
    # custom Function.
    out.mul_(2)
    out.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    (IN_PLACE_CASES[name](x_ref) * 2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)


# ------------------------------------------------------------------------ fullgraph compile
FULLGRAPH_CASES = {
    "bias_swiglu_impl": lambda x, w: swiglu_mod.bias_swiglu_impl(x, None),
    "bias_swiglu_impl clamp": lambda x, w: swiglu_mod.bias_swiglu_impl(x, None, clamp_value=0.5),
    "bias_swiglu_impl situ": lambda x, w: swiglu_mod.bias_swiglu_impl(
        x, None, gate_clamp_scale=2.0, linear_clamp_scale=3.0
    ),
    "weighted_bias_swiglu_impl": lambda x, w: swiglu_mod.weighted_bias_swiglu_impl(x, None, w),
    "bias_geglu_impl": lambda x, w: geglu_mod.bias_geglu_impl(x, None),
    "weighted_bias_quick_geglu_impl": lambda x, w: geglu_mod.weighted_bias_quick_geglu_impl(
        x, None, w, linear_offset=1.0, clamp_value=0.5
    ),
    "bias_gelu_impl": lambda x, w: bias_gelu_impl(x, torch.zeros(x.shape[-1])),
    "weighted_squared_relu_impl": lambda x, w: weighted_squared_relu_impl(x, w, clamp_scale=2.0),
    "clamped_swiglu": lambda x, w: swiglu_mod.clamped_swiglu(x, 0.5),
    "geglu": lambda x, w: geglu_mod.geglu(x),
}


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", list(FULLGRAPH_CASES))
def test_fullgraph_compile_around_an_entry_point(name, requires_grad):
    # backend="eager": Dynamo's tracing is what fullgraph checks; Inductor adds only time here.
    fn = FULLGRAPH_CASES[name]
    x = torch.randn(6, 8, requires_grad=requires_grad)
    w = torch.rand(6, 1)
    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend="eager")(x, w)
    expected = fn(x.detach(), w)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    if requires_grad:
        out.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()


def test_clamp_argument_of_a_fullgraph_function_is_never_served_stale():
    """A user's compiled function taking the clamp as a float: Dynamo makes the float dynamic
    after the second value; the entry point specializes it, so every value gets its own graph
    (correct, never code traced for an earlier value), forward and backward."""

    def user_fn(x, c):
        return swiglu_mod.bias_swiglu_impl(x, None, clamp_value=c) * c

    compiled = torch.compile(user_fn, fullgraph=True)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    with use_kernel_backend("eager"):
        for c in (1.0, 0.5, 2.0, 0.25, 0.5):
            x = (torch.randn(8, 16, generator=gen) * 2.5).requires_grad_()
            out = compiled(x, c)
            out.sum().backward()
            x64 = x.detach().double().requires_grad_()
            (_swiglu64(x64, c) * c).sum().backward()
            assert_close_to_reference(out, _swiglu64(x.detach(), c) * c, torch.float32, f"c={c}")
            assert_close_to_reference(x.grad, x64.grad, torch.float32, f"c={c} dx")


def test_a_spec_argument_whose_clamp_the_caller_also_uses_compiles_correctly():
    """A spec passed into a caller's compiled function, its clamp also used by the caller's own
    ops: the numbers are specialized at the entry point (before the autograd Function), so the
    caller's graph holds one constant per value. A symbolic clamp crossing into the Function's
    traced body would make Dynamo fail with an internal error."""
    import dataclasses

    clamped = ActivationSpec(ActivationKind.SILU, gated=True, clamp_value=1.0)

    def user_fn(x, z, spec):
        return fused_activation(x, spec) * 2 + torch.clamp(z, max=spec.clamp_value)

    torch._dynamo.reset()
    compiled = torch.compile(user_fn, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    with use_kernel_backend("eager"):
        for c in (1.0, 0.5, 2.0, 0.25):
            spec = dataclasses.replace(clamped, clamp_value=c)
            x = (torch.randn(8, 16, generator=gen) * 2.5).requires_grad_()
            z = torch.randn(8, 8, generator=gen) * 2.5
            out = compiled(x, z, spec)
            out.sum().backward()
            x64 = x.detach().double().requires_grad_()
            expected = spec.reference(x64) * 2 + torch.clamp(z.double(), max=c)
            expected.sum().backward()
            assert_close_to_reference(out, expected, torch.float32, f"c={c}")
            assert_close_to_reference(x.grad, x64.grad, torch.float32, f"c={c} dx")


# --------------------------------------------------------------- raw functions check inputs
RAW_REFUSALS = [
    ("swiglu int", lambda: swiglu_mod.swiglu(torch.ones(2, 8, dtype=torch.int64)), TypeError),
    ("geglu int", lambda: geglu_mod.geglu(torch.ones(2, 8, dtype=torch.int32)), TypeError),
    (
        "clamped_swiglu int",
        lambda: swiglu_mod.clamped_swiglu(torch.ones(2, 8, dtype=torch.int64), 7.0),
        TypeError,
    ),
    (
        "bias_swiglu complex",
        lambda: swiglu_mod.bias_swiglu(
            torch.ones(2, 8, dtype=torch.complex64), torch.ones(8, dtype=torch.complex64)
        ),
        TypeError,
    ),
    ("swiglu odd width", lambda: swiglu_mod.swiglu(torch.ones(2, 7)), ValueError),
    ("geglu odd width", lambda: geglu_mod.geglu(torch.ones(2, 7)), ValueError),
    ("bias_gelu bias", lambda: bias_gelu(torch.ones(3), torch.ones(2, 4)), ValueError),
    (
        "weighted_swiglu weights",
        lambda: swiglu_mod.weighted_swiglu(torch.ones(4, 8), torch.ones(3, 1)),
        ValueError,
    ),
    (
        "weighted_squared_relu weights",
        lambda: weighted_squared_relu(torch.ones(4, 8), torch.ones(5)),
        ValueError,
    ),
    (
        "swiglu_back grad",
        lambda: swiglu_mod.swiglu_back(torch.ones(2, 8), torch.ones(2, 8)),
        ValueError,
    ),
    (
        "swiglu_back int grad",
        lambda: swiglu_mod.swiglu_back(torch.ones(2, 4, dtype=torch.int64), torch.ones(2, 8)),
        TypeError,
    ),
    ("swiglu not a tensor", lambda: swiglu_mod.swiglu([1.0, 2.0]), TypeError),
]


@pytest.mark.parametrize(
    "call, error", [(c, e) for _, c, e in RAW_REFUSALS], ids=[n for n, *_ in RAW_REFUSALS]
)
def test_raw_upstream_named_functions_check_their_inputs(call, error):
    with pytest.raises(error, match="input|grad|bias|probs|dimension|width"):
        call()


# ---------------------------------------------------------------- scalar argument types
SCALAR_CASES = [
    ("clamp_value", lambda v: swiglu_mod.bias_swiglu_impl(torch.randn(2, 8), None, clamp_value=v)),
    (
        "gate_clamp_scale",
        lambda v: swiglu_mod.bias_swiglu_impl(torch.randn(2, 8), None, gate_clamp_scale=v),
    ),
    (
        "clamp_value",
        lambda v: swiglu_mod.weighted_bias_swiglu_impl(
            torch.randn(2, 8), None, torch.ones(2, 1), clamp_value=v
        ),
    ),
    ("clamp_value", lambda v: swiglu_mod.clamped_swiglu(torch.randn(2, 8), v)),
    (
        "linear_offset",
        lambda v: geglu_mod.weighted_bias_quick_geglu_impl(
            torch.randn(2, 8), None, torch.ones(2, 1), linear_offset=v
        ),
    ),
    (
        "clamp_value",
        lambda v: geglu_mod.weighted_bias_quick_geglu_impl(
            torch.randn(2, 8), None, torch.ones(2, 1), clamp_value=v
        ),
    ),
    (
        "clamp_scale",
        lambda v: weighted_squared_relu_impl(torch.randn(2, 8), torch.ones(2, 1), clamp_scale=v),
    ),
]


@pytest.mark.parametrize("bad", ["7", 1j, [7.0]], ids=["str", "complex", "list"])
@pytest.mark.parametrize(
    "name, call", SCALAR_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SCALAR_CASES)]
)
def test_scalar_argument_of_the_wrong_type_is_named(name, call, bad):
    with pytest.raises(TypeError, match=f"{name} must be a real number"):
        call(bad)


def test_scalar_arguments_accept_ints_and_one_element_tensors():
    x = torch.randn(4, 8) * 4
    expected = swiglu_mod.bias_swiglu_impl(x, None, clamp_value=2.0)
    for value in (2, torch.tensor(2.0)):
        got = swiglu_mod.bias_swiglu_impl(x, None, clamp_value=value)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


# ------------------------------------------------------------------ the clamp edge per dtype
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["unfused", "fused"])
def test_clamp_edge_matches_the_reference_in_every_dtype(dtype, path):
    """A clamp that the dtype cannot represent (7.02; bf16 rounds it to 7.03125): inputs at the
    dtype's representable values around it keep or lose their gradient as the float64 reference
    says. Clamping a bf16 tensor with the Python bound would round the bound, and an input of
    7.03125 would keep its gradient."""
    c = 7.02
    spec = ActivationSpec(ActivationKind.SILU, gated=True, clamp_value=c)
    # Every representable value of the dtype in [6.9, 7.2] and its negative, as gate and linear.
    around = torch.linspace(6.9, 7.2, 2001, dtype=torch.float64).to(dtype).unique()
    edge = torch.cat([around, -around])
    x = torch.cat([edge, edge.flip(0)]).reshape(1, -1).to(dtype)  # [gate | linear] halves
    x = x.repeat(2, 1).requires_grad_()
    grad = torch.ones(2, x.shape[1] // 2, dtype=dtype)
    if path == "unfused":
        out = unfused_activation(x, spec)
    else:
        out = fused_activation(x, spec)
    out.backward(grad)
    x64 = x.detach().double().requires_grad_()
    ref = spec.reference(x64)
    ref.backward(grad.double())
    assert_close_to_reference(out, ref, dtype, f"{path} out")
    assert_close_to_reference(x.grad, x64.grad, dtype, f"{path} dx")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bias_swiglu_impl clamp", "weighted_bias_swiglu_impl"])
def test_in_place_and_fullgraph_inductor_on_cuda(name):
    """The Triton kernels behind the custom ops, inside a caller's default (Inductor)
    ``torch.compile(fullgraph=True)``, with an in-place op on the output; bf16, 3-D input."""
    fn = FULLGRAPH_CASES[name]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 2, 256, generator=gen) * 2).to("cuda", torch.bfloat16)
    w = torch.rand(8, 1, generator=gen).cuda()
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, w: fn(a, w).mul_(2), fullgraph=True)
    a = x.clone().requires_grad_()
    out = compiled(a, w)
    out.float().sum().backward()
    b = x.clone().requires_grad_()
    expected = fn(b, w).mul_(2)
    expected.float().sum().backward()
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(a.grad, b.grad, rtol=1.6e-2, atol=1.6e-2)
