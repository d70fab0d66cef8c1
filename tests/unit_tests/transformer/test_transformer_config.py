"""TransformerConfig.__post_init__: defaults and every MLP / MoE / activation rule."""

import math
import warnings

import pytest
import torch.nn.functional as F

from megatron.core import activations
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer.activation_spec import ActivationSpec
from megatron.core.transformer.transformer_config import TransformerConfig

BAD_SCALES = [0.0, -1.0, math.nan, math.inf, -math.inf]


def make(**kwargs):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4)
    base.update(kwargs)
    return TransformerConfig(**base)


def moe(**kwargs):
    base = dict(num_moe_experts=4, add_bias_linear=False)
    base.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make(**base)


def test_defaults():
    config = make()
    assert config.ffn_hidden_size == 64
    assert config.activation_func is F.gelu and not config.gated_linear_unit
    assert config.init_method is not None and config.output_layer_init_method is not None
    assert config.expert_tensor_parallel_size == config.tensor_model_parallel_size == 1
    assert config.kv_channels == 4


def test_op_fuser_with_grouped_gemm_uses_grouped_tensor():
    assert moe(use_transformer_engine_op_fuser=True, moe_grouped_gemm=True).moe_use_grouped_tensor
    with pytest.raises(ValueError, match="requires moe_grouped_gemm=True"):
        moe(moe_use_grouped_tensor=True)


def test_moe_rules():
    with pytest.raises(ValueError, match="num_moe_experts must be non-negative"):
        make(num_moe_experts=0)
    with pytest.warns(UserWarning, match="moe_ffn_hidden_size is not set"):
        config = make(num_moe_experts=2, add_bias_linear=False)
    assert config.moe_ffn_hidden_size == config.ffn_hidden_size
    with pytest.raises(ValueError, match="moe_ffn_hidden_size"):
        make(moe_ffn_hidden_size=32)
    with pytest.warns(UserWarning):
        assert make(moe_ffn_hidden_size=32, moe_layer_freq=[1, 0]).moe_ffn_hidden_size is None
    with pytest.raises(ValueError, match="moe_shared_expert_intermediate_size"):
        moe(moe_shared_expert_intermediate_size=0)
    with pytest.raises(ValueError, match="alltoall or flex"):
        moe(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True)
    moe(
        moe_shared_expert_intermediate_size=32,
        moe_shared_expert_overlap=True,
        moe_token_dispatcher_type="alltoall",
    )
    with pytest.raises(ValueError, match="pre-softmax when topk is 1"):
        moe(moe_router_topk=1)
    with pytest.raises(ValueError, match="moe_grouped_gemm"):
        moe(moe_single_grouped_weight=True)


def test_sequence_parallel_needs_tensor_parallel():
    with pytest.raises(ValueError, match="Cannot use sequence parallelism without tensor"):
        make(sequence_parallel=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(activation_func=F.relu), "either gelu, swiglu, or quick_geglu"),
        (dict(activation_func=F.gelu, add_bias_linear=False), "add_bias_linear must also be True"),
        (dict(activation_func=quick_gelu), "gated_linear_unit must be True"),
        (
            dict(activation_func=F.silu, gated_linear_unit=True, glu_linear_offset=1.0),
            "must be quick_gelu",
        ),
        (dict(activation_func=F.gelu, use_te_activation_func=True), "cannot be both true"),
    ],
)
def test_bias_activation_fusion_rules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(bias_activation_fusion=True, **kwargs)


def test_te_activation_and_fp8_store_rules():
    with pytest.raises(ValueError, match="TransformerEngine only support"):
        make(use_te_activation_func=True, activation_func=quick_gelu)
    with pytest.raises(ValueError, match="supported only for SwiGLU"):
        make(activation_func_fp8_input_store=True)
    make(activation_func_fp8_input_store=True, activation_func=F.silu, gated_linear_unit=True)


def test_glu_offset_rules():
    with pytest.raises(ValueError, match="glu_linear_offset=1.0 only applies to gated"):
        make(glu_linear_offset=1.0)
    with pytest.raises(ValueError, match="glu_linear_offset must be finite"):
        make(glu_linear_offset=math.nan, gated_linear_unit=True)


@pytest.mark.parametrize("value", BAD_SCALES)
@pytest.mark.parametrize("func", [F.silu, quick_gelu, activations.fast_gelu, F.relu])
def test_clamp_value_must_be_positive_finite(func, value):
    with pytest.raises(ValueError, match=r"activation_func_clamp_value.*greater than zero"):
        moe(activation_func=func, gated_linear_unit=True, activation_func_clamp_value=value)


