"""Model-parallel process groups: who shares which tensors with whom.

``initialize_model_parallel`` splits the world of ``torch.distributed`` twice:

- the **dense** layout ``tp x cp x dp x pp`` (tensor, context, data and pipeline parallelism), used
  by every non-expert layer;
- the **expert** layout ``etp x ep x edp x pp`` (expert-tensor, expert-model and expert-data
  parallelism), used by MoE experts.

Both layouts enumerate ranks in the same ``order`` (default ``"tp-cp-ep-dp-pp"``, the first
dimension varying fastest), so consecutive ranks share a tensor-parallel group and the pipeline
stages are the outermost dimension of both layouts. The groups are created with
``torch.distributed.new_group`` on the default group's backend, so the same code runs with gloo on
CPU and NCCL on GPU.

Getters return this rank's group or its size / rank in it. ``set_*`` overrides fix a size or rank
without any group, for code that must run outside a distributed job (tests, conversion tools).
Without ``torch.distributed`` the size and rank getters report a single rank (size 1, rank 0);
with it, they require ``initialize_model_parallel`` (or an override) first.

The parallel-state modules, each importing only the ones after it, all re-exported here:

- ``parallel_state`` (this module): ``initialize_model_parallel`` / ``destroy_model_parallel``,
  the dense and expert group getters, the global memory buffer and upstream's module-level
  variable names (``_MODEL_PARALLEL_GROUP``, ...);
- ``parallel_state_groups``: the embedding, gloo and (single-rank) GTP groups, and upstream's
  helper functions;
- ``parallel_state_ranks``: sizes, ranks, source ranks, pipeline stages and the overrides;
- ``parallel_state_store``: the tables of groups, ranks and overrides that the others read.

``megatron.core.utils`` sits between this module (which takes ``GlobalMemoryBuffer`` from it)
and the last two (its tensor-parallel-group fallback reads them).

This fork implements the MLP / MoE stack: hierarchical or hybrid context parallelism, GTP
rematerialization across ranks and several distributed-optimizer instances are not built, and
the options that request them are refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Optional

import torch

from megatron.core.parallel_layout import (  # noqa: F401 - upstream exports both here
    RankGenerator,
    generate_masked_orthogonal_rank_groups,
)
from megatron.core.parallel_state_groups import *  # noqa: F401, F403 - see its __all__
from megatron.core.parallel_state_groups import build_further_groups
from megatron.core.parallel_state_groups import forget_created_groups as _forget_created_groups
from megatron.core.parallel_state_ranks import *  # noqa: F401, F403 - see its __all__
from megatron.core.parallel_state_store import (  # noqa: F401 - is_initialized: upstream's name
    GROUP_RANKS,
    GROUPS,
    LAYOUT_RANKS,
    LEGACY_GROUP_NAMES,
    OVERRIDES,
    clear_groups,
    group_of,
    is_initialized,
    legacy_value,
    ranks_of,
)
from megatron.core.utils import GlobalMemoryBuffer

# --------------------------------------------------------------------------------------- layout


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _refuse(name: str, value, default, reason: str) -> None:
    if value != default:
        raise ValueError(f"{name}={value!r} is not supported: {reason} Leave it at {default!r}.")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[list[int]] = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Optional[Callable[[list[int], Optional[int]], list[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[list[int], Optional[int]], list[int]]] = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: Optional[list[str]] = None,
    sharp_enabled_group: Optional[str] = None,
    rank_offset: int = 0,
    local_world_size: Optional[int] = None,
) -> None:
    """Creates the model-parallel process groups of this rank.

    Every rank of the job must call it with the same arguments: ``new_group`` is collective.
    The data-parallel size is what is left of the world: ``world / (tp * cp * pp)`` densely and
    ``world / (etp * ep * pp)`` for experts.

    Args:
        tensor_model_parallel_size: Ranks one layer's weights are split across.
        pipeline_model_parallel_size: Pipeline stages.
        virtual_pipeline_model_parallel_size: Interleaved model chunks per stage (recorded only).
        pipeline_model_parallel_comm_backend: Backend of the pipeline groups (default: the
            default group's backend).
        use_sharp: NCCL SHARP for data-parallel reductions. Accepted and ignored (performance).
        context_parallel_size: Ranks the sequence is split across.
        hierarchical_context_parallel_sizes: Not supported; must be None.
        hybrid_context_parallel: Not supported; must be False.
        expert_model_parallel_size: Ranks the MoE experts are distributed across.
        gtp_remat_size: Not supported; must be 1.
        expert_gtp_remat_size: Not supported; must be 1.
        num_distributed_optimizer_instances: Not supported; must be 1.
        expert_tensor_parallel_size: Tensor-parallel size inside each expert; defaults to
            ``tensor_model_parallel_size``.
        nccl_communicator_config_path: NCCL tuning file. Accepted and ignored (performance).
        distributed_timeout_minutes: Timeout of collectives on the new groups.
        order: Order of the parallel dimensions, fastest first.
        get_embedding_ranks: Given a pipeline group's ranks, the ranks sharing the word
            embeddings; default: its first and last stage.
        get_position_embedding_ranks: The same for position embeddings; default: first stage.
        create_gloo_process_groups: Also build gloo copies of the data-parallel, data x
            context-parallel and expert-data-parallel groups.
        high_priority_stream_groups: NCCL stream priorities. Accepted and ignored (performance).
        sharp_enabled_group: Accepted and ignored (performance).
        rank_offset: Not supported; must be 0.
        local_world_size: Not supported; must be None.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized, or the world size is not
            divisible by the dense or expert model-parallel size.
        ValueError: A size is not a positive integer, the order is malformed, or an unsupported
            option is requested.
    """
    if not torch.distributed.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group() "
            "before parallel_state.initialize_model_parallel()."
        )
    if expert_tensor_parallel_size is None:
        expert_tensor_parallel_size = tensor_model_parallel_size
    for name, value in (
        ("tensor_model_parallel_size", tensor_model_parallel_size),
        ("pipeline_model_parallel_size", pipeline_model_parallel_size),
        ("context_parallel_size", context_parallel_size),
        ("expert_model_parallel_size", expert_model_parallel_size),
        ("expert_tensor_parallel_size", expert_tensor_parallel_size),
        ("distributed_timeout_minutes", distributed_timeout_minutes),
    ):
        _check_positive(name, value)
    if virtual_pipeline_model_parallel_size is not None:
        _check_positive(
            "virtual_pipeline_model_parallel_size", virtual_pipeline_model_parallel_size
        )

    why = "this fork implements the MLP / MoE stack and does not build these groups."
    _refuse("hierarchical_context_parallel_sizes", hierarchical_context_parallel_sizes, None, why)
    _refuse("hybrid_context_parallel", hybrid_context_parallel, False, why)
    _refuse("gtp_remat_size", gtp_remat_size, 1, why)
    _refuse("expert_gtp_remat_size", expert_gtp_remat_size, 1, why)
    _refuse("num_distributed_optimizer_instances", num_distributed_optimizer_instances, 1, why)
    _refuse("rank_offset", rank_offset, 0, "the layout always spans the whole world.")
    _refuse("local_world_size", local_world_size, None, "the layout always spans the whole world.")
    if use_sharp or nccl_communicator_config_path or high_priority_stream_groups:
        warnings.warn(
            "use_sharp / nccl_communicator_config_path / high_priority_stream_groups tune NCCL "
            "performance only and are ignored by this fork.",
            stacklevel=2,
        )

    world_size = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()

    model_size = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_size != 0:
        raise RuntimeError(
            f"world_size ({world_size}) is not divisible by {model_size} "
            f"(tensor_model_parallel_size {tensor_model_parallel_size} x "
            f"pipeline_model_parallel_size {pipeline_model_parallel_size} x "
            f"context_parallel_size {context_parallel_size})"
        )
    expert_model_size = (
        expert_tensor_parallel_size * expert_model_parallel_size * pipeline_model_parallel_size
    )
    if world_size % expert_model_size != 0:
        raise RuntimeError(
            f"world_size ({world_size}) is not divisible by {expert_model_size} "
            f"(expert_tensor_parallel_size {expert_tensor_parallel_size} x "
            f"expert_model_parallel_size {expert_model_parallel_size} x "
            f"pipeline_model_parallel_size {pipeline_model_parallel_size})"
        )

    dense = RankGenerator(
        tp=tensor_model_parallel_size,
        ep=1,
        dp=world_size // model_size,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
        order=order,
    )
    expert = RankGenerator(
        tp=expert_tensor_parallel_size,
        ep=expert_model_parallel_size,
        dp=world_size // expert_model_size,
        pp=pipeline_model_parallel_size,
        cp=1,
        order=order,
    )
    # Experts and dense layers of one stage must live on the same ranks, or a pipeline stage
    # would hold half a layer.
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        raise ValueError(
            f"order={order!r} gives the dense and expert layouts different pipeline groups; put "
            "'pp' last in the order (e.g. 'tp-cp-ep-dp-pp')."
        )

    # Re-initializing replaces the previous groups; overrides set by hand stay as they are.
    clear_groups()
    timeout = timedelta(minutes=distributed_timeout_minutes)
    backend = torch.distributed.get_backend()

    def build(key: str, generator: RankGenerator, token: str, group_backend=None) -> None:
        # new_group is collective over the whole world: every rank creates every group, in the
        # same order, and keeps the one it belongs to.
        LAYOUT_RANKS[key] = generator.get_ranks(token)
        for ranks in LAYOUT_RANKS[key]:
            group = torch.distributed.new_group(
                ranks, timeout=timeout, backend=group_backend or backend
            )
            if rank in ranks:
                GROUPS[key] = group
                GROUP_RANKS[key] = ranks

    build("dp", dense, "dp")
    build("dp-cp", dense, "dp-cp")
    build("cp", dense, "cp")
    build("mp", dense, "tp-pp")
    build("tp", dense, "tp")
    build("pp", dense, "pp", pipeline_model_parallel_comm_backend)
    build("tp-cp", dense, "tp-cp")
    build("tp-dp", dense, "tp-dp")
    build("tp-dp-cp", dense, "tp-dp-cp")
    build("ep", expert, "ep")
    build("expt-tp", expert, "tp")
    build("tp-ep", expert, "tp-ep")
    build("tp-ep-pp", expert, "tp-ep-pp")
    build("expt-dp", expert, "dp")
    build_further_groups(
        rank,
        timeout,
        create_gloo_process_groups,
        get_embedding_ranks,
        get_position_embedding_ranks,
    )

    if virtual_pipeline_model_parallel_size is not None:
        OVERRIDES["vpp_rank"] = 0
        OVERRIDES["vpp_size"] = virtual_pipeline_model_parallel_size

    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()


def model_parallel_is_initialized() -> bool:
    """Whether the tensor, pipeline and data-parallel groups exist."""
    return all(key in GROUPS for key in ("tp", "pp", "dp"))


def destroy_model_parallel() -> None:
    """Forgets every group and override. Safe to call repeatedly or before initialization.

    The process groups themselves are not destroyed (that is collective on NCCL and would need
    every rank); the default group stays up for the next ``initialize_model_parallel``.
    """
    clear_groups()
    _forget_created_groups()
    OVERRIDES.clear()
    destroy_global_memory_buffer()


# ------------------------------------------------------------------------------------ groups


def get_model_parallel_group(check_initialized: bool = True):
    """Returns the model-parallel (tensor x pipeline) group of this rank."""
    return group_of("mp", check_initialized)


def get_tensor_model_parallel_group(check_initialized: bool = True):
    """Returns the tensor-model-parallel group of this rank."""
    return group_of("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True):
    """Returns the pipeline-model-parallel group of this rank."""
    return group_of("pp", check_initialized)


def get_data_parallel_group(
    with_context_parallel: bool = False,
    with_gtp_remat: bool = True,
    partial_data_parallel: bool = False,
):
    """Returns the data-parallel group of this rank.

    Args:
        with_context_parallel: Include the context-parallel ranks (they hold the same weights).
        with_gtp_remat: Include the GTP weight-rematerialisation peers. GTP is off in this
            fork (one rank per GTP group), so the group is the same either way.
        partial_data_parallel: The group of one distributed-optimizer instance; with the single
            instance this fork supports, that is the whole data-parallel group.
    """
    return group_of("dp-cp" if with_context_parallel else "dp")


def get_context_parallel_group(check_initialized: bool = True):
    """Returns the context-parallel group of this rank."""
    return group_of("cp", check_initialized)


def get_context_parallel_global_ranks(check_initialized: bool = True) -> Optional[list[int]]:
    """Returns the global ranks of this rank's context-parallel group."""
    return ranks_of("cp", check_initialized)


def get_tensor_and_context_parallel_group(check_initialized: bool = True):
    """Returns the tensor x context-parallel group of this rank."""
    return group_of("tp-cp", check_initialized)


def get_tensor_and_data_parallel_group(
    check_initialized: bool = True, with_context_parallel: bool = False
):
    """Returns the tensor x data (x context, if asked) parallel group of this rank."""
    return group_of("tp-dp-cp" if with_context_parallel else "tp-dp", check_initialized)


def get_amax_reduction_group(with_context_parallel: bool = False, tp_only_amax_red: bool = False):
    """Returns the group over which FP8 amax statistics are reduced.

    Every copy of a layer's weights must use the same FP8 scales, so the amax is reduced over
    the tensor and data-parallel ranks (and context-parallel ranks, which also share weights),
    or over the tensor-parallel ranks alone with ``tp_only_amax_red``.
    """
    if tp_only_amax_red:
        return group_of("tp-cp" if with_context_parallel else "tp")
    return group_of("tp-dp-cp" if with_context_parallel else "tp-dp")


def get_expert_model_parallel_group(check_initialized: bool = True):
    """Returns the expert-model-parallel group (ranks holding different experts)."""
    return group_of("ep", check_initialized)


def get_expert_tensor_parallel_group(check_initialized: bool = True):
    """Returns the expert-tensor-parallel group (ranks splitting one expert's weights)."""
    return group_of("expt-tp", check_initialized)


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True):
    """Returns the expert-tensor x expert-model-parallel group."""
    return group_of("tp-ep", check_initialized)


