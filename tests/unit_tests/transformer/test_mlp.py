"""MLP: upstream's construction and forward contract, and every activation path vs float64.

The numerical tests run each catalogue activation on each path the config accepts (unfused,
fused kernels run eagerly, and a small compiled subset) in fp32 and bf16, with and without a
per-token scale, and compare output, input gradient, per-token-scale gradient and every
parameter gradient with a float64 MLP written out by hand (see ``mlp_test_utils``).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import mcore_activations.activation_path as activation_path
from mcore_activations.reference_mlp import reference_mlp
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.activation_spec import ActivationSpec, UnsupportedActivationError
from megatron.core.transformer.mlp import (
    FUSED_KERNEL_PATH,
    MLP,
    TE_MODULE_PATH,
    UNFUSED_PATH,
    MLPSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.activation_catalog import CONFIGS, NEEDS_MOE
from tests.unit_tests.test_utilities import Utils
from tests.unit_tests.tolerances import assert_close_to_reference
from tests.unit_tests.transformer.mlp_test_utils import (
    COMPILED,
    DTYPE_IDS,
    DTYPES,
    FUSED,
    PRE_ACTIVATION_STD,
    UNFUSED,
    anchored,
    assert_clamps_active,
    assert_grads_match,
    capture_output,
    config_accepts,
    fill_bias_,
    fill_weights_,
    kernel_mode,
    leaf64,
    make_config,
)

SEQ, BATCH = 6, 2


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


@pytest.fixture
def pg():
    return ProcessGroupCollection.use_mpu_process_groups(["tp"])


def local_submodules() -> MLPSubmodules:
    return get_gpt_layer_local_submodules().mlp.submodules


def moe_kwargs(entry: str) -> dict:
    # The SwiGLU clamp is legal with MoE only; a dense MLP in an MoE model is a valid setting.
    return dict(num_moe_experts=4, moe_ffn_hidden_size=40) if entry in NEEDS_MOE else {}


def build_mlp(config, pg, submodules=None, ffn_hidden_size=None) -> MLP:
    return MLP(
        config,
        submodules or local_submodules(),
        ffn_hidden_size=ffn_hidden_size or config.ffn_hidden_size,
        tp_group=pg.tp,
        pg_collection=pg,
    )


def randomize_(mlp: MLP, dtype: torch.dtype, seed: int) -> None:
    """Weights that put fc1's pre-activations at std ~8; random biases (fc1's zero in bf16)."""
    gen = torch.Generator().manual_seed(seed)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    fill_weights_(fc1.weight, fc1.weight.shape[1], PRE_ACTIVATION_STD, gen)
    fill_bias_(fc1.bias, 0.5 if dtype == torch.float32 else 0.0, gen)
    fill_weights_(fc2.weight, fc2.weight.shape[1], 1.0, gen)
    fill_bias_(fc2.bias, 0.5, gen)


def check_mlp_against_reference(mlp: MLP, dtype, path, with_scale, seed=0, rows=(SEQ, BATCH)):
    """Runs ``mlp`` forward and backward and compares everything with the float64 reference."""
    randomize_(mlp, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = mlp.linear_fc1.weight.shape[1]
    x = torch.randn(*rows, hidden, generator=gen).to(dtype).requires_grad_()
    scale = torch.rand(*rows, generator=gen).requires_grad_() if with_scale else None
    grad = torch.randn(*rows, mlp.linear_fc2.weight.shape[0], generator=gen).to(dtype)
    fc1_output = capture_output(mlp.linear_fc1)

    with kernel_mode(path):
        out, out_bias = mlp(x, per_token_scale=scale)
        total = out if out_bias is None else out + out_bias
        total.backward(grad)

    spec = mlp.activation_spec
    what = f"MLP[{spec.name}, {path}, {DTYPE_IDS[dtype]}]"
    assert out.dtype == dtype and out.shape == x.shape
    if with_scale or mlp.linear_fc2.bias is None:
        assert out_bias is None, f"{what}: the fc2 bias must be folded into the output"
    else:
        assert out_bias is mlp.linear_fc2.bias

    # The float64 MLP on the same weights.
    params = dict(mlp.named_parameters())
    ref = {name: leaf64(p) for name, p in params.items()}
    x64, scale64 = leaf64(x), leaf64(scale)
    fc1_bias = ref.get("linear_fc1.bias")

    def at(pre):
        if dtype != torch.float32:
            assert_close_to_reference(fc1_output["out"], pre, dtype, f"{what} fc1 output")
            pre = anchored(pre, fc1_output["out"])
        assert_clamps_active(spec, pre if fc1_bias is None else pre + fc1_bias)
        return pre

    expected = reference_mlp(
        x64,
        ref["linear_fc1.weight"],
        ref["linear_fc2.weight"],
        spec,
        fc1_bias=fc1_bias,
        fc2_bias=ref.get("linear_fc2.bias"),
        probs=scale64,
        at=at,
    )
    expected.backward(grad.double())

    assert_close_to_reference(total, expected, dtype, f"{what} output")
    assert_close_to_reference(x.grad, x64.grad, dtype, f"{what} dx")
    if with_scale:
        assert_close_to_reference(scale.grad, scale64.grad, dtype, f"{what} dscale")
    assert_grads_match(params, ref, dtype, what)


# ----------------------------------------------------------------------- upstream's facts


def test_local_spec_parameter_count_and_forward(pg):
    config = TransformerConfig(
        num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True
    )
    mlp = build_mlp(config, pg)
    # fc1 12x48 + 48, fc2 48x12 + 12.
    assert sum(p.numel() for p in mlp.parameters()) == 1212

    out, out_bias = mlp(torch.ones(32, 2, 12))
    assert out.shape == (32, 2, 12) and out.dtype == torch.float32
    assert out_bias.shape == (12,)


@pytest.mark.gpu
def test_local_spec_forward_on_gpu(pg):
    # GPU initialization draws each shard inside the tracker's model-parallel stream.
    model_parallel_cuda_manual_seed(123)
    config = TransformerConfig(num_layers=2, hidden_size=12, num_attention_heads=4)
    mlp = build_mlp(config, pg).cuda()
    out, out_bias = mlp(torch.ones(32, 2, 12, device="cuda"))
    assert out.shape == (32, 2, 12) and out.dtype == torch.float32 and out.is_cuda
    assert out_bias.shape == (12,)


def test_bias_free_mlp_returns_no_bias(pg):
    config = make_config("swiglu", torch.float32, UNFUSED, add_bias_linear=False)
    out, out_bias = build_mlp(config, pg)(torch.randn(3, 2, 24))
    assert out.shape == (3, 2, 24) and out_bias is None


class _RecordingLinear(torch.nn.Module):
    """Records the arguments an MLP builds its linear with; forwards like a plain linear."""

    calls = []

    def __init__(self, input_size, output_size, **kwargs):
        super().__init__()
        _RecordingLinear.calls.append(((input_size, output_size), kwargs))
        self.weight = torch.nn.Parameter(torch.randn(output_size, input_size))

    def forward(self, x):
        return F.linear(x, self.weight), None


def test_builder_arguments_gated(pg):
    _RecordingLinear.calls = []
    config = make_config("swiglu", torch.float32, UNFUSED, ffn_hidden_size=40)
    submodules = MLPSubmodules(linear_fc1=_RecordingLinear, linear_fc2=_RecordingLinear)
    MLP(
        config, submodules, ffn_hidden_size=40, tp_group=pg.tp, name="decoder.mlp", pg_collection=pg
    )

    (fc1_sizes, fc1_kwargs), (fc2_sizes, fc2_kwargs) = _RecordingLinear.calls
    assert fc1_sizes == (24, 80)  # gated: [gate; linear]
    assert fc1_kwargs == dict(
        config=config,
        init_method=config.init_method,
        gather_output=False,
        bias=True,
        skip_bias_add=True,
        is_expert=False,
        tp_comm_buffer_name="fc1",
        tp_group=pg.tp,
        stride=2,
        name="decoder.mlp.linear_fc1",
        pg_collection=pg,
    )
    assert fc2_sizes == (40, 24)
    assert fc2_kwargs == dict(
        config=config,
        init_method=config.output_layer_init_method,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=True,
        is_expert=False,
        tp_comm_buffer_name="fc2",
        tp_group=pg.tp,
        name="decoder.mlp.linear_fc2",
        pg_collection=pg,
    )


def test_gated_fc1_is_split_with_stride_two(pg):
    mlp = build_mlp(make_config("swiglu", torch.float32, UNFUSED), pg)
    assert mlp.linear_fc1.weight.shape == (80, 24)
    assert mlp.linear_fc1.weight.partition_stride == 2
    ungated = build_mlp(make_config("gelu", torch.float32, UNFUSED), pg)
    assert ungated.linear_fc1.weight.shape == (40, 24)
    assert ungated.linear_fc1.weight.partition_stride == 1


def test_ffn_hidden_size_that_disagrees_with_the_config_is_refused_at_build(pg):
    # fc2's input width is config.ffn_hidden_size (upstream's quirk), so an argument that
    # differs builds a layer whose first forward fails inside fc2; upstream accepts it.
    config = make_config("gelu", torch.float32, UNFUSED, ffn_hidden_size=40)
    with pytest.raises(
        ValueError,
        match=r"MLP\(ffn_hidden_size=16\) disagrees with "
        r"config.ffn_hidden_size=40: fc2 is built from the config",
    ):
        build_mlp(config, pg, ffn_hidden_size=16)
    mlp = build_mlp(config, pg, ffn_hidden_size=40)
    assert mlp.linear_fc1.weight.shape == (40, 24) and mlp.linear_fc2.weight.shape == (24, 40)


def test_ffn_hidden_size_defaults(pg):
    config = make_config("gelu", torch.float32, UNFUSED)
    with pytest.warns(DeprecationWarning, match="ffn_hidden_size"):
        mlp = MLP(config, local_submodules(), tp_group=pg.tp)
    assert mlp.linear_fc1.weight.shape == (40, 24)
    with pytest.raises(ValueError, match="MoE MLP requires `ffn_hidden_size`"):
        MLP(config, local_submodules(), is_expert=True, tp_group=pg.tp)


def test_input_size_and_latent_expert(pg):
    config = make_config(
        "gelu", torch.float32, UNFUSED, num_moe_experts=2, moe_ffn_hidden_size=40, moe_latent_size=8
    )
    dense = build_mlp(config, pg, submodules=None)
    assert dense.linear_fc1.weight.shape == (40, 24) and not dense.use_latent
    expert = MLP(config, local_submodules(), is_expert=True, ffn_hidden_size=40, tp_group=pg.tp)
    assert expert.use_latent
    assert expert.linear_fc1.weight.shape == (40, 8)
    assert expert.linear_fc2.weight.shape == (8, 40)
    narrow = MLP(config, local_submodules(), input_size=10, ffn_hidden_size=40, tp_group=pg.tp)
    assert narrow.linear_fc1.weight.shape == (40, 10)


def test_backward_dw_runs_fc2_then_fc1(pg):
    mlp = build_mlp(make_config("gelu", torch.float32, UNFUSED), pg)
    order = []
    mlp.linear_fc1.backward_dw = lambda: order.append("fc1")
    mlp.linear_fc2.backward_dw = lambda: order.append("fc2")
    mlp.backward_dw()
    assert order == ["fc2", "fc1"]


def test_as_mlp_submodule(pg):
    config = make_config("swiglu", torch.float32, UNFUSED)
    mlp = MLP.as_mlp_submodule(
        local_submodules(), config, pg, is_mtp_layer=False, ffn_hidden_size=40, name="mlp"
    )
    assert isinstance(mlp, MLP) and mlp.tp_group is pg.tp
    assert mlp.linear_fc1.name == "mlp.linear_fc1"
    with pytest.raises(ValueError, match="tp group"):
        MLP.as_mlp_submodule(local_submodules(), config, ProcessGroupCollection(), False)


# --------------------------------------------------------------- numerics vs the reference


def _numeric_cases():
    cases = []
    for entry in CONFIGS:
        for path in (UNFUSED, FUSED):
            if config_accepts(entry, path, **moe_kwargs(entry)):
                cases.append(pytest.param(entry, path, id=f"{entry}-{path}"))
    return cases


@pytest.mark.parametrize("with_scale", [False, True], ids=["", "scaled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("entry, path", _numeric_cases())
def test_matches_reference(pg, entry, path, dtype, with_scale):
    mlp = build_mlp(make_config(entry, dtype, path, **moe_kwargs(entry)), pg)
    assert mlp.activation_path == (FUSED_KERNEL_PATH if path == FUSED else UNFUSED_PATH)
    check_mlp_against_reference(mlp, dtype, path, with_scale)


@pytest.mark.parametrize(
    "entry, dtype, with_scale",
    [
        ("swiglu_clamp", torch.float32, True),
        ("quick_geglu_gpt_oss", torch.bfloat16, False),
    ],
    ids=["swiglu_clamp-fp32-scaled", "quick_geglu_gpt_oss-bf16"],
)
def test_compiled_kernels_match_reference(pg, entry, dtype, with_scale):
    mlp = build_mlp(make_config(entry, dtype, COMPILED, **moe_kwargs(entry)), pg)
    check_mlp_against_reference(mlp, dtype, COMPILED, with_scale)


@pytest.mark.parametrize(
    "entry, path",
    [
        pytest.param(entry, path, id=f"{entry}-{path}")
        for entry in ("swiglu_clamp", "situ_glu", "squared_relu_tanh")
        for path in (UNFUSED, FUSED)
        if config_accepts(entry, path, **moe_kwargs(entry))
    ],
)
def test_ffn_not_multiple_of_32(pg, entry, path):
    config = make_config(entry, torch.float32, path, ffn_hidden_size=112, **moe_kwargs(entry))
    check_mlp_against_reference(build_mlp(config, pg), torch.float32, path, with_scale=True)


@pytest.mark.parametrize("entry", ["reglu", "squared_relu_tanh", "geglu_clamp", "quick_gelu"])
def test_fused_path_computes_specs_the_config_does_not_fuse(pg, entry):
    # TransformerConfig keeps upstream's rule that bias_activation_fusion needs gelu, silu or
    # gated quick_gelu. MLP itself lowers any non-custom spec: enabling the flag after
    # validation runs these on the fused kernels, exactly.
    assert not config_accepts(entry, FUSED)
    config = make_config(entry, torch.float32, UNFUSED)
    config.bias_activation_fusion = True
    mlp = build_mlp(config, pg)
    assert mlp.activation_path == FUSED_KERNEL_PATH
    check_mlp_against_reference(mlp, torch.float32, FUSED, with_scale=True)


# ----------------------------------------------------------------- custom callables, refusals


def _softsign_gate(x):
    return x / (1.0 + x.abs())


@pytest.mark.parametrize("with_scale", [False, True], ids=["", "scaled"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "unary"])
def test_custom_callable_runs_unfused(pg, gated, with_scale):
    config = make_config(
        "gelu", torch.float32, UNFUSED, gated_linear_unit=gated, activation_func=_softsign_gate
    )
    mlp = build_mlp(config, pg)
    assert mlp.activation_path == UNFUSED_PATH and mlp.activation_func is _softsign_gate
    check_mlp_against_reference(mlp, torch.float32, UNFUSED, with_scale)


def test_config_refuses_fusing_a_custom_callable():
    with pytest.raises(ValueError, match="gelu, swiglu, or quick_geglu"):
        make_config("gelu", torch.float32, FUSED, activation_func=_softsign_gate)


def test_fused_path_refuses_a_custom_callable_at_construction(pg):
    # A config edited after validation reaches MLP unchecked; MLP lowers at build time.
    config = make_config("swiglu", torch.float32, FUSED)
    config.activation_func = _softsign_gate
    with pytest.raises(UnsupportedActivationError, match=r"MLP\(bias_activation_fusion=True\)"):
        build_mlp(config, pg)


class _FakeTEActivation(torch.nn.Module):
    """Stands in for TE's activation module: the plain formula on the two-halves layout."""

    def __init__(self, config):
        super().__init__()
        self.spec = ActivationSpec.from_config(config)

    def forward(self, x):
        return self.spec.reference(x, dtype=x.dtype)


