"""The TE-ops adapter builders (``te_ops_adapters``), over a fake Transformer Engine.

Each builder makes one ``te.pytorch.ops`` operation on the meta device and points its
parameters at a source module's. Checked here: the aliasing, the constructor arguments (global
feature counts, tensor parallelism, Userbuffers), what a source module must have (the
``ValueError`` a plain TE module gets), the empty bias, and that ``transformer_engine`` and
``TEFusedOpsMixin`` expose the very same functions under upstream's names.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import megatron.core.extensions.te_ops_adapters as adapters
import megatron.core.extensions.transformer_engine as te_ext
from megatron.core.extensions.te_fused_ops import TEFusedOpsMixin
from tests.unit_tests.extensions.fake_te import install_fake_te

IN, OUT = 6, 10
DTYPE = torch.float64

UPSTREAM_NAMES = [
    "_te_ops_has_nested_attr",
    "_validate_te_ops_adapter_module",
    "_get_te_ops_tensor_parallel_context",
    "_get_te_ops_rng_state_tracker_function",
    "_make_te_ops_rmsnorm_from_te_rmsnorm",
    "_make_te_ops_norm_from_mcore_te_layernorm_linear",
    "_make_te_ops_basic_linear_from_mcore_te_linear",
    "_make_te_ops_bias_from_tensor",
]


@pytest.fixture
def fake_te(monkeypatch):
    return install_fake_te(monkeypatch)


class MegatronLinear(torch.nn.Module):
    """What a Megatron TE linear wrapper exposes to the adapters."""

    def __init__(self, *, tp_comm_overlap=False, ub_name=None, fuse_wgrad=False, bias=True):
        super().__init__()
        self.config = SimpleNamespace(tp_comm_overlap=tp_comm_overlap)
        self.ub_name = ub_name
        self.fuse_wgrad_accumulation = fuse_wgrad
        self.weight = torch.nn.Parameter(torch.randn(OUT, IN, dtype=DTYPE))
        size = OUT if bias else 0
        self.bias = torch.nn.Parameter(torch.randn(size, dtype=DTYPE))


class Linear(torch.nn.Module):
    """A plain ``te.pytorch.Linear``: TE's attributes, but no Megatron ``config``."""

    def __init__(self):
        super().__init__()
        self.ub_name = None
        self.fuse_wgrad_accumulation = False
        self.weight = torch.nn.Parameter(torch.randn(OUT, IN))


class LayerNormLinear(MegatronLinear):
    def __init__(self, normalization="LayerNorm", zero_centered_gamma=True, **kwargs):
        super().__init__(**kwargs)
        self.normalization = normalization
        self.eps = 1e-6
        self.zero_centered_gamma = zero_centered_gamma
        # A norm dtype unlike the linear's, to see which one the op takes.
        self.layer_norm_weight = torch.nn.Parameter(torch.randn(IN, dtype=torch.float32))
        ln_bias = torch.nn.Parameter(torch.randn(IN)) if normalization == "LayerNorm" else None
        self.layer_norm_bias = ln_bias


class TERMSNorm(torch.nn.Module):
    def __init__(self, sm_margins=True):
        super().__init__()
        self.eps = 1e-5
        self.zero_centered_gamma = False
        self.weight = torch.nn.Parameter(torch.ones(IN, dtype=DTYPE))
        if sm_margins:
            self._sm_margins = {"forward": 2, "backward": 4, "inference": 0}


def fake_group(monkeypatch, size=2):
    group = object()
    monkeypatch.setattr(adapters, "get_pg_size", lambda g=None: size if g is group else 1)
    return group


# ------------------------------------------------------------------------- names and delegation


@pytest.mark.parametrize("name", UPSTREAM_NAMES)
def test_upstream_names_are_the_adapter_functions(name):
    assert getattr(te_ext, name) is getattr(adapters, name)


