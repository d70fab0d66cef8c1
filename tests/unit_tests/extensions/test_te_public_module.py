"""``megatron.core.extensions.transformer_engine`` behaves as upstream's module where users and
upstream's tests reach into it, over a fake Transformer Engine on CPU.

- Patching the public module's ``is_te_min_version``, ``get_tensor_model_parallel_world_size``
  or ``get_cuda_rng_tracker`` changes what the TE classes call, though they live in ``te_*``
  modules (``te_public``).
- ``te_general_gemm`` is exported: the TE wrapper where TE has ``general_gemm``, else None.
- ``_set_expert_parameter_attributes`` marks expert parameters as upstream's does.
- ``TEFusedMLPWithGroupedLinear`` refuses in its own ``__init__`` (whatever the base initializer
  does), with upstream's phrases (``Transformer Engine >= 2.14.0``, ``SwiGLU activation``).
- The fused classes warn about a pre-forward hook added after the ops were built before running
  it, and refuse one that modifies the inputs.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import megatron.core.extensions.transformer_engine as te_ext
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.extensions.fake_te import (
    CpuLayerNormLinear,
    CpuRowLinear,
    install_fake_te_with_cpu_linears,
    load_private_copy,
    remove_te,
)
from tests.unit_tests.test_utilities import Utils

PUBLIC = "megatron.core.extensions.transformer_engine"
GROUPED = te_ext.TE_ONLY_CLASSES["TEFusedMLPWithGroupedLinear"]
FUSED = te_ext.TE_ONLY_CLASSES["TEFusedMLP"]
SUBMODULES = MLPSubmodules(linear_fc1=CpuLayerNormLinear, linear_fc2=CpuRowLinear)


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


@pytest.fixture
def fake_te(monkeypatch):
    monkeypatch.setenv("FP4_RECIPE", "none")
    return install_fake_te_with_cpu_linears(monkeypatch)


def make_config(**overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=1,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        activation_func=F.silu,
        gated_linear_unit=True,
        add_bias_linear=False,
        params_dtype=torch.float64,
        use_cpu_initialization=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


# ------------------------------------------------------------- patches of the public module


def test_public_world_size_patch_reaches_the_grouped_class(fake_te):
    shell = GROUPED.__new__(GROUPED)  # no group of its own: parallel_state's size decides
    assert not shell._tensor_parallel()
    with mock.patch(f"{PUBLIC}.get_tensor_model_parallel_world_size", return_value=2):
        assert shell._tensor_parallel()
        assert GROUPED._tensor_parallel_size_of(None, None) == 2


def test_public_version_patch_reaches_the_grouped_class(fake_te):
    def older_than_2_14(version, *args, **kwargs):
        return version != "2.14.0"

    with mock.patch(f"{PUBLIC}.is_te_min_version", side_effect=older_than_2_14):
        with pytest.raises(RuntimeError, match=r"Transformer Engine >= 2\.14\.0"):
            GROUPED(make_config(), SUBMODULES, ffn_hidden_size=64)
    assert isinstance(GROUPED(make_config(), SUBMODULES, ffn_hidden_size=64), GROUPED)


def test_public_version_patch_reaches_the_grouped_linear(fake_te):
    with mock.patch(f"{PUBLIC}.is_te_min_version", return_value=False):
        with pytest.raises(RuntimeError, match=r"TEGroupedLinear requires Transformer Engine"):
            te_ext.TEGroupedLinear(
                2, 4, 4, parallel_mode="column", config=make_config(), init_method=None,
                bias=False, skip_bias_add=False, is_expert=True,
            )  # fmt: skip


def test_public_rng_tracker_patch_reaches_the_linears(fake_te):
    tracker = SimpleNamespace(is_initialized=lambda: True)
    with mock.patch(f"{PUBLIC}.get_cuda_rng_tracker", return_value=tracker) as getter:
        assert te_ext._get_te_ops_rng_state_tracker_function() is getter


# -------------------------------------------------------------- refusals in the grouped class


def test_grouped_refuses_in_its_own_init_with_upstreams_phrases(fake_te, monkeypatch):
    def base_init_that_only_keeps_the_config(self, config, submodules, **kwargs):
        self.config = config

    monkeypatch.setattr(FUSED, "__init__", base_init_that_only_keeps_the_config)
    cases = [
        ({"add_bias_linear": True}, "add_bias_linear"),
        ({"activation_func": F.gelu}, "SwiGLU activation"),
        ({"gated_linear_unit": False}, "SwiGLU activation"),
    ]
    for overrides, phrase in cases:
        with pytest.raises(ValueError, match=phrase):
            GROUPED(make_config(**overrides), SUBMODULES)


def test_fused_linear_type_errors_name_fc1_and_fc2(fake_te):
    fused = FUSED(make_config(), SUBMODULES, ffn_hidden_size=64)
    fused.linear_fc2 = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="FC2"):
        fused._check_fused_linears()
    fused.linear_fc1 = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="FC1"):
        fused._check_fused_linears()


# ------------------------------------------------------------------------------ te_general_gemm


def test_te_general_gemm_is_none_without_te(monkeypatch):
    import megatron.core.extensions.te_gemm as te_gemm

    remove_te(monkeypatch)
    assert te_gemm.te_general_gemm_or_none() is None
    assert load_private_copy(te_ext).te_general_gemm is None
    with pytest.raises(RuntimeError, match="general_gemm"):
        te_gemm.te_general_gemm(torch.ones(2, 2), torch.ones(2, 2))


def test_te_general_gemm_is_exported_and_calls_tes_gemm(fake_te):
    import megatron.core.extensions.te_gemm as te_gemm

    calls = []

    def general_gemm(A, B, **kwargs):
        calls.append(kwargs)
        return [(B.double() @ A.double().t()).to(kwargs["out_dtype"])]

    fake_te.pytorch.cpp_extensions = SimpleNamespace(general_gemm=general_gemm)
    public = load_private_copy(te_ext)
    assert public.te_general_gemm is te_gemm.te_general_gemm
    weight, x = torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(5, 4, dtype=torch.bfloat16)
    out = public.te_general_gemm(weight, x, out_dtype=torch.float32)[0]
    assert out.dtype == torch.float32 and out.shape == (5, 3)
    assert calls[0]["layout"] == "TN" and calls[0]["quantization_params"] is None
    assert "workspace" not in calls[0]  # this fake TE has no get_workspace


def test_te_general_gemm_is_importable_from_the_public_module():
    from megatron.core.extensions.transformer_engine import te_general_gemm  # noqa: F401


# ---------------------------------------------------------------- expert parameter attributes


@pytest.mark.parametrize(("mode", "dim"), [("column", 0), ("row", 1)])
def test_expert_parameter_attributes(mode, dim):
    module = torch.nn.Module()
    for name in ("weight0", "bias0", "weight_scale"):
        module.register_parameter(name, torch.nn.Parameter(torch.empty(2)))
    te_ext._set_expert_parameter_attributes(module, parallel_mode=mode, use_expert_pgs=True)
    assert module.weight0.allreduce is False and module.weight_scale.allreduce is False
    assert module.weight0.tensor_model_parallel is True and module.weight0.partition_dim == dim
    assert module.bias0.tensor_model_parallel is (mode == "column")
    assert not hasattr(module.weight_scale, "tensor_model_parallel")


# ---------------------------------------------------------------------------------- hooks


def _shell_with_hooks_replayed():
    module = FUSED.__new__(FUSED)
    torch.nn.Module.__init__(module)
    module.linear_fc1 = torch.nn.Linear(2, 2)
    module.linear_fc2 = torch.nn.Linear(2, 2)
    fused = torch.nn.Identity()
    module._register_hooks_on_fused_impl(fused)
    return module, fused


def test_input_modifying_hook_added_after_construction_warns_then_is_refused():
    module, fused = _shell_with_hooks_replayed()
    module.linear_fc1.register_forward_pre_hook(lambda _module, inputs: inputs)
    with pytest.warns(UserWarning, match="pre-forward hook"):
        with pytest.raises(RuntimeError, match="modifies input tensor"):
            fused(torch.ones(1, 2))


def test_hook_added_after_construction_runs_before_the_fused_forward():
    module, fused = _shell_with_hooks_replayed()
    seen = []
    module.linear_fc2.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs), with_kwargs=True
    )
    with pytest.warns(UserWarning, match="pre-forward hook"):
        fused(torch.ones(1, 2))
    assert seen == [{}]
