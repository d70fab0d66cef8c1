"""The in-place backward option: same bits as out of place, the input's memory reused, and every
unsafe case handled or refused by name.

Numerics: for every catalogue activation (GLU interleave included), with and without bias and
token weights, on the eager torch backend and on the Triton kernels (Triton's interpreter on
CPU, compiled under ``-m gpu``), the in-place backward gives bitwise the out-of-place gradients,
which are themselves checked against the float64 reference within the dtype's tolerance; inputs
at std 3 hit every clamp. The dtype rotates over the cases; one spec runs every dtype.

Safety: a second backward through a retained graph, a double backward, fp8 input store, CPU
offload, activation recomputation (reentrant, ``moe_act``-style, non-reentrant), CUDA-graph
capture, saved-tensor hooks, a leaf input and other users of the input; the config refusals at
layer construction; the option's keyword, process default and environment variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mcore_activations.fusions import activation_ops, in_place
from mcore_activations.fusions.activation_kernels import KernelVariant
from mcore_activations.fusions.activation_ops import use_kernel_backend
from mcore_activations.fusions.in_place import InPlaceBackwardError, use_in_place_backward
from mcore_activations.kernel_params import params_tensor, spec_params
from megatron.core.fusions import fused_bias_geglu as geglu_mod
from megatron.core.fusions import fused_bias_swiglu as swiglu_mod
from megatron.core.fusions.fused_activation import fused_activation
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl
from tests.unit_tests.activation_catalog import SPECS, layout_cases, spec_of
from tests.unit_tests.tolerances import assert_close_to_reference

ROOT = Path(__file__).resolve().parents[4]
CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SWIGLU_CLAMP = SPECS["swiglu_clamp"]

# (backend, device): the eager torch math on CPU, the Triton kernels where they run.
BACKENDS = [
    pytest.param("eager", "cpu", id="eager"),
    pytest.param(
        "triton",
        "cpu",
        id="triton-interpreted",
        marks=pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET unset"),
    ),
    pytest.param("triton", "cuda", id="triton-cuda", marks=pytest.mark.gpu),
]


def _inputs(spec, dtype, has_bias, has_probs, rows, ffn, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * ffn if spec.gated else ffn
    x = (torch.randn(rows, width, generator=gen) * 3.0).to(dtype).to(device)
    bias = (torch.randn(width, generator=gen) * 0.5).to(dtype).to(device) if has_bias else None
    probs = torch.rand(rows, 1, generator=gen).to(dtype).to(device) if has_probs else None
    grad = torch.randn(rows, ffn, generator=gen).to(dtype).to(device)
    return x, bias, probs, grad


def _run(spec, x, bias, probs, grad, in_place_backward, **kwargs):
    """fc1's output stand-in ``x * 1`` (an intermediate, as the option needs) through the fused
    activation and back; returns the gradients, the intermediate and its gradient's pointers."""
    leaf = x.detach().clone().requires_grad_()
    b = bias.detach().clone().requires_grad_() if bias is not None else None
    p = probs.detach().clone().requires_grad_() if probs is not None else None
    fc1_out = leaf * 1
    seen = []
    fc1_out.register_hook(lambda g: seen.append(g.data_ptr()))
    out = fused_activation(
        fc1_out, spec, bias=b, probs=p, in_place_backward=in_place_backward, **kwargs
    )
    out.backward(grad)
    grads = (leaf.grad, b.grad if b is not None else None, p.grad if p is not None else None)
    return out, grads, fc1_out, seen


def _assert_equal(a, b, what):
    for name, x, y in zip(("dx", "dbias", "dprobs"), a, b):
        if x is None:
            assert y is None, what
            continue
        assert torch.equal(x, y), f"{what} {name}: in-place differs from out-of-place"