@pytest.mark.parametrize(
    "method",
    [
        "_make_te_ops_rmsnorm_from_te_rmsnorm",
        "_make_te_ops_norm_from_mcore_te_layernorm_linear",
        "_make_te_ops_basic_linear_from_mcore_te_linear",
        "_make_te_ops_grouped_linear_from_mcore_te_linear",
        "_make_te_ops_bias_from_tensor",
        "_get_te_ops_rng_state_tracker_function",
    ],
)
def test_mixin_methods_are_the_adapter_functions(method):
    # One implementation: the mixin's helper methods are the module-level functions.
    assert getattr(TEFusedOpsMixin, method) is getattr(adapters, method)


def test_mixin_tensor_parallel_context(monkeypatch):
    group = fake_group(monkeypatch)
    holder = SimpleNamespace(tp_group=group)
    assert TEFusedOpsMixin._get_te_ops_tensor_parallel_context(holder) == (2, group)
    via_fc1 = SimpleNamespace(linear_fc1=SimpleNamespace(tp_group=group))
    assert TEFusedOpsMixin._get_te_ops_tensor_parallel_context(via_fc1) == (2, group)
    # No group at all: built outside a distributed job, one rank.
    assert TEFusedOpsMixin._get_te_ops_tensor_parallel_context(SimpleNamespace()) == (1, None)


# ------------------------------------------------------------------------------- validation


def test_nested_attribute_lookup():
    module = SimpleNamespace(config=SimpleNamespace(tp_comm_overlap=False), weight=1)
    assert adapters._te_ops_has_nested_attr(module, "weight")
    assert adapters._te_ops_has_nested_attr(module, "config.tp_comm_overlap")
    assert not adapters._te_ops_has_nested_attr(module, "config.missing")
    assert not adapters._te_ops_has_nested_attr(module, "missing.tp_comm_overlap")


def test_validation_names_the_module_its_class_and_every_missing_attribute():
    with pytest.raises(ValueError) as info:
        adapters._validate_te_ops_adapter_module(Linear(), "fc", ("weight", "a", "config.b"))
    message = str(info.value)
    assert "fc" in message and "Linear" in message and "a, config.b" in message
    assert "weight" not in message.split("lacks")[1]


def test_plain_te_linear_is_refused_by_the_basic_linear_adapter(fake_te):
    plain = Linear()
    with pytest.raises(ValueError) as info:
        te_ext._make_te_ops_basic_linear_from_mcore_te_linear(plain, module_name="plain_linear")
    message = str(info.value)
    assert "plain_linear" in message and "Linear" in message
    assert "config.tp_comm_overlap" in message
    # A config without the field is just as incomplete.
    plain.config = SimpleNamespace()
    with pytest.raises(ValueError, match="config.tp_comm_overlap"):
        te_ext._make_te_ops_basic_linear_from_mcore_te_linear(plain, module_name="plain_linear")


# ------------------------------------------------------------------------------ BasicLinear


def test_basic_linear_aliases_the_weight_on_the_meta_device(fake_te):
    linear = MegatronLinear(fuse_wgrad=True)
    rng = object()
    op = adapters._make_te_ops_basic_linear_from_mcore_te_linear(
        linear, module_name="fc", rng_state_tracker_function=rng
    )
    assert type(op) is fake_te.pytorch.ops.BasicLinear
    assert op.weight is linear.weight
    assert op.args == (IN, OUT)
    assert op.kwargs == dict(
        device="meta",
        dtype=DTYPE,
        tensor_parallel_mode=None,
        tensor_parallel_group=None,
        sequence_parallel=False,
        rng_state_tracker_function=rng,
        accumulate_into_main_grad=True,
    )
    assert list(op.parameters()) == [linear.weight]  # the meta placeholder is gone
    x = torch.randn(3, IN, dtype=DTYPE)
    torch.testing.assert_close(op(x), x @ linear.weight.T)


