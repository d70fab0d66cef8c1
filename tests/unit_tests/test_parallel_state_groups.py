"""parallel_state's further groups: embedding, gloo, GTP, helpers, NCCL options, legacy names."""

from datetime import timedelta

import pytest
import torch

import megatron.core.parallel_state as ps
from tests.unit_tests.test_utilities import Utils, run_distributed


@pytest.fixture
def single_rank():
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


def test_default_embedding_ranks():
    assert ps.default_embedding_ranks([3]) == [3]
    assert ps.default_embedding_ranks([0, 4, 8]) == [0, 8]
    assert ps.default_position_embedding_ranks([0, 4, 8]) == [0]


def test_one_rank_further_groups(single_rank):
    assert ps.get_embedding_group().size() == 1
    assert ps.get_position_embedding_group().size() == 1
    assert ps.is_rank_in_embedding_group() and ps.is_rank_in_position_embedding_group()
    assert ps.is_rank_in_embedding_group(ignore_virtual=False)
    for gloo in (
        ps.get_data_parallel_group_gloo(),
        ps.get_data_parallel_group_gloo(with_context_parallel=True),
        ps.get_data_parallel_group_gloo(with_context_parallel=True, partial_data_parallel=True),
        ps.get_expert_data_parallel_group_gloo(),
    ):
        assert torch.distributed.get_backend(gloo) == "gloo"
    with pytest.raises(AssertionError, match="Partial DP for Optimizer needs to include CP"):
        ps.get_data_parallel_group_gloo(partial_data_parallel=True)
    # GTP is off: every rank is its own group, as upstream with gtp_remat_size=1.
    assert ps.get_gtp_weight_remat_world_size() == 1 and ps.get_gtp_weight_remat_rank() == 0
    assert ps.get_gtp_weight_remat_global_ranks() == [0]
    assert ps.get_expert_gtp_weight_remat_world_size() == 1
    assert ps.get_expert_gtp_weight_remat_group().size() == 1
    assert ps.get_all_ranks() == "0_0_0_0_0_0"


def test_getters_before_initialization():
    ps.destroy_model_parallel()
    assert ps.get_embedding_group(check_initialized=False) is None
    with pytest.raises(AssertionError, match="embedding group is not initialized"):
        ps.get_embedding_group()
    assert ps.get_gtp_weight_remat_world_size() == 0
    assert not ps.is_rank_in_position_embedding_group()


def test_groups_this_fork_does_not_build(single_rank):
    with pytest.raises(AssertionError, match="hierarchical"):
        ps.get_hierarchical_context_parallel_groups()
    assert ps.get_hierarchical_context_parallel_groups(check_initialized=False) is None
    with pytest.raises(AssertionError, match="inter distributed-optimizer"):
        ps.get_inter_distributed_optimizer_instance_group()
    assert ps.get_inter_distributed_optimizer_instance_group(check_initialized=False) is None
    # The whole data x context-parallel size is the data x context-parallel group itself.
    assert ps.get_hybrid_data_context_parallel_groups(group_size=1) is ps.get_data_parallel_group(
        with_context_parallel=True
    )
    with pytest.raises(AssertionError, match="hybrid"):
        ps.get_hybrid_data_context_parallel_groups(group_size=4)


def test_no_gloo_copies_when_not_asked():
    Utils.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    try:
        with pytest.raises(AssertionError, match="gloo"):
            ps.get_data_parallel_group_gloo()
    finally:
        Utils.destroy_model_parallel()


def test_legacy_module_variables(single_rank):
    assert ps._MODEL_PARALLEL_GROUP is ps.get_model_parallel_group()
    assert ps._PIPELINE_GLOBAL_RANKS == [0]
    assert ps._EMBEDDING_GLOBAL_RANKS == [0]
    ps.destroy_model_parallel()
    assert ps._MODEL_PARALLEL_GROUP is None
    with pytest.raises(AttributeError, match="_NO_SUCH_GROUP"):
        ps._NO_SUCH_GROUP  # noqa: B018 - the attribute access is the test


