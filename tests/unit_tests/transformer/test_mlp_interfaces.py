"""The MLP submodule Protocols: upstream's signatures, reachable from mlp, used by MLPSubmodules,
and met by the fork's linear and TE classes (checked by binding the Protocol's call against each
class's signature, and by building and running the local linears on CPU)."""

from __future__ import annotations

import inspect
import typing
from typing import Optional, Union

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.extensions import transformer_engine as te_ext
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import mlp, mlp_interfaces
from megatron.core.transformer.mlp import (
    LinearFc1Builder,
    LinearFc1Interface,
    LinearFc2Builder,
    LinearFc2Interface,
    MLPSubmodules,
    TEActivationFunctionBuilder,
    TEActivationFunctionInterface,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

P, K = inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.KEYWORD_ONLY
NO = inspect.Parameter.empty

# Upstream main's parameters (name, kind, default) of each builder's __call__, self left out.
UPSTREAM_CALLS = {
    LinearFc1Builder: [
        ("input_size", P, NO),
        ("output_size", P, NO),
        ("config", K, NO),
        ("init_method", K, NO),
        ("gather_output", K, NO),
        ("bias", K, NO),
        ("skip_bias_add", K, NO),
        ("is_expert", K, NO),
        ("tp_comm_buffer_name", K, NO),
        ("tp_group", K, NO),
        ("stride", K, 1),
        ("name", K, None),
    ],
    LinearFc2Builder: [
        ("input_size", P, NO),
        ("output_size", P, NO),
        ("config", K, NO),
        ("init_method", K, NO),
        ("bias", K, NO),
        ("input_is_parallel", K, NO),
        ("skip_bias_add", K, NO),
        ("is_expert", K, NO),
        ("tp_comm_buffer_name", K, NO),
        ("tp_group", K, NO),
        ("name", K, None),
    ],
    TEActivationFunctionBuilder: [("config", K, NO)],
}
INTERFACES = (LinearFc1Interface, LinearFc2Interface, TEActivationFunctionInterface)


def _call_parameters(protocol) -> list[inspect.Parameter]:
    return list(inspect.signature(protocol.__call__).parameters.values())[1:]


def accepts_builder_call(builder, protocol) -> bool:
    """Whether ``builder`` can be called as ``protocol`` says: with every parameter, and with
    only the required ones (a caller may leave the Protocol's defaulted parameters out)."""
    signature = inspect.signature(builder)
    params = _call_parameters(protocol)
    for subset in (params, [p for p in params if p.default is NO]):
        args = [p.name for p in subset if p.kind is P]
        kwargs = {p.name: p.name for p in subset if p.kind is K}
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            return False
    return True


def test_builder_signatures_are_upstreams():
    for protocol, expected in UPSTREAM_CALLS.items():
        got = [(p.name, p.kind, p.default) for p in _call_parameters(protocol)]
        assert got == expected, protocol.__name__


def test_interfaces_declare_upstreams_methods():
    for interface in INTERFACES:
        forward = list(inspect.signature(interface.forward).parameters.values())
        assert [p.kind for p in forward[1:]] == [P], interface.__name__  # one positional input
    for interface in (LinearFc1Interface, LinearFc2Interface):
        assert list(inspect.signature(interface.backward_dw).parameters) == ["self"]
    assert not hasattr(TEActivationFunctionInterface, "backward_dw")


def test_reachable_from_mlp_and_used_by_mlp_submodules():
    for name in mlp_interfaces.__all__:
        assert getattr(mlp, name) is getattr(mlp_interfaces, name)
    hints = typing.get_type_hints(MLPSubmodules)
    assert hints["linear_fc1"] == Optional[Union[ModuleSpec, LinearFc1Builder]]
    assert hints["linear_fc2"] == Optional[Union[ModuleSpec, LinearFc2Builder]]
    assert hints["activation_func"] == Optional[Union[ModuleSpec, TEActivationFunctionBuilder]]


def test_static_only_as_upstreams():
    # Not runtime_checkable: an isinstance check is a TypeError, not a silent structural match.
    with pytest.raises(TypeError):
        isinstance(object(), LinearFc1Interface)


@pytest.mark.parametrize(
    "builder, protocol",
    [
        (ColumnParallelLinear, LinearFc1Builder),
        (RowParallelLinear, LinearFc2Builder),
        (te_ext.TEColumnParallelLinear, LinearFc1Builder),
        (te_ext.TELayerNormColumnParallelLinear, LinearFc1Builder),
        (te_ext.TERowParallelLinear, LinearFc2Builder),
        (te_ext.TE_ONLY_CLASSES["TEActivationOp"], TEActivationFunctionBuilder),
    ],
    ids=lambda value: getattr(value, "__name__", str(value)),
)
def test_the_forks_classes_accept_the_builder_call(builder, protocol):
    assert accepts_builder_call(builder, protocol)


def test_the_conformance_check_can_fail():
    class TakesAnything:
        def __init__(self, *args, **kwargs):
            pass

    class NeedsExtra:
        def __init__(self, *args, extra, **kwargs):
            pass

    class RequiresStride:
        def __init__(self, *args, stride, **kwargs):
            pass

    def no_tp_group(input_size, output_size, *, config, init_method, gather_output, bias):
        pass

    assert not accepts_builder_call(no_tp_group, LinearFc1Builder)
    assert not accepts_builder_call(NeedsExtra, LinearFc2Builder)
    # The Protocol lets a caller omit stride, so a builder may not require it.
    assert not accepts_builder_call(RequiresStride, LinearFc1Builder)
    assert accepts_builder_call(TakesAnything, LinearFc2Builder)


def test_local_linears_built_by_the_protocol_call_meet_the_interfaces(single_rank_model_parallel):
    model_parallel_cuda_manual_seed(2)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        ffn_hidden_size=12,
        use_cpu_initialization=True,
        add_bias_linear=True,
    )
    common = dict(
        config=config,
        bias=True,
        skip_bias_add=True,
        is_expert=False,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
    )
    fc1 = ColumnParallelLinear(
        8,
        12,
        init_method=config.init_method,
        gather_output=False,
        tp_comm_buffer_name="fc1",
        **common,
    )
    fc2 = RowParallelLinear(
        12,
        8,
        init_method=config.output_layer_init_method,
        input_is_parallel=True,
        tp_comm_buffer_name="fc2",
        **common,
    )
    x = torch.randn(3, 8)
    hidden, fc1_bias = fc1.forward(x)
    out, fc2_bias = fc2.forward(hidden + fc1_bias)
    assert hidden.shape == (3, 12) and out.shape == (3, 8)
    # skip_bias_add: the bias comes back separately, as the interfaces' second element.
    torch.testing.assert_close(fc1_bias, fc1.bias)
    torch.testing.assert_close(out, (hidden + fc1_bias) @ fc2.weight.T)
    assert fc2_bias is fc2.bias
    assert fc1.backward_dw() is None and fc2.backward_dw() is None
