"""TENorm over a fake Transformer Engine: which TE norm it builds, with which arguments, what it
refuses, and when it fuses the residual (TEFusedResidualRMSNorm itself:
test_te_fused_residual_rmsnorm.py)."""

from __future__ import annotations

import pytest
import torch

import megatron.core.extensions.te_norm as te_norm
import megatron.core.extensions.transformer_engine as te_ext
from megatron.core.extensions.te_norm import TENorm
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.extensions.fake_te import install_fake_te, remove_te


class _RecordingNorm(torch.nn.Module):
    """Records its keyword arguments, as a TE norm module would receive them."""

    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs


class FakeLayerNorm(_RecordingNorm):
    pass


class FakeRMSNorm(_RecordingNorm):
    pass


def _config(**kwargs):
    return TransformerConfig(num_layers=1, hidden_size=12, num_attention_heads=4, **kwargs)


@pytest.fixture
def fake_te(monkeypatch):
    fake = install_fake_te(monkeypatch)
    fake.pytorch.LayerNorm = FakeLayerNorm
    fake.pytorch.RMSNorm = FakeRMSNorm
    return fake


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_builds_the_te_norm_the_config_names(fake_te, normalization):
    config = _config(normalization=normalization, layernorm_zero_centered_gamma=True)
    norm = TENorm(config, 8, eps=1e-6)
    assert type(norm) is getattr(fake_te.pytorch, normalization)  # the TE module, not a TENorm
    assert norm.kwargs == dict(
        normalized_shape=8,
        eps=1e-6,
        sequence_parallel=False,
        zero_centered_gamma=True,
        params_dtype=config.params_dtype,
        device="cpu" if not torch.cuda.is_available() else torch.cuda.current_device(),
    )
    assert norm.returns_residual is False
    assert te_ext.TENorm is TENorm and "TENorm" in te_ext.__all__


def test_normalization_set_after_construction_is_read(fake_te):
    # Upstream's callers (and tests) change config.normalization after building the config.
    config = _config()
    config.normalization = "RMSNorm"
    assert isinstance(TENorm(config, 8), FakeRMSNorm)
    config.normalization = "UnknownNorm"
    with pytest.raises(ValueError, match="normalization='UnknownNorm' is not supported"):
        TENorm(config, 8)


def test_allocation_device_follows_the_config(fake_te):
    assert TENorm(_config(use_cpu_initialization=True), 8).kwargs["device"] == "cpu"
    config = _config()
    config.init_model_with_meta_device = True
    assert TENorm(config, 8).kwargs["device"] == "meta"


class FakeFusedResidualRMSNorm(_RecordingNorm):
    pass


def test_fused_residual_builds_the_fused_residual_rmsnorm(fake_te, monkeypatch):
    monkeypatch.setattr(te_norm, "TEFusedResidualRMSNorm", FakeFusedResidualRMSNorm)
    config = _config(normalization="RMSNorm")
    config.fused_residual_rmsnorm = True
    # Both halves of the opt-in: the fused module, built with the plain norm's arguments, and
    # returns_residual=True (its forward returns (normalized, residual)), as upstream.
    norm = TENorm(config, 8, eps=1e-6, has_residual=True)
    assert isinstance(norm, FakeFusedResidualRMSNorm) and norm.returns_residual is True
    assert norm.kwargs == TENorm(config, 8, eps=1e-6).kwargs
    assert isinstance(TENorm(config, 8), FakeRMSNorm)  # no residual at this site: no fusion
    config.normalization = "LayerNorm"
    with pytest.raises(ValueError, match="fused_residual_rmsnorm fuses the residual into an"):
        TENorm(config, 8, has_residual=True)
    assert isinstance(TENorm(config, 8), FakeLayerNorm)


def test_te_without_rmsnorm_is_named(fake_te):
    del fake_te.pytorch.RMSNorm
    with pytest.raises(RuntimeError, match="has no te.pytorch.RMSNorm"):
        TENorm(_config(normalization="RMSNorm"), 8)


def test_without_te_construction_raises_import_error(monkeypatch):
    remove_te(monkeypatch)
    with pytest.raises(ImportError, match="TENorm requires Transformer Engine"):
        TENorm(_config(), 8)
