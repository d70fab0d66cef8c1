"""transformer.module: MegatronModule, the mixed-precision helpers and Float16Module."""

from __future__ import annotations

import pytest
import torch

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.module import (
    Float16Module,
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
