"""TEFusedResidualRMSNorm on CPU, over a fake Transformer Engine.

The class derives from ``te.pytorch.RMSNorm``, a base chosen when ``te_norm`` is imported; the
shared module was imported without TE. The tests therefore load a private copy of ``te_norm``
while the import seam holds the fake (``fake_te.load_private_copy``), whose classes derive from
the fake's RMSNorm module. Checked: the fused ops (``MakeExtraOutput`` then an RMSNorm op that
aliases ``weight``), their cache (built once, resettable, never a submodule or a state-dict
entry), the forward against a float64 reference (output and residual, and the gradients of
both), TENorm choosing the class, and what happens without TE or with an old one. Real-TE
numerics: test_te_fused_residual_rmsnorm_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

import megatron.core.extensions.te_norm as te_norm
import megatron.core.extensions.transformer_engine as te_ext
from mcore_activations import te_import
from megatron.core.extensions.te_fused_ops import TEFusedOpsMixin
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.extensions.fake_te import install_fake_te, load_private_copy, remove_te

HIDDEN = 16
DTYPE = torch.float64


@pytest.fixture
def fake_te(monkeypatch):
    return install_fake_te(monkeypatch)


@pytest.fixture
def norm_module(fake_te):
    """``te_norm`` as imported on a machine whose TE is the fake."""
    return load_private_copy(te_norm)


def make_norm(norm_module, **kwargs):
    kwargs = dict(dict(normalized_shape=HIDDEN, dtype=DTYPE, device="cpu"), **kwargs)
    return norm_module.TEFusedResidualRMSNorm(**kwargs)


def reference_rmsnorm(x, weight, eps, zero_centered_gamma=False):
    """RMSNorm in float64, written from its definition."""
    x64, w64 = x.double(), weight.double()
    gamma = 1.0 + w64 if zero_centered_gamma else w64
    rms = torch.sqrt((x64 * x64).sum(-1, keepdim=True) / x64.shape[-1] + eps)
    return x64 / rms * gamma


def test_is_te_rmsnorm_with_the_mixin(fake_te, norm_module):
    norm = make_norm(norm_module)
    assert isinstance(norm, fake_te.pytorch.RMSNorm) and isinstance(norm, TEFusedOpsMixin)
    assert norm._fused_impl is None  # built lazily, on the first forward


def test_fused_impl_forks_the_residual_then_aliases_the_weight(fake_te, norm_module):
    norm = make_norm(norm_module, eps=1e-6, zero_centered_gamma=True)
    fused = norm._get_fused_impl()
    assert type(fused) is fake_te.pytorch.ops.Sequential
    assert len(fused) == 2 and type(fused[0]) is fake_te.pytorch.ops.MakeExtraOutput
    op = fused[1]
    assert type(op) is fake_te.pytorch.ops.RMSNorm and op.weight is norm.weight
    assert op.args == (norm.weight.shape,)
    assert op.kwargs == dict(
        eps=1e-6,
        device="meta",
        dtype=DTYPE,
        zero_centered_gamma=True,
        sm_margin=norm._sm_margins,
    )


def test_fused_impl_is_cached_and_resettable(norm_module):
    norm = make_norm(norm_module)
    first = norm._get_fused_impl()
    assert isinstance(norm._fused_impl, tuple) and norm._fused_impl == (first,)
    assert norm._get_fused_impl() is first
    norm._reset_fused_impl()
    assert norm._fused_impl is None
    second = norm._get_fused_impl()
    assert second is not first and second[1].weight is norm.weight


def test_fused_impl_is_no_submodule_and_no_state_dict_entry(norm_module):
    norm = make_norm(norm_module)
    keys, params, children = list(norm.state_dict()), list(norm.parameters()), dict(norm._modules)
    fused = norm._get_fused_impl()
    norm(torch.randn(2, HIDDEN, dtype=DTYPE))
    assert keys == list(norm.state_dict()) == ["weight"]
    assert list(norm.parameters()) == params == [norm.weight]
    assert dict(norm._modules) == children == {}
    assert all(module is not fused for module in norm.modules())


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_forward_returns_the_norm_and_the_residual(norm_module, zero_centered_gamma):
    eps = 1e-5
    norm = make_norm(norm_module, eps=eps, zero_centered_gamma=zero_centered_gamma)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(0.5 + torch.rand(HIDDEN, generator=gen, dtype=DTYPE))
    x = (3 * torch.randn(4, 3, HIDDEN, generator=gen, dtype=DTYPE)).requires_grad_()
    out, residual = norm(x)
    assert out.shape == residual.shape == x.shape
    torch.testing.assert_close(residual, x, rtol=0, atol=0)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = norm.weight.detach().clone().requires_grad_()
    ref = reference_rmsnorm(x_ref, w_ref, eps, zero_centered_gamma)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # Both outputs feed the loss: the residual's gradient reaches the input as well.
    grad_out = torch.randn(x.shape, generator=gen, dtype=DTYPE)
    grad_res = torch.randn(x.shape, generator=gen, dtype=DTYPE)
    torch.autograd.backward((out, residual), (grad_out, grad_res))
    torch.autograd.backward((ref, x_ref), (grad_out, grad_res))
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(norm.weight.grad, w_ref.grad, rtol=1e-12, atol=1e-12)


def test_loaded_weights_reach_the_cached_ops(norm_module):
    norm = make_norm(norm_module)
    x = torch.randn(2, HIDDEN, dtype=DTYPE)
    norm(x)  # builds the ops
    weight = torch.linspace(0.5, 2.0, HIDDEN, dtype=DTYPE)
    norm.load_state_dict({"weight": weight})
    torch.testing.assert_close(norm(x)[0], reference_rmsnorm(x, weight, 1e-5))


def test_meta_device_builds(norm_module):
    norm = make_norm(norm_module, device="meta")
    assert norm.weight.is_meta and norm._get_fused_impl()[1].weight is norm.weight


def test_old_te_is_refused(monkeypatch, norm_module):
    install_fake_te(monkeypatch, version="1.12.0")
    with pytest.raises(RuntimeError, match="TEFusedResidualRMSNorm requires .* >= 1.13"):
        make_norm(norm_module)


def test_without_te_construction_raises_import_error(monkeypatch):
    remove_te(monkeypatch)
    with pytest.raises(ImportError, match="TEFusedResidualRMSNorm requires Transformer Engine"):
        te_norm.TEFusedResidualRMSNorm(normalized_shape=HIDDEN)


def test_exported_as_none_without_te():
    assert te_ext.TE_ONLY_CLASSES["TEFusedResidualRMSNorm"] is te_norm.TEFusedResidualRMSNorm
    assert "TEFusedResidualRMSNorm" in te_ext.__all__
    expected = te_norm.TEFusedResidualRMSNorm if te_import.have_te() else None
    assert te_ext.TEFusedResidualRMSNorm is expected


# ----------------------------------------------------------------------------------- TENorm


def _config(**kwargs):
    kwargs = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        normalization="RMSNorm",
        params_dtype=DTYPE,
        use_cpu_initialization=True,
        **kwargs,
    )
    return TransformerConfig(**kwargs)


def test_tenorm_builds_the_fused_residual_norm(fake_te, norm_module):
    config = _config(fused_residual_rmsnorm=True, layernorm_zero_centered_gamma=True)
    norm = norm_module.TENorm(config, HIDDEN, eps=1e-6, has_residual=True)
    assert type(norm) is norm_module.TEFusedResidualRMSNorm
    assert norm.returns_residual is True
    assert norm.eps == 1e-6 and norm.zero_centered_gamma is True
    assert norm.weight.dtype == DTYPE and norm.weight.device.type == "cpu"
    x = torch.randn(5, HIDDEN, dtype=DTYPE)
    out, residual = norm(x)
    torch.testing.assert_close(out, reference_rmsnorm(x, norm.weight, 1e-6, True))
    assert torch.equal(residual, x)
    # Either half of the opt-in alone: the plain RMSNorm, which returns one tensor.
    for plain in (
        norm_module.TENorm(config, HIDDEN),
        norm_module.TENorm(_config(), HIDDEN, 1e-5, True),
    ):
        assert type(plain) is fake_te.pytorch.RMSNorm and plain.returns_residual is False
        assert isinstance(plain(x), torch.Tensor)
