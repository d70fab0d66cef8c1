"""TEFusedResidualRMSNorm with real Transformer Engine, against a float64 reference.

GPU tier (``-m gpu``; needs CUDA and an importable TE >= 1.13). The fused ops (``MakeExtraOutput``
then TE's RMSNorm op on the module's own weight) run forward and backward on ``[s, b, h]`` inputs
in float32 and bfloat16; the normalized output, the residual, the input gradient (which also
carries the residual's gradient) and the weight gradient are compared with RMSNorm written in
float64, within tests/unit_tests/tolerances.py. Also checked with real TE: the ops alias the
weight and stay out of the module tree, and TENorm builds the class when asked to fuse.
"""

from __future__ import annotations

import pytest
import torch

import megatron.core.extensions.transformer_engine as te_ext
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.tolerances import assert_close_to_reference

pytestmark = [pytest.mark.gpu, pytest.mark.te]

EPS = 1e-5


def reference_rmsnorm(x, weight, eps, zero_centered_gamma):
    gamma = 1.0 + weight if zero_centered_gamma else weight
    rms = torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return x / rms * gamma


def make_norm(hidden, dtype, zero_centered_gamma=False):
    norm = te_ext.TEFusedResidualRMSNorm(
        normalized_shape=hidden,
        eps=EPS,
        zero_centered_gamma=zero_centered_gamma,
        params_dtype=dtype,
        device="cuda",
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # Away from the initial ones / zeros, so a dropped or wrong gamma shows.
        norm.weight.copy_(
            0.1 * torch.randn(hidden, generator=gen) + (0 if zero_centered_gamma else 1)
        )
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zero-centered"])
@pytest.mark.parametrize("hidden", [1024, 2880])
def test_forward_and_backward_match_the_float64_reference(dtype, zero_centered_gamma, hidden):
    norm = make_norm(hidden, dtype, zero_centered_gamma)
    gen = torch.Generator().manual_seed(0)
    shape = (64, 3, hidden)
    x = (2 * torch.randn(shape, generator=gen)).to("cuda", dtype).requires_grad_()
    grad_out = torch.randn(shape, generator=gen).to("cuda", dtype)
    grad_res = torch.randn(shape, generator=gen).to("cuda", dtype)

    out, residual = norm(x)
    torch.autograd.backward((out, residual), (grad_out, grad_res))

    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    ref = reference_rmsnorm(x64, w64, EPS, zero_centered_gamma)
    torch.autograd.backward((ref, x64), (grad_out.double(), grad_res.double()))

    assert out.dtype == residual.dtype == dtype
    assert torch.equal(residual.detach(), x.detach())
    assert_close_to_reference(out, ref, dtype, "output")
    assert_close_to_reference(x.grad, x64.grad, dtype, "dx (norm and residual)")
    assert_close_to_reference(norm.weight.grad, w64.grad, dtype, "dweight")


def test_real_te_ops_alias_the_weight_and_stay_out_of_the_module():
    norm = make_norm(1024, torch.float32)
    keys, children = list(norm.state_dict()), dict(norm._modules)
    fused = norm._get_fused_impl()
    norm(torch.randn(8, 1024, device="cuda"))
    assert type(fused[0]) is te_ext.te.pytorch.ops.MakeExtraOutput
    assert fused[1].weight is norm.weight
    assert list(norm.state_dict()) == keys and dict(norm._modules) == children
    assert all(module is not fused for module in norm.modules())


def test_tenorm_builds_it_with_real_te():
    config = TransformerConfig(
        num_layers=1,
        hidden_size=1024,
        num_attention_heads=8,
        normalization="RMSNorm",
        fused_residual_rmsnorm=True,
    )
    norm = te_ext.TENorm(config, 1024, has_residual=True)
    assert isinstance(norm, te_ext.TEFusedResidualRMSNorm) and norm.returns_residual is True
    x = torch.randn(4, 2, 1024, device="cuda")
    out, residual = norm(x)
    assert torch.equal(residual, x)
    ref = reference_rmsnorm(x.double(), norm.weight.detach().double(), EPS, False)
    assert_close_to_reference(out, ref, torch.float32, "TENorm output")
