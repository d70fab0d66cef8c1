"""TEGroupedMLP's unfused paths vs float64, its GLU interleave, and its TE op wiring on CPU.

Transformer Engine's GroupedLinear needs a GPU, so the grouped linears here are
:class:`LocalGroupedLinear`, a CPU test double with the same construction and forward contract
(expert ``i``'s weight is ``weight<i>``; ``forward(x, m_splits) -> (out, bias)``). The fused
op-sequence path is checked structurally with fake ``te`` objects; its numerics are GPU-tier.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import megatron.core.transformer.moe.experts as experts_module
from mcore_activations import te_import
from mcore_activations.reference_mlp import reference_experts
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.activation_spec import (
    ActivationSpec,
    UnsupportedActivationError,
    deinterleave_glu,
    interleave_glu,
)
from megatron.core.transformer.mlp import FUSED_KERNEL_PATH, TE_MODULE_PATH, UNFUSED_PATH
from megatron.core.transformer.moe.experts import (
    GroupedMLPSubmodules,
    InferenceGroupedMLP,
    TEGroupedMLP,
    _remove_glu_interleaving,
)
from tests.unit_tests.activation_catalog import SPECS
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

HIDDEN, EXPERT_FFN = 24, 40
TOKENS_PER_EXPERT = [7, 2, 0, 5]
NUM_EXPERTS = len(TOKENS_PER_EXPERT)
INTERLEAVE = 8  # 2 * EXPERT_FFN = 80 columns = 5 [gate(8), linear(8)] pairs

# Activation paths of TEGroupedMLP beyond mlp_test_utils' unfused / fused / compiled.
TE_MODULE = "te_module"  # use_te_activation_func with a TE activation module (a fake here)
WEIGHTED_SRELU = "weighted_srelu"  # use_fused_weighted_squared_relu


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


@pytest.fixture
def pg():
    return ProcessGroupCollection.use_mpu_process_groups(["ep", "expt_tp"])


class LocalGroupedLinear(torch.nn.Module):
    """CPU test double of a grouped linear: one ``[out, in]`` weight per expert.

    Built and called like ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``.
    ``forward`` splits the rows of ``x`` by ``m_splits`` and applies expert ``i``'s weight to
    chunk ``i``. With ``skip_bias_add`` it returns the per-expert biases instead of adding them.
    """

    def __init__(
        self,
        num_gemms,
        input_size,
        output_size,
        *,
        config,
        init_method,
        bias,
        skip_bias_add,
        is_expert,
        tp_comm_buffer_name=None,
        pg_collection=None,
        name=None,
    ):
        super().__init__()
        assert is_expert
        self.num_gemms, self.skip_bias_add, self.use_bias, self.name = (
            num_gemms,
            skip_bias_add,
            bias,
            name,
        )
        for index in range(num_gemms):
            weight = torch.empty(output_size, input_size, dtype=config.params_dtype)
            init_method(weight)
            setattr(self, f"weight{index}", torch.nn.Parameter(weight))
            if bias:
                zeros = torch.zeros(output_size, dtype=config.params_dtype)
                setattr(self, f"bias{index}", torch.nn.Parameter(zeros))

    def weights(self):
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def biases(self):
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else None

    def forward(self, x, m_splits):
        biases = self.biases() or [None] * self.num_gemms
        pieces = []
        for chunk, weight, bias in zip(torch.split(x, m_splits), self.weights(), biases):
            pieces.append(F.linear(chunk, weight, None if self.skip_bias_add else bias))
        out = torch.cat(pieces)
        return out, (self.biases() if self.skip_bias_add else None)

    def backward_dw(self):
        pass


class FakeTEActivation(torch.nn.Module):
    """Stands in for TE's activation module: the plain formula on the two-halves layout."""

    def __init__(self, config):
        super().__init__()
        self.spec = ActivationSpec.from_config(config)

    def forward(self, x):
        return self.spec.reference(x, dtype=x.dtype)


def path_kwargs(path: str) -> dict:
    if path == TE_MODULE:
        return dict(use_te_activation_func=True)
    if path == WEIGHTED_SRELU:
        return dict(use_fused_weighted_squared_relu=True)
    return {}


