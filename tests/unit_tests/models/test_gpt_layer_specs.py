"""GPT layer-spec builders and backend providers: upstream's names, shapes and refusals."""

from functools import partial

import pytest
import torch

from megatron.core.extensions import transformer_engine as te_ext
from megatron.core.models.backends import LocalSpecProvider, TESpecProvider
from megatron.core.models.gpt import gpt_layer_specs as specs
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, get_submodules
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils


@pytest.fixture
def model_parallel():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


def test_local_spec_wraps_the_local_submodules():
    spec = specs.get_gpt_layer_local_spec()
    assert isinstance(spec, ModuleSpec)
    assert spec.module == ("megatron.core.transformer.transformer_layer", "TransformerLayer")
    mlp = spec.submodules.mlp
    assert mlp.module is MLP
    assert mlp.submodules.linear_fc1 is ColumnParallelLinear
    assert mlp.submodules.linear_fc2 is RowParallelLinear
    assert spec.submodules == specs.get_gpt_layer_local_submodules()


def test_building_the_whole_layer_names_the_missing_module():
    with pytest.raises(ImportError, match="megatron.core.transformer.transformer_layer"):
        build_module(specs.get_gpt_layer_local_spec())


def test_the_mlp_of_the_local_spec_builds_and_runs(model_parallel):
    config = TransformerConfig(
        num_layers=1, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True
    )
    mlp = MLP(config, specs.get_gpt_layer_local_spec().submodules.mlp.submodules)
    # 12 -> 48 -> 12 with biases: upstream's parameter count for this config.
    assert sum(p.numel() for p in mlp.parameters()) == 1212
    out, bias = mlp(torch.ones(4, 2, 12))
    assert out.shape == (4, 2, 12) and bias.shape == (12,)


def test_te_submodules_use_te_linears():
    mlp = specs.get_gpt_layer_with_transformer_engine_submodules().mlp
    assert mlp.module is MLP
    assert mlp.submodules.linear_fc1 is te_ext.TELayerNormColumnParallelLinear
    assert mlp.submodules.linear_fc2 is te_ext.TERowParallelLinear
    assert mlp.submodules.activation_func is None
    act = specs.get_gpt_layer_with_transformer_engine_submodules(use_te_activation_func=True)
    assert act.mlp.submodules.activation_func is te_ext.TEActivationOp
    spec = specs.get_gpt_layer_with_transformer_engine_spec()
    assert spec.module == ("megatron.core.transformer.transformer_layer", "TransformerLayer")


@pytest.mark.parametrize(
    "option",
    ["qk_layernorm", "multi_latent_attention", "qk_l2_norm", "use_kitchen", "mla_down_proj_fusion"],
)
def test_te_submodules_refuse_parts_the_fork_does_not_build(option):
    with pytest.raises(ValueError, match=rf"{option}=True is not supported"):
        specs.get_gpt_layer_with_transformer_engine_submodules(**{option: True})


def test_op_fuser_with_experts_is_refused():
    with pytest.raises(ValueError, match="does not support mixture-of-experts"):
        specs.get_gpt_layer_with_transformer_engine_submodules(num_experts=4, use_te_op_fuser=True)
    with pytest.raises(ValueError, match="does not support mixture-of-experts"):
        specs.get_mlp_module_spec(num_experts=4, use_te_op_fuser=True)


@pytest.mark.skipif(te_ext.TEFusedMLP is not None, reason="Transformer Engine is installed")
def test_op_fuser_without_te_names_the_class_and_the_fix():
    with pytest.raises(ValueError, match=r"builds TEFusedMLP, which needs Transformer Engine"):
        specs.get_mlp_module_spec(use_te_op_fuser=True)
    with pytest.raises(ValueError, match="TEFusedMLPWithGroupedLinear"):
        specs.get_mlp_module_spec_for_backend(
            TESpecProvider(), use_te_op_fuser=True, use_grouped_gemm_for_dense_mlp=True
        )


def test_mlp_spec_for_a_custom_backend():
    class FusedNormBackend(LocalSpecProvider):
        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return RowParallelLinear  # any class: the spec must take the fused one

    spec = specs.get_mlp_module_spec_for_backend(FusedNormBackend())
    assert spec.submodules.linear_fc1 is RowParallelLinear
    local = specs.get_mlp_module_spec_for_backend(LocalSpecProvider())
    assert local == specs.get_mlp_module_spec(use_te=False)


