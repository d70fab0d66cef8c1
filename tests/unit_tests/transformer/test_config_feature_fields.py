"""Upstream config fields of features the fork does not implement: accepted, checked, reported."""

import dataclasses
import warnings

import pytest
import torch

from megatron.core import config_feature_fields
from megatron.core.config_feature_fields import (
    FIELDS_READ_BY_FORK,
    ModelParallelFeatureFields,
    UnimplementedFeatureWarning,
)
from megatron.core.model_parallel_config import (
    ModelParallelConfig,
    resolve_tensor_parallel_weight_shards,
)
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_feature_fields import TransformerFeatureFields
from tests.unit_tests.test_utilities import Utils


@pytest.fixture(autouse=True)
def fresh_warning_state(monkeypatch):
    # The once-per-process memory would make the test order matter.
    monkeypatch.setattr(config_feature_fields, "_WARNED", set())


def make(**kwargs):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4)
    base.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimplementedFeatureWarning)
        return TransformerConfig(**base)


def test_feature_fields_are_config_fields_with_upstream_defaults():
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    for cls in (ModelParallelFeatureFields, TransformerFeatureFields):
        assert {f.name for f in dataclasses.fields(cls)} <= names
    assert {f.name for f in dataclasses.fields(ModelParallelFeatureFields)} <= {
        f.name for f in dataclasses.fields(ModelParallelConfig)
    }
    config = make()
    # A sample of upstream's defaults, including ones that are "on" by default.
    assert config.attention_backend is AttnBackend.auto
    assert config.tp_comm_bulk_wgrad is True and config.batch_p2p_comm is True
    assert config.moe_flex_dispatcher_backend == "deepep"
    assert config.transformer_impl == "transformer_engine"
    assert config.fp8_recipe == "delayed" and config.fp4_recipe == "nvfp4"
    assert config.mtp_num_layers is None and config.gdp_num_householder == 3
    assert config.min_offloaded_tensor_size == 1024 * 1024
    assert config.offload_modules == [] and config.gtp_remat_opt_in_modules == []
    # Mutable defaults are not shared between configs.
    assert make().offload_modules is not config.offload_modules


def test_defaults_construct_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4)
        ModelParallelConfig()


def test_values_derived_as_upstream():
    config = make(params_dtype=torch.bfloat16, bf16=True)
    assert config.num_query_groups == 4
    assert config.recompute_modules == ["core_attn"]
    assert config.autocast_dtype is torch.bfloat16
    assert config.microbatch_group_size_per_vp_stage == 1
    assert config.gtp_weight_remat_size == 1
    assert make(moe_expert_capacity_factor=-1.0).moe_expert_capacity_factor is None
    layer_recompute = make(moe_layer_recompute=True)
    assert layer_recompute.recompute_granularity == "selective"
    assert layer_recompute.recompute_modules == ["core_attn", "moe"]
    assert make(fp32_residual_connection=True, pipeline_dtype=torch.bfloat16).pipeline_dtype is (
        torch.float
    )


def test_enabling_a_feature_warns_once_naming_field_and_value():
    with pytest.warns(UnimplementedFeatureWarning, match=r"TransformerConfig\.qk_layernorm=True"):
        TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, qk_layernorm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, qk_layernorm=True)
    with pytest.warns(UnimplementedFeatureWarning, match="tp_comm_bulk_wgrad=False"):
        ModelParallelConfig(tp_comm_bulk_wgrad=False)


def test_fields_the_fork_reads_never_warn():
    assert {"fp8_recipe", "recompute_modules", "offload_modules"} <= FIELDS_READ_BY_FORK
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnimplementedFeatureWarning)
        make(fp8_recipe="mxfp8", recompute_modules=["mlp"], num_query_groups=2)


@pytest.mark.parametrize(
    "name, value",
    [("cuda_graph_impl", "cuda"), ("softmax_type", "softmax"), ("moe_router_dtype", "fp16")],
)
def test_value_outside_declared_choices_is_refused(name, value):
    with pytest.raises(ValueError, match=rf"TransformerConfig\.{name}={value!r} is not one of"):
        make(**{name: value})


def test_none_is_accepted_for_choice_fields():
    assert make(moe_flex_dispatcher_backend=None).moe_flex_dispatcher_backend is None
    with pytest.raises(ValueError, match="cross_entropy_fusion_impl"):
        ModelParallelConfig(cross_entropy_fusion_impl="fast")


