"""The GLU backward formulations the kernel benchmark times all compute ``backward_math``."""

import pytest
import torch

from megatron.core.fusions import activation_kernels as ak
from megatron.core.transformer.activation_spec import interleave_glu
from tools.kernel_variants.common import SPECS, check_formulation
from tools.kernel_variants.compile_layout import layout_formulations


@pytest.mark.parametrize("name", sorted(SPECS))
def test_layout_formulations_match_backward_math(name):
    spec = SPECS[name]
    v = ak.KernelVariant.of(spec, has_bias=False, has_probs=False)
    x = torch.randn(6, 128, dtype=torch.bfloat16) * 4
    grad = torch.randn(6, 64, dtype=torch.bfloat16)
    params = ak.params_tensor(ak.spec_params(spec), x.device)
    expected = ak.backward_math(v, grad, x, None, None, params)[0]
    for label, (fn, layout) in layout_formulations(v).items():
        out = fn(grad, x, params)
        if layout != "in graph":
            out = interleave_glu(*out, v.interleave)
        assert torch.equal(out, expected), label


def test_compiled_formulations_pass_the_benchmark_check():
    """Compiled code may round differently from eager; the benchmark's check allows that."""
    spec = SPECS["SiTU-GLU(4,25), interleave 32"]
    v = ak.KernelVariant.of(spec, has_bias=False, has_probs=False)
    x = torch.randn(300, 256, dtype=torch.bfloat16) * 4
    grad = torch.randn(300, 128, dtype=torch.bfloat16)
    params = ak.params_tensor(ak.spec_params(spec), x.device)
    expected = ak.backward_math(v, grad, x, None, None, params)[0]
    fn, _ = layout_formulations(v)["slice assignments"]
    check_formulation(
        "slice assignments", ak.compile_with_dynamic_rows(fn)(grad, x, params), expected
    )
    with pytest.raises(AssertionError):
        check_formulation("wrong", expected * 1.05, expected)


def test_formulation_check_allows_the_units_it_is_given():
    """Eight units of float32 rounding at the largest value fail the default check and pass
    with ``units=16`` (the A/B tool's baseline check); a 5 % error fails both."""
    expected = torch.linspace(-3.0, 3.0, 101)
    off = expected.clone()
    off[50] += 8 * torch.finfo(torch.float32).eps * 3.0  # the element at 0
    with pytest.raises(AssertionError):
        check_formulation("default", off, expected)
    check_formulation("sixteen", off, expected, units=16)
    with pytest.raises(AssertionError):
        check_formulation("wrong", expected * 1.05, expected, units=16)


def test_every_experiment_is_documented():
    """The module docstring lists exactly the experiments ``--experiment`` accepts."""
    import re

    import tools.benchmark_kernel_variants as bench

    documented = set(re.findall(r"^- ``([a-z0-9-]+)``:", bench.__doc__, re.MULTILINE))
    assert documented == set(bench._experiments(1, 1)) | {"host"}