def test_backend_expert_modules():
    experts = LocalSpecProvider().grouped_mlp_modules(moe_use_grouped_gemm=True)
    assert isinstance(experts, partial) and experts.func is SequentialMLP
    assert experts.keywords["submodules"] == MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
    )
    te_experts = TESpecProvider().grouped_mlp_modules(moe_use_grouped_gemm=False)
    assert te_experts.func is SequentialMLP
    assert te_experts.keywords["submodules"].linear_fc1 is te_ext.TEColumnParallelLinear
    assert TESpecProvider().fuse_layernorm_and_linear() is True
    assert LocalSpecProvider().column_parallel_layer_norm_linear() is None


# ------------------------------------------- the dense MLP spec is upstream's as_mlp_submodule
def _te_classes_over_fake_te(monkeypatch):
    from tests.unit_tests.extensions.fake_te import install_fake_te

    install_fake_te(monkeypatch)
    return te_ext.TE_ONLY_CLASSES["TEFusedMLP"], te_ext.TE_ONLY_CLASSES[
        "TEFusedMLPWithGroupedLinear"
    ]


def test_dense_mlp_spec_is_a_partial_of_as_mlp_submodule():
    spec = specs.get_mlp_module_spec_for_backend(LocalSpecProvider())
    assert isinstance(spec, partial) and spec.func.__self__ is MLP
    assert spec.func.__func__ is MLP.as_mlp_submodule.__func__
    assert spec.args == ()
    assert spec.keywords == {
        "submodules": MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    }
    # Read as a ModuleSpec reads, for code written against one.
    assert spec.module is MLP and spec.submodules is spec.keywords["submodules"]
    assert spec.params == {}
    assert get_submodules(spec) is spec.submodules
    assert spec == specs.get_mlp_module_spec(use_te=False)
    assert hash(spec) == hash(specs.get_mlp_module_spec(use_te=False))
    assert specs.get_gpt_layer_local_submodules().mlp == spec


def test_dense_mlp_spec_selects_the_te_class_as_upstream(monkeypatch):
    fused, grouped = _te_classes_over_fake_te(monkeypatch)

    def mlp_class(**flags):
        return specs.get_mlp_module_spec_for_backend(
            backend=TESpecProvider(), **flags
        ).func.__self__

    assert mlp_class(use_te_op_fuser=True, use_grouped_gemm_for_dense_mlp=True) is grouped
    assert mlp_class(use_te_op_fuser=True, use_grouped_gemm_for_dense_mlp=False) is fused
    assert mlp_class(use_te_op_fuser=False, use_grouped_gemm_for_dense_mlp=True) is MLP
    te = specs.get_gpt_layer_with_transformer_engine_submodules(use_te_op_fuser=True).mlp
    assert te.func.__self__ is fused and te.module is fused
    assert te.submodules.linear_fc1 is te_ext.TELayerNormColumnParallelLinear


def test_a_layer_builds_its_mlp_by_calling_the_spec(model_parallel):
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = TransformerConfig(
        num_layers=1, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True
    )
    pg = ProcessGroupCollection.use_mpu_process_groups(["tp"])
    spec = specs.get_gpt_layer_local_spec().submodules.mlp
    # What upstream's TransformerLayer does with its mlp entry.
    mlp = build_module(spec, config=config, pg_collection=pg, is_mtp_layer=False, name="mlp")
    assert isinstance(mlp, MLP) and mlp.tp_group is pg.tp
    assert sum(p.numel() for p in mlp.parameters()) == 1212


def test_te_fused_classes_patched_on_this_module_reach_the_spec(monkeypatch):
    # Upstream binds TEFusedMLP / TEFusedMLPWithGroupedLinear in gpt_layer_specs, and tools
    # substitute them there (a stand-in class on a machine without TE, a subclass with hooks).
    assert specs.TEFusedMLP is te_ext.TEFusedMLP  # read through the extension, unpatched
    stand_in = type("TEFusedMLP", (MLP,), {})
    grouped_stand_in = type("TEFusedMLPWithGroupedLinear", (MLP,), {})
    monkeypatch.setattr(specs, "TEFusedMLP", stand_in)
    monkeypatch.setattr(specs, "TEFusedMLPWithGroupedLinear", grouped_stand_in)

    def mlp_class(grouped):
        return specs.get_mlp_module_spec_for_backend(
            backend=TESpecProvider(), use_te_op_fuser=True, use_grouped_gemm_for_dense_mlp=grouped
        ).func.__self__

    assert mlp_class(False) is stand_in
    assert mlp_class(True) is grouped_stand_in
