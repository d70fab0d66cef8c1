"""GPU-only properties of the Triton kernels (``-m gpu``): every element written, bitwise
replay, CUDA-graph capture, and agreement with Transformer Engine's ops.
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_activations.fusions import activation_ops
from mcore_activations.fusions.activation_kernels import KernelVariant
from mcore_activations.fusions.activation_ops import use_kernel_backend
from megatron.core.fusions.fused_activation import fused_activation
from tests.unit_tests.activation_catalog import SPECS
from tests.unit_tests.mcore_activations.fusions.triton_cases import GATED
from tests.unit_tests.tolerances import assert_close_to_reference

pytest.importorskip("triton")


def _poisoned_cache(nbytes: int):
    """Fills the caching allocator's free blocks with NaN so an unwritten output shows up."""
    block = torch.full((nbytes // 4 + 1024,), math.nan, device="cuda")
    del block


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["swiglu_clamp", "situ_glu", "squared_relu_tanh"])
def test_cuda_triton_writes_every_element(name):
    spec = SPECS[name]
    rows, ffn = 1027, 1000
    width = 2 * ffn if spec.gated else ffn
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(width, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(rows, 1, device="cuda")
    variant = KernelVariant.of(spec, has_bias=True, has_probs=True)
    from mcore_activations.fusions.activation_kernels import params_tensor, spec_params

    params = params_tensor(spec_params(spec), x.device)
    grad = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)
    with use_kernel_backend("triton"):
        _poisoned_cache(64 * rows * width)
        out = activation_ops.run_forward(variant, x, bias, probs, params)
        _poisoned_cache(64 * rows * width)
        dx, dbias, dprobs = activation_ops.run_backward(variant, grad, x, bias, probs, params)
    for t in (out, dx, dbias, dprobs):
        assert not t.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("has_bias", [False, True], ids=["", "bias"])
def test_cuda_triton_is_bitwise_reproducible(has_bias):
    spec = SPECS["swiglu_clamp"]
    torch.manual_seed(0)
    x = torch.randn(4099, 2 * 1536, device="cuda", dtype=torch.bfloat16) * 4
    bias = torch.randn(2 * 1536, device="cuda", dtype=torch.bfloat16) if has_bias else None
    probs = torch.rand(4099, 1, device="cuda")
    grad = torch.randn(4099, 1536, device="cuda", dtype=torch.bfloat16)
    results = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, bias, probs)]
        with use_kernel_backend("triton"):
            out = fused_activation(leaves[0], spec, bias=leaves[1], probs=leaves[2])
        out.backward(grad)
        results.append([out] + [t.grad for t in leaves if t is not None])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.gpu
@pytest.mark.parametrize("ffn", [1024, 1536], ids=["one-block", "three-blocks"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("has_probs", [False, True], ids=["unweighted", "probs"])
def test_cuda_triton_captures_in_a_cuda_graph(has_probs, has_bias, ffn):
    """Forward and backward capture in one CUDA graph (no host sync, no per-call host-to-device
    copies) and a replay on new input values gives exactly what an eager call gives: with and
    without a bias and probabilities, over one column block and over three (whose partial
    probability gradients are summed after the kernel)."""
    spec = SPECS["situ_glu"]
    leaves = {"x": (torch.randn(512, 2 * ffn, device="cuda", dtype=torch.bfloat16) * 4)}
    if has_bias:
        leaves["bias"] = torch.randn(2 * ffn, device="cuda", dtype=torch.bfloat16)
    if has_probs:
        leaves["probs"] = torch.rand(512, 1, device="cuda")
    for leaf in leaves.values():
        leaf.requires_grad_()
    grad = torch.randn(512, ffn, device="cuda", dtype=torch.bfloat16)

    def call(t):
        return fused_activation(t["x"], spec, bias=t.get("bias"), probs=t.get("probs"))

    with use_kernel_backend("triton"):
        # Warm up on a side stream (compiles the kernels, fills the params cache), then capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                call(leaves).backward(grad)
        torch.cuda.current_stream().wait_stream(stream)
        for leaf in leaves.values():
            leaf.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(leaves)
            out.backward(grad)
        with torch.no_grad():
            for leaf in leaves.values():
                leaf.mul_(0.5).add_(0.25)
        graph.replay()
        torch.cuda.synchronize()
        fresh = {name: leaf.detach().clone().requires_grad_() for name, leaf in leaves.items()}
        eager = call(fresh)
        eager.backward(grad)
    assert torch.equal(out, eager)
    for name, leaf in leaves.items():
        assert torch.equal(leaf.grad, fresh[name].grad), name


@pytest.mark.gpu
@pytest.mark.te
@pytest.mark.parametrize("weighted", [False, True], ids=["", "scaled"])
@pytest.mark.parametrize("name", GATED + ["squared_relu", "squared_relu_tanh"])
def test_cuda_triton_matches_te_op(name, weighted):
    """Where Transformer Engine has an op for the spec, it and the Triton kernels agree (both
    against the float64 reference, through the one tolerance table, forward and backward)."""
    from mcore_activations.activation_spec import UnsupportedActivationError
    from mcore_activations.te_lowering import lower_activation_to_te_op

    spec = SPECS[name]
    try:
        op = lower_activation_to_te_op(spec, path="test", scaled=weighted)
    except UnsupportedActivationError:
        pytest.skip(f"TE has no {'scaled ' if weighted else ''}op for {name}")
    width = 2 * 512 if spec.gated else 512
    x = torch.randn(257, width, device="cuda", dtype=torch.bfloat16) * 3
    probs = torch.rand(257, 1, device="cuda") if weighted else None
    grad = torch.randn(257, 512, device="cuda", dtype=torch.bfloat16)
    results = []
    for run in ("triton", "te"):
        xs = x.clone().requires_grad_()
        ps = probs.clone().requires_grad_() if weighted else None
        if run == "triton":
            with use_kernel_backend("triton"):
                out = fused_activation(xs, spec, probs=ps)
        else:
            out = op(xs, ps.view(-1)) if weighted else op(xs)
        out.backward(grad)
        results.append((out, xs.grad))
    xr = x.double().requires_grad_()
    ref = spec.reference(xr, probs=probs.double() if weighted else None)
    ref.backward(grad.double())
    for (out, dx), run in zip(results, ("triton", "te")):
        assert_close_to_reference(out, ref, torch.bfloat16, f"{run} {name} out")
        assert_close_to_reference(dx, xr.grad, torch.bfloat16, f"{run} {name} dx")