def test_basic_linear_takes_global_feature_counts(fake_te, monkeypatch):
    group = fake_group(monkeypatch)
    linear = MegatronLinear()
    column = adapters._make_te_ops_basic_linear_from_mcore_te_linear(
        linear,
        module_name="fc1",
        tensor_parallel_mode="column",
        tensor_parallel_group=group,
        sequence_parallel=True,
    )
    assert column.args == (IN, 2 * OUT)
    assert column.kwargs["tensor_parallel_mode"] == "column"
    assert column.kwargs["tensor_parallel_group"] is group
    assert column.kwargs["sequence_parallel"] is True
    row = adapters._make_te_ops_basic_linear_from_mcore_te_linear(
        linear, module_name="fc2", tensor_parallel_mode="row", tensor_parallel_group=group
    )
    assert row.args == (2 * IN, OUT)
    given = adapters._make_te_ops_basic_linear_from_mcore_te_linear(
        linear,
        module_name="fc1",
        output_features=7,
        tensor_parallel_mode="column",
        tensor_parallel_group=group,
    )
    assert given.args == (IN, 7)  # an explicit output_features wins, as upstream


@pytest.mark.parametrize("mode", ["column", "row"])
def test_basic_linear_refuses_a_mode_without_its_group(fake_te, mode):
    # TE would split over the whole world, whatever group the weight was split over.
    with pytest.raises(ValueError, match=rf"tensor_parallel_mode='{mode}'.*tensor_parallel_group"):
        adapters._make_te_ops_basic_linear_from_mcore_te_linear(
            MegatronLinear(), module_name="fc", tensor_parallel_mode=mode
        )


@pytest.mark.parametrize(
    "overlap,ub_name,passed",
    [(True, "fc1", {"comm_name": "fc1"}), (True, None, None), (False, "fc1", None)],
)
def test_basic_linear_userbuffers_options(fake_te, overlap, ub_name, passed):
    linear = MegatronLinear(tp_comm_overlap=overlap, ub_name=ub_name)
    op = adapters._make_te_ops_basic_linear_from_mcore_te_linear(linear, module_name="fc")
    if passed is None:
        # Left out rather than None, so TE builds without the keyword still construct.
        assert "userbuffers_options" not in op.kwargs
    else:
        assert op.kwargs["userbuffers_options"] == passed


def test_userbuffers_on_a_te_without_the_option_is_refused(fake_te, monkeypatch):
    def older_init(self, in_features, out_features, *, device=None, dtype=None):
        pass

    monkeypatch.setattr(
        fake_te.pytorch.ops, "BasicLinear", type("BasicLinear", (), {"__init__": older_init})
    )
    linear = MegatronLinear(tp_comm_overlap=True, ub_name="fc1")
    with pytest.raises(RuntimeError, match="tp_comm_overlap=True.*userbuffers_options"):
        adapters._make_te_ops_basic_linear_from_mcore_te_linear(linear, module_name="fc1")
    assert adapters._te_ops_userbuffers_options(MegatronLinear()) is None  # nothing to refuse


# ------------------------------------------------------------------------------------ norms


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_from_a_layernorm_linear_aliases_its_norm_parameters(fake_te, normalization):
    linear = LayerNormLinear(normalization)
    op = te_ext._make_te_ops_norm_from_mcore_te_layernorm_linear(linear, "linear_fc1")
    assert type(op) is getattr(fake_te.pytorch.ops, normalization)
    assert op.args == (IN,)  # the linear's input features
    assert op.kwargs == dict(eps=1e-6, device="meta", dtype=torch.float32, zero_centered_gamma=True)
    assert op.weight is linear.layer_norm_weight
    if normalization == "LayerNorm":
        assert op.bias is linear.layer_norm_bias


def test_norm_from_a_layernorm_linear_refuses(fake_te):
    linear = LayerNormLinear()
    linear.normalization = "ScaleNorm"
    with pytest.raises(ValueError, match=r"linear_fc1: Unsupported normalization \(ScaleNorm\)"):
        adapters._make_te_ops_norm_from_mcore_te_layernorm_linear(linear, "linear_fc1")
    with pytest.raises(ValueError, match="linear_fc1.*MegatronLinear lacks eps, layer_norm_bias"):
        adapters._make_te_ops_norm_from_mcore_te_layernorm_linear(MegatronLinear(), "linear_fc1")