def check_in_place(spec, dtype, has_bias, has_probs, backend, device, rows=7, ffn=13, **kw):
    """In-place == out-of-place bitwise, close to float64, and x's memory holds dx."""
    x, bias, probs, grad = _inputs(spec, dtype, has_bias, has_probs, rows, ffn, device)
    with use_kernel_backend(backend):
        out_ref, grads_ref, _, _ = _run(spec, x, bias, probs, grad, False, **kw)
        out, grads, fc1_out, seen = _run(spec, x, bias, probs, grad, True, **kw)
    what = f"{spec.name} {dtype} bias={has_bias} probs={has_probs} {backend}"
    assert torch.equal(out, out_ref), what
    _assert_equal(grads, grads_ref, what)
    # The gradient fc1 receives is the activation input's own memory, holding dx.
    assert seen == [fc1_out.data_ptr()], what
    assert torch.equal(fc1_out.detach(), grads[0]), what
    # And the gradients are the reference's (so neither path is wrong in the same way).
    x64 = x.double().requires_grad_()
    b64 = bias.double().requires_grad_() if bias is not None else None
    p64 = probs.double().requires_grad_() if probs is not None else None
    spec.reference(x64, bias=b64, probs=p64).backward(grad.double())
    if not kw.get("fp8_input_store"):
        assert_close_to_reference(grads[0], x64.grad, dtype, f"{what} dx")
        if has_bias:
            assert_close_to_reference(grads[1], b64.grad, dtype, f"{what} dbias")
        if has_probs:
            assert_close_to_reference(grads[2], p64.grad, dtype, f"{what} dprobs")


# ------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("has_probs", [False, True], ids=["", "probs"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("name,interleave", layout_cases())
def test_in_place_equals_out_of_place_bitwise(
    name, interleave, has_bias, has_probs, backend, device
):
    spec = spec_of(name, glu_interleave_size=interleave)
    dtype = DTYPES[sum(map(ord, f"{name}{interleave}{has_bias}{has_probs}")) % len(DTYPES)]
    ffn = 24 if interleave else 13
    check_in_place(spec, dtype, has_bias, has_probs, backend, device, ffn=ffn)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,ffn", [(1, 8), (19, 40)], ids=["one-row", "19x40"])
def test_in_place_every_dtype_and_shape(rows, ffn, dtype, backend, device):
    check_in_place(SWIGLU_CLAMP, dtype, True, True, backend, device, rows=rows, ffn=ffn)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("name", ["swiglu_clamp", "squared_relu_tanh"])
