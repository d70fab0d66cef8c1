"""SharedExpertMLP (plain and overlapped) vs float64, and FusedSharedExpertMLP's TE wiring on CPU.

The fused class's numerics need a real Transformer Engine (GPU tier); here its validation and op
construction are checked with fake ``te`` objects, as upstream's tests do.
"""

import contextlib
from types import SimpleNamespace

import pytest
import torch

import megatron.core.extensions.te_recipes as te_recipes
import megatron.core.transformer.moe.shared_experts as shared_experts_module
from mcore_activations import te_import
from mcore_activations.reference_mlp import reference_mlp
from megatron.core.extensions.transformer_engine import TEFusedRecipeError
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.activation_spec import ActivationSpec, UnsupportedActivationError
from megatron.core.transformer.mlp import FUSED_KERNEL_PATH, UNFUSED_PATH, MLPSubmodules
from megatron.core.transformer.moe.shared_experts import FusedSharedExpertMLP, SharedExpertMLP
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
    fill_weights_,
    kernel_mode,
    leaf64,
    make_config,
)

SHARED_FFN = 40
SEQ, BATCH, HIDDEN = 6, 2, 24

ENTRIES = ["swiglu", "swiglu_clamp", "situ_glu", "quick_geglu_gpt_oss", "silu_tanh", "squared_relu"]


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


@pytest.fixture
def pg():
    return ProcessGroupCollection.use_mpu_process_groups(["tp"])


def shared_kwargs(overlap=False, shared_ffn=SHARED_FFN, **extra) -> dict:
    kwargs = dict(
        add_bias_linear=False,
        num_moe_experts=4,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=shared_ffn,
        moe_shared_expert_overlap=overlap,
        moe_token_dispatcher_type="alltoall",
    )
    kwargs.update(extra)
    return kwargs


def submodules() -> MLPSubmodules:
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def build(entry, dtype, path, pg, gate=True, overlap=False, **extra) -> SharedExpertMLP:
    config = make_config(entry, dtype, path, **shared_kwargs(overlap, **extra))
    return SharedExpertMLP(config, submodules(), gate=gate, pg_collection=pg)