def _te_activation_submodules():
    return MLPSubmodules(
        linear_fc1=ColumnParallelLinear,
        linear_fc2=RowParallelLinear,
        activation_func=_FakeTEActivation,
    )


@pytest.mark.parametrize("with_scale", [False, True], ids=["", "scaled"])
@pytest.mark.parametrize("entry", ["swiglu", "geglu_erf", "relu"])
def test_te_activation_module_path(pg, entry, with_scale):
    config = make_config(entry, torch.float32, UNFUSED, use_te_activation_func=True)
    mlp = build_mlp(config, pg, submodules=_te_activation_submodules())
    assert mlp.activation_path == TE_MODULE_PATH
    assert isinstance(mlp.activation_func, _FakeTEActivation)
    check_mlp_against_reference(mlp, torch.float32, UNFUSED, with_scale)


def test_te_activation_module_path_refuses_a_linear_offset(pg):
    # TE's activation modules have no offset; computing plain SwiGLU instead would be silent.
    config = make_config(
        "swiglu", torch.float32, UNFUSED, use_te_activation_func=True, glu_linear_offset=1.0
    )
    with pytest.raises(UnsupportedActivationError, match="use_te_activation_func=True"):
        build_mlp(config, pg, submodules=_te_activation_submodules())


def test_te_activation_flag_without_builder_computes_unfused(pg):
    config = make_config("swiglu", torch.float32, UNFUSED, use_te_activation_func=True)
    mlp = build_mlp(config, pg)
    assert mlp.activation_path == UNFUSED_PATH and mlp.activation_func is F.silu
    check_mlp_against_reference(mlp, torch.float32, UNFUSED, with_scale=False)