def test_in_place_across_programs(name, backend, device):
    """Several row programs each looping over several row blocks, and several column blocks: the
    Triton plans whose loads run ahead of the stores (the loop's one-trip-ahead loads). The
    launch options that make a small shape take them reach the raw kernels only, so on the
    Triton backend the kernels' in-place and out-of-place backwards are compared directly."""
    if backend != "triton":
        for has_probs in (False, True):
            check_in_place(SPECS[name], torch.float32, True, has_probs, backend, device, 19, 300)
        return
    from mcore_activations.fusions import triton_kernels
    from mcore_activations.fusions.triton_plans import LaunchOptions

    counts = dict(bias_programs=4, bias_programs_glu=4, bias_programs_narrow=4)
    options = LaunchOptions(bwd_tile=256, bwd_tile_row=256, **counts)
    spec = SPECS[name]
    for has_probs in (False, True):
        x, bias, probs, grad = _inputs(spec, torch.float32, True, has_probs, 19, 300, device)
        v = KernelVariant.of(spec, has_bias=True, has_probs=has_probs)
        params = params_tensor(spec_params(spec), x.device)
        expected = triton_kernels.triton_backward(v, grad, x, bias, probs, params, options=options)
        own = x.clone()
        got = triton_kernels.triton_backward(
            v, grad, own, bias, probs, params, True, options=options
        )
        assert got[0].data_ptr() == own.data_ptr()
        _assert_equal(got, expected, f"{spec.name} probs={has_probs}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("has_probs", [False, True], ids=["", "probs"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("name", ["swiglu", "swiglu_clamp", "situ_glu", "quick_geglu_gpt_oss"])
def test_in_place_production_shapes_on_gpu(name, has_bias, has_probs, dtype):
    # Shapes whose plans pipeline the loads (several stages) and split rows over many programs.
    for rows, ffn in ((4096, 1536), (1000, 2880)):
        check_in_place(SPECS[name], dtype, has_bias, has_probs, "triton", "cuda", rows, ffn)


def test_in_place_fp8_input_store_writes_over_the_upcast_only():
    """fp8 store saves a rounded copy; the backward overwrites its private upcast, never the
    input, and a second backward through the retained graph still works."""
    spec = swiglu_mod.SWIGLU
    x, _, _, grad = _inputs(spec, torch.bfloat16, False, False, 7, 16, "cpu")
    results = []
    for flag in (False, True):
        leaf = x.detach().clone().requires_grad_()
        fc1_out = leaf * 1
        kept = fc1_out.detach().clone()
        out = swiglu_mod.bias_swiglu_impl(fc1_out, None, True, in_place_backward=flag)
        out.backward(grad, retain_graph=True)
        first = leaf.grad.clone()
        out.backward(grad)
        assert torch.equal(fc1_out.detach(), kept), "fp8 store: the input itself is untouched"
        results.append((first, leaf.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize(
    "call",
    [
        lambda x, w, ip: swiglu_mod.bias_swiglu_impl(x, None, clamp_value=0.7, **ip),
        lambda x, w, ip: swiglu_mod.bias_swiglu_impl(
            x, None, gate_clamp_scale=2.0, linear_clamp_scale=3.0, **ip
        ),
        lambda x, w, ip: swiglu_mod.weighted_bias_swiglu_impl(x, None, w, clamp_value=0.7, **ip),
        lambda x, w, ip: geglu_mod.bias_geglu_impl(x, None, **ip),
        lambda x, w, ip: geglu_mod.weighted_bias_quick_geglu_impl(
            x, None, w, False, 1.0, 0.7, **ip
        ),
        lambda x, w, ip: weighted_squared_relu_impl(x, w, clamp_scale=2.0, **ip),
    ],
    ids=["swiglu", "situ", "weighted_swiglu", "geglu", "quick_geglu", "squared_relu"],
)
def test_entry_points_take_the_keyword(call):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 16, generator=gen) * 3
    w = torch.rand(6, 1, generator=gen)
    got = []
    for option in ({"in_place_backward": False}, {"in_place_backward": True}):
        leaf = x.clone().requires_grad_()
        wl = w.clone().requires_grad_()
        fc1_out = leaf * 1
        call(fc1_out, wl, option).square().sum().backward()
        got.append((leaf.grad, wl.grad))
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)


def test_upstream_named_functions_follow_the_process_default():
    # bias_gelu_impl is upstream's autograd Function itself: no keyword, the process default.
    gen = torch.Generator().manual_seed(4)
    x, bias = torch.randn(5, 8, generator=gen), torch.randn(8, generator=gen)
    grads = []
    for enabled in (False, True):
        leaf = x.clone().requires_grad_()
        fc1_out = leaf * 1
        with use_in_place_backward(enabled):
            bias_gelu_impl(fc1_out, bias).sum().backward()
        grads.append(leaf.grad)
        assert torch.equal(fc1_out.detach(), leaf.grad) == enabled
    assert torch.equal(grads[0], grads[1])


def test_raw_upstream_functions_never_write_over_their_input():
    """Megatron's JIT warmup (megatron.training.initialize) runs upstream's raw bias_swiglu and
    bias_gelu on leaf tensors that want a gradient, with the option on for the process: they
    run, and their backward leaves the input alone."""
    from megatron.core.fusions.fused_bias_gelu import bias_gelu
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu, clamped_swiglu

    gen = torch.Generator().manual_seed(6)
    with use_in_place_backward(True):
        for input_grad in (False, True):  # the warmup's two passes
            x = torch.rand(4, 2, 16, generator=gen).requires_grad_(input_grad)
            b = torch.rand(16, generator=gen).requires_grad_()
            kept = x.detach().clone()
            for out in (bias_swiglu(x, b), bias_gelu(b, x)):
                out.sum().backward()
                assert torch.equal(x.detach(), kept)
        y = torch.randn(5, 16, generator=gen).requires_grad_()
        kept = y.detach().clone()
        clamped_swiglu(y, 1.0).square().sum().backward()
        assert torch.equal(y.detach(), kept) and y.grad is not None


# ------------------------------------------------------------------------- handled cases
def test_double_backward_runs_out_of_place():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, generator=gen) * 2
    second = torch.randn(4, 8, generator=gen)
    got = []
    for flag in (False, True):
        leaf = x.clone().requires_grad_()
        fc1_out = leaf * 1
        kept = fc1_out.detach().clone()
        out = swiglu_mod.bias_swiglu_impl(fc1_out, None, in_place_backward=flag)
        with use_kernel_backend("eager"):  # the backend whose backward autograd differentiates
            (first,) = torch.autograd.grad(out.sum(), fc1_out, create_graph=True)
            (first * second).sum().backward()
        assert torch.equal(fc1_out.detach(), kept)
        got.append(leaf.grad)
    assert torch.equal(got[0], got[1])