def test_nccl_comm_cfgs():
    cfgs = {}
    ps.overwrite_nccl_comm_cfgs(cfgs, "dp", ("max_ctas", 8))
    ps.overwrite_nccl_comm_cfgs(cfgs, "dp", ("min_ctas", 2))
    assert cfgs == {"dp": {"max_ctas": 8, "min_ctas": 2}}
    assert ps.get_nccl_options("tp", cfgs) is None


@pytest.mark.skipif(
    not hasattr(torch.distributed, "ProcessGroupNCCL"), reason="this torch has no NCCL backend"
)
def test_nccl_options_read_the_config():
    options = ps.get_nccl_options("dp", {"dp": {"max_ctas": 8, "is_high_priority_stream": True}})
    assert options.config.max_ctas == 8 and options.is_high_priority_stream
    with pytest.raises(RuntimeError, match="net_name"):
        ps.get_nccl_options("dp", {"dp": {"net_name": "ethernet"}})


def test_create_group_and_timeout(single_rank):
    group = ps.create_group([0], timeout=timedelta(minutes=5), group_desc="TEST")
    assert group.size() == 1
    ps.update_pg_timeout(timedelta(minutes=7), pg=group)
    ps.update_pg_timeout(timedelta(minutes=30))


def test_destroy_forgets_the_created_groups():
    from megatron.core import parallel_state_groups

    Utils.initialize_model_parallel(1, 1)
    ps.create_group([0])
    assert parallel_state_groups._CREATED_GROUPS
    Utils.destroy_model_parallel()
    # As upstream clears its group list: nothing of the last set-up stays referenced here.
    assert parallel_state_groups._CREATED_GROUPS == []


def test_harness_set_ups_leave_no_gloo_groups_behind():
    # Each one-rank gloo group keeps threads; the harness destroys the ones a set-up made (NCCL
    # groups, on a GPU machine, stay: destroying them is collective business).
    Utils.initialize_distributed()
    world = torch.distributed.distributed_c10d._world

    def gloo_groups():
        return [g for g in world.pg_map if torch.distributed.get_backend(g) == "gloo"]

    before = len(gloo_groups())
    for _ in range(2):
        Utils.initialize_model_parallel(1, 1)
        assert len(gloo_groups()) > before  # the data-parallel gloo copies
        Utils.destroy_model_parallel()
        assert len(gloo_groups()) == before


def test_harness_teardown_leaves_a_tests_own_groups_alone():
    Utils.initialize_distributed()
    Utils.initialize_model_parallel(1, 1)
    own = torch.distributed.new_group([0], backend="gloo")
    Utils.destroy_model_parallel()
    try:
        assert own in torch.distributed.distributed_c10d._world.pg_map
        torch.distributed.barrier(own)
    finally:
        torch.distributed.destroy_process_group(own)


def test_all_gather_groups_need_initialization():
    ps.destroy_model_parallel()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.create_all_gather_groups()


def test_hierarchical_groups_reject_wrong_sizes(single_rank):
    with pytest.raises(ValueError, match="multiply to 4, not the 1 ranks"):
        ps.create_hierarchical_groups(0, [0], [2, 2])


def _two_rank_worker(rank, world_size):
    # pp=2: the embedding group spans both stages, the position embedding only the first.
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    result = {
        "embd": torch.distributed.get_process_group_ranks(ps.get_embedding_group()),
        "in_pos": ps.is_rank_in_position_embedding_group(),
        "dp_gloo": ps.get_data_parallel_group_gloo().size(),
    }
    dp_cp_ag, expt_dp_ag = ps.create_all_gather_groups(for_expert_parallelism=True)
    result["ag"] = (dp_cp_ag.size(), expt_dp_ag.size())
    groups, gloo = ps.create_hierarchical_groups(
        rank, [0, 1], [2], create_gloo_process_groups=True, group_desc="T"
    )
    result["hier"] = (torch.distributed.get_process_group_ranks(groups[0]), gloo[0].size())
    result["hybrid"] = ps.create_hybrid_dp_cp_groups(rank, [0, 1], None)
    ps.destroy_model_parallel()
    # A custom callback decides the embedding ranks.
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=2, get_embedding_ranks=lambda pp_ranks: pp_ranks[-1:]
    )
    result["custom"] = ps.is_rank_in_embedding_group()
    all_results = [None, None]
    torch.distributed.all_gather_object(all_results, result)
    return all_results