def test_fused_path_passes_store_and_offload_flags(pg, monkeypatch):
    calls = []
    real = activation_path.fused_activation_with_plan

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(activation_path, "fused_activation_with_plan", recording)
    monkeypatch.setattr(activation_path, "have_te", lambda: True)
    config = make_config(
        "swiglu",
        torch.float32,
        FUSED,
        activation_func_fp8_input_store=True,
        cpu_offloading=True,
        cpu_offloading_activations=True,
    )
    mlp = build_mlp(config, pg)
    mlp(torch.randn(3, 2, 24))
    assert calls[-1]["fp8_input_store"] is True and calls[-1]["cpu_offload_input"] is True

    monkeypatch.setattr(activation_path, "have_te", lambda: False)
    mlp(torch.randn(3, 2, 24))
    assert calls[-1]["cpu_offload_input"] is False


def test_no_activation_decision_reads_the_callable_at_forward(pg):
    # The math is fixed at construction: swapping the attribute that upstream inspects per
    # forward must not change which formula the fused path computes.
    mlp = build_mlp(make_config("swiglu", torch.float32, FUSED), pg)
    x = torch.randn(3, 2, 24)
    before = mlp(x)[0]
    mlp.activation_func = F.relu
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        after = mlp(x)[0]
    torch.testing.assert_close(before, after, rtol=0, atol=0)


