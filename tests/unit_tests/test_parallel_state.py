"""parallel_state: rank layouts, group membership, getters, overrides and errors."""

import pytest
import torch

import megatron.core.parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.test_utilities import Utils, run_distributed

# ------------------------------------------------------------------------- pure layout math


def test_orthogonal_groups_tp_fastest():
    # 8 ranks as tp=2 x dp=2 x pp=2 (tp fastest).
    sizes = [2, 2, 2]
    tp = ps.generate_masked_orthogonal_rank_groups(8, sizes, [True, False, False])
    dp = ps.generate_masked_orthogonal_rank_groups(8, sizes, [False, True, False])
    pp = ps.generate_masked_orthogonal_rank_groups(8, sizes, [False, False, True])
    tp_dp = ps.generate_masked_orthogonal_rank_groups(8, sizes, [True, True, False])
    assert tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert pp == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert tp_dp == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("sizes", [[2, 3, 2], [4, 1, 3], [1, 1, 1], [3, 2]])
def test_orthogonal_groups_partition_the_world(sizes):
    world = 1
    for size in sizes:
        world *= size
    for mask_bits in range(2 ** len(sizes)):
        mask = [bool(mask_bits >> i & 1) for i in range(len(sizes))]
        groups = ps.generate_masked_orthogonal_rank_groups(world, sizes, mask)
        assert sorted(r for g in groups for r in g) == list(range(world))
        expected_size = 1
        for size, masked in zip(sizes, mask):
            expected_size *= size if masked else 1
        assert all(len(g) == expected_size for g in groups)


