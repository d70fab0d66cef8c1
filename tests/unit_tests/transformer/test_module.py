"""transformer.module: MegatronModule, the mixed-precision helpers and Float16Module."""

from __future__ import annotations

import pytest
import torch

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.module import (
    Float16Module,
    GraphableMegatronModule,
    MegatronModule,
    conversion_helper,
    float16_to_fp32,
    fp32_to_float16,
    mark_keep_in_fp32,
    param_is_not_shared,
)


def test_param_is_not_shared():
    param = torch.nn.Parameter(torch.zeros(2))
    assert param_is_not_shared(param)
    param.shared = True
    assert not param_is_not_shared(param)


def test_conversions_keep_nesting_and_touch_only_the_right_dtypes():
    nested = (torch.ones(2), [torch.ones(2, dtype=torch.int64), 3.0], torch.ones(1).half())
    assert conversion_helper(nested, lambda v: "x") == ("x", ["x", "x"], "x")
    half = fp32_to_float16(nested, lambda t: t.bfloat16())
    assert half[0].dtype == torch.bfloat16 and half[1][0].dtype == torch.int64
    assert half[1][1] == 3.0 and half[2].dtype == torch.float16
    back = float16_to_fp32(half)
    assert back[0].dtype == back[2].dtype == torch.float32 and back[1][0].dtype == torch.int64


class _Net(MegatronModule):
    def __init__(self, config):
        super().__init__(config)
        self.linear = torch.nn.Linear(4, 3)
        self.scale = mark_keep_in_fp32(torch.nn.Parameter(torch.ones(3)))
        self.seen = None

    def forward(self, x):
        self.seen = x.dtype
        return self.linear(x) * self.scale.to(x.dtype)


