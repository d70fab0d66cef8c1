"""VocabParallelEmbedding against a full nn.Embedding on the same weights: one process, and two
gloo ranks (all-reduce and reduce-scatter outputs, each rank's weight gradient)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.utils import init_method_normal
from tests.unit_tests.test_utilities import Utils, run_distributed

VOCAB, HIDDEN, BATCH, SEQ = 12, 5, 2, 4


def _config(**kwargs):
    return ModelParallelConfig(use_cpu_initialization=True, **kwargs)


def _ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _embedding(group, **kwargs):
    torch.manual_seed(0)  # the full weight is drawn identically on every rank
    return VocabParallelEmbedding(
        VOCAB, HIDDEN, init_method=init_method_normal(1.0), tp_group=group, **kwargs
    )


def _full_weight():
    torch.manual_seed(0)
    weight = torch.empty(VOCAB, HIDDEN)
    init_method_normal(1.0)(weight)
    return weight


@pytest.fixture
def one_rank():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


@pytest.mark.parametrize("deterministic", [False, True])
def test_single_rank_is_a_plain_embedding(deterministic, one_rank):
    layer = _embedding(None, config=_config(deterministic_mode=deterministic))
    assert torch.equal(layer.weight, _full_weight())
    ids = _ids()
    out = layer(ids)
    torch.testing.assert_close(out, F.embedding(ids, _full_weight()), rtol=0, atol=0)
    out.sum().backward()
    counts = torch.bincount(ids.flatten(), minlength=VOCAB).float()
    torch.testing.assert_close(layer.weight.grad, counts[:, None].expand(VOCAB, HIDDEN))


def _worker(rank, world):
    group = dist.new_group(list(range(world)))
    rows = slice(rank * VOCAB // world, (rank + 1) * VOCAB // world)
    full = _full_weight().requires_grad_()
    ids = _ids()
    expected = F.embedding(ids, full)
    grad = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(2))
    expected.backward(grad)

    layer = _embedding(group, config=_config())
    assert torch.equal(layer.weight, full.detach()[rows])
    out = layer(ids)
    out.backward(grad)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(layer.weight.grad, full.grad[rows])

    scattered = _embedding(group, config=_config(), reduce_scatter_embeddings=True)
    out = scattered(ids)  # [seq / tp, batch, hidden]
    seq = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    torch.testing.assert_close(out, expected.transpose(0, 1)[seq])


def test_two_ranks_match_a_full_embedding():
    run_distributed(_worker, world_size=2, timeout_s=120)


def _indivisible_worker(rank, world):
    group = dist.new_group(list(range(world)))
    with pytest.raises(ValueError, match="num_embeddings=11 is not divisible"):
        VocabParallelEmbedding(
            11, 4, init_method=init_method_normal(1.0), config=_config(), tp_group=group
        )


def test_vocabulary_must_divide_by_the_tensor_parallel_size():
    run_distributed(_indivisible_worker, world_size=2, timeout_s=120)