def get_expert_tensor_model_pipeline_parallel_group(
    check_initialized: bool = True, with_egtp_remat: bool = False
):
    """Returns the expert-tensor x expert-model x pipeline-parallel group.

    ``with_egtp_remat`` (merge the expert GTP peers in) gives the same group here: expert GTP
    is off, one rank per group.
    """
    return group_of("tp-ep-pp", check_initialized)


def get_expert_data_parallel_group(
    check_initialized: bool = True,
    with_gtp_remat: bool = True,
    partial_expert_data_parallel: bool = False,
):
    """Returns the expert-data-parallel group (ranks holding the same expert shard).

    ``partial_expert_data_parallel`` is the whole group here (one optimizer instance), and
    ``with_gtp_remat`` changes nothing (expert GTP is off).
    """
    return group_of("expt-dp", check_initialized)


# ---------------------------------------------------------------------------- scratch memory
_GLOBAL_MEMORY_BUFFER: Optional[GlobalMemoryBuffer] = None


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """The process-wide scratch buffer created by ``initialize_model_parallel``.

    Raises:
        AssertionError: ``initialize_model_parallel`` has not run.
    """
    assert _GLOBAL_MEMORY_BUFFER is not None, (
        "the global memory buffer is not initialized; call "
        "parallel_state.initialize_model_parallel() first."
    )
    return _GLOBAL_MEMORY_BUFFER


def destroy_global_memory_buffer() -> None:
    """Drops the global memory buffer (its tensors are freed when no view is left)."""
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = None


# Upstream's module-level group variables, for code that reads them directly (e.g. tests that
# check ``parallel_state._MODEL_PARALLEL_GROUP is None`` after a reset). Answered from the tables
# at each read, so they follow initialize / destroy; None when the group does not exist.
def __getattr__(name: str):
    if name not in LEGACY_GROUP_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return legacy_value(name)
