"""The Triton backend behind the custom ops: the backend choice, ``opcheck``, a user's
``torch.compile`` and ``torch.export``, tracers, and upstream's raw functions on this backend.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from mcore_activations.fusions import activation_ops
from mcore_activations.fusions.activation_kernels import KernelVariant
from mcore_activations.fusions.activation_ops import kernel_backend, use_kernel_backend
from megatron.core.fusions.fused_activation import fused_activation
from tests.unit_tests.activation_catalog import SPECS, spec_of
from tests.unit_tests.mcore_activations.fusions.triton_cases import BOTH
from tests.unit_tests.tolerances import assert_close_to_reference

pytest.importorskip("triton")


def test_backend_choice():
    assert kernel_backend(torch.device("cuda")) == "triton"
    with use_kernel_backend("eager"):
        assert kernel_backend(torch.device("cuda")) == "eager"
        with use_kernel_backend(None):
            assert kernel_backend(torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="'cutlass' is not an activation kernel backend"):
        with use_kernel_backend("cutlass"):
            pass


def test_triton_backend_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_kernel_backend("triton"), pytest.raises(ValueError, match="runs on CUDA"):
        fused_activation(torch.randn(2, 8), SPECS["swiglu"])


def test_bad_backend_in_environment_is_refused_at_import():
    import subprocess
    import sys

    env = dict(os.environ, MCORE_ACTIVATIONS_BACKEND="fast")
    proc = subprocess.run(
        [sys.executable, "-c", "import mcore_activations.fusions.activation_ops"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "MCORE_ACTIVATIONS_BACKEND='fast' is not an activation kernel backend" in proc.stderr


@pytest.mark.parametrize(
    "backend,device",
    [
        ("eager", "cpu"),
        pytest.param("triton", "cpu", marks=BOTH[0].marks),
        pytest.param("triton", "cuda", marks=pytest.mark.gpu),
    ],
)
def test_custom_ops_pass_opcheck(backend, device):
    spec = spec_of("swiglu_clamp", glu_interleave_size=4)
    variant = KernelVariant.of(spec, has_bias=True, has_probs=True)
    from mcore_activations.fusions.activation_kernels import params_tensor, spec_params

    x = torch.randn(5, 16, device=device, requires_grad=False)
    bias = torch.randn(16, device=device)
    probs = torch.rand(5, 1, device=device)
    grad = torch.randn(5, 8, device=device)
    params = params_tensor(spec_params(spec), x.device).clone()
    structure = activation_ops.structure_args(variant)
    with use_kernel_backend(backend):
        torch.library.opcheck(
            activation_ops.activation_forward_op, (x, bias, probs, params, *structure)
        )
        torch.library.opcheck(
            activation_ops.activation_backward_op, (grad, x, bias, probs, params, *structure)
        )


def test_user_compile_sees_one_opaque_op_and_specializes_each_clamp():
    """Inside a caller's torch.compile the kernel family is one opaque node per direction (in
    the traced body of the autograd Function, with no graph break), and the spec's numbers are
    specialized: every clamp value is computed exactly, a new value gets a graph of its own and
    a repeated one reuses its graph, so no value is ever served code traced for another."""
    from torch._dynamo.utils import counters

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(x, spec):
        return fused_activation(x, spec).sum()

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    counts = []
    for clamp in (0.5, 1.5, 3.0, 0.25, 1.5):
        spec = dataclasses.replace(SPECS["swiglu_clamp"], clamp_value=clamp)
        x = (torch.randn(4, 16) * 4).requires_grad_()
        got = compiled(x, spec)
        got.backward()
        xr = x.detach().double().requires_grad_()
        ref = spec.reference(xr).sum()
        ref.backward()
        assert_close_to_reference(got, ref, torch.float32, f"clamp {clamp}")
        assert_close_to_reference(x.grad, xr.grad, torch.float32, f"clamp {clamp} dx")
        counts.append(counters["stats"]["unique_graphs"])
    assert counts[-1] == counts[-2], f"a repeated clamp value recompiled: {counts}"
    ops = {
        str(node.target)
        for gm in graphs
        for module in gm.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    }
    assert "mcore_activations.activation_forward.default" in ops


def test_export_leaves_no_fake_tensor_behind():
    """torch.export (non-strict) traces the params tensor under a fake mode; nothing created there
    may stay cached, or every later eager call with the same values fails (#12 item 4)."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    class Layer(torch.nn.Module):
        def forward(self, x):
            return bias_swiglu_impl(x, None, clamp_value=2.75)

    x = torch.randn(4, 16) * 4
    exported = torch.export.export(Layer(), (x,), strict=False)
    targets = {str(node.target) for node in exported.graph.nodes}
    assert "mcore_activations.activation_forward.default" in targets
    eager = Layer()(x)  # failed with "Cannot access data pointer of Tensor" before the fix
    torch.testing.assert_close(exported.module()(x), eager, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_tracers_see_the_op_and_plain_calls_skip_only_the_dispatcher():
    """Plain eager calls run the backend directly; under a dispatch mode (as under fake tensors,
    FX tracing, functionalization) the call goes through the op, with the same result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    spec = SPECS["swiglu_clamp"]
    x = torch.randn(3, 8) * 4
    direct = fused_activation(x, spec)
    with Log():
        traced = fused_activation(x, spec)
    assert "mcore_activations.activation_forward.default" in seen
    torch.testing.assert_close(direct, traced, rtol=0, atol=0)
    # Under vmap the op's batching fallback runs it row by row: the kernels never see a
    # batched (wrapped) tensor.
    vmapped = torch.vmap(lambda row: fused_activation(row, spec))(x)
    torch.testing.assert_close(vmapped, direct, rtol=0, atol=0)


@pytest.mark.parametrize("device", BOTH)
def test_upstream_raw_functions_stay_differentiable_on_the_triton_backend(device):
    """Upstream's ``@jit_fuser`` functions (``clamped_swiglu``, ``bias_gelu``, ...) are compiled
    torch code there, so autograd goes through them; on the Triton backend they must too."""
    from megatron.core.fusions import fused_bias_gelu as ge
    from megatron.core.fusions import fused_bias_swiglu as sw

    y = (torch.randn(5, 16, device=device) * 4).requires_grad_()
    b = torch.randn(16, device=device, requires_grad=True)
    with use_kernel_backend("triton"):
        cases = [
            (sw.clamped_swiglu(y, 1.5), sw.clamped_swiglu._torchdynamo_orig_callable(y, 1.5)),
            (
                ge.bias_gelu(b, y),
                (lambda t: 0.5 * t * (1 + torch.tanh(0.79788456 * t * (1 + 0.044715 * t * t))))(
                    y + b
                ),
            ),
        ]
        for got, ref in cases:
            g = torch.randn_like(got)
            got_grads = torch.autograd.grad(got, (y, b), g, allow_unused=True)
            ref_grads = torch.autograd.grad(ref, (y, b), g, allow_unused=True)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            for a, r in zip(got_grads, ref_grads):
                if r is not None:
                    torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