def randomize_(layer: SharedExpertMLP, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    fill_weights_(layer.linear_fc1.weight, HIDDEN, PRE_ACTIVATION_STD, gen)
    fill_weights_(layer.linear_fc2.weight, layer.linear_fc2.weight.shape[1], 1.0, gen)
    if layer.gate_weight is not None:
        fill_weights_(layer.gate_weight, HIDDEN, 1.0, gen)


def check_against_reference(layer: SharedExpertMLP, dtype, path, seed=0):
    randomize_(layer, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(dtype)
    fc1_output = capture_output(layer.linear_fc1)
    with kernel_mode(path):
        out = layer(x)
        out.backward(grad)

    spec = layer.activation_spec
    gate = layer.use_shared_expert_gate
    what = f"SharedExpertMLP[{spec.name}, {path}, {DTYPE_IDS[dtype]}, gate={gate}]"
    assert isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == dtype

    params = dict(layer.named_parameters())
    ref = {name: leaf64(p) for name, p in params.items()}
    x64 = leaf64(x)

    def at(pre):
        if dtype != torch.float32:
            assert_close_to_reference(fc1_output["out"], pre, dtype, f"{what} fc1 output")
            pre = anchored(pre, fc1_output["out"])
        assert_clamps_active(spec, pre)
        return pre

    expected = reference_mlp(x64, ref["linear_fc1.weight"], ref["linear_fc2.weight"], spec, at=at)
    if "gate_weight" in ref:
        expected = expected * torch.sigmoid(x64 @ ref["gate_weight"].T)
    expected.backward(grad.double())

    assert_close_to_reference(out, expected, dtype, f"{what} output")
    assert_close_to_reference(x.grad, x64.grad, dtype, f"{what} dx")
    assert_grads_match(params, ref, dtype, what)


# --------------------------------------------------------------------------------- numerics


def _cases():
    return [
        pytest.param(entry, path, id=f"{entry}-{path}")
        for entry in ENTRIES
        for path in (UNFUSED, FUSED)
        if config_accepts(entry, path, **shared_kwargs())
    ]


@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "nogate"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("entry, path", _cases())
def test_matches_reference(pg, entry, path, dtype, gate, overlap):
    layer = build(entry, dtype, path, pg, gate=gate, overlap=overlap)
    assert layer.activation_path == (FUSED_KERNEL_PATH if path == FUSED else UNFUSED_PATH)
    check_against_reference(layer, dtype, path)


def test_compiled_kernels_match_reference(pg):
    layer = build("swiglu_clamp", torch.float32, COMPILED, pg, gate=True, overlap=True)
    check_against_reference(layer, torch.float32, COMPILED)


@pytest.mark.parametrize("entry", ["situ_glu", "squared_relu"])
def test_ffn_not_multiple_of_32(pg, entry):
    layer = build(entry, torch.float32, UNFUSED, pg, shared_ffn=112)
    assert layer.linear_fc2.weight.shape == (HIDDEN, 112)
    check_against_reference(layer, torch.float32, UNFUSED)


# ----------------------------------------------------------------------------- construction


def test_bias_is_refused(pg):
    config = make_config("swiglu", torch.float32, UNFUSED, **shared_kwargs(add_bias_linear=True))
    with pytest.raises(AssertionError, match="bias is not supported in the shared experts"):
        SharedExpertMLP(config, submodules(), gate=False, pg_collection=pg)


def test_config_is_copied_and_resized(pg):
    config = make_config("swiglu", torch.float32, UNFUSED, **shared_kwargs(shared_ffn=56))
    layer = SharedExpertMLP(config, submodules(), gate=False, pg_collection=pg)
    assert config.ffn_hidden_size == 40 and layer.config is not config
    assert layer.config.ffn_hidden_size == 56
    assert layer.linear_fc1.weight.shape == (112, HIDDEN)
    assert layer.linear_fc2.weight.shape == (HIDDEN, 56)
    assert layer.tp_group is pg.tp


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_gate_weight(pg, dtype):
    layer = build("swiglu", dtype, UNFUSED, pg, gate=True)
    assert layer.gate_weight.shape == (1, HIDDEN) and layer.gate_weight.dtype == dtype
    assert layer.gate_weight.sequence_parallel is False
    assert "gate_weight" in dict(layer.named_parameters())
    assert build("swiglu", dtype, UNFUSED, pg, gate=False).gate_weight is None


def test_overlap_turns_off_the_linears_communication(pg):
    layer = build("swiglu", torch.float32, UNFUSED, pg, overlap=True)
    assert layer.linear_fc1.explicit_expert_comm and layer.linear_fc2.explicit_expert_comm
    plain = build("swiglu", torch.float32, UNFUSED, pg, overlap=False)
    assert not plain.linear_fc1.explicit_expert_comm


# ------------------------------------------------------------------------ overlap protocol


def test_overlap_steps_equal_plain_forward(pg):
    plain = build("swiglu_clamp", torch.float32, FUSED, pg, gate=True, overlap=False)
    overlapped = build("swiglu_clamp", torch.float32, FUSED, pg, gate=True, overlap=True)
    randomize_(plain, seed=5)
    overlapped.load_state_dict(plain.state_dict())
    x = torch.randn(SEQ, BATCH, HIDDEN)

    overlapped.pre_forward_comm(x)
    overlapped.linear_fc1_forward_and_act()
    overlapped.linear_fc2_forward()
    overlapped.post_forward_comm()
    stepped = overlapped.get_output()
    torch.testing.assert_close(stepped, plain(x), rtol=0, atol=0)
    # The protocol is back at its start: a second round (via forward) works.
    torch.testing.assert_close(overlapped(x), stepped, rtol=0, atol=0)


def test_overlap_steps_out_of_order_raise(pg):
    layer = build("swiglu", torch.float32, UNFUSED, pg, overlap=True)
    with pytest.raises(RuntimeError, match="out of order"):
        layer.linear_fc1_forward_and_act()
    layer.pre_forward_comm(torch.randn(2, 1, HIDDEN))
    with pytest.raises(RuntimeError, match="expected FC1_FORWARD_DONE"):
        layer.linear_fc2_forward()
    with pytest.raises(RuntimeError, match="out of order"):
        layer.pre_forward_comm(torch.randn(2, 1, HIDDEN))


def test_overlap_steps_need_overlap_enabled(pg):
    layer = build("swiglu", torch.float32, UNFUSED, pg, overlap=False)
    with pytest.raises(RuntimeError, match="moe_shared_expert_overlap=True"):
        layer.pre_forward_comm(torch.randn(2, 1, HIDDEN))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_overlap_on_the_side_stream_matches_plain_forward(pg, dtype):
    plain = build("swiglu_clamp", dtype, FUSED, pg, gate=True, overlap=False).cuda()
    overlapped = build("swiglu_clamp", dtype, FUSED, pg, gate=True, overlap=True).cuda()
    randomize_(plain, seed=6)
    overlapped.load_state_dict(plain.state_dict())
    assert isinstance(SharedExpertMLP.stream, torch.cuda.Stream)
    x = torch.randn(64, 4, HIDDEN, device="cuda", dtype=dtype)
    grad = torch.randn_like(x)

    outputs, grads = [], []
    for layer in (plain, overlapped):
        x_leaf = x.clone().requires_grad_()
        out = layer(x_leaf)
        out.backward(grad)
        outputs.append(out)
        grads.append([x_leaf.grad] + [p.grad for p in layer.parameters()])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_overlap_uses_no_stream_on_cpu(pg):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback")
    build("swiglu", torch.float32, UNFUSED, pg, overlap=True)
    assert SharedExpertMLP.stream is None


# ------------------------------------------------------------- FusedSharedExpertMLP (fakes)


class _FakeGroupedLinear(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs
        self.weight0 = torch.nn.Parameter(
            torch.empty(kwargs["out_features"], kwargs["in_features"], device="meta")
        )


class _FakeSequential:
    def __init__(self, *ops):
        self.ops = ops


class _FakeActivationOp(torch.nn.Module):
    pass


@pytest.fixture
def fake_te(monkeypatch):
    """Transformer Engine >= 2.14 as far as FusedSharedExpertMLP can tell, with a recording
    ``lower_activation_to_te_op``."""
    lowered = []

    def lower_activation_to_te_op(spec, *, path, scaled, glu_interleave_size):
        lowered.append(dict(spec=spec, path=path, scaled=scaled, k=glu_interleave_size))
        if spec.kind.value != "silu" or not spec.gated:
            raise UnsupportedActivationError(path, spec, "no scaled TE op", "Use SwiGLU.")
        return _FakeActivationOp()

    replacements = dict(
        lower_activation_to_te_op=lower_activation_to_te_op,
        resolve_fused_recipe=lambda config, path: "none",
        make_fused_recipe=lambda name: None,
        fused_recipe_model_init=lambda recipe: contextlib.nullcontext(),
        fused_recipe_autocast=lambda recipe: contextlib.nullcontext(),
    )
    for name, replacement in replacements.items():
        monkeypatch.setattr(shared_experts_module, name, replacement)
    te = SimpleNamespace(
        __version__="2.20.2",
        pytorch=SimpleNamespace(
            Linear=torch.nn.Module,
            ops=SimpleNamespace(GroupedLinear=_FakeGroupedLinear, Sequential=_FakeSequential),
        ),
    )
    # One place to replace TE: the import seam (its version checks read the fake's version).
    monkeypatch.setattr(te_import, "te", te)
    monkeypatch.setattr(te_import, "HAVE_TE", True)
    return lowered


def _fused_config(entry="swiglu_clamp", **extra):
    kwargs = dict(moe_shared_expert_glu_interleave_size=8, use_grouped_gemm_for_shared_expert=True)
    kwargs.update(extra)
    return make_config(entry, torch.float32, UNFUSED, **shared_kwargs(**kwargs))


def test_fused_shared_expert_requires_te(pg, monkeypatch):
    monkeypatch.setattr(te_import, "HAVE_TE", False)
    with pytest.raises(RuntimeError, match="requires Transformer Engine"):
        FusedSharedExpertMLP(_fused_config(), submodules(), gate=False, pg_collection=pg)


def test_fused_shared_expert_requires_te_2_14(pg, monkeypatch, fake_te):
    monkeypatch.setattr(te_import.te, "__version__", "2.13.0")
    with pytest.raises(RuntimeError, match="2.14"):
        FusedSharedExpertMLP(_fused_config(), submodules(), gate=False, pg_collection=pg)


def test_fused_shared_expert_lowers_the_activation_at_construction(pg, fake_te):
    layer = FusedSharedExpertMLP(_fused_config(), submodules(), gate=True, pg_collection=pg)
    assert len(fake_te) == 1
    call = fake_te[0]
    assert call["spec"] == ActivationSpec.from_config(layer.config)
    assert call["spec"].clamp_value == 1.5
    assert call == dict(spec=call["spec"], path="FusedSharedExpertMLP", scaled=True, k=8)


def test_fused_shared_expert_refuses_what_te_cannot_lower(pg, fake_te):
    with pytest.raises(UnsupportedActivationError, match="FusedSharedExpertMLP cannot compute"):
        FusedSharedExpertMLP(
            _fused_config("quick_geglu_gpt_oss"), submodules(), gate=False, pg_collection=pg
        )


def test_fused_shared_expert_requires_glu_interleave(pg, fake_te):
    config = _fused_config(moe_shared_expert_glu_interleave_size=None)
    with pytest.raises(ValueError, match="glu_interleave_size"):
        FusedSharedExpertMLP(config, submodules(), gate=False, pg_collection=pg)


def test_fused_shared_expert_requires_te_linears(pg, fake_te):
    fake_te_module = shared_experts_module.te
    fake_te_module.pytorch.Linear = type("Linear", (torch.nn.Module,), {})
    with pytest.raises(ValueError, match="Transformer Engine Linear"):
        FusedSharedExpertMLP(_fused_config(), submodules(), gate=False, pg_collection=pg)


def test_fused_shared_expert_ops_alias_the_linears(pg, fake_te):
    layer = FusedSharedExpertMLP(_fused_config(), submodules(), gate=True, pg_collection=pg)
    keys = set(layer.state_dict())
    fc1, activation, fc2 = layer._make_fused_ops().ops
    assert fc1.weight0 is layer.linear_fc1.weight and fc2.weight0 is layer.linear_fc2.weight
    assert fc1.kwargs["num_groups"] == 1 and fc1.kwargs["bias"] is False
    assert (fc1.kwargs["in_features"], fc1.kwargs["out_features"]) == (HIDDEN, 2 * SHARED_FFN)
    assert fc1._glu_interleave_size == 8 and not hasattr(fc2, "_glu_interleave_size")
    assert isinstance(activation, _FakeActivationOp)
    assert activation._grouped_mlp_unit_activation_scale is True
    # Same parameters as the unfused class: weights move between the two both ways.
    plain = SharedExpertMLP(layer.config, submodules(), gate=True, pg_collection=pg)
    assert (
        keys
        == set(plain.state_dict())
        == {
            "linear_fc1.weight",
            "linear_fc2.weight",
            "gate_weight",
        }
    )


def _plain_and_fused_on_one_checkpoint(pg):
    """A gated SharedExpertMLP with random fc1 weights and a FusedSharedExpertMLP loaded from
    its state dict."""
    config = _fused_config()
    plain = SharedExpertMLP(config, submodules(), gate=True, pg_collection=pg)
    with torch.no_grad():
        plain.linear_fc1.weight.normal_(0.0, 1.0)
    fused = FusedSharedExpertMLP(config, submodules(), gate=True, pg_collection=pg)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def test_fused_shared_expert_state_dict_moves_weights_both_ways(pg, fake_te):
    """Same function on the same checkpoint: the fused class keeps fc1 block-interleaved in
    memory (the grouped op's layout) and the parent's [gate; linear] layout in state dicts."""
    plain, fused = _plain_and_fused_on_one_checkpoint(pg)
    config = plain.config
    w = plain.linear_fc1.weight
    assert not torch.equal(fused.linear_fc1.weight, w)  # interleaved in memory
    for key, value in fused.state_dict().items():
        assert torch.equal(value, plain.state_dict()[key]), key
    x = torch.randn(6, 2, HIDDEN)
    # The inherited unfused computation reads the interleaved memory layout consistently.
    torch.testing.assert_close(SharedExpertMLP.forward(fused, x), plain(x))
    roundtrip = SharedExpertMLP(config, submodules(), gate=True, pg_collection=pg)
    roundtrip.load_state_dict(fused.state_dict())
    assert torch.equal(roundtrip.linear_fc1.weight, w)


def test_audit_compares_fused_shared_expert_gradients_in_checkpoint_layout(pg, fake_te):
    """The fused class's fc1 gradient is block-interleaved like its weight; the activation audit
    maps it through the state-dict hooks before comparing with the parent's."""
    from mcore_activations.audit_runner import grads_in_checkpoint_layout

    plain, fused = _plain_and_fused_on_one_checkpoint(pg)
    x = torch.randn(6, 2, HIDDEN)
    grad = torch.randn(6, 2, HIDDEN)
    SharedExpertMLP.forward(fused, x).backward(grad)
    plain(x).backward(grad)
    fused_weight = fused.linear_fc1.weight.detach().clone()
    mapped = grads_in_checkpoint_layout(fused)
    expected = {name: p.grad for name, p in plain.named_parameters()}
    assert mapped.keys() == expected.keys()
    for name, value in mapped.items():
        torch.testing.assert_close(value, expected[name], msg=name)
    # Raw, the interleaved gradient differs from the parent's; the parameters are untouched.
    assert not torch.allclose(fused.linear_fc1.weight.grad, plain.linear_fc1.weight.grad)
    assert torch.equal(fused.linear_fc1.weight, fused_weight)


def test_fused_shared_expert_resolves_its_recipe_at_construction(pg, fake_te, monkeypatch):
    def refuse(config, path):
        raise TEFusedRecipeError(f"{path}: unknown quantization recipe 'fp8'")

    monkeypatch.setattr(shared_experts_module, "resolve_fused_recipe", refuse)
    with pytest.raises(ValueError, match="FusedSharedExpertMLP: unknown quantization recipe"):
        FusedSharedExpertMLP(_fused_config(), submodules(), gate=False, pg_collection=pg)


def test_fused_shared_expert_refuses_a_recipe_this_gpu_lacks_at_the_first_forward(
    pg, fake_te, monkeypatch
):
    # The real recipe policy and probe: this fake TE reports no MXFP8 support, as a CPU or a
    # pre-SM100 GPU would. The model still builds (it may be moved to an SM100 GPU later).
    monkeypatch.setattr(
        shared_experts_module, "resolve_fused_recipe", te_recipes.resolve_fused_recipe
    )
    te_import.te.pytorch.is_mxfp8_available = lambda return_reason=False: (False, "fake: no MXFP8")
    config = _fused_config(te_fused_recipe="mxfp8")
    layer = FusedSharedExpertMLP(config, submodules(), gate=False, pg_collection=pg)
    assert layer.fused_recipe_name == "mxfp8"
    with pytest.raises(TEFusedRecipeError) as info:
        layer(torch.randn(6, 2, HIDDEN))
    message = str(info.value)
    assert message.startswith("FusedSharedExpertMLP: the 'mxfp8' recipe cannot run")
    assert "fake: no MXFP8" in message and "te_fused_recipe='none'" in message
    assert layer._fused_ops is None  # nothing was built under a recipe the GPU cannot run
