"""``TEFusedMLPWithGroupedLinear`` at tensor-parallel size 1 takes Transformer Engine's own
``LayerNormLinear`` / ``Linear`` as fc1 / fc2 (as upstream's class does), refuses a normalization
TE's ops lack before it resolves its recipe, and at tensor-parallel size > 1 hands the caller's
keywords to ``TEFusedMLP.forward`` unchanged. Over a fake TE on CPU.
"""

from __future__ import annotations

import pytest
import torch

import megatron.core.extensions.transformer_engine as te_ext
from tests.unit_tests.extensions.fake_te import install_fake_te
from tests.unit_tests.test_utilities import Utils

GROUPED = te_ext.TE_ONLY_CLASSES["TEFusedMLPWithGroupedLinear"]
FUSED = te_ext.TE_ONLY_CLASSES["TEFusedMLP"]


class TELayerNormLinear:  # stands for te.pytorch.LayerNormLinear
    def __init__(self, normalization="RMSNorm"):
        self.normalization = normalization
        self.weight = torch.ones(8, 4)
        self.layer_norm_weight = torch.ones(4)
        self.layer_norm_bias = torch.zeros(4)
        self.eps = 1e-5
        self.zero_centered_gamma = False
        self.fuse_wgrad_accumulation = False


class TELinear:  # stands for te.pytorch.Linear
    def __init__(self):
        self.weight = torch.ones(4, 4)
        self.fuse_wgrad_accumulation = False


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


@pytest.fixture
def fake_te(monkeypatch):
    fake = install_fake_te(monkeypatch)
    fake.pytorch.LayerNormLinear = TELayerNormLinear
    fake.pytorch.Linear = TELinear
    return fake


def _shell(fc1, fc2):
    # A module without __init__ (no recipe resolved, no ops built), as upstream's tests make one.
    shell = GROUPED.__new__(GROUPED)
    shell.linear_fc1, shell.linear_fc2 = fc1, fc2
    return shell


def test_te_own_linears_are_accepted_at_tensor_parallel_size_one(fake_te):
    _shell(TELayerNormLinear(), TELinear())._check_fused_linears()
    with pytest.raises(ValueError, match="FC1"):
        _shell(object(), TELinear())._check_fused_linears()
    with pytest.raises(ValueError, match="FC2"):
        _shell(TELayerNormLinear(), object())._check_fused_linears()


def test_an_unsupported_normalization_is_refused_before_the_recipe(fake_te):
    shell = _shell(TELayerNormLinear(normalization="UnsupportedNorm"), TELinear())
    with pytest.raises(ValueError, match=r"Unsupported normalization \(UnsupportedNorm\)"):
        GROUPED._make_fused_impl(shell)


def test_tensor_parallel_forward_passes_the_callers_keywords(fake_te, monkeypatch):
    monkeypatch.setattr(te_ext, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(
        FUSED, "forward", lambda self, hidden_states, **kwargs: (hidden_states, kwargs)
    )
    shell, x, scale = GROUPED.__new__(GROUPED), torch.ones(2), torch.ones(1)
    assert GROUPED.forward(shell, x, flag=True) == (x, {"flag": True})
    out, kwargs = GROUPED.forward(shell, x, per_token_scale=scale)
    assert out is x and kwargs == {"per_token_scale": scale}