def test_rank_generator_default_order_and_expert_layout():
    # 8 ranks: dense tp=2 cp=1 dp=4; experts etp=1 ep=4 edp=2.
    dense = ps.RankGenerator(tp=2, ep=1, dp=4, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    expert = ps.RankGenerator(tp=1, ep=4, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    assert dense.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dense.get_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert expert.get_ranks("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert expert.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert expert.get_ranks("tp") == [[r] for r in range(8)]


@pytest.mark.parametrize("order", ["tp-tp-dp", "tp-xx-dp", "tp_cp_ep_dp_pp"])
def test_rank_generator_rejects_malformed_order(order):
    with pytest.raises(ValueError, match="order="):
        ps.RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order=order)


def test_rank_generator_missing_dimension_must_have_size_one():
    assert ps.RankGenerator(tp=2, ep=1, dp=1, pp=1, cp=1, order="tp-dp").world_size == 2
    with pytest.raises(ValueError, match="lacks 'ep'"):
        ps.RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=1, order="tp-dp")


# --------------------------------------------------------------- one-process gloo world


@pytest.fixture
def single_rank():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


def test_initialize_and_getters(single_rank):
    assert ps.is_initialized() and ps.model_parallel_is_initialized()
    for getter in (
        ps.get_tensor_model_parallel_world_size,
        ps.get_pipeline_model_parallel_world_size,
        ps.get_data_parallel_world_size,
        ps.get_context_parallel_world_size,
        ps.get_expert_model_parallel_world_size,
        ps.get_expert_tensor_parallel_world_size,
        ps.get_expert_data_parallel_world_size,
        ps.get_expert_tensor_and_model_parallel_world_size,
        ps.get_tensor_and_context_parallel_world_size,
    ):
        assert getter() == 1, getter.__name__
    for getter in (
        ps.get_tensor_model_parallel_rank,
        ps.get_pipeline_model_parallel_rank,
        ps.get_data_parallel_rank,
        ps.get_context_parallel_rank,
        ps.get_expert_model_parallel_rank,
        ps.get_expert_tensor_parallel_rank,
        ps.get_expert_data_parallel_rank,
    ):
        assert getter() == 0, getter.__name__
    for getter in (
        ps.get_tensor_model_parallel_group,
        ps.get_pipeline_model_parallel_group,
        ps.get_model_parallel_group,
        ps.get_data_parallel_group,
        ps.get_context_parallel_group,
        ps.get_tensor_and_context_parallel_group,
        ps.get_tensor_and_data_parallel_group,
        ps.get_amax_reduction_group,
        ps.get_expert_model_parallel_group,
        ps.get_expert_tensor_parallel_group,
        ps.get_expert_tensor_and_model_parallel_group,
        ps.get_expert_tensor_model_pipeline_parallel_group,
        ps.get_expert_data_parallel_group,
    ):
        assert getter() is not None, getter.__name__
    assert ps.get_tensor_model_parallel_src_rank() == 0
    assert ps.get_data_parallel_src_rank() == 0
    assert ps.get_context_parallel_global_ranks() == [0]
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.get_pipeline_model_parallel_first_rank() == ps.get_pipeline_model_parallel_last_rank()
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None


def test_destroy_is_idempotent_and_getters_then_assert(single_rank):
    ps.destroy_model_parallel()
    ps.destroy_model_parallel()
    assert not ps.is_initialized() and not ps.model_parallel_is_initialized()
    with pytest.raises(AssertionError, match="tensor model parallel group is not initialized"):
        ps.get_tensor_model_parallel_group()
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    with pytest.raises(AssertionError, match="expert tensor parallel group is not initialized"):
        ps.get_expert_tensor_parallel_world_size()


def test_reinitialize_replaces_groups(single_rank):
    first = ps.get_tensor_model_parallel_group()
    Utils.initialize_model_parallel(1, 1, virtual_pipeline_model_parallel_size=2)
    assert ps.get_tensor_model_parallel_group() is not first
    assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
    assert ps.get_virtual_pipeline_model_parallel_rank() == 0


@pytest.mark.parametrize(
    "kwargs, divisor",
    [
        ({"tensor_model_parallel_size": 2}, 2),
        ({"context_parallel_size": 3}, 3),
        ({"expert_model_parallel_size": 2}, 2),
        ({"expert_tensor_parallel_size": 4}, 4),
    ],
)
def test_world_size_not_divisible(single_rank, kwargs, divisor):
    with pytest.raises(RuntimeError, match=rf"world_size \(1\) is not divisible by {divisor}"):
        ps.initialize_model_parallel(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tensor_model_parallel_size": 0}, "tensor_model_parallel_size must be a positive"),
        ({"expert_model_parallel_size": -1}, "expert_model_parallel_size must be a positive"),
        ({"order": "tp-dp-dp"}, "order="),
        ({"hierarchical_context_parallel_sizes": [1]}, "hierarchical_context_parallel_sizes"),
        ({"num_distributed_optimizer_instances": 2}, "num_distributed_optimizer_instances"),
        ({"rank_offset": 1}, "rank_offset"),
    ],
)
def test_invalid_arguments(single_rank, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ps.initialize_model_parallel(**kwargs)


def test_requires_torch_distributed(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ps.initialize_model_parallel()


def test_without_torch_distributed_one_rank(monkeypatch):
    ps.destroy_model_parallel()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_expert_model_parallel_world_size() == 1
    assert ps.get_expert_tensor_parallel_rank() == 0


def test_overrides_win_and_are_cleared():
    ps.set_tensor_model_parallel_world_size(4)
    ps.set_tensor_model_parallel_rank(3)
    ps.set_expert_model_parallel_world_size(8)
    ps.set_expert_model_parallel_rank(5)
    ps.set_pipeline_model_parallel_world_size(2)
    ps.set_pipeline_model_parallel_rank(1)
    try:
        assert ps.get_tensor_model_parallel_world_size() == 4
        assert ps.get_tensor_model_parallel_rank() == 3
        assert ps.get_expert_model_parallel_world_size() == 8
        assert ps.get_expert_model_parallel_rank() == 5
        assert ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()
    finally:
        ps.destroy_model_parallel()


def test_fake_initialize_model_parallel():
    Utils.fake_initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=4)
    try:
        assert ps.get_tensor_model_parallel_world_size() == 2
        assert ps.get_tensor_model_parallel_rank() == 0
        assert ps.get_expert_model_parallel_world_size() == 4
    finally:
        Utils.destroy_model_parallel()
    assert not Utils.inited


def test_global_memory_buffer(single_rank):
    buffer = ps.get_global_memory_buffer()
    a = buffer.get_tensor((2, 3), torch.float32, "scratch")
    b = buffer.get_tensor((6,), torch.float32, "scratch")
    assert a.shape == (2, 3) and a.data_ptr() == b.data_ptr()  # one buffer, reused
    bigger = buffer.get_tensor((4, 4), torch.float32, "scratch")
    assert bigger.numel() == 16
    other = buffer.get_tensor((2,), torch.bfloat16, "scratch")
    assert other.dtype == torch.bfloat16  # (name, dtype) keys separate buffers
    ps.destroy_global_memory_buffer()
    with pytest.raises(AssertionError, match="global memory buffer is not initialized"):
        ps.get_global_memory_buffer()


def test_process_group_collection(single_rank):
    everything = ProcessGroupCollection.use_mpu_process_groups()
    assert everything.tp is ps.get_tensor_model_parallel_group()
    assert everything.expt_tp is ps.get_expert_tensor_parallel_group()
    assert everything.dp_cp is ps.get_data_parallel_group(with_context_parallel=True)
    assert everything.embd is ps.get_embedding_group()
    assert everything.gtp_remat is ps.get_gtp_weight_remat_group()
    # Groups this fork never builds are collected as None, as upstream's are when off.
    assert everything.hcp is None and "hcp" in vars(everything)
    assert everything.inter_dist_opt is None and everything.dp_cp_ag is None

    only_tp = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "ep"])
    # As upstream: a declared group that was not given reads as None; vars() tells what was given.
    assert only_tp.dp is None and set(vars(only_tp)) == {"tp", "ep"}
    assert repr(only_tp) == "ProcessGroupCollection(tp(1), ep(1))"
    assert repr(ProcessGroupCollection()) == "ProcessGroupCollection(empty)"
    with pytest.raises(AttributeError, match="has no attribute 'tensor'"):
        only_tp.tensor  # noqa: B018 - not a declared group

    with pytest.raises(ValueError, match="Invalid process groups requested: \\['nope'\\]"):
        ProcessGroupCollection.use_mpu_process_groups(required_pgs=["nope"])
    with pytest.raises(ValueError, match="unknown process group name"):
        ProcessGroupCollection(tensor=None)