def test_upstream_value_rules():
    with pytest.raises(ValueError, match="gdp_num_householder must be positive"):
        make(gdp_num_householder=0)
    with pytest.raises(ValueError, match="Only one of fp16"):
        make(fp16=True, bf16=True)
    with pytest.raises(ValueError, match="multiple or divisor"):
        make(num_query_groups=3, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="fp8_param"):
        make(fp8_param=True)
    with pytest.raises(ValueError, match="mtp_hsm"):
        make(mtp_hsm=True, mtp_num_layers=1)
    with pytest.raises(ValueError, match="recompute_method"):
        make(recompute_granularity="full")
    with pytest.raises(ValueError, match="flex token dispatcher"):
        make(moe_enable_deepep=True)
    with pytest.raises(ValueError, match="requires moe_token_dispatcher_type='flex'"):
        make(moe_flex_dispatcher_backend="ncclep")
    with pytest.raises(ValueError, match="require the 'ncclep' flex"):
        make(moe_dispatch_fwd_dtype="mxfp8")
    with pytest.raises(ValueError, match="moe_router_num_groups must be specified"):
        make(num_moe_experts=4, add_bias_linear=False, moe_router_group_topk=2)
    with pytest.raises(AssertionError, match="only supported with expert model parallelism"):
        make(overlap_moe_expert_parallel_comm=True)
    with pytest.raises(AssertionError, match="Unknown batch_invariant_backend"):
        make(batch_invariant_mode=True, batch_invariant_backend="te-native")
    with pytest.raises(ValueError, match="defer_embedding_wgrad_compute"):
        ModelParallelConfig(defer_embedding_wgrad_compute=True)


def test_upstream_check_fires_before_the_choice_check():
    # Upstream's own assertion (and its exception type) wins over the generic choice check.
    with pytest.raises(AssertionError):
        make(batch_invariant_mode=True, batch_invariant_backend="bogus")
    with pytest.raises(ValueError, match="is not one of"):
        make(batch_invariant_backend="bogus")


def test_weight_shard_resolution():
    assert resolve_tensor_parallel_weight_shards(2, None, 3) == (6, 3)
    assert resolve_tensor_parallel_weight_shards(2, 8, 1) == (8, 4)
    assert resolve_tensor_parallel_weight_shards(2, 8, 4) == (8, 4)  # idempotent on its result
    with pytest.raises(ValueError, match=r"tensor_parallel_num_weight_shards \(1\) must be >="):
        resolve_tensor_parallel_weight_shards(2, 1, 1)
    with pytest.raises(ValueError, match="expert_tensor_parallel_num_weight_shards .* divisible"):
        resolve_tensor_parallel_weight_shards(
            2,
            3,
            1,
            shards_field="expert_tensor_parallel_num_weight_shards",
            tp_field="expert_tensor_parallel_size",
        )
    assert ModelParallelConfig(tensor_parallel_num_weight_shards=1).gtp_weight_remat_size == 1


@pytest.fixture
def model_parallel():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


def test_unimplemented_features_do_not_change_mlp_math(model_parallel):
    def run(**features):
        config = make(hidden_size=8, ffn_hidden_size=16, use_cpu_initialization=True, **features)
        torch.manual_seed(0)
        mlp = MLP(config, _local_submodules())
        torch.manual_seed(1)
        x = torch.randn(3, 2, 8)
        out, _ = mlp(x)
        return out

    plain = run()
    with_features = run(qk_layernorm=True, moe_router_fusion=True, mlp_chunks_for_training=2)
    torch.testing.assert_close(with_features, plain, rtol=0, atol=0)


def _local_submodules():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def test_upstream_errors_come_before_the_forks_own_refusals():
    # pipeline_model_parallel_size=2 is legal upstream and refused only by this fork: a config
    # that upstream itself refuses reports upstream's error first.
    pp2 = dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="glu_linear_offset"):
        make(glu_linear_offset=1.0, **pp2)
    with pytest.raises(ValueError, match="activation_func must be a callable"):
        make(activation_func="silu", **pp2)
    with pytest.raises(ValueError, match="cuda_graph_impl"):
        make(cuda_graph_impl="cuda", **pp2)
    with pytest.raises(ValueError, match="pipeline_dtype must be specified"):
        make(pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="supports pipeline_model_parallel_size=1"):
        make(**pp2)


def test_mla_config_constructs_with_upstream_defaults_and_rules():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    with pytest.warns(UnimplementedFeatureWarning, match="multi_latent_attention=True"):
        config = MLATransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4)
    assert isinstance(config, TransformerConfig)
    assert (config.q_lora_rank, config.kv_lora_rank, config.rope_type) == (512, 512, "yarn")
    assert config.normalization == "RMSNorm"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimplementedFeatureWarning)
        with pytest.raises(ValueError, match="only works with YARN RoPE"):
            MLATransformerConfig(
                num_layers=1,
                hidden_size=16,
                num_attention_heads=4,
                apply_rope_fusion=True,
                rope_type="rope",
            )
        with pytest.raises(NotImplementedError, match="Output gate"):
            MLATransformerConfig(
                num_layers=1, hidden_size=16, num_attention_heads=4, attention_output_gate=True
            )