def moe_kwargs(interleave=None, **extra) -> dict:
    kwargs = dict(
        num_moe_experts=8,
        moe_ffn_hidden_size=EXPERT_FFN,
        moe_grouped_gemm=True,
        moe_mlp_glu_interleave_size=interleave,
    )
    kwargs.update(extra)
    return kwargs


def config_path(path):
    # The TE-module and weighted squared-ReLU paths are chosen by their own flags.
    return UNFUSED if path in (TE_MODULE, WEIGHTED_SRELU) else path


def build(entry, dtype, path, pg, interleave=None, **extra) -> TEGroupedMLP:
    config = make_config(
        entry, dtype, config_path(path), **moe_kwargs(interleave, **path_kwargs(path), **extra)
    )
    submodules = GroupedMLPSubmodules(
        linear_fc1=LocalGroupedLinear,
        linear_fc2=LocalGroupedLinear,
        activation_func=FakeTEActivation if path == TE_MODULE else None,
    )
    return TEGroupedMLP(NUM_EXPERTS, config, submodules, pg_collection=pg)


def randomize_(layer: TEGroupedMLP, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for index in range(NUM_EXPERTS):
        fill_weights_(getattr(layer.linear_fc1, f"weight{index}"), HIDDEN, PRE_ACTIVATION_STD, gen)
        fc2_weight = getattr(layer.linear_fc2, f"weight{index}")
        fill_weights_(fc2_weight, fc2_weight.shape[1], 1.0, gen)
        # fc1 adds its own bias, so the bf16 anchor below includes it: random in every dtype.
        fill_bias_(getattr(layer.linear_fc1, f"bias{index}", None), 0.5, gen)
        fill_bias_(getattr(layer.linear_fc2, f"bias{index}", None), 0.5, gen)


def check_against_reference(layer: TEGroupedMLP, dtype, path, seed=0):
    randomize_(layer, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = sum(TOKENS_PER_EXPERT)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(tokens, generator=gen).requires_grad_()
    grad = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    fc1_output = capture_output(layer.linear_fc1)

    with kernel_mode(config_path(path)):
        out, bias = layer(x, torch.tensor(TOKENS_PER_EXPERT), probs)
        out.backward(grad)
    assert bias is None and out.shape == x.shape and out.dtype == dtype

    spec = layer.activation_spec  # carries the interleaved layout of fc1's output
    what = f"TEGroupedMLP[{spec.name}, {path}, {DTYPE_IDS[dtype]}]"
    params = dict(layer.named_parameters())
    ref = {name: leaf64(p) for name, p in params.items()}
    x64, probs64 = leaf64(x), leaf64(probs)
    layer_fc1 = torch.split(fc1_output["out"], TOKENS_PER_EXPERT)
    pre_activations = []

    def at(index, pre):
        bias = ref.get(f"linear_fc1.bias{index}")  # fc1 adds it: the anchor includes it
        pre = pre if bias is None else pre + bias
        if dtype != torch.float32:
            assert_close_to_reference(layer_fc1[index], pre, dtype, f"{what} fc1 output")
            pre = anchored(pre, layer_fc1[index])
        pre_activations.append(pre)
        return pre

    experts = [
        dict(
            fc1_weight=ref[f"linear_fc1.weight{index}"],
            fc2_weight=ref[f"linear_fc2.weight{index}"],
            fc2_bias=ref.get(f"linear_fc2.bias{index}"),
        )
        for index in range(len(TOKENS_PER_EXPERT))
    ]
    expected = reference_experts(x64, TOKENS_PER_EXPERT, experts, spec, probs64, at)
    assert_clamps_active(spec, torch.cat(pre_activations))
    expected.backward(grad.double())

    assert_close_to_reference(out, expected, dtype, f"{what} output")
    assert_close_to_reference(x.grad, x64.grad, dtype, f"{what} dx")
    assert_close_to_reference(probs.grad, probs64.grad, dtype, f"{what} dprobs")
    assert_grads_match(params, ref, dtype, what)


# --------------------------------------------------------------------------------- numerics

ENTRIES = [
    "swiglu",
    "swiglu_clamp",
    "situ_glu",
    "situ_glu_gate_only",
    "geglu",
    "geglu_erf",
    "reglu",
    "quick_geglu_gpt_oss",
    "gelu",
    "silu_tanh",
    "squared_relu",
]


def _cases():
    cases = []
    for entry in ENTRIES:
        for path in (UNFUSED, FUSED):
            if not config_accepts(entry, path, **moe_kwargs()):
                continue
            for interleave in (None, INTERLEAVE) if SPECS[entry].gated else (None,):
                tag = f"{entry}-{path}" + (f"-il{interleave}" if interleave else "")
                cases.append(pytest.param(entry, path, interleave, id=tag))
    for entry in ("squared_relu", "squared_relu_tanh"):
        cases.append(pytest.param(entry, WEIGHTED_SRELU, None, id=f"{entry}-{WEIGHTED_SRELU}"))
    for entry, interleave in (("swiglu", INTERLEAVE), ("geglu_erf", INTERLEAVE), ("relu", None)):
        tag = f"{entry}-{TE_MODULE}" + (f"-il{interleave}" if interleave else "")
        cases.append(pytest.param(entry, TE_MODULE, interleave, id=tag))
    return cases


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("entry, path, interleave", _cases())
def test_matches_reference(pg, entry, path, interleave, dtype):
    layer = build(entry, dtype, path, pg, interleave=interleave)
    expected_path = {
        UNFUSED: UNFUSED_PATH,
        FUSED: FUSED_KERNEL_PATH,
        WEIGHTED_SRELU: FUSED_KERNEL_PATH,
        TE_MODULE: TE_MODULE_PATH,
    }[path]
    assert layer.activation_path == expected_path
    assert layer.activation_spec.glu_interleave_size == interleave
    check_against_reference(layer, dtype, path)


def test_compiled_kernels_match_reference(pg):
    layer = build("swiglu_clamp", torch.bfloat16, COMPILED, pg, interleave=INTERLEAVE)
    check_against_reference(layer, torch.bfloat16, COMPILED)


@pytest.mark.parametrize("path", [UNFUSED, FUSED])
def test_without_bias(pg, path):
    layer = build("swiglu_clamp", torch.float32, path, pg, INTERLEAVE, add_bias_linear=False)
    check_against_reference(layer, torch.float32, path)


@pytest.mark.parametrize("path", [UNFUSED, FUSED])
def test_ffn_not_multiple_of_32(pg, path):
    layer = build("situ_glu", torch.float32, path, pg, INTERLEAVE, moe_ffn_hidden_size=112)
    assert layer.linear_fc1.weight0.shape == (224, HIDDEN)
    check_against_reference(layer, torch.float32, path)


def test_probs_applied_on_input(pg):
    layer = build(
        "swiglu",
        torch.float32,
        UNFUSED,
        pg,
        moe_apply_probs_on_input=True,
        moe_router_topk=1,
        moe_router_score_function="sigmoid",
    )
    randomize_(layer, seed=2)
    x, probs = torch.randn(14, HIDDEN), torch.rand(14)
    out, _ = layer(x, TOKENS_PER_EXPERT, probs)
    expected, _ = layer(x * probs.unsqueeze(-1), TOKENS_PER_EXPERT, torch.ones(14))
    assert_close_to_reference(out, expected, torch.float32, "probs on input")


# ------------------------------------------------------------------- layout and construction


@pytest.mark.parametrize("block", [1, 4, 8, 20])
def test_remove_glu_interleaving(block):
    gate, lin = torch.randn(3, 40), torch.randn(3, 40)
    interleaved = interleave_glu(gate, lin, block)
    halves = _remove_glu_interleaving(interleaved, block)
    torch.testing.assert_close(halves, torch.cat([gate, lin], dim=-1), rtol=0, atol=0)
    assert torch.equal(torch.cat(deinterleave_glu(interleaved, block), -1), halves)
    assert TEGroupedMLP._remove_glu_interleaving is _remove_glu_interleaving


def test_remove_glu_interleaving_rejects_a_partial_block():
    with pytest.raises(ValueError, match="glu_interleave_size=16"):
        _remove_glu_interleaving(torch.randn(2, 80), 16)


def test_grouped_linears_are_built_per_expert(pg):
    config = make_config("swiglu", torch.float32, UNFUSED, **moe_kwargs(moe_latent_size=12))
    submodules = GroupedMLPSubmodules(linear_fc1=LocalGroupedLinear, linear_fc2=LocalGroupedLinear)
    layer = TEGroupedMLP(NUM_EXPERTS, config, submodules, pg_collection=pg, name="experts")
    assert layer.use_latent and layer.tp_group is pg.expt_tp and layer.ep_group is pg.ep
    assert layer.linear_fc1.weight0.shape == (2 * EXPERT_FFN, 12)
    assert layer.linear_fc2.weight3.shape == (12, EXPERT_FFN)
    assert not layer.linear_fc1.skip_bias_add and layer.linear_fc2.skip_bias_add
    assert layer.linear_fc1.name == "experts.linear_fc1"


def test_bias_with_bias_dropout_fusion_is_refused(pg):
    with pytest.raises(AssertionError, match="bias_dropout_fusion"):
        build("swiglu", torch.float32, UNFUSED, pg, bias_dropout_fusion=True)


def test_custom_callable_runs_unfused_and_is_refused_fused(pg):
    def softsign(x):
        return x / (1.0 + x.abs())

    layer = build("swiglu", torch.float32, UNFUSED, pg, INTERLEAVE, activation_func=softsign)
    assert layer.activation_path == UNFUSED_PATH
    check_against_reference(layer, torch.float32, UNFUSED)

    config = make_config("swiglu", torch.float32, FUSED, **moe_kwargs())
    config.activation_func = softsign  # edited after validation
    submodules = GroupedMLPSubmodules(linear_fc1=LocalGroupedLinear, linear_fc2=LocalGroupedLinear)
    with pytest.raises(UnsupportedActivationError, match="TEGroupedMLP"):
        TEGroupedMLP(NUM_EXPERTS, config, submodules, pg_collection=pg)


def test_inference_grouped_mlp_computes_the_same(pg):
    config = make_config("swiglu_clamp", torch.float32, FUSED, **moe_kwargs(INTERLEAVE))
    submodules = GroupedMLPSubmodules(linear_fc1=LocalGroupedLinear, linear_fc2=LocalGroupedLinear)
    training = TEGroupedMLP(NUM_EXPERTS, config, submodules, pg_collection=pg)
    inference = InferenceGroupedMLP(NUM_EXPERTS, config, submodules, pg_collection=pg)
    randomize_(training, seed=1)
    inference.load_state_dict(training.state_dict())
    x, probs = torch.randn(14, HIDDEN), torch.rand(14)
    torch.testing.assert_close(
        inference(x, TOKENS_PER_EXPERT, probs)[0], training(x, TOKENS_PER_EXPERT, probs)[0]
    )


# ---------------------------------------------------------------- TE op sequence (fakes)


def test_op_fuser_without_te_is_refused(pg, monkeypatch):
    monkeypatch.setattr(te_import, "HAVE_TE", False)
    with pytest.raises(AssertionError, match="Fused GroupedMLP is not supported"):
        build("swiglu", torch.float32, UNFUSED, pg, use_transformer_engine_op_fuser=True)


class _FakeGroupedLinearOp(torch.nn.Module):
    def __init__(self, *, scale_bias=None, **kwargs):
        super().__init__()
        self.kwargs = kwargs
        if scale_bias is not None:
            self.kwargs["scale_bias"] = scale_bias


class _FakeScaledOp(torch.nn.Module):
    pass


class _FakeSequential:
    def __init__(self, *ops):
        self.ops = ops


@pytest.fixture
def fake_te(monkeypatch):
    """Transformer Engine >= 2.14 with grouped ops, and a recording lowering function."""
    lowered = []

    def lower_activation_to_te_op(spec, *, path, scaled, glu_interleave_size):
        lowered.append(dict(spec=spec, path=path, scaled=scaled, k=glu_interleave_size))
        if spec.is_situ_glu:
            raise UnsupportedActivationError(path, spec, "no scaled SiTU-GLU op", "Unfuse it.")
        return _FakeScaledOp()

    monkeypatch.setattr(experts_module, "lower_activation_to_te_op", lower_activation_to_te_op)
    ops = SimpleNamespace(GroupedLinear=_FakeGroupedLinearOp, Sequential=_FakeSequential)
    pytorch = SimpleNamespace(GroupedLinear=LocalGroupedLinear, ops=ops)
    # One place to replace TE: the import seam (its version checks read the fake's version).
    monkeypatch.setattr(te_import, "te", SimpleNamespace(__version__="2.20.2", pytorch=pytorch))
    monkeypatch.setattr(te_import, "HAVE_TE", True)
    monkeypatch.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")
    return lowered


def test_fused_impl_supported_with_te(pg, fake_te):
    layer = build("swiglu_clamp", torch.float32, UNFUSED, pg, INTERLEAVE, add_bias_linear=False)
    assert layer._is_fused_impl_supported()
    call = fake_te[-1]
    # The lowering gets the math (two-halves spec) and the layout separately.
    assert call["spec"] == layer.activation_spec.with_interleave(None)
    assert call["spec"].clamp_value == 1.5
    assert (call["path"], call["scaled"], call["k"]) == ("TEGroupedMLP", True, INTERLEAVE)


@pytest.mark.parametrize(
    "entry, extra, reason",
    [
        ("situ_glu", {}, "SiTU-GLU"),
        ("swiglu", dict(moe_apply_probs_on_input=True, moe_router_topk=1,
                        moe_router_score_function="sigmoid"), "moe_apply_probs_on_input"),
        ("gelu", {}, "use_fused_weighted_squared_relu"),
    ],
)  # fmt: skip
def test_fused_impl_unsupported(pg, fake_te, entry, extra, reason):
    layer = build(entry, torch.float32, UNFUSED, pg, add_bias_linear=False, **extra)
    assert not layer._is_fused_impl_supported()
    assert reason in layer._fused_impl_unsupported_reason()


def test_fused_impl_needs_the_cutedsl_switch_for_glu(pg, fake_te, monkeypatch):
    monkeypatch.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "0")
    layer = build("swiglu", torch.float32, UNFUSED, pg, add_bias_linear=False)
    assert "NVTE_CUTEDSL_FUSED_GROUPED_MLP" in layer._fused_impl_unsupported_reason()


def test_fused_ops_alias_the_grouped_weights(pg, fake_te):
    layer = build("swiglu", torch.float32, UNFUSED, pg, INTERLEAVE)
    fc1, activation, fc2 = layer._make_fused_ops().ops
    assert isinstance(activation, _FakeScaledOp)
    assert fc1.kwargs["num_groups"] == NUM_EXPERTS and fc1._glu_interleave_size == INTERLEAVE
    for index in range(NUM_EXPERTS):
        assert getattr(fc1, f"weight{index}") is getattr(layer.linear_fc1, f"weight{index}")
        assert getattr(fc2, f"bias{index}") is getattr(layer.linear_fc2, f"bias{index}")
    assert fc2.kwargs["scale_bias"] is True and "scale_bias" not in fc1.kwargs
    # The ops are not submodules: the state dict is the unfused module's.
    assert all(key.startswith(("linear_fc1.", "linear_fc2.")) for key in layer.state_dict())


def test_fused_forward_needs_grouped_tensors(pg, fake_te):
    layer = build("swiglu", torch.float32, UNFUSED, pg, add_bias_linear=False)
    layer.use_fused_impl = True
    with pytest.raises(RuntimeError, match="moe_use_grouped_tensor=True"):
        layer(torch.randn(14, HIDDEN), TOKENS_PER_EXPERT, torch.rand(14))


def test_an_interleave_that_does_not_divide_the_expert_width_is_refused_at_construction(pg):
    with pytest.raises(ValueError, match="moe_mlp_glu_interleave_size=7 must divide"):
        build("swiglu", torch.float32, UNFUSED, pg, interleave=7)
