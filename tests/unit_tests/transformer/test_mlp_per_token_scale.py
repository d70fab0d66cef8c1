"""``per_token_scale`` of any real dtype: every MLP path computes the same answer.

Upstream's MLP multiplies the activation by the scale, which promotes an integer or boolean scale
to a float; its fused weighted kernels do the same. The fused kernels take float probabilities
only, so the scale is converted to float32 before any path sees it; a complex scale is refused
with an error that names ``per_token_scale`` on every path.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.mlp import MLP
from tests.unit_tests.test_utilities import Utils
from tests.unit_tests.transformer.mlp_test_utils import FUSED, UNFUSED, make_config

SEQ, BATCH = 4, 3


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


def _mlp(path: str, seed: int = 0) -> MLP:
    config = make_config("swiglu", torch.float32, path)
    pg = ProcessGroupCollection.use_mpu_process_groups(["tp"])
    torch.manual_seed(seed)
    layer = MLP(
        config,
        get_gpt_layer_local_submodules().mlp.submodules,
        ffn_hidden_size=config.ffn_hidden_size,
        tp_group=pg.tp,
        pg_collection=pg,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_per_token_scale_gives_the_same_answer_on_every_path(dtype):
    x = torch.randn(SEQ, BATCH, 24)
    scale = torch.randint(0, 3, (SEQ, BATCH)).to(dtype)
    results = {}
    for path in (UNFUSED, FUSED):
        layer = _mlp(path)
        xi = x.clone().requires_grad_()
        out, out_bias = layer(xi, per_token_scale=scale)
        assert out_bias is None
        out.sum().backward()
        results[path] = (out.detach(), xi.grad)
        # The float scale of the same values computes the same.
        expected, _ = _mlp(path)(x, per_token_scale=scale.float())
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[UNFUSED][0], results[FUSED][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[UNFUSED][1], results[FUSED][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", [UNFUSED, FUSED])
def test_complex_per_token_scale_is_refused_by_name_on_every_path(path):
    layer = _mlp(path)
    scale = torch.ones(SEQ, BATCH, dtype=torch.complex64)
    with pytest.raises(TypeError, match="per_token_scale must be a real tensor"):
        layer(torch.randn(SEQ, BATCH, 24), per_token_scale=scale)
