"""tensor_parallel names added for upstream compatibility: attribute helpers, the frozen-weight
Function and the last-dim / all-to-all collectives (two gloo ranks against full tensors)."""

import pytest
import torch

import megatron.core.tensor_parallel as tp
from megatron.core.tensor_parallel import layers, mappings
from tests.unit_tests.test_utilities import Utils, run_distributed


class _Group:
    """A stand-in group that only answers ``rank()``, enough for the duplicate filters."""

    def __init__(self, rank):
        self._rank = rank

    def rank(self):
        return self._rank


def test_exported_from_the_package():
    for name in (
        "LinearWithFrozenWeight",
        "copy_gtp_attributes",
        "param_is_not_gtp_duplicate",
        "all_gather_last_dim_from_tensor_parallel_region",
        "reduce_scatter_last_dim_to_tensor_parallel_region",
        "all_to_all_sp2hp",
        "all_to_all_hp2sp",
        "convert_cuda_rng_state",
    ):
        assert hasattr(tp, name), name


def test_tensor_parallel_duplicate_filter_uses_the_given_groups():
    param = torch.empty(2)
    assert layers.param_is_not_tensor_parallel_duplicate(param, tp_group=_Group(0))
    assert not layers.param_is_not_tensor_parallel_duplicate(param, tp_group=_Group(1))
    # A parameter reduced over the expert data-parallel group is judged in the expert TP group.
    param.allreduce = False
    assert layers.param_is_not_tensor_parallel_duplicate(
        param, tp_group=_Group(1), expert_tp_group=_Group(0)
    )
    shard = torch.empty(2)
    shard.tensor_model_parallel = True
    assert layers.param_is_not_tensor_parallel_duplicate(shard, tp_group=_Group(3))


def test_attribute_copies_keep_upstream_markers():
    source, destination = torch.empty(4), torch.empty(4)
    source.is_qkv = True
    source.qkv_split_shapes = [2, 2]
    source.expert_tp = True
    source.partition_dim = 0
    layers.copy_tensor_model_parallel_attributes(destination, source)
    assert destination.is_qkv and destination.qkv_split_shapes == [2, 2]
    assert destination.expert_tp and destination.partition_dim == 0

    fresh = torch.empty(1)
    layers.set_defaults_if_not_set_tensor_model_parallel_attributes(fresh)
    assert fresh.is_qkv is False and fresh.qkv_split_shapes is None and fresh.expert_tp is False

    source.is_gtp_weight_remat = True
    source.allreduce = False
    source.pad_length = 3
    copy = torch.empty(4)
    layers.copy_gtp_attributes(copy, source)
    assert copy.is_gtp_weight_remat and copy.allreduce is False and copy.pad_length == 3
    assert not hasattr(copy, "gtp_replica_group")  # only what the source has is copied


def test_gtp_duplicate_filter():
    Utils.initialize_model_parallel(1, 1)
    try:
        remat = torch.empty(1)
        remat.is_gtp_weight_remat = True
        expert = torch.empty(1)
        expert.allreduce = False
        # Without GTP every rank is rank 0 of its (single-rank) GTP group: everything counts.
        assert layers.param_is_not_gtp_duplicate(remat)
        assert layers.param_is_not_gtp_duplicate(expert)
        assert layers.param_is_not_gtp_duplicate(torch.empty(1))
    finally:
        Utils.destroy_model_parallel()


def test_linear_with_frozen_weight_function():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.float64)
    bias = torch.randn(6, dtype=torch.float64)
    out = layers.LinearWithFrozenWeight.apply(x, weight, bias, False, None, None)
    torch.testing.assert_close(out, x.detach() @ weight.T + bias)
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.testing.assert_close(x.grad, grad @ weight)
    # The output dtype is honoured; the input gradient keeps the input's dtype.
    x32 = x.detach().float().requires_grad_()
    half = layers.LinearWithFrozenWeight.apply(
        x32, weight.float(), None, False, None, torch.bfloat16
    )
    assert half.dtype == torch.bfloat16
    half.float().sum().backward()
    assert x32.grad.dtype == torch.float32


def test_all_to_all_needs_a_group():
    with pytest.raises(ValueError, match="needs a process group"):
        mappings.all_to_all(None, torch.zeros(2, 2))


def _worker(rank, world_size):
    group = torch.distributed.new_group([0, 1])
    torch.manual_seed(0)  # the same full tensors on both ranks
    full = torch.randn(4, 3, 8, dtype=torch.float64)
    grad_full = torch.randn(4, 3, 8, dtype=torch.float64)
    other = torch.randn(4, 3, 8, dtype=torch.float64)  # rank 1's addend in the reduction
    results = {}

    local = full.chunk(2, dim=-1)[rank].clone().requires_grad_()
    out = mappings.all_gather_last_dim_from_tensor_parallel_region(local, group)
    results["ag"] = torch.equal(out.detach(), full)
    out.backward(grad_full)
    # Adjoint: reduce-scatter of the (identical) gradients, i.e. twice this rank's chunk.
    results["ag_grad"] = torch.equal(local.grad, 2 * grad_full.chunk(2, dim=-1)[rank])

    summand = (full if rank == 0 else other).clone().requires_grad_()
    out = mappings.reduce_scatter_last_dim_to_tensor_parallel_region(summand, group)
    results["rs"] = torch.allclose(out.detach(), (full + other).chunk(2, dim=-1)[rank])
    out.backward(grad_full.chunk(2, dim=-1)[rank])
    results["rs_grad"] = torch.equal(summand.grad, grad_full)

    tokens = full.reshape(-1, 8)  # 12 tokens
    seq_local = tokens.chunk(2, dim=0)[rank].clone().requires_grad_()
    hidden = mappings.all_to_all_sp2hp(seq_local, group)
    results["sp2hp"] = torch.equal(hidden.detach(), tokens.chunk(2, dim=-1)[rank])
    back = mappings.all_to_all_hp2sp(hidden, group)
    results["hp2sp"] = torch.equal(back.detach(), seq_local.detach())
    back.backward(torch.ones_like(back))
    results["a2a_grad"] = torch.equal(seq_local.grad, torch.ones_like(seq_local))
    return results


def test_last_dim_and_all_to_all_collectives_on_two_ranks():
    results = run_distributed(_worker, world_size=2, timeout_s=120)
    assert results == {key: True for key in results} and len(results) == 7, results
