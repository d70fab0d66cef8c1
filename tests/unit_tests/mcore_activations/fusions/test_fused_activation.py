"""Fused activation kernels vs the float64 reference, for every activation in the catalogue."""

import pytest
import torch

from mcore_activations.fusions.activation_ops import use_compiled_kernels
from megatron.core.fusions.fused_activation import fused_activation, lower_to_fused_kernel
from megatron.core.transformer.activation_spec import (
    ActivationKind,
    ActivationSpec,
    UnsupportedActivationError,
)
from tests.unit_tests.activation_catalog import SPECS, spec_of
from tests.unit_tests.tolerances import assert_close_to_reference

DTYPES = [torch.float32, torch.bfloat16]
ROWS, FFN = 37, 40  # FFN deliberately not a multiple of 32


def _inputs(spec, dtype, has_bias, has_probs, rows=ROWS, ffn=FFN, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * ffn if spec.gated else ffn
    x = (torch.randn(rows, width, generator=gen) * 3.0).to(dtype)
    bias = (torch.randn(width, generator=gen) * 0.5).to(dtype) if has_bias else None
    probs = torch.rand(rows, 1, generator=gen).to(dtype) if has_probs else None
    grad = torch.randn(rows, ffn, generator=gen).to(dtype)
    return x, bias, probs, grad


def _leaf(t, dtype=None):
    if t is None:
        return None
    t = t.detach().clone()
    if dtype is not None:
        t = t.to(dtype)
    return t.requires_grad_()


def check_against_reference(spec, dtype, has_bias, has_probs, device="cpu", **shape):
    x, bias, probs, grad = _inputs(spec, dtype, has_bias, has_probs, **shape)
    x, grad = x.to(device), grad.to(device)
    bias = bias.to(device) if bias is not None else None
    probs = probs.to(device) if probs is not None else None
    xs, bs, ps = _leaf(x), _leaf(bias), _leaf(probs)
    out = fused_activation(xs, spec, bias=bs, probs=ps)
    out.backward(grad)

    xr, br, pr = _leaf(x, torch.float64), _leaf(bias, torch.float64), _leaf(probs, torch.float64)
    ref = spec.reference(xr, bias=br, probs=pr)
    ref.backward(grad.double())

    assert out.dtype == dtype
    assert_close_to_reference(out, ref, dtype, f"{spec.name} output")
    assert_close_to_reference(xs.grad, xr.grad, dtype, f"{spec.name} dx")
    if has_bias:
        assert bs.grad.dtype == dtype
        assert_close_to_reference(bs.grad, br.grad, dtype, f"{spec.name} dbias")
    if has_probs:
        assert ps.grad.dtype == dtype
        assert_close_to_reference(ps.grad, pr.grad, dtype, f"{spec.name} dprobs")


@pytest.mark.parametrize("has_probs", [False, True], ids=["", "probs"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_eager_kernels_match_reference(name, dtype, has_bias, has_probs):
    with use_compiled_kernels(False):
        check_against_reference(SPECS[name], dtype, has_bias, has_probs)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_compiled_kernels_match_reference(name):
    # One compiled variant per activation (bias + probs, bf16) keeps the CPU tier's compile time
    # bounded; the eager test above covers the remaining structure combinations.
    with use_compiled_kernels(True):
        check_against_reference(SPECS[name], torch.bfloat16, True, True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_cuda_compiled_kernels_match_reference(name, dtype):
    with use_compiled_kernels(True):
        check_against_reference(SPECS[name], dtype, True, True, device="cuda", rows=1031, ffn=344)
        check_against_reference(SPECS[name], dtype, False, False, device="cuda", rows=64, ffn=40)


@pytest.mark.gpu
def test_cuda_runs_are_bitwise_deterministic():
    spec = SPECS["swiglu_clamp"]
    x = torch.randn(4096, 2 * 1000, device="cuda", dtype=torch.bfloat16) * 3
    probs = torch.rand(4096, 1, device="cuda", requires_grad=True)
    grads = []
    for _ in range(3):
        xs = x.clone().requires_grad_()
        probs.grad = None
        out = fused_activation(xs, spec, probs=probs)
        out.backward(torch.ones_like(out))
        grads.append((out.detach(), xs.grad, probs.grad.clone()))
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", ["swiglu_clamp", "situ_glu", "quick_geglu_gpt_oss"])
def test_glu_interleave_matches_reference(name, use_compile):
    spec = spec_of(name, glu_interleave_size=4)
    with use_compiled_kernels(use_compile):
        check_against_reference(spec, torch.float32, False, True, ffn=16)


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
def test_three_dim_input_keeps_leading_shape(use_compile):
    spec = SPECS["swiglu_clamp"]
    x = (torch.randn(5, 3, 16) * 3).requires_grad_()
    b = torch.randn(16, requires_grad=True)
    probs = torch.rand(5, 3, requires_grad=True)
    grad = torch.randn(5, 3, 8)
    with use_compiled_kernels(use_compile):
        out = fused_activation(x, spec, bias=b, probs=probs)
        out.backward(grad)
    assert out.shape == (5, 3, 8)
    leaves = [t.detach().double().requires_grad_() for t in (x, b, probs)]
    ref = spec.reference(leaves[0], bias=leaves[1], probs=leaves[2].unsqueeze(-1))
    ref.backward(grad.double())
    assert_close_to_reference(out, ref, torch.float32, "3-D out")
    for got, leaf in zip((x.grad, b.grad, probs.grad), leaves):
        assert got.shape == leaf.shape
        assert_close_to_reference(got, leaf.grad, torch.float32, "3-D grad")


def test_upstream_functions_accept_three_dim_inputs():
    from megatron.core.fusions.fused_bias_swiglu import BiasSwiGLUFunction

    x = (torch.randn(4, 2, 16) * 3).requires_grad_()
    b = torch.randn(16, requires_grad=True)
    with use_compiled_kernels(False):
        BiasSwiGLUFunction.apply(x, b, False, False, 1.5).sum().backward()
    xr, br = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    SPECS["swiglu_clamp"].reference(xr, bias=br).sum().backward()
    assert_close_to_reference(b.grad, br.grad, torch.float32, "dbias")
    assert_close_to_reference(x.grad, xr.grad, torch.float32, "dx")


def test_clamps_are_hit_by_test_inputs():
    # Guards the tests above against inputs too small to exercise the clamp branches.
    x, *_ = _inputs(SPECS["swiglu_clamp"], torch.float32, False, False)
    gate, lin = x.chunk(2, -1)
    c = SPECS["swiglu_clamp"].clamp_value
    assert (gate > c).float().mean() > 0.2 and (lin.abs() > c).float().mean() > 0.4


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", ["swiglu_clamp", "quick_geglu_gpt_oss"])
def test_gradient_masks_are_inclusive_at_the_clamp_boundary(name, use_compile):
    """Inputs exactly equal to +-c pass the gradient through, as torch.clamp's masks do."""
    spec = SPECS[name]
    c = spec.clamp_value  # exactly representable in bf16
    gate = torch.tensor([[c, c, -c, 0.5]], dtype=torch.bfloat16)
    lin = torch.tensor([[c, -c, c, -c]], dtype=torch.bfloat16)
    x = torch.cat([gate, lin], -1).requires_grad_()
    with use_compiled_kernels(use_compile):
        fused_activation(x, spec).sum().backward()
    xr = x.detach().double().requires_grad_()
    spec.reference(xr).sum().backward()
    assert (xr.grad != 0).all(), "reference gradient vanished at the boundary"
    assert_close_to_reference(x.grad, xr.grad, torch.bfloat16, "boundary dx")


def test_minimum_is_not_a_clamp_at_ties():
    # Why the kernels use explicit inclusive masks: torch.minimum splits the gradient at ties.
    a = torch.tensor([1.5], requires_grad=True)
    torch.minimum(a, torch.tensor(1.5)).backward()
    b = torch.tensor([1.5], requires_grad=True)
    torch.clamp(b, max=1.5).backward()
    assert a.grad.item() == 0.5 and b.grad.item() == 1.0


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
def test_nan_propagates(use_compile):
    spec = SPECS["swiglu_clamp"]
    x = torch.randn(2, 8)
    x[0, 0] = float("nan")
    x.requires_grad_()
    with use_compiled_kernels(use_compile):
        out = fused_activation(x, spec)
        out.sum().backward()
    assert torch.isnan(out[0, 0]) and torch.isfinite(out[1]).all()
    assert torch.isnan(x.grad[0, 0])


def test_fp8_input_store_differentiates_at_the_rounded_input():
    spec = SPECS["swiglu"]
    x = (torch.randn(16, 32) * 2).requires_grad_()
    with use_compiled_kernels(False):
        out = fused_activation(x, spec, fp8_input_store=True)
        out.backward(torch.ones_like(out))
    rounded = x.detach().to(torch.float8_e4m3fn).double().requires_grad_()
    spec.reference(rounded).sum().backward()
    assert_close_to_reference(x.grad, rounded.grad, torch.float32, "fp8-store dx")
    assert_close_to_reference(out, spec.reference(x.detach()), torch.float32, "fp8-store out")


def test_cpu_offload_tags_saved_input():
    spec = SPECS["swiglu"]
    x = torch.randn(4, 8, requires_grad=True)
    with use_compiled_kernels(False):
        out = fused_activation(x, spec, cpu_offload_input=True)
    node = out.grad_fn
    while not hasattr(node, "saved_tensors"):  # skip view nodes between out and the Function
        node = node.next_functions[0][0]
    assert getattr(node.saved_tensors[0], "activation_offloading", False)


def test_custom_activation_is_refused_by_the_fused_kernels():
    spec = ActivationSpec(ActivationKind.CUSTOM, gated=True, custom_func=torch.tanh)
    with pytest.raises(UnsupportedActivationError, match="MyPath cannot compute GLU tanh"):
        lower_to_fused_kernel(spec, "MyPath")
    with pytest.raises(UnsupportedActivationError):
        fused_activation(torch.randn(2, 4), spec)


def test_shape_errors_are_clear():
    spec = SPECS["swiglu"]
    with pytest.raises(ValueError, match=r"probs of shape \(3, 1\) do not match"):
        fused_activation(torch.randn(2, 4), spec, probs=torch.ones(3, 1))
    with pytest.raises(ValueError, match="bias of shape"):
        fused_activation(torch.randn(2, 4), spec, bias=torch.ones(3))


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
def test_zero_rows(use_compile):
    # An expert that receives no tokens still runs its activation on an empty batch.
    x = torch.empty(0, 16, requires_grad=True)
    probs = torch.empty(0, 1, requires_grad=True)
    with use_compiled_kernels(use_compile):
        out = fused_activation(x, SPECS["swiglu_clamp"], bias=torch.zeros(16), probs=probs)
        out.sum().backward()
    assert out.shape == (0, 8) and x.grad.shape == (0, 16) and probs.grad.shape == (0, 1)


def test_row_counts_share_one_graph_and_widths_are_static():
    """MoE changes the token count every step: new row counts must not recompile. Widths are
    compiled as constants, each with its own graphs (symbolic widths cost 2-3x on an H200,
    docs/bench/history.md), and a second width must not turn the first one symbolic."""
    from torch._dynamo.utils import counters

    # A variant no other test compiles, so the counts below are this test's alone.
    spec = spec_of("quick_geglu_gpt_oss", glu_interleave_size=2)

    def graphs_after(rows, width):
        x = torch.randn(rows, width, requires_grad=True)
        with use_compiled_kernels(True):
            fused_activation(x, spec).sum().backward()
        return counters["stats"]["unique_graphs"]

    first = graphs_after(5, 16)  # fwd and bwd graphs for width 16
    assert [graphs_after(rows, 16) for rows in (7, 33, 130)] == [first] * 3
    second = graphs_after(9, 24)
    assert second == first + 2  # width 24: its own fwd and bwd graphs
    assert graphs_after(11, 16) == second  # width 16 still runs its own (static) graphs
    assert graphs_after(13, 40) == second + 2  # a third width is static too, not symbolic
    assert graphs_after(0, 40) == second + 2  # no rows: nothing to compile
