"""TEFusedMLP / TEFusedMLPWithGroupedLinear on CPU, with a fake ``te`` and TE-free linears.

The fake ops (tests/unit_tests/extensions/fake_te.py) compute te-ops.md's formulas in torch, and
the CPU linears below stand in for the TE wrappers (same attributes, same math). That lets these
tests run the fused classes end to end on CPU in float64 and compare them with the unfused
``MLP`` on the same weights: output, input gradient and every weight gradient. Real-TE numerics
are in test_te_fused_mlp_gpu.py.

Also checked: the op chain and its parameter aliasing, identical state-dict keys (weights move
both ways), refusals of what no machine can compute at construction (never at the first
forward), recipes (a recipe this machine's GPU cannot run is refused at the first forward), hooks.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

import megatron.core.extensions.te_ops_adapters as te_ops_adapters
import megatron.core.extensions.te_recipes as te_recipes
import megatron.core.extensions.transformer_engine as te_ext
from megatron.core.extensions.te_recipes import TEFusedRecipeError
from megatron.core.transformer import mlp as mlp_module
from megatron.core.transformer.activation_spec import (
    ActivationSpec,
    UnsupportedActivationError,
    deinterleave_glu,
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.activation_catalog import CONFIGS, NEEDS_MOE
from tests.unit_tests.extensions.fake_te import (
    CpuColumnLinear,
    CpuLayerNormLinear,
    CpuRowLinear,
    install_fake_te,
    install_fake_te_with_cpu_linears,
    remove_te,
)
from tests.unit_tests.test_utilities import Utils


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    # The session keeps one process group alive; MLP then expects model parallelism set up.
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


HIDDEN, FFN = 64, 128
DTYPE = torch.float64

SUBMODULES = MLPSubmodules(linear_fc1=CpuLayerNormLinear, linear_fc2=CpuRowLinear)


@pytest.fixture
def fake_te(monkeypatch):
    """Fake TE 2.20.2; the fused classes accept the CPU linears as TE wrappers."""
    return install_fake_te_with_cpu_linears(monkeypatch)


def make_config(activation="swiglu_clamp", **overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=4,
        add_bias_linear=False,
        params_dtype=DTYPE,
        use_cpu_initialization=True,
        # fc1 weights ~N(0, 1): fc1 outputs have std ~8, so clamps and tanh scales are active.
        init_method=lambda w: torch.nn.init.normal_(w, 0.0, 1.0),
        **CONFIGS[activation],
    )
    if activation in NEEDS_MOE:
        kwargs["num_moe_experts"] = 4
    kwargs.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # moe_ffn_hidden_size defaulting
        return TransformerConfig(**kwargs)


def build(cls, config, submodules=SUBMODULES, **kwargs):
    return cls(config, submodules, ffn_hidden_size=config.ffn_hidden_size, **kwargs)


def _spec(config) -> ActivationSpec:
    return ActivationSpec.from_config(config)


def _lowers(activation, scaled) -> bool:
    """Whether TE can compute catalogue entry ``activation`` (decided by the lowering itself)."""
    try:
        te_ext.plan_te_activation(_spec(make_config(activation)), path="probe", scaled=scaled)
    except UnsupportedActivationError:
        return False
    return True


def _tolerance(config) -> float:
    # MLP computes tanh soft clamps (SiTU-GLU, tanh-clamped activations) in float32 even for
    # float64 inputs (activations.tanh_soft_clamp); everything else here is float64 on both sides.
    return 1e-5 if config.activation_func_tanh_clamp_scale is not None else 1e-10


def halves_layout(fc1_rows: torch.Tensor, interleave) -> torch.Tensor:
    """fc1 rows in TE's block-interleaved layout -> MLP's ``[gate; linear]`` rows."""
    if interleave is None:
        return fc1_rows
    gate, lin = deinterleave_glu(fc1_rows.transpose(0, -1), interleave)
    return torch.cat([gate, lin], dim=-1).transpose(0, -1)


def compare_with_mlp(fused, mlp, *, rows=(6, 3), fc1_interleave=None):
    """Same weights, same input: output, dx and every weight gradient must agree.

    ``fc1_interleave``: the fused module keeps fc1 block-interleaved in memory, so its fc1
    weight gradient is compared in MLP's layout.
    """
    tol = _tolerance(mlp.config)
    fused.load_state_dict(mlp.state_dict())
    x = torch.randn(*rows, HIDDEN, dtype=DTYPE)
    x_fused, x_mlp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_f, bias_f = fused(x_fused)
    out_m, bias_m = mlp(x_mlp)
    torch.testing.assert_close(out_f, out_m, rtol=tol, atol=tol)
    assert (bias_f is None) == (bias_m is None)
    # The caller adds a returned fc2 bias; include it so its gradient is compared too.
    if bias_m is not None:
        out_f, out_m = out_f + bias_f, out_m + bias_m
    grad = torch.randn_like(out_m)
    out_f.backward(grad)
    out_m.backward(grad)
    torch.testing.assert_close(x_fused.grad, x_mlp.grad, rtol=tol, atol=tol)
    grads_m = {n: p.grad for n, p in mlp.named_parameters()}
    for name, param in fused.named_parameters():
        if param.numel() == 0:
            continue  # the empty bias of a bias-free layer
        assert param.grad is not None, f"{name} got no gradient through the fused ops"
        grad = param.grad
        if name == "linear_fc1.weight":
            grad = halves_layout(grad, fc1_interleave)
        torch.testing.assert_close(grad, grads_m[name], rtol=tol, atol=tol, msg=name)


CATALOG = list(CONFIGS)

# ------------------------------------------------------------------------------ TEFusedMLP


@pytest.mark.parametrize("activation", CATALOG)
def test_te_fused_mlp_matches_mlp_or_refuses_at_construction(fake_te, activation):
    config = make_config(activation)
    if not _lowers(activation, scaled=False):
        with pytest.raises(UnsupportedActivationError, match="TEFusedMLP"):
            build(te_ext.TEFusedMLP, config)
        return
    torch.manual_seed(0)
    mlp = build(MLP, config)
    fused = build(te_ext.TEFusedMLP, config)
    compare_with_mlp(fused, mlp)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("bias", [False, True])
def test_te_fused_mlp_norm_and_bias_wiring(fake_te, normalization, bias):
    config = make_config("swiglu_clamp", normalization=normalization, add_bias_linear=bias)
    torch.manual_seed(1)
    mlp, fused = build(MLP, config), build(te_ext.TEFusedMLP, config)
    compare_with_mlp(fused, mlp)
    chain = fused._get_fused_impl()
    expected = [normalization, "BasicLinear"] + (["Bias"] if bias else [])
    assert chain.op_names == expected + ["ClampedSwiGLU", "BasicLinear"]
    # fc2's bias is returned to the caller (skip_bias_add), not added by the ops.
    assert (fused(torch.randn(2, HIDDEN, dtype=DTYPE))[1] is None) is (not bias)


def test_te_fused_mlp_without_norm(fake_te):
    config = make_config("swiglu")
    submodules = MLPSubmodules(linear_fc1=CpuColumnLinear, linear_fc2=CpuRowLinear)
    torch.manual_seed(2)
    mlp, fused = build(MLP, config, submodules), build(te_ext.TEFusedMLP, config, submodules)
    compare_with_mlp(fused, mlp)
    assert fused._get_fused_impl().op_names == ["BasicLinear", "SwiGLU", "BasicLinear"]


def test_ops_alias_parameters_and_stay_out_of_the_module(fake_te):
    config = make_config("swiglu_clamp", add_bias_linear=True)
    fused = build(te_ext.TEFusedMLP, config)
    keys = list(fused.state_dict())
    params = list(fused.parameters())
    chain = fused._get_fused_impl()
    norm, fc1, fc1_bias, activation, fc2 = chain.ops
    assert norm.weight is fused.linear_fc1.layer_norm_weight
    assert norm.bias is fused.linear_fc1.layer_norm_bias
    assert fc1.weight is fused.linear_fc1.weight and fc1_bias.bias is fused.linear_fc1.bias
    assert fc2.weight is fused.linear_fc2.weight
    assert activation.kwargs == dict(
        limit=1.5, alpha=1.0, glu_linear_offset=0.0, cache_quantized_input=False
    )
    assert fc1.kwargs["device"] == "meta" and fc1.kwargs["tensor_parallel_mode"] is None
    # The cache is a 1-tuple: never a submodule, never a state-dict or parameter source.
    assert isinstance(fused._fused_impl, tuple) and len(fused._fused_impl) == 1
    assert list(fused.state_dict()) == keys
    assert list(fused.parameters()) == params
    assert all(m is not chain for m in fused.modules())
    assert fused._get_fused_impl() is chain
    fused._reset_fused_impl()
    assert fused._get_fused_impl() is not chain


def test_state_dict_keys_match_mlp_and_weights_move_both_ways(fake_te):
    config = make_config("situ_glu", add_bias_linear=True)
    torch.manual_seed(3)
    mlp, fused = build(MLP, config), build(te_ext.TEFusedMLP, config)
    assert list(fused.state_dict()) == list(mlp.state_dict())
    compare_with_mlp(fused, mlp)  # MLP -> fused
    with torch.no_grad():
        for p in fused.parameters():
            p.add_(0.01 * torch.randn_like(p))
    mlp.load_state_dict(fused.state_dict())  # fused -> MLP
    x = torch.randn(4, HIDDEN, dtype=DTYPE)
    tol = _tolerance(config)
    torch.testing.assert_close(fused(x)[0], mlp(x)[0], rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "activation,overrides,version,error",
    [
        ("geglu_erf", {}, "2.20.2", UnsupportedActivationError),
        ("gelu", {}, "2.20.2", UnsupportedActivationError),
        ("situ_glu_gate_only", {}, "2.20.2", UnsupportedActivationError),
        ("geglu_clamp", {}, "2.20.2", UnsupportedActivationError),
        ("silu_tanh", {}, "2.20.2", UnsupportedActivationError),
        ("squared_relu_tanh", {}, "2.20.2", UnsupportedActivationError),
        ("swiglu_clamp", {}, "2.16.0", te_ext.TEVersionError),
        ("situ_glu", {}, "2.19.0", te_ext.TEVersionError),
        ("silu", {}, "2.7.0", te_ext.TEVersionError),
    ],
)
def test_te_fused_mlp_refuses_at_construction(
    fake_te, monkeypatch, activation, overrides, version, error
):
    install_fake_te(monkeypatch, version=version)
    config = make_config(activation, **overrides)
    built = []
    monkeypatch.setattr(
        te_ext.TEFusedMLP, "_make_fused_impl", lambda self: built.append(self) or None
    )
    with pytest.raises(error) as info:
        build(te_ext.TEFusedMLP, config)
    assert "TEFusedMLP" in str(info.value) and _spec(config).name in str(info.value)
    assert not built, "the refusal must come from __init__, before any op is built"
    if error is te_ext.TEVersionError:
        assert isinstance(info.value, RuntimeError)  # upstream's exception type for old TE


def test_te_fused_mlp_needs_te(monkeypatch):
    remove_te(monkeypatch)
    with pytest.raises(ImportError, match="TEFusedMLP.*transformer-engine"):
        build(te_ext.TE_ONLY_CLASSES["TEFusedMLP"], make_config("swiglu"))
    install_fake_te(monkeypatch, version="1.12.0")
    with pytest.raises(RuntimeError, match="1.13"):
        build(te_ext.TEFusedMLP, make_config("swiglu"))


def test_te_fused_mlp_requires_te_linears(fake_te):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = make_config("swiglu")
    local = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    with pytest.raises(
        ValueError, match=r"FC1 \(linear_fc1\) to be a TELayerNormColumnParallelLinear"
    ):
        build(te_ext.TEFusedMLP, config, local)
    te_fc1 = MLPSubmodules(linear_fc1=CpuLayerNormLinear, linear_fc2=RowParallelLinear)
    with pytest.raises(ValueError, match=r"FC2 \(linear_fc2\) to be a TERowParallelLinear"):
        build(te_ext.TEFusedMLP, config, te_fc1)


def test_te_fused_mlp_refuses_per_token_scale(fake_te):
    fused = build(te_ext.TEFusedMLP, make_config("swiglu"))
    with pytest.raises(ValueError, match="per_token_scale"):
        fused(torch.randn(2, HIDDEN, dtype=DTYPE), per_token_scale=torch.ones(2, dtype=DTYPE))


def fake_tp_group(monkeypatch, size=2):
    """A stand-in process group of ``size`` ranks that MLP keeps and ``get_pg_size`` reports."""
    group = object()
    # The op builders (te_ops_adapters) size the group, for the TP context and BasicLinear.
    monkeypatch.setattr(te_ops_adapters, "get_pg_size", lambda g=None: size if g is group else 1)
    monkeypatch.setattr(
        mlp_module, "get_tensor_model_parallel_group_if_none", lambda tp_group, **kw: tp_group
    )
    return group


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_te_fused_mlp_tensor_parallel_chain(fake_te, monkeypatch, sequence_parallel):
    group = fake_tp_group(monkeypatch)
    config = make_config("swiglu_clamp", add_bias_linear=True)
    fused = build(te_ext.TEFusedMLP, config, tp_group=group)
    fused.linear_fc1.sequence_parallel = sequence_parallel
    fused.linear_fc2.sequence_parallel = sequence_parallel
    fused.linear_fc2.te_return_bias = False
    chain = fused._get_fused_impl()
    reduce_op = "ReduceScatter" if sequence_parallel else "AllReduce"
    assert chain.op_names == [
        "LayerNorm",
        "BasicLinear",
        "Bias",
        "ClampedSwiGLU",
        "BasicLinear",
        reduce_op,
        "Bias",
    ]
    fc1, fc2, reduce = chain.ops[1], chain.ops[4], chain.ops[5]
    # BasicLinear takes global sizes: the column split is multiplied back.
    assert fc1.args == (HIDDEN, 2 * 2 * FFN)
    assert fc1.kwargs["tensor_parallel_mode"] == "column"
    assert fc1.kwargs["tensor_parallel_group"] is group
    assert fc1.kwargs["sequence_parallel"] is sequence_parallel
    assert fc2.kwargs["tensor_parallel_mode"] is None and fc2.args == (FFN, HIDDEN)
    assert reduce.args == (group,)


# ---------------------------------------------------------------------------------- hooks


def test_userbuffers_overlap_is_passed_to_the_ops(fake_te):
    # A TE linear built with tp_comm_overlap carries its buffer name (ub_name); the fused ops
    # must overlap the same way rather than silently run without it.
    fused = build(te_ext.TEFusedMLP, make_config("swiglu"))
    fused.linear_fc1.config = SimpleNamespace(tp_comm_overlap=True)
    fused.linear_fc1.ub_name = "fc1"
    fused.linear_fc2.config = SimpleNamespace(tp_comm_overlap=True)
    fused.linear_fc2.ub_name = None  # no buffer for this one: nothing to pass
    chain = fused._get_fused_impl()
    fc1, fc2 = [op for op in chain.ops if op.name == "BasicLinear"]
    assert fc1.kwargs["userbuffers_options"] == {"comm_name": "fc1"}
    assert "userbuffers_options" not in fc2.kwargs


def test_userbuffers_overlap_on_a_te_without_the_option_is_refused(fake_te, monkeypatch):
    # A TE whose ops.BasicLinear predates the keyword; the check runs at construction
    # (TEFusedMLP.__init__ calls _check_fused_linears), here after setting the overlap.
    def older_init(self, in_features, out_features, *, device=None, dtype=None):
        pass

    monkeypatch.setattr(
        fake_te.pytorch.ops, "BasicLinear", type("BasicLinear", (), {"__init__": older_init})
    )
    fused = build(te_ext.TEFusedMLP, make_config("swiglu"))
    fused.linear_fc1.config = SimpleNamespace(tp_comm_overlap=True)
    fused.linear_fc1.ub_name = "fc1"
    with pytest.raises(RuntimeError, match="tp_comm_overlap=True.*userbuffers_options"):
        fused._check_fused_linears()


def test_forward_pre_hooks_of_submodules_are_replayed(fake_te):
    fused = build(te_ext.TEFusedMLP, make_config("swiglu"))
    calls = []
    fused.linear_fc1.register_forward_pre_hook(lambda m, args: calls.append(args))
    with pytest.warns(UserWarning, match="replaying pre-forward hook"):
        fused(torch.randn(2, HIDDEN, dtype=DTYPE))
    fused(torch.randn(2, HIDDEN, dtype=DTYPE))
    assert calls == [(), ()]


def test_pre_hook_returning_a_value_is_refused(fake_te):
    fused = build(te_ext.TEFusedMLP, make_config("swiglu"))
    fused.linear_fc2.register_forward_pre_hook(lambda m, args: (torch.zeros(1),))
    with pytest.raises(RuntimeError, match="returned a value"):
        fused(torch.randn(2, HIDDEN, dtype=DTYPE))


def test_backward_hooks_on_submodules_are_refused(fake_te):
    fused = build(te_ext.TEFusedMLP, make_config("swiglu"))
    fused.linear_fc1.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(RuntimeError, match="backward hooks"):
        fused(torch.randn(2, HIDDEN, dtype=DTYPE))


def test_forward_post_hooks_are_replayed_with_a_warning(fake_te):
    fused = build(te_ext.TEFusedMLP, make_config("swiglu"))
    calls = []
    fused.linear_fc2.register_forward_hook(lambda m, args, out: calls.append((args, out)))
    with pytest.warns(UserWarning, match="forward hooks"):
        fused(torch.randn(2, HIDDEN, dtype=DTYPE))
    assert calls == [((), None)]


# --------------------------------------------------------------- TEFusedMLPWithGroupedLinear

GROUPED = te_ext.TE_ONLY_CLASSES["TEFusedMLPWithGroupedLinear"]  # None as te_ext.<name> w/o TE


@pytest.fixture
def unquantized(monkeypatch):
    monkeypatch.setenv("FP4_RECIPE", "none")


@pytest.mark.parametrize("activation", CATALOG)
def test_grouped_matches_mlp_or_refuses_at_construction(fake_te, unquantized, activation):
    config = make_config(activation)
    if not _lowers(activation, scaled=True):
        with pytest.raises(UnsupportedActivationError, match="TEFusedMLPWithGroupedLinear"):
            build(GROUPED, config)
        return
    torch.manual_seed(4)
    mlp, fused = build(MLP, config), build(GROUPED, config)
    compare_with_mlp(fused, mlp)
    chain = fused._get_fused_impl()
    assert chain.op_names[0] == chain.op_names[2] == "GroupedLinear"
    assert chain.ops[0].weight0 is fused.linear_fc1.weight
    assert chain.ops[2].weight0 is fused.linear_fc2.weight
    assert chain.ops[1]._grouped_mlp_unit_activation_scale is True
    assert fused._norm_seq[0].op_names == ["LayerNorm"]


def test_grouped_clamp_builds_scaled_clamped_qgeglu(fake_te, unquantized):
    fused = build(GROUPED, make_config("swiglu_clamp"))
    activation = fused._get_fused_impl().ops[1]
    assert type(activation).__name__ == "ScaledClampedQGeGLU"
    assert activation.kwargs == dict(
        glu_interleave_size=None, limit=1.5, alpha=1.0, glu_linear_offset=0.0
    )


def test_grouped_interleaved_fc1_keeps_mlp_state_dict_layout(fake_te, unquantized):
    config = make_config("swiglu_clamp")
    torch.manual_seed(5)
    mlp = build(MLP, config)
    fused = build(GROUPED, config, glu_interleave_size=32)
    assert fused._get_fused_impl().ops[1].kwargs["glu_interleave_size"] == 32
    # Loads MLP's [gate; linear] weights into the interleaved fc1.
    compare_with_mlp(fused, mlp, fc1_interleave=32)
    # In memory fc1 is block-interleaved; the state dict is MLP's layout again.
    w_mlp, w_fused = mlp.linear_fc1.weight, fused.linear_fc1.weight
    assert not torch.equal(w_fused, w_mlp)
    assert torch.equal(w_fused[32:64], w_mlp[FFN : FFN + 32])  # first linear block
    for key, value in fused.state_dict().items():
        torch.testing.assert_close(value, mlp.state_dict()[key], rtol=0, atol=0, msg=key)
    mlp.load_state_dict(fused.state_dict())
    torch.testing.assert_close(mlp.linear_fc1.weight, w_mlp, rtol=0, atol=0)


def test_grouped_interleave_must_divide_ffn(fake_te, unquantized):
    with pytest.raises(ValueError, match="must divide the per-rank FFN width"):
        build(GROUPED, make_config("swiglu", ffn_hidden_size=112), glu_interleave_size=32)
    with pytest.raises(UnsupportedActivationError, match="multiple of 32"):
        build(GROUPED, make_config("swiglu"), glu_interleave_size=16)


def test_grouped_construction_checks(fake_te, unquantized, monkeypatch):
    with pytest.raises(ValueError, match="add_bias_linear"):
        build(GROUPED, make_config("swiglu", add_bias_linear=True))
    install_fake_te(monkeypatch, version="2.13.0")
    with pytest.raises(RuntimeError, match="2.14"):
        build(GROUPED, make_config("swiglu"))


def test_grouped_asks_the_public_world_size_as_upstream_and_hands_over_to_tefusedmlp(
    fake_te, unquantized, monkeypatch
):
    # With parallel_state's group, the tensor-parallel size is asked of the public function at
    # each call, as upstream's class asks it; a patch of it there sends forward to TEFusedMLP's.
    fused = build(GROUPED, make_config("swiglu"))
    calls = []

    def base_forward(self, hidden_states, **kwargs):
        calls.append(kwargs)
        return "TEFusedMLP.forward", None

    monkeypatch.setattr(te_ext.TEFusedMLP, "forward", base_forward)
    monkeypatch.setattr(te_ext, "get_tensor_model_parallel_world_size", lambda: 2)
    x = torch.randn(3, HIDDEN, dtype=DTYPE)
    assert fused(x, flag=True) == ("TEFusedMLP.forward", None)
    assert calls == [{"flag": True}]
    monkeypatch.setattr(te_ext, "get_tensor_model_parallel_world_size", lambda: 1)
    out, bias = fused(x)
    assert out.shape == x.shape and bias is None and len(calls) == 1


def test_grouped_ops_are_made_under_the_recipe_and_hooked_once(fake_te, unquantized, monkeypatch):
    fused = build(GROUPED, make_config("swiglu"))
    hooked = []
    original = type(fused)._register_hooks_on_fused_impl

    def spy(self, ops, **kwargs):
        hooked.append(ops)
        return original(self, ops, **kwargs)

    monkeypatch.setattr(type(fused), "_register_hooks_on_fused_impl", spy)
    x = torch.randn(3, HIDDEN, dtype=DTYPE)
    fused(x)
    fused(x)
    assert hooked == [fused._get_fused_impl()]
    assert fused._recipe is None  # "none": made once, kept under upstream's attribute name


def test_grouped_default_recipe_is_refused_at_the_first_forward_without_mxfp8(fake_te):
    # Upstream's default is MXFP8. Not having it is a property of the machine, not of the config:
    # the model builds (on a CPU, the meta device, any GPU) and the first forward refuses.
    fused = build(GROUPED, make_config("swiglu"))
    assert fused.fused_recipe_name == "mxfp8"
    x = torch.randn(3, HIDDEN, dtype=DTYPE)
    for _ in range(2):  # and every forward after it: a refusal is not remembered as a pass
        with pytest.raises(te_ext.TEFusedRecipeError) as info:
            fused(x)
        message = str(info.value)
        assert message.startswith("TEFusedMLPWithGroupedLinear: the 'mxfp8' recipe")
        assert "fake: no MXFP8" in message and "te_fused_recipe='none'" in message
    assert te_ext.te.records.model_init == [] and te_ext.te.records.autocast == []


def test_grouped_recipe_falls_back_to_the_compute_capability(fake_te, monkeypatch):
    # A TE without is_mxfp8_available: the GPU's compute capability decides, at the first forward.
    del te_ext.te.pytorch.is_mxfp8_available
    monkeypatch.setenv("FP4_RECIPE", "mxfp8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capability = [(9, 0)]
    probes = []

    def get_device_capability(device=None):
        probes.append(device)
        return capability[0]

    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    fused = build(GROUPED, make_config("swiglu"))
    assert probes == []  # construction never asks the GPU
    x = torch.randn(3, HIDDEN, dtype=DTYPE)
    with pytest.raises(te_ext.TEFusedRecipeError, match="compute capability 10.0.*this GPU is 9.0"):
        fused(x)
    capability[0] = (10, 0)  # e.g. the model moved to a B200
    fused(x)
    fused(x)
    assert len(probes) == 2  # once per refusal, then once for the forward that passed
    assert [r.kind for r in te_ext.te.records.autocast] == ["mxfp8", "mxfp8"]


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_grouped_runs_under_the_chosen_recipe(fake_te, monkeypatch, recipe):
    fake = install_fake_te(monkeypatch, mxfp8=True, nvfp4=True)
    monkeypatch.setenv("FP4_RECIPE", recipe)
    fused = build(GROUPED, make_config("swiglu_clamp"))
    assert fused.fused_recipe_name == recipe
    fused(torch.randn(3, HIDDEN, dtype=DTYPE))
    assert [r.kind for r in fake.records.model_init] == [recipe]
    assert [r.kind for r in fake.records.autocast] == [recipe]


def test_grouped_unquantized_uses_no_recipe_context(fake_te, unquantized):
    fake = te_ext.te
    fused = build(GROUPED, make_config("swiglu"))
    fused(torch.randn(3, HIDDEN, dtype=DTYPE))
    assert fake.records.model_init == [] and fake.records.autocast == []


def test_grouped_tensor_parallel_runs_te_fused_mlp_ops(fake_te, unquantized, monkeypatch):
    group = fake_tp_group(monkeypatch)
    config = make_config("swiglu_clamp")
    fused = build(GROUPED, config, tp_group=group)
    assert fused._grouped_te_activation is None
    assert fused._te_activation.op_name == "ClampedSwiGLU"
    assert "BasicLinear" in fused._get_fused_impl().op_names


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_grouped_tensor_parallel_refuses_a_quantized_recipe_it_would_not_apply(
    fake_te, monkeypatch, recipe
):
    group = fake_tp_group(monkeypatch)
    config = make_config("swiglu")
    config.te_fused_recipe = recipe
    with pytest.raises(TEFusedRecipeError, match=f"te_fused_recipe='{recipe}'.*tensor-parallel"):
        build(GROUPED, config, tp_group=group)


@pytest.mark.parametrize("recipe", [None, "none"])
def test_grouped_tensor_parallel_accepts_an_unset_or_unquantized_recipe(
    fake_te, monkeypatch, recipe
):
    # FP4_RECIPE (upstream's process-wide switch) and the default stay accepted at TP > 1, as
    # upstream accepts them: other layers of the same process may run at TP = 1.
    monkeypatch.setenv("FP4_RECIPE", "mxfp8")
    group = fake_tp_group(monkeypatch)
    config = make_config("swiglu")
    config.te_fused_recipe = recipe
    fused = build(GROUPED, config, tp_group=group)
    assert fused._grouped_te_activation is None


def test_grouped_tensor_parallel_refuses_scaled_only_activations(fake_te, unquantized, monkeypatch):
    group = fake_tp_group(monkeypatch)
    with pytest.raises(UnsupportedActivationError, match="tensor-parallel"):
        build(GROUPED, make_config("squared_relu_tanh"), tp_group=group)


def test_grouped_replays_pre_hooks_before_the_norm(fake_te, unquantized):
    fused = build(GROUPED, make_config("swiglu"))
    calls = []
    fused.linear_fc1.register_forward_pre_hook(lambda m, args: calls.append("fc1 pre-hook"))
    with pytest.warns(UserWarning, match="replaying pre-forward hook"):
        fused(torch.randn(2, HIDDEN, dtype=DTYPE))
    fused._norm_seq[0].register_forward_hook(lambda *args: calls.append("norm"))
    fused(torch.randn(2, HIDDEN, dtype=DTYPE))
    assert calls == ["fc1 pre-hook", "fc1 pre-hook", "norm"]


def test_grouped_refuses_per_token_scale(fake_te, unquantized):
    fused = build(GROUPED, make_config("swiglu"))
    with pytest.raises(ValueError, match="per_token_scale"):
        fused(torch.randn(2, HIDDEN, dtype=DTYPE), per_token_scale=torch.ones(2, dtype=DTYPE))


# --------------------------------------------------------------------------------- recipes


def test_recipe_resolution_order(fake_te, monkeypatch):
    monkeypatch.setattr(te_recipes, "_recipe_available", lambda name: (True, ""))
    resolve = te_ext.resolve_fused_recipe
    assert resolve({}) == "mxfp8"  # upstream's default
    assert resolve({"FP4_RECIPE": "nvfp4"}) == "nvfp4"  # upstream's switch
    assert resolve({"FP4_RECIPE": " None "}) == "none"
    assert resolve({"FP4_RECIPE": ""}) == "mxfp8"
    monkeypatch.setenv("FP4_RECIPE", "nvfp4")
    assert resolve(SimpleNamespace(te_fused_recipe="none")) == "none"  # config wins
    assert resolve(SimpleNamespace(te_fused_recipe=None)) == "nvfp4"
    assert resolve(None) == "nvfp4"


def test_unknown_recipe_is_refused(fake_te):
    with pytest.raises(te_ext.TEFusedRecipeError, match="unknown quantization recipe 'fp8'"):
        te_ext.resolve_fused_recipe({"FP4_RECIPE": "fp8"}, path="P")


def test_unavailable_recipe_names_the_fix(fake_te):
    config = SimpleNamespace(te_fused_recipe="nvfp4")
    with pytest.raises(te_ext.TEFusedRecipeError) as info:
        te_ext.resolve_fused_recipe(config, path="P", check_available=True)
    message = str(info.value)
    assert "P:" in message and "fake: no NVFP4" in message and "'none'" in message
    assert "(from config.te_fused_recipe)" in message
    # The hardware is asked only when asked for: the fused classes do it at the first forward.
    assert te_ext.resolve_fused_recipe(config, path="P") == "nvfp4"
    with pytest.raises(te_ext.TEFusedRecipeError, match="P: the 'nvfp4' recipe cannot run"):
        te_recipes.check_fused_recipe_runs_here("nvfp4", path="P")
    te_recipes.check_fused_recipe_runs_here("none", path="P")  # unquantized runs anywhere


def test_make_fused_recipe(fake_te):
    assert te_ext.make_fused_recipe("none") is None
    assert te_ext.make_fused_recipe("mxfp8").kind == "mxfp8"
    assert te_ext.make_fused_recipe("nvfp4").kind == "nvfp4"


def test_te_fused_mlp_is_not_refused_by_the_fc2_chunks_option(fake_te, monkeypatch):
    """The op chain runs fc2 once on the whole input: the option, which an ``MLP`` on the same
    config (unfused path) refuses, does not reach it."""
    from mcore_activations.fusions import fc2_chunks
    from mcore_activations.fusions.in_place import use_in_place_backward
    from mcore_activations.fusions.output_recompute import use_recompute_output

    config = make_config("swiglu", bias_activation_fusion=False)
    monkeypatch.setattr(fc2_chunks, "_default", 2)
    with use_in_place_backward(True), use_recompute_output(True):
        with pytest.raises(ValueError, match="fc2_chunks=2"):
            build(MLP, config)
        build(te_ext.TEFusedMLP, config)