@pytest.mark.parametrize("path", [UNFUSED, FUSED])
@pytest.mark.parametrize("scale_shape", [(SEQ, BATCH, 1), (), (SEQ,)])
def test_per_token_scale_of_another_shape_is_refused_on_every_path(pg, path, scale_shape):
    # Unfused once broadcast a [s, b, 1] or 0-d scale and fused refused it: both refuse now.
    config = make_config("swiglu", torch.float32, path)
    mlp = build_mlp(config, pg)
    x = torch.randn(SEQ, BATCH, config.hidden_size)
    with pytest.raises(ValueError, match="per_token_scale of shape .* does not match"):
        mlp(x, per_token_scale=torch.rand(scale_shape))


@pytest.mark.parametrize("path", [UNFUSED, FUSED])
def test_clamp_beyond_the_dtype_range_bounds_nothing_finite(pg, path):
    """fp16 with clamp 1e5 (above fp16's 65504): every finite value is inside the clamp, so the
    layer computes plain SwiGLU; the unfused path once crashed at the first forward."""
    moe = moe_kwargs("swiglu_clamp")
    flags = dict(params_dtype=torch.float16, fp16=True, bf16=False, **moe)
    clamped = build_mlp(
        make_config("swiglu_clamp", torch.float16, path, **flags, activation_func_clamp_value=1e5),
        pg,
    )
    plain = build_mlp(make_config("swiglu", torch.float16, path, **flags), pg)
    randomize_(clamped, torch.float16, seed=3)
    plain.load_state_dict(clamped.state_dict())
    x = torch.randn(SEQ, BATCH, 24, dtype=torch.float16)
    with kernel_mode(path):
        out, _ = clamped(x.clone().requires_grad_())
        expected, _ = plain(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


class _ViewOfNewTensor(torch.autograd.Function):
    """Returns its input as a view made inside the Function, as Transformer Engine's linears do;
    autograd refuses to modify such an output in place."""

    @staticmethod
    def forward(ctx, x):
        return x.clone().view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.parametrize("path", [UNFUSED, FUSED])
@pytest.mark.parametrize("entry", ["swiglu", "quick_geglu_gpt_oss"])
def test_weighted_fc2_bias_is_added_out_of_place_and_rounded_once(pg, path, entry):
    """An expert's fc2 bias, weighted per token, joins an fc2 output that autograd forbids to
    modify in place (Transformer Engine's); the sum is taken in float32 and rounded once."""
    config = make_config(entry, torch.bfloat16, path, **moe_kwargs(entry))
    mlp = build_mlp(config, pg)
    randomize_(mlp, torch.bfloat16, seed=5)
    fc2_forward = mlp.linear_fc2.forward
    seen = {}

    def fc2_with_view_output(x):
        out, bias = fc2_forward(x)
        seen["out"], seen["bias"] = out.detach().clone(), bias.detach().clone()
        return _ViewOfNewTensor.apply(out), bias

    mlp.linear_fc2.forward = fc2_with_view_output
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(SEQ, BATCH, config.hidden_size, generator=gen).to(torch.bfloat16)
    scale = torch.rand(SEQ, BATCH, generator=gen)
    with kernel_mode(path):
        out, out_bias = mlp(x.requires_grad_(), per_token_scale=scale)
        out.float().sum().backward()
    assert out_bias is None
    # What upstream's in-place add computes on a tensor it may modify: the same bits.
    expected = seen["out"].clone()
    expected += seen["bias"].unsqueeze(0) * scale.unsqueeze(-1)
    assert torch.equal(out.detach(), expected)
    assert x.grad is not None and torch.isfinite(x.grad).all()