@pytest.mark.parametrize("sm_margins", [True, False])
def test_rmsnorm_from_a_te_rmsnorm(fake_te, sm_margins):
    norm = TERMSNorm(sm_margins)
    op = te_ext._make_te_ops_rmsnorm_from_te_rmsnorm(norm, "norm")
    assert type(op) is fake_te.pytorch.ops.RMSNorm
    assert op.weight is norm.weight and op.args == (norm.weight.shape,)
    expected = dict(eps=1e-5, device="meta", dtype=DTYPE, zero_centered_gamma=False)
    if sm_margins:
        expected["sm_margin"] = norm._sm_margins  # older TE modules have none to pass
    assert op.kwargs == expected


def test_rmsnorm_adapter_refuses_a_module_without_the_norm_attributes(fake_te):
    with pytest.raises(ValueError, match="final_norm.*Linear lacks eps, zero_centered_gamma"):
        adapters._make_te_ops_rmsnorm_from_te_rmsnorm(Linear(), "final_norm")


# ------------------------------------------------------------------------ bias, grouped, misc


def test_bias_op_aliases_a_bias_and_is_none_without_one(fake_te):
    assert te_ext._make_te_ops_bias_from_tensor(None) is None
    # TE registers an empty tensor as the bias of a bias-free layer.
    assert te_ext._make_te_ops_bias_from_tensor(MegatronLinear(bias=False).bias) is None
    bias = MegatronLinear().bias
    op = te_ext._make_te_ops_bias_from_tensor(bias)
    assert op.bias is bias and op.args == (OUT,)
    assert op.kwargs == dict(device="meta", dtype=DTYPE)


def test_grouped_linear_aliases_the_weight_as_weight0(fake_te):
    linear = MegatronLinear(fuse_wgrad=True)
    op = adapters._make_te_ops_grouped_linear_from_mcore_te_linear(linear, module_name="fc1")
    assert op.weight0 is linear.weight and op.args == (1, IN, OUT)
    assert op.kwargs["bias"] is False and op.kwargs["accumulate_into_main_grad"] is True
    with pytest.raises(ValueError, match="fc1.*lacks fuse_wgrad_accumulation"):
        adapters._make_te_ops_grouped_linear_from_mcore_te_linear(
            torch.nn.Linear(2, 2), module_name="fc1"
        )


def test_tensor_parallel_context(monkeypatch):
    group = fake_group(monkeypatch)
    assert te_ext._get_te_ops_tensor_parallel_context(group) == (2, group)
    single = object()  # a one-rank group: TE ops get no group
    assert te_ext._get_te_ops_tensor_parallel_context(single) == (1, None)
    # Without an argument: parallel_state's global group, as upstream; its size is read through
    # the public module, where upstream's tests patch it.
    monkeypatch.setattr(te_ext, "get_tensor_model_parallel_world_size", lambda: 4)
    monkeypatch.setattr(
        adapters, "get_tensor_model_parallel_group", lambda check_initialized=True: group
    )
    assert te_ext._get_te_ops_tensor_parallel_context() == (4, group)
    monkeypatch.setattr(te_ext, "get_tensor_model_parallel_world_size", lambda: 1)
    assert te_ext._get_te_ops_tensor_parallel_context() == (1, None)


@pytest.mark.parametrize("initialized", [False, True])
def test_rng_tracker_function_only_once_the_tracker_is_seeded(monkeypatch, initialized):
    tracker = SimpleNamespace(is_initialized=lambda: initialized)

    def getter():
        return tracker

    monkeypatch.setattr(te_ext, "get_cuda_rng_tracker", getter)
    expected = getter if initialized else None
    assert te_ext._get_te_ops_rng_state_tracker_function() is expected
