"""The compile boundary's runtime guard: no Python number reaches a compiled kernel."""

from __future__ import annotations

import pytest
import torch

from mcore_activations import activations
from mcore_activations.kernel_params import check_kernel_args, tensor_arguments


@pytest.mark.parametrize("number", [2.0, 3, True, 1j])
def test_python_numbers_are_refused(number):
    with pytest.raises(TypeError, match="Python number"):
        check_kernel_args("kernel", (torch.ones(2), number))
    with pytest.raises(TypeError, match="argument 'scale'"):
        check_kernel_args("kernel", (torch.ones(2),), {"scale": number})


def test_tensors_none_and_structure_pass():
    check_kernel_args("kernel", (torch.ones(2), None, torch.tensor(2.0), "fwd", ("a", "b")))


def test_guarded_function_refuses_before_compiling():
    calls = []

    @tensor_arguments
    def kernel(x, params):
        calls.append(params)
        return x * params[0]

    x = torch.ones(3)
    torch.testing.assert_close(kernel(x, torch.tensor([2.0])), 2 * x)
    with pytest.raises(TypeError, match="kernel: argument 1 is the Python number 2.0"):
        kernel(x, 2.0)
    assert len(calls) == 1
    assert kernel.__name__ == "kernel"


def test_the_activations_compiled_helpers_are_guarded():
    # The public callables convert their float scales to the params tensor; calling the compiled
    # helper with the raw float is exactly what the guard exists to stop.
    x = torch.randn(4, 8)
    torch.testing.assert_close(activations.tanh_soft_clamp(x, 2.0), 2.0 * torch.tanh(x / 2.0))
    for helper in (activations._tanh_soft_clamp, activations._situ):
        with pytest.raises(TypeError, match="Python number"):
            helper(x, 2.0)


def test_the_fused_kernels_compiled_by_torch_are_guarded():
    # The inductor backend's per-variant kernels (activation_kernels._compiled): a float where
    # the params tensor belongs is refused before Dynamo sees it, and nothing is compiled.
    from mcore_activations.activation_spec import ActivationKind, ActivationSpec
    from mcore_activations.fusions import activation_kernels as ak

    spec = ActivationSpec(ActivationKind.SILU, gated=True, clamp_value=3.0)
    variant = ak.KernelVariant.of(spec, has_bias=False, has_probs=False)
    kernel = ak._compiled(variant, "fwd", 8)
    with pytest.raises(TypeError, match="argument 3 is the Python number 3.0"):
        kernel(torch.randn(4, 8), None, None, 3.0)
