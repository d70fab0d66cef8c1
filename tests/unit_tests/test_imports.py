"""Every module path and public name of the parallel-state / tensor-parallel API imports.

Upstream code and tests import these by path, so a rename or a missing export is an API break.
"""

import importlib

import pytest

PUBLIC_API = {
    "megatron.core.model_parallel_config": ["ModelParallelConfig"],
    "megatron.core.transformer.transformer_config": ["TransformerConfig"],
    "megatron.core.transformer": [
        "MegatronModule",
        "ModuleSpec",
        "build_module",
        "TransformerConfig",
    ],
    "megatron.core.transformer.module": ["MegatronModule"],
    "megatron.core.transformer.spec_utils": [
        "ModuleSpec",
        "build_module",
        "get_submodules",
        "import_module",
    ],
    "megatron.core.transformer.identity_op": ["IdentityOp", "IdentityFuncOp"],
    "megatron.core.models.gpt.gpt_layer_specs": [
        "get_gpt_layer_local_submodules",
        "get_mlp_module_spec",
    ],
    "megatron.core.utils": [
        "divide",
        "get_pg_rank",
        "get_pg_size",
        "get_tensor_model_parallel_group_if_none",
        "init_method_normal",
        "scaled_init_method_normal",
        "make_viewless_tensor",
        "safely_set_viewless_tensor_data",
        "get_attr_wrapped_model",
        "get_model_config",
        "log_single_rank",
        "nvtx_range_push",
        "nvtx_range_pop",
        "deprecate_inference_params",
        "GlobalMemoryBuffer",
    ],
    "megatron.core.parallel_state": [
        "get_model_parallel_src_rank",
        "get_expert_model_parallel_src_rank",
        "get_intra_distributed_optimizer_instance_group",
        "get_global_memory_buffer",
        "destroy_global_memory_buffer",
        "get_all_ranks",
        "initialize_model_parallel",
        "destroy_model_parallel",
        "is_initialized",
        "model_parallel_is_initialized",
        "get_tensor_model_parallel_group",
        "get_tensor_model_parallel_world_size",
        "get_tensor_model_parallel_rank",
        "get_tensor_model_parallel_src_rank",
        "get_pipeline_model_parallel_group",
        "get_pipeline_model_parallel_world_size",
        "get_pipeline_model_parallel_rank",
        "get_data_parallel_group",
        "get_data_parallel_world_size",
        "get_data_parallel_rank",
        "get_context_parallel_group",
        "get_context_parallel_world_size",
        "get_context_parallel_rank",
        "get_context_parallel_global_ranks",
        "get_amax_reduction_group",
        "get_model_parallel_group",
        "get_tensor_and_context_parallel_group",
        "get_tensor_and_data_parallel_group",
        "get_expert_model_parallel_group",
        "get_expert_model_parallel_world_size",
        "get_expert_model_parallel_rank",
        "get_expert_tensor_parallel_group",
        "get_expert_tensor_parallel_world_size",
        "get_expert_tensor_parallel_rank",
        "get_expert_tensor_and_model_parallel_group",
        "get_expert_tensor_model_pipeline_parallel_group",
        "get_expert_data_parallel_group",
        "get_expert_data_parallel_world_size",
        "get_expert_data_parallel_rank",
        "set_tensor_model_parallel_world_size",
        "set_tensor_model_parallel_rank",
        "set_pipeline_model_parallel_world_size",
        "set_pipeline_model_parallel_rank",
        "set_expert_model_parallel_world_size",
        "set_expert_model_parallel_rank",
        "set_expert_tensor_parallel_world_size",
        "set_expert_tensor_parallel_rank",
        "RankGenerator",
        "generate_masked_orthogonal_rank_groups",
    ],
    "megatron.core.process_groups_config": ["ProcessGroupCollection"],
    "megatron.core.tensor_parallel": [
        "ColumnParallelLinear",
        "RowParallelLinear",
        "linear_with_grad_accumulation_and_async_allreduce",
        "LinearWithGradAccumulationAndAsyncCommunication",
        "linear_with_frozen_weight",
        "VocabParallelEmbedding",
        "checkpoint",
        "CheckpointWithoutOutput",
        "VocabUtility",
        "split_tensor_into_1d_equal_chunks",
        "gather_split_1d_tensor",
        "CudaRNGStatesTracker",
        "get_cuda_rng_tracker",
        "model_parallel_cuda_manual_seed",
        "get_expert_parallel_rng_tracker_name",
        "get_data_parallel_rng_tracker_name",
        "copy_to_tensor_model_parallel_region",
        "reduce_from_tensor_model_parallel_region",
        "scatter_to_tensor_model_parallel_region",
        "gather_from_tensor_model_parallel_region",
        "gather_from_sequence_parallel_region",
        "reduce_scatter_to_sequence_parallel_region",
        "scatter_to_sequence_parallel_region",
        "all_to_all",
        "divide",
        "split_tensor_along_last_dim",
        "set_tensor_model_parallel_attributes",
        "param_is_not_tensor_parallel_duplicate",
    ],
    "megatron.core.tensor_parallel.layers": ["ColumnParallelLinear", "RowParallelLinear"],
    "megatron.core.tensor_parallel.mappings": [
        "copy_to_tensor_model_parallel_region",
        "gather_from_sequence_parallel_region",
        "reduce_scatter_to_sequence_parallel_region",
    ],
    "megatron.core.tensor_parallel.random": [
        "CudaRNGStatesTracker",
        "get_cuda_rng_tracker",
        "model_parallel_cuda_manual_seed",
        "get_expert_parallel_rng_tracker_name",
        "get_data_parallel_rng_tracker_name",
        "checkpoint",
        "CheckpointFunction",
        "CheckpointWithoutOutput",
        "convert_cuda_rng_state",
    ],
    "megatron.core.tensor_parallel.utils": [
        "divide",
        "split_tensor_along_last_dim",
        "split_tensor_into_1d_equal_chunks",
        "gather_split_1d_tensor",
        "VocabUtility",
    ],
    "tests.unit_tests.test_utilities": ["Utils", "TestModel", "run_distributed"],
}


@pytest.mark.parametrize("module_path", sorted(PUBLIC_API))
def test_public_names_import(module_path):
    module = importlib.import_module(module_path)
    missing = [name for name in PUBLIC_API[module_path] if not hasattr(module, name)]
    assert not missing, f"{module_path} lacks {missing}"


def test_utils_attributes():
    from tests.unit_tests.test_utilities import Utils

    for name in ("world_size", "rank", "local_rank", "inited", "store"):
        assert hasattr(Utils, name), name
    for name in (
        "initialize_distributed",
        "initialize_model_parallel",
        "destroy_model_parallel",
        "set_world_size",
        "fake_initialize_model_parallel",
        "clear_nvte_env_vars",
    ):
        assert callable(getattr(Utils, name)), name