@pytest.mark.parametrize("flag,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_float16_module_runs_in_half_and_returns_fp32(flag, dtype):
    config = ModelParallelConfig(**{flag: True})
    net = _Net(config)
    wrapped = Float16Module(config, net)
    assert net.linear.weight.dtype == dtype and net.scale.dtype == torch.float32
    out = wrapped(torch.randn(2, 4))
    assert net.seen == dtype and out.dtype == torch.float32
    assert wrapped(torch.randn(2, 4), fp32_output=False).dtype == dtype
    assert set(wrapped.state_dict()) == {"linear.weight", "linear.bias", "scale"}
    wrapped.load_state_dict(wrapped.state_dict())


def test_float16_module_needs_a_half_precision_flag():
    with pytest.raises(ValueError, match="config.fp16 or config.bf16"):
        Float16Module(ModelParallelConfig(), _Net(ModelParallelConfig()))


def _config_with(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True
    )
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def _module_with_flagged_child(config):
    from megatron.core.transformer.module import MegatronModule

    module = MegatronModule(config)
    module.flagged = torch.nn.Module()
    module.flagged.is_first_microbatch = False
    module.plain = torch.nn.Linear(1, 1)
    return module


@pytest.mark.parametrize(
    "fields",
    [{"fp8": "hybrid"}, {"fp4": "nvfp4"}, {"use_kitchen": True}, {"quant_recipe": object()}],
)
def test_set_is_first_microbatch_flags_te_modules_under_quantization(fields):
    module = _module_with_flagged_child(_config_with(**fields))
    module.set_is_first_microbatch()
    assert module.flagged.is_first_microbatch is True
    assert module.modules_with_is_first_microbatch == [module.flagged]
    module.flagged.is_first_microbatch = False  # a forward clears it; the next call sets it again
    module.set_is_first_microbatch()
    assert module.flagged.is_first_microbatch is True


def test_set_is_first_microbatch_leaves_the_flag_without_quantization():
    module = _module_with_flagged_child(_config_with())
    module.set_is_first_microbatch()
    assert module.flagged.is_first_microbatch is False


def test_set_symmetric_ar_sets_every_module_that_has_the_option():
    module = _module_with_flagged_child(_config_with())
    module.plain.symmetric_ar_type = "two_shot"
    module.set_symmetric_ar("one_shot")
    assert module.plain._symmetric_ar_cache == "one_shot"
    module.set_symmetric_ar(None)
    assert module.plain._symmetric_ar_cache is None
    with pytest.raises(AssertionError):
        module.set_symmetric_ar("three_shot")


# ------------------------------------------------------------------ GraphableMegatronModule
class _Graphable(GraphableMegatronModule):
    def __init__(self, config):
        super().__init__(config)
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.child = torch.nn.Linear(1, 1)
        self.calls = 0

    def forward(self, hidden_states, scale=None, is_first_microbatch=False):
        self.calls += 1
        return hidden_states + self.weight


class _Graph:
    def __init__(self):
        self.calls, self.backward_dw_calls = [], 0

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return args[0] * 10

    def backward_dw(self):
        self.backward_dw_calls += 1


def test_graphable_module_refuses_a_config_that_is_not_a_transformer_config():
    with pytest.raises(AssertionError, match="config must be a TransformerConfig"):
        GraphableMegatronModule(ModelParallelConfig())


def test_graphable_module_without_cuda_graphs_runs_its_forward():
    layer = _Graphable(_config_with())
    assert not hasattr(layer, "cuda_graphs")
    assert torch.equal(layer(torch.zeros(1)), torch.ones(1)) and layer.calls == 1


def test_graphable_module_replays_te_graphs_in_training_only():
    layer = _Graphable(_config_with(cuda_graph_impl="transformer_engine"))
    assert layer.cuda_graphs == [] and layer.cuda_graph_manual_hooks == []
    layer.train()
    layer(torch.zeros(1))  # no graph yet: the capture path, which is the forward
    assert layer.calls == 1

    hooked = []
    layer.setup_manual_hooks(lambda: hooked.append)
    # Every module holding parameters itself gets its hook (the graph skips pre-hooks).
    assert {id(args[0]) for _, args in layer.cuda_graph_manual_hooks} == {
        id(layer),
        id(layer.child),
    }
    graphs = [_Graph(), _Graph()]
    layer.cuda_graphs = graphs
    layer.current_microbatch = 3
    out = layer(torch.ones(1), scale=torch.tensor(2.0))
    assert torch.equal(out, torch.full((1,), 10.0)) and layer.calls == 1
    (args, kwargs) = graphs[1].calls[0]
    assert kwargs["is_first_microbatch"] is False and torch.equal(
        kwargs["scale"], torch.tensor(2.0)
    )
    assert sorted(map(id, hooked)) == sorted([id(layer), id(layer.child)])

    layer.current_microbatch = 0
    layer(hidden_states=torch.ones(1))
    assert graphs[0].calls[0][1] == {"is_first_microbatch": True}
    layer._te_cuda_graph_backward_dw_graph(2)
    assert graphs[0].backward_dw_calls == 1
    layer.cuda_graphs = [object()]  # a graph without a weight-gradient part: nothing to run
    layer._te_cuda_graph_backward_dw_graph(0)

    layer.eval()
    layer.cuda_graphs = graphs
    layer(torch.zeros(1))
    assert layer.calls == 2  # evaluation runs the forward, never a training graph


def test_graphable_module_replay_arguments_are_checked_with_upstreams_messages():
    layer = _Graphable(_config_with(cuda_graph_impl="transformer_engine"))
    layer.cuda_graphs = [_Graph()]
    with pytest.raises(AssertionError, match="CUDA graph accepts only Tensor inputs"):
        layer._te_cuda_graph_replay("not-a-tensor")
    with pytest.raises(AssertionError, match="CUDA graph accepts only Tensor inputs"):
        layer._te_cuda_graph_replay(torch.ones(1), scale=2.0)
    with pytest.raises(AssertionError, match="hidden_states should only"):
        layer._get_te_cuda_graph_replay_args(torch.ones(1), hidden_states=torch.ones(1))
    with pytest.raises(AssertionError, match="hidden_states is required"):
        layer._get_te_cuda_graph_replay_args(scale=torch.ones(1))


def test_graphable_module_static_inputs_split_the_sequence(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    config = _config_with(context_parallel_size=2, sequence_parallel=True)
    config.tensor_model_parallel_size = 2
    inputs = _Graphable(config).get_layer_static_inputs(seq_length=8, micro_batch_size=3)
    hidden = inputs["hidden_states"]
    assert hidden.shape == (2, 3, 8) and hidden.dtype == torch.bfloat16 and hidden.requires_grad


def test_graphable_module_hands_calls_to_a_local_graph_manager():
    class _WithManager(_Graphable):
        def create_mcore_cudagraph_manager(self, config):
            self.cudagraph_manager = lambda module, args, kwargs: ("managed", module, args)

    layer = _WithManager(_config_with(cuda_graph_impl="local"))
    x = torch.ones(1)
    assert layer(x) == ("managed", layer, (x,)) and layer.calls == 0
    # Without a manager of its own the fork has none to make: the layer runs eagerly.
    assert torch.equal(_Graphable(_config_with(cuda_graph_impl="local"))(x), 2 * x)


def test_module_exposes_parallel_state_as_upstream():
    # Upstream's tests and users patch transformer.module.parallel_state.<getter>.
    from megatron.core import parallel_state
    from megatron.core.transformer import module

    assert module.parallel_state is parallel_state