def test_no_input_gradient_leaves_the_input_alone():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 8, generator=gen) * 2
    w = torch.rand(4, 1, generator=gen, requires_grad=True)
    out = swiglu_mod.weighted_bias_swiglu_impl(x, None, w, in_place_backward=True)
    out.sum().backward()
    assert torch.equal(x, torch.randn(4, 8, generator=torch.Generator().manual_seed(6)) * 2)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_non_contiguous_input_is_copied_then_overwritten(backend, device):
    base = torch.randn(16, 6, device=device).requires_grad_()
    kept = base.detach().clone()
    with use_kernel_backend(backend):
        fc1_out = (base * 1).t()  # [6, 16], not contiguous
        swiglu_mod.bias_swiglu_impl(fc1_out, None, in_place_backward=True).sum().backward()
        ref = kept.clone().requires_grad_()
        swiglu_mod.bias_swiglu_impl((ref * 1).t(), None).sum().backward()
    assert torch.equal(base.detach(), kept)
    if backend == "triton":  # both paths run the kernel on a contiguous copy
        assert torch.equal(base.grad, ref.grad)
    else:
        # Eager CPU math on a strided tensor and on its contiguous copy may take different
        # (vectorised or not) code: the same formula, last-bit differences.
        torch.testing.assert_close(base.grad, ref.grad)


def test_torch_compile_runs_out_of_place():
    x = torch.randn(4, 8) * 2

    def step(leaf):
        fc1_out = leaf * 1
        return swiglu_mod.bias_swiglu_impl(fc1_out, None, in_place_backward=True).sum()

    leaf = x.clone().requires_grad_()
    torch.compile(step, backend="aot_eager", fullgraph=True)(leaf).backward()
    ref = x.clone().requires_grad_()
    swiglu_mod.bias_swiglu_impl(ref * 1, None).sum().backward()
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=0, atol=0)


def test_reentrant_recompute_is_compatible():
    """Megatron's checkpoint (full / 'mlp' recompute) rebuilds the graph in the backward: fc1's
    output there is an intermediate again, and the in-place backward is safe."""
    from megatron.core.tensor_parallel.random import checkpoint

    gen = torch.Generator().manual_seed(7)
    h, w1 = torch.randn(5, 8, generator=gen), torch.randn(16, 8, generator=gen)

    def block(hidden, weight):
        return swiglu_mod.bias_swiglu_impl(hidden @ weight.t(), None, in_place_backward=True)

    got = []
    for recompute in (False, True):
        hl, wl = h.clone().requires_grad_(), w1.clone().requires_grad_()
        out = checkpoint(block, False, hl, wl) if recompute else block(hl, wl)
        out.square().sum().backward()
        got.append((hl.grad, wl.grad))
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)


# ------------------------------------------------------------------------------- refusals
def _fc1_out(shape=(4, 8)):
    return torch.randn(*shape, requires_grad=True) * 1


def test_second_backward_through_retained_graph_is_refused():
    fc1_out = _fc1_out()
    out = swiglu_mod.bias_swiglu_impl(fc1_out, None, in_place_backward=True)
    out.sum().backward(retain_graph=True)
    with pytest.raises(InPlaceBackwardError, match="second backward.*retain_graph"):
        out.sum().backward()


def test_cpu_offload_is_refused():
    with pytest.raises(ValueError, match="in_place_backward=True with cpu_offload_input=True"):
        swiglu_mod.bias_swiglu_impl(_fc1_out(), None, False, True, in_place_backward=True)


@pytest.mark.parametrize("shape", [(4, 8), (2, 2, 8)], ids=["2d", "3d view"])
def test_leaf_input_is_refused(shape):
    leaf = torch.randn(*shape, requires_grad=True)
    with pytest.raises(InPlaceBackwardError, match="leaf tensor"):
        swiglu_mod.bias_swiglu_impl(leaf, None, in_place_backward=True)