# ------------------------------------------------------------------ two-process gloo world


def _check_layout(rank, expected):
    for name, value in expected.items():
        actual = getattr(ps, name)()
        assert actual == value, f"rank {rank}: {name}() = {actual}, expected {value}"


def _two_rank_worker(rank, world_size):
    assert world_size == 2

    # TP=2: both ranks split one layer; experts default to the same tensor-parallel split.
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    _check_layout(
        rank,
        {
            "get_tensor_model_parallel_world_size": 2,
            "get_tensor_model_parallel_rank": rank,
            "get_tensor_model_parallel_src_rank": 0,
            "get_data_parallel_world_size": 1,
            "get_data_parallel_src_rank": rank,
            "get_expert_tensor_parallel_world_size": 2,
            "get_expert_tensor_parallel_rank": rank,
            "get_expert_model_parallel_world_size": 1,
            "get_expert_data_parallel_world_size": 1,
            "get_model_parallel_src_rank": 0,
            "get_expert_model_parallel_src_rank": rank,
            "get_all_ranks": f"{rank}_0_0_0_0_0",
        },
    )
    assert ps.get_intra_distributed_optimizer_instance_group() is ps.get_data_parallel_group(
        with_context_parallel=True
    )
    assert torch.distributed.get_process_group_ranks(ps.get_tensor_model_parallel_group()) == [0, 1]
    # The group really communicates: an all-reduce over it sums both ranks.
    value = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(value, group=ps.get_tensor_model_parallel_group())
    assert value.item() == 3.0
    ps.destroy_model_parallel()

    # EP=2 with dense TP=1: the dense layers are data parallel, the experts are split.
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    _check_layout(
        rank,
        {
            "get_tensor_model_parallel_world_size": 1,
            "get_data_parallel_world_size": 2,
            "get_data_parallel_rank": rank,
            "get_expert_model_parallel_world_size": 2,
            "get_expert_model_parallel_rank": rank,
            "get_expert_tensor_parallel_world_size": 1,
            "get_expert_data_parallel_world_size": 1,
            "get_expert_tensor_and_model_parallel_world_size": 2,
        },
    )
    assert torch.distributed.get_process_group_ranks(ps.get_expert_model_parallel_group()) == [0, 1]
    ps.destroy_model_parallel()

    # TP=2 dense with ETP=1 x EP=2 experts: the same two ranks, split differently.
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    )
    _check_layout(
        rank,
        {
            "get_tensor_model_parallel_world_size": 2,
            "get_expert_model_parallel_world_size": 2,
            "get_expert_model_parallel_rank": rank,
            "get_expert_tensor_parallel_world_size": 1,
            "get_expert_data_parallel_world_size": 1,
        },
    )
    # FP8 amax statistics are shared by every copy of a weight: here, the TP pair.
    assert torch.distributed.get_process_group_ranks(ps.get_amax_reduction_group()) == [0, 1]
    ps.destroy_model_parallel()

    # PP=2: one rank per stage.
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    _check_layout(
        rank,
        {
            "get_pipeline_model_parallel_world_size": 2,
            "get_pipeline_model_parallel_rank": rank,
            "get_pipeline_model_parallel_first_rank": 0,
            "get_pipeline_model_parallel_last_rank": 1,
            "get_pipeline_model_parallel_next_rank": 1 - rank,
            "is_pipeline_first_stage": rank == 0,
            "is_pipeline_last_stage": rank == 1,
        },
    )
    ps.destroy_model_parallel()


def test_two_rank_layouts():
    run_distributed(_two_rank_worker, world_size=2, timeout_s=120)