def test_two_rank_further_groups():
    first, second = run_distributed(_two_rank_worker, world_size=2, timeout_s=120)
    assert first["embd"] == second["embd"] == [0, 1]
    assert first["in_pos"] and not second["in_pos"]
    assert first["dp_gloo"] == 1
    assert first["ag"] == (1, 1)
    assert first["hier"] == ([0, 1], 2)
    # Power-of-two sizes from 2 up to half the ranks: none for two ranks.
    assert first["hybrid"] == {}
    assert not first["custom"] and second["custom"]


def test_resolve_gtp_remat_group(single_rank):
    from megatron.core.process_groups_config import ProcessGroupCollection, resolve_gtp_remat_group

    assert resolve_gtp_remat_group(None, is_expert=False) is ps.get_gtp_weight_remat_group()
    assert resolve_gtp_remat_group(None, is_expert=True) is ps.get_expert_gtp_weight_remat_group()
    # A collection that carries the field decides, even when it holds None.
    assert resolve_gtp_remat_group(ProcessGroupCollection(gtp_remat=None), is_expert=False) is None
    custom = ps.get_tensor_model_parallel_group()
    given = ProcessGroupCollection(expt_gtp_remat=custom)
    assert resolve_gtp_remat_group(given, is_expert=True) is custom
    # One without the field falls back to parallel_state.
    assert resolve_gtp_remat_group(ProcessGroupCollection(), is_expert=False) is (
        ps.get_gtp_weight_remat_group()
    )


def test_upstream_signatures_take_the_gtp_flags(single_rank):
    assert ps.get_data_parallel_group(False, False) is ps.get_data_parallel_group()
    assert ps.get_data_parallel_world_size(True, False) == 1
    assert ps.get_expert_data_parallel_group(True, False) is ps.get_expert_data_parallel_group()
    assert ps.get_tensor_and_data_parallel_group(False) is ps.get_tensor_and_data_parallel_group()
    assert ps.get_expert_tensor_model_pipeline_parallel_group(True, True) is (
        ps.get_expert_tensor_model_pipeline_parallel_group()
    )


def test_multi_module_collection(single_rank):
    from megatron.core.process_groups_config import (
        MultiModuleProcessGroupCollection,
        ProcessGroupCollection,
        ProcessGroupHelperMeta,
    )

    llm = ProcessGroupCollection(cp=ps.get_context_parallel_group())
    encoder = ProcessGroupCollection()
    both = MultiModuleProcessGroupCollection({"encoder": encoder, "llm": llm}, "llm")
    assert both.has_language_model() and both.get_language_model_cp_size() == 1
    assert both["encoder"] is encoder and list(both) == [encoder, llm] and len(both) == 2
    assert list(both.keys()) == ["encoder", "llm"]
    assert repr(both) == (
        "MultiModuleProcessGroupCollection(modules=[encoder, llm], "
        "language_model_module_name='llm')"
    )
    no_lm = MultiModuleProcessGroupCollection({"encoder": encoder})
    with pytest.raises(ValueError, match="No language model"):
        no_lm.get_language_model_collection()
    with pytest.raises(ValueError, match="Module 'x' not found"):
        no_lm.get_module_collection("x")
    with pytest.raises(ValueError, match="cannot be empty"):
        MultiModuleProcessGroupCollection({})
    with pytest.raises(ValueError, match="'llm' not found"):
        MultiModuleProcessGroupCollection({"encoder": encoder}, "llm")

    class Helper(metaclass=ProcessGroupHelperMeta):
        pass

    Helper.other = 1
    with pytest.raises(AttributeError, match="set_virtual_pipeline_model_parallel_size"):
        Helper.virtual_pipeline_model_parallel_size = 2