class _LinearReturningAView(torch.autograd.Function):
    """Like Transformer Engine's linears: the output is a view of a buffer the Function made."""

    @staticmethod
    def forward(ctx, x):
        buffer = torch.empty(x.numel(), dtype=x.dtype)
        buffer.copy_(x.reshape(-1) * 2)
        return buffer.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_view_made_inside_a_custom_function_is_written_over():
    x, _, _, grad = _inputs(SWIGLU_CLAMP, torch.float32, False, False, 4, 8, "cpu")
    got = []
    for enabled in (False, True):
        leaf = x.clone().requires_grad_()
        fc1_out = _LinearReturningAView.apply(leaf)
        assert fc1_out._base is not None and fc1_out._base.grad_fn is None
        fused_activation(fc1_out, SWIGLU_CLAMP, in_place_backward=enabled).backward(grad)
        got.append(leaf.grad)
    assert torch.equal(*got)


def test_moe_act_style_recompute_is_refused():
    """Upstream's 'moe_act' recompute runs the activation on the checkpoint's detached copy of
    fc1's output (CheckpointWithoutOutput): a leaf, refused when the backward recomputes it."""
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    fc1_out = _fc1_out()
    ckpt = CheckpointWithoutOutput()

    def act(x):
        return swiglu_mod.bias_swiglu_impl(x, None, in_place_backward=True)

    hidden = ckpt.checkpoint(act, fc1_out)
    out = hidden @ torch.randn(4, 3)
    ckpt.discard_output_and_register_recompute(out)
    with pytest.raises(InPlaceBackwardError, match="moe_act"):
        out.sum().backward()


def test_non_reentrant_checkpoint_is_refused():
    from torch.utils.checkpoint import checkpoint

    def block(x):
        return swiglu_mod.bias_swiglu_impl(x * 1, None, in_place_backward=True)

    with pytest.raises(InPlaceBackwardError, match="saved-tensor hooks"):
        checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False)


def test_saved_tensor_hooks_are_refused():
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with pytest.raises(InPlaceBackwardError, match="saved-tensor hooks"):
            swiglu_mod.bias_swiglu_impl(_fc1_out(), None, in_place_backward=True)


def test_cuda_graph_capture_is_refused_in_forward_and_backward(monkeypatch):
    fc1_out = _fc1_out()
    out = swiglu_mod.bias_swiglu_impl(fc1_out, None, in_place_backward=True)
    monkeypatch.setattr(in_place, "_capturing", lambda: True)
    with pytest.raises(InPlaceBackwardError, match="CUDA graph capture"):
        swiglu_mod.bias_swiglu_impl(_fc1_out(), None, in_place_backward=True)
    with pytest.raises(InPlaceBackwardError, match="CUDA graph capture"):
        out.sum().backward()


@pytest.mark.gpu
def test_cuda_graph_capture_is_refused_on_gpu():
    fc1_out = torch.randn(64, 256, device="cuda", requires_grad=True) * 1
    swiglu_mod.bias_swiglu_impl(fc1_out, None).sum().backward()  # warm up the kernels
    graph = torch.cuda.CUDAGraph()
    static = torch.randn(64, 256, device="cuda", requires_grad=True) * 1
    with pytest.raises(InPlaceBackwardError, match="CUDA graph capture"):
        with torch.cuda.graph(graph):
            swiglu_mod.bias_swiglu_impl(static, None, in_place_backward=True)


def test_second_in_place_user_of_the_input_is_refused():
    fc1_out = _fc1_out()
    swiglu_mod.bias_swiglu_impl(fc1_out, None, in_place_backward=True)
    with pytest.raises(InPlaceBackwardError, match="already saved"):
        swiglu_mod.bias_swiglu_impl(fc1_out.view(2, 2, 8), None, in_place_backward=True)


