"""A layer's activation is one object built at construction; a forward does no spec work.

``MLP`` and ``SequentialMLP``'s experts build their ``LayerActivation`` (spec, path, kernel
variants, parameter tensor) in ``__init__``. These tests count, during forwards and backwards of
built layers, the calls of every function that derives something from the config or the spec
(``ActivationSpec.from_config``, the path selection, the fused lowering, ``KernelVariant.of``,
``spec_params``): none. They also check that the object's fused call gives the same bits as the
functional ``fused_activation`` and that its parameter tensors are a per-device cache that a
fake-tensor trace, a copy or a pickle never carries off.
"""

from __future__ import annotations

import copy
import pickle
import sys
from collections import Counter

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mcore_activations import activation_path
from mcore_activations.activation_spec import ActivationSpec
from mcore_activations.fusions import fused_activation as fused_module
from mcore_activations.fusions.activation_kernels import KernelVariant
from mcore_activations.fusions.fused_activation import fused_activation
from mcore_activations.kernel_params import spec_params
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import FUSED_KERNEL_PATH, MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from tests.unit_tests.test_utilities import Utils
from tests.unit_tests.transformer.mlp_test_utils import FUSED, UNFUSED, kernel_mode, make_config

FORWARDS = 5
HIDDEN = 24
SUBMODULES = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
MOE = dict(num_moe_experts=2, moe_ffn_hidden_size=40, ffn_hidden_size=40)


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


# Functions that derive something from the config or the spec; a built layer's forward calls
# none of them. Module-level functions are counted under every name the package binds them to.
_FUNCTIONS = {
    "spec_params": spec_params,
    "lower_to_fused_kernel": fused_module.lower_to_fused_kernel,
    "select_activation_path": activation_path.select_activation_path,
    "select_layer_activation": activation_path.select_layer_activation,
    "fused_activation": fused_activation,
}
_CLASSMETHODS = {
    "KernelVariant.of": (KernelVariant, "of"),
    "from_config": (ActivationSpec, "from_config"),
}


def count_spec_work(monkeypatch) -> Counter:
    """Counts the calls of the derivations above from now on (restored by ``monkeypatch``)."""
    counts: Counter = Counter()

    def counting(name, original):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        return wrapper

    for name, original in _FUNCTIONS.items():
        wrapper = counting(name, original)
        for module_name, module in list(sys.modules.items()):
            if not module_name.startswith(("mcore_activations", "megatron.core")):
                continue
            for attr, value in list(vars(module).items()):
                if value is original:
                    monkeypatch.setattr(module, attr, wrapper)
    for name, (cls, attr) in _CLASSMETHODS.items():
        original = cls.__dict__[attr].__func__
        monkeypatch.setattr(cls, attr, classmethod(counting(name, original)))
    return counts


def _mlp(path, entry="swiglu_clamp", **extra):
    config = make_config(entry, torch.float32, path, **MOE, **extra)
    pg = ProcessGroupCollection.use_mpu_process_groups(["tp"])
    return MLP(config, SUBMODULES, ffn_hidden_size=40, tp_group=pg.tp, pg_collection=pg)


def _experts(path, entry="swiglu_clamp"):
    config = make_config(entry, torch.float32, path, **MOE)
    pg = ProcessGroupCollection.use_mpu_process_groups(["ep", "expt_tp"])
    return SequentialMLP(2, config, SUBMODULES, pg_collection=pg)


def _run_mlp(mlp, scale: bool):
    x = torch.randn(3, 2, HIDDEN, requires_grad=True)
    probs = torch.rand(3, 2) if scale else None
    out, bias = mlp(x, per_token_scale=probs)
    (out if bias is None else out + bias).sum().backward()
    with torch.no_grad():
        mlp(x, per_token_scale=probs)


def _run_experts(experts):
    x = torch.randn(7, HIDDEN, requires_grad=True)
    out, _ = experts(x, [4, 3], torch.rand(7))
    out.sum().backward()


@pytest.mark.parametrize("path", [FUSED, UNFUSED])
def test_built_mlp_forward_derives_nothing(path, monkeypatch):
    mlp = _mlp(path)
    counts = count_spec_work(monkeypatch)
    with kernel_mode(path):
        for i in range(FORWARDS):
            _run_mlp(mlp, scale=bool(i % 2))
    assert counts == Counter(), counts


@pytest.mark.parametrize("path", [FUSED, UNFUSED])
def test_built_sequential_mlp_forward_derives_nothing(path, monkeypatch):
    experts = _experts(path)
    counts = count_spec_work(monkeypatch)
    with kernel_mode(path):
        for _ in range(FORWARDS):
            _run_experts(experts)
    assert counts == Counter(), counts


