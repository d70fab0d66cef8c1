"""SequentialMLP: per-expert MLPs with router probabilities, vs a float64 model per expert."""

import pytest
import torch

from mcore_activations.reference_mlp import reference_mlp
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import FUSED_KERNEL_PATH, MLP, UNFUSED_PATH, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
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
TOKENS_PER_EXPERT = [5, 0, 9]  # uneven, and one expert without tokens

ENTRIES = [
    "swiglu",
    "swiglu_clamp",
    "situ_glu",
    "situ_glu_gate_only",
    "geglu",
    "reglu",
    "quick_geglu_gpt_oss",
    "gelu",
    "silu_tanh",
    "squared_relu_tanh",
]


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


@pytest.fixture
def pg():
    return ProcessGroupCollection.use_mpu_process_groups(["ep", "expt_tp"])


def moe_kwargs(**extra) -> dict:
    # ffn_hidden_size differs from the experts' width, so SequentialMLP must resize its copy.
    kwargs = dict(num_moe_experts=3, moe_ffn_hidden_size=EXPERT_FFN, ffn_hidden_size=64)
    kwargs.update(extra)
    return kwargs


def build(entry, dtype, path, pg, **extra) -> SequentialMLP:
    config = make_config(entry, dtype, path, **moe_kwargs(**extra))
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return SequentialMLP(len(TOKENS_PER_EXPERT), config, submodules, pg_collection=pg)


