"""Tensor-parallel parameter attributes and the initialization of split weights.

The attributes (``tensor_model_parallel``, ``partition_dim``, ``partition_stride`` and upstream's
markers that travel with them) tell optimizers, checkpointing and gradient clipping how a
parameter is split; the initializers give every rank exactly its slice of the weight a
single-device layer would draw (see ``layers``). Shared by the parallel linear layers and the
vocabulary-parallel embedding; ``megatron.core.tensor_parallel.layers`` re-exports the public
names, where upstream defines them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.utils import (
    divide,
    get_tensor_model_parallel_group_if_none,
)

# Upstream's set: the expert and fused-QKV markers travel with the tensor-parallel ones, so a
# copied parameter (e.g. an optimizer's fp32 master) keeps every attribute upstream code reads.
_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "expert_tp": False,
    "is_qkv": False,
    "qkv_split_shapes": None,
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}

# Attributes of GTP weight rematerialisation that a parameter's copies must keep (which axis
# counts the parameter once, its checkpoint writer group, and its shard padding).
_GTP_ATTRIBUTES = ("is_gtp_weight_remat", "allreduce", "gtp_replica_group", "pad_length")


# ------------------------------------------------------------------- parameter attributes


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
    expert_tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> bool:
    """Whether ``param`` counts once per tensor-parallel group (a shard, or on TP rank 0).

    Used to avoid counting replicated parameters once per rank (e.g. in gradient norms).

    Args:
        param: The parameter.
        tp_group: The tensor-parallel group to judge rank 0 in; None reads ``parallel_state``.
        expert_tp_group: Used instead of ``tp_group`` for a parameter marked
            ``allreduce=False`` (reduced over the expert data-parallel group, so duplicated
            across the expert tensor-parallel group).
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    if not getattr(param, "allreduce", True) and expert_tp_group is not None:
        tp_group = expert_tp_group
    if tp_group is not None:
        return tp_group.rank() == 0
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() == 0


def copy_gtp_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copies the GTP weight-rematerialisation attributes ``source`` has to ``destination``.

    Args:
        destination: A view or copy of ``source`` (e.g. an optimizer's master shard).
        source: The model parameter.
    """
    for attribute in _GTP_ATTRIBUTES:
        if hasattr(source, attribute):
            setattr(destination, attribute, getattr(source, attribute))


def param_is_not_gtp_duplicate(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient counts once across the GTP weight-rematerialisation axis.

    A rematerialised shard (``is_gtp_weight_remat``) is unique on every rank of that axis; any
    other parameter is replicated across it and counts on its rank 0 only: the expert axis for
    parameters marked ``allreduce=False``, the dense axis otherwise. Without GTP every rank is
    rank 0, so every parameter counts.
    """
    if getattr(param, "is_gtp_weight_remat", False):
        return True
    from megatron.core import parallel_state

    if not getattr(param, "allreduce", True):
        return parallel_state.get_expert_gtp_weight_remat_rank() == 0
    return parallel_state.get_gtp_weight_remat_rank() == 0


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Marks ``tensor`` as a tensor-parallel shard split along ``dim`` with ``stride``.

    Raises:
        ValueError: The tensor already carries these attributes.
    """
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise ValueError(f"tensor already has the tensor-parallel attribute {attribute!r}")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Gives ``tensor`` the "not split" attributes where it has none."""
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(
    destination_tensor: torch.Tensor, source_tensor: torch.Tensor
) -> None:
    """Copies the tensor-parallel attributes ``source_tensor`` has to ``destination_tensor``."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


# --------------------------------------------------------------------------- initialization


def _initialize_affine_weight_cpu(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: Callable[[torch.Tensor], torch.Tensor],
    stride: int = 1,
    return_master_weight: bool = False,
    *,
    params_dtype: torch.dtype = torch.float32,
    rank: int = 0,
    world_size: int = 1,
) -> Optional[torch.Tensor]:
    """Initializes the full weight on CPU and copies this rank's slice into ``weight``.

    The master weight is drawn in float32 from the default generator, identically on every
    rank, then cast. With ``stride`` s the split dimension holds s consecutive blocks (e.g. the
    gate and linear halves of a gated MLP's fc1); each rank keeps its slice of every block, so
    rank i holds ``[block_1 slice i; ...; block_s slice i]``.
    """
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)

    master_weight = torch.empty(output_size, input_size, dtype=torch.float32)
    init_method(master_weight)
    master_weight = master_weight.to(dtype=params_dtype)

    piece = divide(per_partition_size, stride)
    pieces = torch.split(master_weight, piece, dim=partition_dim)
    with torch.no_grad():
        weight.copy_(torch.cat(pieces[rank::world_size], dim=partition_dim))
    return master_weight if return_master_weight else None


def _initialize_affine_weight_gpu(
    weight: torch.Tensor,
    init_method: Callable[[torch.Tensor], torch.Tensor],
    partition_dim: int,
    stride: int = 1,
    is_expert: bool = False,
) -> None:
    """Initializes this rank's shard in place, inside the rank's own RNG stream."""
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    if is_expert:
        stream = get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())
    else:
        stream = get_cuda_rng_tracker().fork()
    with stream:
        init_method(weight)


def _use_cpu_initialization(config: ModelParallelConfig) -> bool:
    return config.use_cpu_initialization or not torch.cuda.is_available()


def _partition_size(layer: str, dimension: str, size: int, tp_size: int, stride: int) -> int:
    if size % (tp_size * stride) != 0:
        raise ValueError(
            f"{layer}: {dimension} ({size}) must be divisible by the tensor-parallel size "
            f"({tp_size}) times stride ({stride}); change the size or the parallel layout."
        )
    return size // tp_size


def _resolve_tp_group(tp_group, pg_collection, is_expert: bool, layer: str):
    if tp_group is None and pg_collection is not None:
        attribute = "expt_tp" if is_expert else "tp"
        if getattr(pg_collection, attribute) is None:
            raise ValueError(
                f"{layer}(is_expert={is_expert}) needs pg_collection.{attribute}, which the given "
                f"ProcessGroupCollection lacks; add it or pass tp_group= instead."
            )
        tp_group = getattr(pg_collection, attribute)
    return get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)


def _check_gradient_accumulation_fusion(config: ModelParallelConfig, layer: str) -> None:
    if config.gradient_accumulation_fusion:
        raise ValueError(
            f"{layer}: gradient_accumulation_fusion=True needs APEX's fused weight-gradient "
            "kernels, which the local linear layers do not use; set "
            "gradient_accumulation_fusion=False or use the Transformer Engine linear layers."
        )