def test_another_user_that_saved_the_input_fails_instead_of_reading_the_gradient():
    """A consumer that saved fc1's output and runs its backward after the activation's (autograd
    runs the later-recorded node first) sees the bumped version counter: autograd refuses, and
    nothing reads the overwritten values."""
    fc1_out = _fc1_out()
    other = fc1_out * torch.randn(4, 8, requires_grad=True)  # saves fc1_out for its backward
    act = swiglu_mod.bias_swiglu_impl(fc1_out, None, in_place_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (other.sum() + act.sum()).backward()


def test_another_user_whose_backward_ran_first_reads_the_input_intact():
    gen = torch.Generator().manual_seed(10)
    x, w = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    got = []
    for flag in (False, True):
        leaf, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        fc1_out = leaf * 1
        act = swiglu_mod.bias_swiglu_impl(fc1_out, None, in_place_backward=flag)
        other = fc1_out * wl  # recorded later, so its backward (reading fc1_out) runs first
        (other.sum() + act.square().sum()).backward()
        got.append((leaf.grad, wl.grad))
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)


def test_another_user_that_saved_nothing_is_fine():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4, 8, generator=gen)
    got = []
    for flag in (False, True):
        leaf = x.clone().requires_grad_()
        fc1_out = leaf * 1
        act = swiglu_mod.bias_swiglu_impl(fc1_out, None, in_place_backward=flag)
        (act.square().sum() + (fc1_out + 1).sum()).backward()
        got.append(leaf.grad)
    assert torch.equal(got[0], got[1])


# --------------------------------------------------------------- configuration refusals
CONFLICTS = {
    "cpu_offloading": dict(cpu_offloading=True, cpu_offloading_activations=True),
    "fine_grained_offload": dict(
        fine_grained_activation_offloading=True, offload_modules=["moe_act"]
    ),
    "moe_act_recompute": dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
    "cuda_graph_impl": dict(cuda_graph_impl="transformer_engine"),
    "enable_cuda_graph": dict(enable_cuda_graph=True),
    "external_cuda_graph": dict(external_cuda_graph=True),
}


@pytest.mark.parametrize("name", sorted(CONFLICTS))
def test_config_conflicts_are_named(name):
    config = types.SimpleNamespace(**CONFLICTS[name])
    with pytest.raises(ValueError, match="TestLayer: the in-place activation backward.*unsafe"):
        in_place.check_config(config, "TestLayer")
    named = str(in_place.config_conflicts(config))
    assert any(field in named for field in CONFLICTS[name]), named


def test_compatible_configs_pass():
    config = types.SimpleNamespace(
        cpu_offloading=True,
        cpu_offloading_activations=False,
        recompute_granularity="full",
        recompute_modules=["mlp", "moe", "core_attn"],
        fine_grained_activation_offloading=True,
        offload_modules=["core_attn", "attn_norm"],
        cuda_graph_impl="none",
        activation_func_fp8_input_store=True,
    )
    assert in_place.config_conflicts(config) == []


@pytest.fixture
def mlp_builder():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.test_utilities import Utils

    Utils.initialize_model_parallel(1, 1)
    pg = ProcessGroupCollection.use_mpu_process_groups(["tp"])

    def build(**overrides):
        fields = dict(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=4,
            ffn_hidden_size=24,
            activation_func=F.silu,
            gated_linear_unit=True,
            bias_activation_fusion=True,
            add_bias_linear=True,
        )
        config = TransformerConfig(**(fields | overrides))
        submodules = get_gpt_layer_local_submodules().mlp.submodules
        return MLP(config, submodules, tp_group=pg.tp, pg_collection=pg)

    yield build
    Utils.destroy_model_parallel()


def test_mlp_refuses_a_conflicting_config_at_construction(mlp_builder):
    with use_in_place_backward(True):
        with pytest.raises(ValueError, match="MLP: .*enable_cuda_graph=True"):
            mlp_builder(enable_cuda_graph=True)
    mlp_builder(enable_cuda_graph=True)  # the option off: upstream's behaviour


def test_mlp_in_place_gives_the_same_gradients(mlp_builder):
    torch.manual_seed(9)
    mlp = mlp_builder()
    hidden = torch.randn(6, 2, 16)
    got = []
    for enabled in (False, True):
        mlp.zero_grad()
        h = hidden.clone().requires_grad_()
        with use_in_place_backward(enabled):
            out, bias = mlp(h)
        (out + bias).square().sum().backward()
        got.append([h.grad] + [p.grad.clone() for p in mlp.parameters()])
    for a, b in zip(*got):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- the option