def randomize_(experts: SequentialMLP, dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for expert in experts.local_experts:
        fill_weights_(expert.linear_fc1.weight, HIDDEN, PRE_ACTIVATION_STD, gen)
        # Zero in bf16: the unfused path's bias add rounds (see mlp_test_utils).
        fill_bias_(expert.linear_fc1.bias, 0.5 if dtype == torch.float32 else 0.0, gen)
        fill_weights_(expert.linear_fc2.weight, EXPERT_FFN, 1.0, gen)
        fill_bias_(expert.linear_fc2.bias, 0.5, gen)


def reference_expert(expert_params, x64, probs64, spec, fc1_anchor, probs_on_input=False):
    """One expert in float64: ``p * fc2(act(fc1(x)))`` (fc2 bias included)."""
    return reference_mlp(
        x64,
        expert_params["linear_fc1.weight"],
        expert_params["linear_fc2.weight"],
        spec,
        fc1_bias=expert_params.get("linear_fc1.bias"),
        fc2_bias=expert_params.get("linear_fc2.bias"),
        # With the probabilities on the input, x64 already carries them.
        probs=None if probs_on_input else probs64,
        at=lambda pre: anchored(pre, fc1_anchor),
    )


def check_against_reference(experts: SequentialMLP, dtype, path, seed=0, probs_on_input=False):
    randomize_(experts, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = sum(TOKENS_PER_EXPERT)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(tokens, generator=gen).requires_grad_()
    grad = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    fc1_outputs = [capture_output(expert.linear_fc1) for expert in experts.local_experts]

    with kernel_mode(path):
        out, bias = experts(x, torch.tensor(TOKENS_PER_EXPERT), probs)
        out.backward(grad)
    assert bias is None and out.shape == x.shape and out.dtype == dtype

    spec = experts.local_experts[0].activation_spec
    what = f"SequentialMLP[{spec.name}, {path}, {DTYPE_IDS[dtype]}]"
    params = dict(experts.named_parameters())
    ref = {name: leaf64(p) for name, p in params.items()}
    x64, probs64 = leaf64(x), leaf64(probs)
    expert_in = x64
    if probs_on_input:
        expert_in = x64 * probs64.unsqueeze(-1)
    pieces, pre_activations = [], []
    for index, (x_i, p_i) in enumerate(
        zip(torch.split(expert_in, TOKENS_PER_EXPERT), torch.split(probs64, TOKENS_PER_EXPERT))
    ):
        prefix = f"local_experts.{index}."
        expert_params = {n[len(prefix) :]: p for n, p in ref.items() if n.startswith(prefix)}
        anchor = None
        if dtype != torch.float32 and x_i.shape[0]:
            anchor = fc1_outputs[index]["out"]
            exact = x_i @ expert_params["linear_fc1.weight"].T
            assert_close_to_reference(anchor, exact, dtype, f"{what} expert {index} fc1 output")
        pieces.append(reference_expert(expert_params, x_i, p_i, spec, anchor, probs_on_input))
        pre_activations.append(x_i @ expert_params["linear_fc1.weight"].T)
    assert_clamps_active(spec, torch.cat(pre_activations))
    expected = torch.cat(pieces)
    expected.backward(grad.double())

    assert_close_to_reference(out, expected, dtype, f"{what} output")
    assert_close_to_reference(x.grad, x64.grad, dtype, f"{what} dx")
    assert_close_to_reference(probs.grad, probs64.grad, dtype, f"{what} dprobs")
    # An expert without tokens gets zero gradients, which the reference reproduces.
    assert_grads_match(params, ref, dtype, what)


def _cases():
    return [
        pytest.param(entry, path, id=f"{entry}-{path}")
        for entry in ENTRIES
        for path in (UNFUSED, FUSED)
        if config_accepts(entry, path, **moe_kwargs())
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("entry, path", _cases())
def test_matches_reference(pg, entry, path, dtype):
    experts = build(entry, dtype, path, pg)
    expected_path = FUSED_KERNEL_PATH if path == FUSED else UNFUSED_PATH
    assert all(e.activation_path == expected_path for e in experts.local_experts)
    check_against_reference(experts, dtype, path)


def test_compiled_kernels_match_reference(pg):
    experts = build("situ_glu", torch.float32, COMPILED, pg)
    check_against_reference(experts, torch.float32, COMPILED)


@pytest.mark.parametrize("path", [UNFUSED, FUSED])
def test_without_bias(pg, path):
    experts = build("swiglu_clamp", torch.float32, path, pg, add_bias_linear=False)
    check_against_reference(experts, torch.float32, path)


@pytest.mark.parametrize("path", [UNFUSED, FUSED])
def test_probs_applied_on_input(pg, path):
    experts = build(
        "swiglu",
        torch.float32,
        path,
        pg,
        moe_apply_probs_on_input=True,
        moe_router_topk=1,
        moe_router_score_function="sigmoid",
    )
    check_against_reference(experts, torch.float32, path, probs_on_input=True)


def test_probs_on_input_needs_top1(pg):
    experts = build("swiglu", torch.float32, UNFUSED, pg, moe_apply_probs_on_input=True)
    x, probs = torch.randn(14, HIDDEN), torch.rand(14)
    with pytest.raises(AssertionError, match="topk=1"):
        experts(x, torch.tensor(TOKENS_PER_EXPERT), probs)


def test_experts_are_mlps_with_the_expert_width(pg):
    config = make_config("swiglu", torch.float32, UNFUSED, **moe_kwargs())
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    experts = SequentialMLP(2, config, submodules, pg_collection=pg, name="decoder.experts")
    assert config.ffn_hidden_size == 64 and experts.config.ffn_hidden_size == EXPERT_FFN
    assert len(experts.local_experts) == 2
    for index, expert in enumerate(experts.local_experts):
        assert isinstance(expert, MLP)
        assert expert.linear_fc1.weight.shape == (2 * EXPERT_FFN, HIDDEN)
        assert expert.linear_fc2.weight.shape == (HIDDEN, EXPERT_FFN)
        assert expert.linear_fc1.is_expert and expert.tp_group is pg.expt_tp
        assert expert.linear_fc1.name == f"decoder.experts.local_experts.{index}.linear_fc1"


def test_tokens_per_expert_as_a_list(pg):
    experts = build("gelu", torch.float32, UNFUSED, pg)
    x, probs = torch.randn(14, HIDDEN), torch.rand(14)
    from_tensor, _ = experts(x, torch.tensor(TOKENS_PER_EXPERT), probs)
    from_list, _ = experts(x, TOKENS_PER_EXPERT, probs)
    torch.testing.assert_close(from_tensor, from_list, rtol=0, atol=0)


def test_quantization_padding_changes_nothing(pg):
    # FP8 GEMMs need 16-row multiples: each expert's tokens are padded with zero rows of zero
    # probability and the padding is cut off again. The local linears ignore fp8, so the result
    # must equal the unpadded one (up to the GEMM's blocking, which depends on the row count).
    experts = build("swiglu_clamp", torch.float32, FUSED, pg)
    randomize_(experts, torch.float32, seed=4)
    x, probs = torch.randn(14, HIDDEN), torch.rand(14)
    unpadded, _ = experts(x, TOKENS_PER_EXPERT, probs)

    rows_seen = []
    for expert in experts.local_experts:
        expert.register_forward_pre_hook(lambda module, args: rows_seen.append(args[0].shape[0]))
    experts.config.fp8 = "e4m3"
    padded, _ = experts(x, TOKENS_PER_EXPERT, probs)
    assert rows_seen == [16, 0, 16]
    assert_close_to_reference(padded, unpadded, torch.float32, "padded experts")


def test_backward_dw_visits_every_expert(pg):
    experts = build("gelu", torch.float32, UNFUSED, pg)
    visited = []
    for index, expert in enumerate(experts.local_experts):
        expert.backward_dw = lambda index=index: visited.append(index)
    experts.backward_dw()
    assert visited == [0, 1, 2]


@pytest.mark.parametrize("path", [UNFUSED, FUSED])
@pytest.mark.parametrize(
    "tokens_per_expert, probs_shape, match",
    [
        ([5, 9], (14,), "has 3 local experts but tokens_per_expert has 2 entries"),
        ([5, 0, 9, 0], (14,), "has 4 entries"),
        ([5, 0, 8], (14,), "sums to 13 but the input has 14 tokens"),
        (TOKENS_PER_EXPERT, (14, 1), r"one probability per token, shape \(14,\); got \(14, 1\)"),
    ],
)
def test_routing_inputs_that_would_drop_or_broadcast_are_refused(
    pg, path, tokens_per_expert, probs_shape, match
):
    experts = build("swiglu", torch.float32, path, pg)
    with pytest.raises(ValueError, match=match):
        experts(torch.randn(14, HIDDEN), tokens_per_expert, torch.rand(probs_shape))
