"""TEGroupedLinear's checkpoints: either of TE's parameter layouts loads into either layout.

TE's ``GroupedLinear`` keeps its parameters one tensor per GEMM (``weight0`` .. ``weight{N-1}``,
``bias0`` ..) or, with ``single_grouped_weight`` / ``single_grouped_bias``, as one grouped tensor
(``weight`` of shape ``[N, out, in]``, ``bias`` of ``[N, out]``). Here ``TEGroupedLinear`` is
built over a CPU stand-in for TE's module (same constructor keywords, same parameter names) by
loading a private copy of ``te_linears`` while the import seam holds a fake TE: the class chooses
its TE base class when its module is imported, and the shared module imported without TE.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import megatron.core.extensions.te_linears as te_linears
from mcore_activations import te_import
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

NUM_GEMMS, HIDDEN, FFN = 3, 8, 6
# (single_grouped_weight, single_grouped_bias) of a module.
LAYOUTS = [(False, False), (True, False), (False, True), (True, True)]
LAYOUT_IDS = ["per-gemm", "grouped-weight", "grouped-bias", "grouped"]


class FakeGroupedLinear(torch.nn.Module):
    """TE's ``GroupedLinear`` as far as its parameters go, with a per-GEMM CPU forward.

    Records its constructor keywords in ``te_kwargs``. A bias-free layer holds empty plain
    tensors, not parameters, so no bias reaches its state dict (as in TE).
    """

    def __init__(
        self,
        num_gemms,
        in_features,
        out_features,
        *,
        bias=True,
        params_dtype=None,
        init_method=None,
        single_grouped_weight=False,
        single_grouped_bias=False,
        **te_kwargs,
    ):
        super().__init__()
        self.te_kwargs = dict(
            te_kwargs,
            bias=bias,
            single_grouped_weight=single_grouped_weight,
            single_grouped_bias=single_grouped_bias,
        )
        self.num_gemms, self.use_bias = num_gemms, bias
        self.single_grouped_weight = single_grouped_weight
        self.single_grouped_bias = single_grouped_bias and bias
        self.return_bias = te_kwargs.get("return_bias", False)
        dtype = params_dtype or torch.float32
        weights = torch.empty(num_gemms, out_features, in_features, dtype=dtype)
        for weight in weights:
            init_method(weight)
        self._register("weight", weights, single_grouped_weight)
        if bias:
            self._register("bias", torch.randn(num_gemms, out_features), single_grouped_bias)
        else:
            for index in range(num_gemms):
                setattr(self, f"bias{index}", torch.empty(0, dtype=dtype))

    def _register(self, name, stacked, single):
        if single:
            self.register_parameter(name, torch.nn.Parameter(stacked.clone()))
            return
        for index, part in enumerate(stacked):
            self.register_parameter(f"{name}{index}", torch.nn.Parameter(part.clone()))

    def gemm_tensors(self, name) -> list:
        """The per-GEMM tensors of ``name`` ("weight" / "bias"), whatever the layout."""
        if name in self._parameters:
            return list(self._parameters[name].unbind(0))
        return [getattr(self, f"{name}{index}") for index in range(self.num_gemms)]

    def forward(self, x, m_splits, is_first_microbatch=None):
        weights = self.gemm_tensors("weight")
        biases = self.gemm_tensors("bias") if self.use_bias else [None] * self.num_gemms
        chunks = x.split(list(m_splits))
        if self.return_bias:
            outs = [F.linear(chunk, w) for chunk, w in zip(chunks, weights)]
            return torch.cat(outs), biases
        return torch.cat([F.linear(chunk, w, b) for chunk, w, b in zip(chunks, weights, biases)])


class OlderFakeGroupedLinear(FakeGroupedLinear):
    """A TE ``GroupedLinear`` from before the single grouped parameter: per-GEMM only."""

    def __init__(self, num_gemms, in_features, out_features, *, bias=True, **te_kwargs):
        for keyword in ("single_grouped_weight", "single_grouped_bias"):
            assert keyword not in te_kwargs, f"{keyword} passed to a TE that does not take it"
        super().__init__(num_gemms, in_features, out_features, bias=bias, **te_kwargs)


def load_te_linears(monkeypatch, grouped_linear=FakeGroupedLinear):
    """A private copy of ``te_linears`` whose TEGroupedLinear derives from ``grouped_linear``."""
    pytorch = SimpleNamespace(
        Linear=torch.nn.Module, LayerNormLinear=torch.nn.Module, GroupedLinear=grouped_linear
    )
    monkeypatch.setattr(te_import, "te", SimpleNamespace(__version__="2.20.2", pytorch=pytorch))
    monkeypatch.setattr(te_import, "HAVE_TE", True)
    spec = importlib.util.spec_from_file_location("te_linears_over_fake_te", te_linears.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    # One-rank groups for the whole module, whatever earlier tests left behind (an initialized
    # default process group without model-parallel groups makes the group getters raise). Once
    # per module, not per test: every set-up creates gloo groups whose threads outlive it.
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


@pytest.fixture
def linears(monkeypatch):
    return load_te_linears(monkeypatch)


def make_config(bias: bool, layout=(False, False)) -> TransformerConfig:
    single_weight, single_bias = layout
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_moe_experts=NUM_GEMMS,
        moe_ffn_hidden_size=FFN,
        moe_grouped_gemm=True,
        moe_single_grouped_weight=single_weight,
        moe_single_grouped_bias=single_bias and bias,
        add_bias_linear=bias,
        use_cpu_initialization=True,
    )


def build(linears, bias, layout, skip_bias_add=False):
    layer = linears.TEColumnParallelGroupedLinear(
        NUM_GEMMS,
        HIDDEN,
        FFN,
        config=make_config(bias, layout),
        init_method=torch.nn.init.normal_,
        bias=bias,
        skip_bias_add=skip_bias_add,
        is_expert=True,
    )
    # A prefix, as inside a model, so the hook's keys carry one.
    return torch.nn.ModuleDict({"fc1": layer})


def expected_keys(bias, layout) -> set:
    single_weight, single_bias = layout
    keys = {"fc1.weight"} if single_weight else {f"fc1.weight{i}" for i in range(NUM_GEMMS)}
    if bias:
        keys |= {"fc1.bias"} if single_bias else {f"fc1.bias{i}" for i in range(NUM_GEMMS)}
    return keys


def assert_same_gemms(a, b, bias):
    for name in ("weight", "bias") if bias else ("weight",):
        for index, (x, y) in enumerate(
            zip(a["fc1"].gemm_tensors(name), b["fc1"].gemm_tensors(name))
        ):
            assert torch.equal(x, y), f"{name} of GEMM {index}"


# ------------------------------------------------------------------------------ both ways


def _layout_pairs():
    # A grouped bias needs a bias: bias-free modules come in the two weight layouts only.
    for bias in (False, True):
        layouts = [
            (layout, name) for layout, name in zip(LAYOUTS, LAYOUT_IDS) if bias or not layout[1]
        ]
        for source, source_id in layouts:
            for target, target_id in layouts:
                label = f"{'bias' if bias else 'no-bias'}-{source_id}-to-{target_id}"
                yield pytest.param(bias, source, target, id=label)


@pytest.mark.parametrize("bias, source, target", list(_layout_pairs()))
def test_each_layout_loads_into_each_layout(linears, bias, source, target):
    torch.manual_seed(0)
    saved, loaded = build(linears, bias, source), build(linears, bias, target)
    # Saving keeps the module's own layout.
    assert set(saved.state_dict()) == expected_keys(bias, source)
    result = loaded.load_state_dict(saved.state_dict(), strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_same_gemms(saved, loaded, bias)
    assert set(loaded.state_dict()) == expected_keys(bias, target)
    # The loaded module computes what the saved one does, GEMM by GEMM.
    x, m_splits = torch.randn(7, HIDDEN), [2, 0, 5]
    torch.testing.assert_close(loaded["fc1"](x, m_splits)[0], saved["fc1"](x, m_splits)[0])


def test_layout_follows_the_config(linears):
    per_gemm, grouped = build(linears, True, (False, False)), build(linears, True, (True, True))
    assert grouped["fc1"].te_kwargs["single_grouped_weight"] is True
    assert grouped["fc1"].te_kwargs["single_grouped_bias"] is True
    assert per_gemm["fc1"].te_kwargs["single_grouped_weight"] is False
    assert grouped["fc1"].weight.shape == (NUM_GEMMS, FFN, HIDDEN)


def test_older_te_gets_no_single_grouped_keywords(monkeypatch):
    # The config asks for the grouped layout, but this TE's constructor cannot take it.
    linears = load_te_linears(monkeypatch, OlderFakeGroupedLinear)
    layer = build(linears, True, (True, True))
    assert set(layer.state_dict()) == expected_keys(True, (False, False))
    # A grouped checkpoint still loads, split into the GEMMs this TE keeps.
    grouped = build(load_te_linears(monkeypatch), True, (True, True))
    layer.load_state_dict(grouped.state_dict(), strict=True)
    assert_same_gemms(grouped, layer, True)


def test_concatenated_grouped_tensor_loads_per_gemm(linears):
    torch.manual_seed(1)
    source, target = build(linears, True, (False, False)), build(linears, True, (False, False))
    weights, biases = source["fc1"].gemm_tensors("weight"), source["fc1"].gemm_tensors("bias")
    # Concatenated along dim 0: [N * out, in] and [N * out].
    state = {"fc1.weight": torch.cat(weights).detach(), "fc1.bias": torch.cat(biases).detach()}
    assert state["fc1.weight"].shape == (NUM_GEMMS * FFN, HIDDEN)
    result = target.load_state_dict(state, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_same_gemms(source, target, True)


def test_ungroupable_leading_dim_is_refused(linears):
    layer = build(linears, False, (False, False))
    state = {"fc1.weight": torch.zeros(2 * NUM_GEMMS + 1, HIDDEN)}
    with pytest.raises(RuntimeError) as info:
        layer.load_state_dict(state)
    message = str(info.value)
    assert "fc1.weight" in message and "(7, 8)" in message and "num_gemms" in message
    assert "expert_model_parallel_size" in message  # what to do instead
    with pytest.raises(RuntimeError, match="Cannot split checkpoint tensor"):
        layer["fc1"]._split_grouped_checkpoint_tensor(torch.tensor(1.0), "weight")


def test_per_gemm_tensors_of_different_shapes_are_refused_by_name(linears):
    layer = build(linears, False, (True, False))
    state = {f"fc1.weight{i}": torch.zeros(FFN, HIDDEN) for i in range(NUM_GEMMS)}
    state["fc1.weight1"] = torch.zeros(FFN + 2, HIDDEN)
    with pytest.raises(RuntimeError) as info:
        layer.load_state_dict(state, strict=False)
    message = str(info.value)
    assert "fc1.weight1 (8, 8)" in message and "fc1.weight0 (6, 8)" in message
    assert "into fc1.weight" in message and "ffn_hidden_size" in message  # what to do instead


def test_quantized_grouped_tensor_splits_into_its_members(linears):
    layer = build(linears, False, (False, False))["fc1"]
    members = [torch.full((FFN, HIDDEN), float(i)) for i in range(NUM_GEMMS)]
    grouped = SimpleNamespace(split_into_quantized_tensors=lambda: members)
    assert layer._split_grouped_checkpoint_tensor(grouped, "weight") == members
    short = SimpleNamespace(split_into_quantized_tensors=lambda: members[:2])
    with pytest.raises(RuntimeError, match=f"has 2 groups, expected {NUM_GEMMS}"):
        layer._split_grouped_checkpoint_tensor(short, "weight")


def test_incomplete_per_gemm_keys_are_reported_not_grouped(linears):
    layer = build(linears, False, (True, False))
    state = {"fc1.weight0": torch.zeros(FFN, HIDDEN), "fc1.weight2": torch.zeros(FFN, HIDDEN)}
    result = layer.load_state_dict(state, strict=False)
    assert result.missing_keys == ["fc1.weight"]
    assert sorted(result.unexpected_keys) == ["fc1.weight0", "fc1.weight2"]


def test_bias_keys_into_a_bias_free_layer_stay_unexpected(linears):
    with_bias, bias_free = build(linears, True, (False, True)), build(linears, False, (True, False))
    result = bias_free.load_state_dict(with_bias.state_dict(), strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == ["fc1.bias"]