def test_the_counters_count(monkeypatch):
    # Teeth: the functional entry point derives per call, and building a layer derives.
    counts = count_spec_work(monkeypatch)
    spec = _mlp(FUSED).activation_spec
    assert counts["from_config"] and counts["select_layer_activation"]
    counts.clear()
    with kernel_mode(FUSED):
        fused_activation(torch.randn(4, 80), spec)
    assert counts["KernelVariant.of"] == 1 and counts["spec_params"] == 1, counts
    assert counts["lower_to_fused_kernel"] == 1, counts


@pytest.mark.parametrize("entry", ["swiglu_clamp", "situ_glu", "quick_geglu_gpt_oss", "gelu"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_probs", [False, True])
def test_fused_call_equals_the_functional_entry_point(entry, with_bias, with_probs):
    activation = _mlp(FUSED, entry).layer_activation
    spec = activation.spec
    width = 80 if spec.gated else 40
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, width, generator=gen)
    bias = torch.randn(width, generator=gen) if with_bias else None
    probs = torch.rand(6, 1, generator=gen) if with_probs else None
    grad = torch.randn(6, 40, generator=gen)

    def run(fn):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, bias, probs)]
        out = fn(*leaves)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves if t is not None]

    with kernel_mode(FUSED):
        got = run(lambda x, b, p: activation(x, b, p))
        expected = run(lambda x, b, p: fused_activation(x, spec, bias=b, probs=p))
        with torch.no_grad():
            assert torch.equal(activation(x, bias, probs), expected[0])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_params_are_cached_per_device_and_never_fake():
    activation = _mlp(FUSED).layer_activation
    assert activation.path == FUSED_KERNEL_PATH
    plan = activation._plan
    cpu = torch.device("cpu")
    params = plan.params(cpu)
    assert plan.params(cpu) is params
    torch.testing.assert_close(params, torch.tensor(spec_params(activation.spec)))
    with FakeTensorMode():
        fake = plan.params(cpu)
    assert fake is not params and plan.params(cpu) is params


def test_copied_and_pickled_activations_make_their_own_params():
    # A layer holding process groups cannot be copied, nor a config holding local init
    # functions pickled; the activation object copies and pickles with what it holds.
    activation = _mlp(FUSED).layer_activation
    bare = activation_path.LayerActivation(activation.spec, activation.path, activation.func)
    x = torch.randn(4, 80)
    with kernel_mode(FUSED):
        expected = activation(x)
        bare(x)
    assert activation._plan._params and bare._plan._params
    for clone in (copy.deepcopy(activation), pickle.loads(pickle.dumps(bare))):
        assert clone._plan._params == {}
        assert clone.spec == activation.spec and clone.path == activation.path
        with kernel_mode(FUSED):
            torch.testing.assert_close(clone(x), expected, rtol=0, atol=0)


def test_the_in_place_option_is_resolved_at_each_call(monkeypatch):
    # None: the process default when the call is made, not when the layer was built.
    from mcore_activations.fusions import in_place

    activation = _mlp(FUSED).layer_activation
    assert activation.in_place_backward is None
    seen = []
    real = in_place.resolve
    monkeypatch.setattr(in_place, "resolve", lambda value: seen.append(value) or real(value))
    x = torch.randn(4, 80).mul(2).requires_grad_()  # not a leaf: an in-place backward may run
    with in_place.use_in_place_backward(True):
        out = activation(x.clone())
    assert seen == [None] and out.grad_fn is not None
    with pytest.raises(TypeError, match="in_place_backward must be True, False or None"):
        activation_path.LayerActivation(
            activation.spec, FUSED_KERNEL_PATH, None, in_place_backward="1"
        )


@pytest.mark.parametrize("path", [FUSED, UNFUSED])
def test_an_assigned_activation_spec_is_what_the_layer_computes(path, monkeypatch):
    # A subclass may change the spec after MLP.__init__ (FusedSharedExpertMLP sets its GLU
    # layout): the next forward rebuilds the activation once, and later ones derive nothing.
    clamped, plain = _mlp(path), _mlp(path, "swiglu")
    plain.load_state_dict(clamped.state_dict())
    x = torch.randn(3, 2, HIDDEN) * 8
    clamped.activation_spec = plain.activation_spec
    with kernel_mode(path):
        torch.testing.assert_close(clamped(x)[0], plain(x)[0], rtol=0, atol=0)
        assert clamped.layer_activation.spec is plain.activation_spec
        counts = count_spec_work(monkeypatch)
        clamped(x)
    assert counts == Counter(), counts