def test_clamp_value_needs_gating():
    with pytest.raises(ValueError, match="applies to gated linear units only"):
        make(activation_func=quick_gelu, activation_func_clamp_value=7.0)


def test_gpt_oss_config_is_dense_legal():
    config = make(
        activation_func=quick_gelu,
        gated_linear_unit=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=7.0,
    )
    assert ActivationSpec.from_config(config).name == "quick-GEGLU(clamp=7, offset=1)"


@pytest.mark.parametrize("value", BAD_SCALES)
@pytest.mark.parametrize(
    "field", ["activation_func_tanh_clamp_scale", "activation_func_tanh_clamp_scale_linear"]
)
def test_tanh_scales_must_be_positive_finite(field, value):
    kwargs = dict(activation_func=F.silu, gated_linear_unit=True)
    kwargs["activation_func_tanh_clamp_scale"] = 4.0
    kwargs[field] = value
    with pytest.raises(ValueError, match=f"{field} must be finite and greater than zero, got"):
        make(**kwargs)


def test_tanh_scale_rules():
    silu_glu = dict(activation_func=F.silu, gated_linear_unit=True)
    with pytest.raises(ValueError, match="requires activation_func_tanh_clamp_scale "):
        make(activation_func_tanh_clamp_scale_linear=25.0, **silu_glu)
    with pytest.raises(ValueError, match="mutually exclusive"):
        moe(activation_func_clamp_value=7.0, activation_func_tanh_clamp_scale=4.0, **silu_glu)
    with pytest.raises(ValueError, match="defines SiTU-GLU and requires activation_func=F.silu"):
        make(
            activation_func=quick_gelu, gated_linear_unit=True, activation_func_tanh_clamp_scale=4.0
        )
    with pytest.raises(ValueError, match="scales the linear half"):
        make(
            activation_func=activations.squared_relu,
            activation_func_tanh_clamp_scale=4.0,
            activation_func_tanh_clamp_scale_linear=25.0,
        )
    with pytest.raises(ValueError, match="use_te_activation_func must be False"):
        make(activation_func_tanh_clamp_scale=4.0, use_te_activation_func=True, **silu_glu)


def test_valid_tanh_configs():
    k3 = make(
        activation_func=F.silu,
        gated_linear_unit=True,
        activation_func_tanh_clamp_scale=4.0,
        activation_func_tanh_clamp_scale_linear=25.0,
    )
    assert ActivationSpec.from_config(k3).name == "SiTU-GLU(s_g=4, s_l=25)"
    sq = make(activation_func=activations.squared_relu, activation_func_tanh_clamp_scale=10.0)
    assert ActivationSpec.from_config(sq).name == "squared-ReLU(tanh_scale=10)"
    dense_situ = make(
        activation_func=F.silu, gated_linear_unit=True, activation_func_tanh_clamp_scale=4.0
    )
    assert ActivationSpec.from_config(dense_situ).is_situ_glu


def test_activation_spec_identity_classification():
    from megatron.core.transformer.activation_spec import ActivationKind, activation_kind_of

    assert activation_kind_of(quick_gelu) == ActivationKind.QUICK_GELU
    assert activation_kind_of(activations.quick_gelu) == ActivationKind.QUICK_GELU
    assert activation_kind_of(activations.squared_relu) == ActivationKind.SQUARED_RELU
    assert activation_kind_of(F.gelu) == ActivationKind.GELU
    assert activation_kind_of(activations.fast_gelu) == ActivationKind.GELU_TANH
    assert activation_kind_of(lambda x: x) == ActivationKind.CUSTOM


@pytest.mark.parametrize(
    "field, flag",
    [
        ("moe_mlp_glu_interleave_size", "moe_grouped_gemm"),
        ("moe_shared_expert_glu_interleave_size", "use_grouped_gemm_for_shared_expert"),
    ],
)
@pytest.mark.parametrize("value", [0, -32])
def test_glu_interleave_size_must_be_positive_at_config_time(field, flag, value):
    # At config time: a 0 block would otherwise surface in the grouped class's constructor, as a
    # ZeroDivisionError that names nothing.
    with pytest.raises(ValueError, match=f"{field} must be a positive number"):
        moe(**{field: value, flag: True})


def test_glu_interleave_size_is_ignored_where_no_class_reads_it():
    # As upstream: without grouped experts the field is not read, so no value is refused.
    assert moe(moe_mlp_glu_interleave_size=0).moe_mlp_glu_interleave_size == 0
    assert moe(moe_grouped_gemm=True, moe_mlp_glu_interleave_size=32).moe_mlp_glu_interleave_size