@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_environment_on(value):
    assert in_place.in_place_backward_from_env({in_place.ENV_VAR: value}) is True


@pytest.mark.parametrize("value", ["0", "false", "No", "off", "", "  "])
def test_environment_off(value):
    assert in_place.in_place_backward_from_env({in_place.ENV_VAR: value}) is False
    assert in_place.in_place_backward_from_env({}) is False


@pytest.mark.parametrize("value", ["2", "enable", "quiet", "ture"])
def test_environment_typo_is_refused(value):
    with pytest.raises(ValueError, match=f"{in_place.ENV_VAR}={value!r} is not understood"):
        in_place.in_place_backward_from_env({in_place.ENV_VAR: value})


def _python(code: str, value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{in_place.ENV_VAR: value}, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT
    )


def test_environment_variable_sets_the_default_in_a_fresh_process():
    code = (
        "from mcore_activations.fusions import in_place\n"
        "print(in_place.in_place_backward_enabled())"
    )
    on = _python(code, "yes")
    assert on.returncode == 0 and on.stdout.strip() == "True", on.stderr
    bad = _python(code, "maybe")
    assert bad.returncode != 0
    assert f"{in_place.ENV_VAR}='maybe' is not understood" in bad.stderr


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_keyword_must_be_a_bool_or_none(value):
    with pytest.raises(TypeError, match="in_place_backward must be True, False or None"):
        swiglu_mod.bias_swiglu_impl(_fc1_out(), None, in_place_backward=value)


def test_process_default_setters():
    assert in_place.in_place_backward_enabled() is False
    with use_in_place_backward(True):
        assert in_place.in_place_backward_enabled() is True
        in_place.configure_in_place_backward(None)  # keeps it
        assert in_place.in_place_backward_enabled() is True
    assert in_place.in_place_backward_enabled() is False
    previous = in_place.set_in_place_backward(True)
    try:
        assert previous is False
        in_place.configure_in_place_backward(False)
        assert in_place.in_place_backward_enabled() is False
    finally:
        in_place.set_in_place_backward(previous)
    with pytest.raises(TypeError, match="in_place_backward must be True, False or None"):
        in_place.configure_in_place_backward("on")
    with pytest.raises(TypeError, match="set_in_place_backward takes True or False"):
        in_place.set_in_place_backward(None)


# ------------------------------------------------------------------------ the custom op
def _op_args(spec, has_bias, has_probs):
    x, bias, probs, grad = _inputs(spec, torch.float32, has_bias, has_probs, 5, 8, "cpu")
    variant = KernelVariant.of(spec, has_bias=has_bias, has_probs=has_probs)
    params = params_tensor(spec_params(spec), x.device)
    return variant, (grad, x, bias, probs, params, *activation_ops.structure_args(variant))


@pytest.mark.parametrize("has_probs", [False, True], ids=["", "probs"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["", "bias"])
def test_in_place_op_writes_dx_and_declares_the_mutation(has_bias, has_probs):
    spec = spec_of("quick_geglu_gpt_oss", glu_interleave_size=4)
    variant, args = _op_args(spec, has_bias, has_probs)
    with use_kernel_backend("eager"):
        torch.library.opcheck(
            activation_ops.activation_backward_in_place_op,
            args,
            test_utils=("test_schema", "test_faketensor"),
        )
        dx, dbias, dprobs = activation_ops.run_backward(variant, *args[:5])
        x = args[1].clone()
        version = x._version
        dbias_op, dprobs_op = activation_ops.activation_backward_in_place_op(args[0], x, *args[2:])
    assert torch.equal(x, dx) and x._version > version
    if has_bias:
        assert torch.equal(dbias_op, dbias)
    if has_probs:
        assert torch.equal(dprobs_op, dprobs)


def test_run_backward_in_place_bumps_the_version_on_the_direct_path():
    variant, args = _op_args(SWIGLU_CLAMP, True, True)
    x = args[1].clone()
    version = x._version
    with use_kernel_backend("eager"):
        dx, _, _ = activation_ops.run_backward_in_place(variant, args[0], x, *args[2:5])
    assert dx is x and x._version > version
