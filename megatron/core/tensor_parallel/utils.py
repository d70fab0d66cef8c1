"""Small tensor helpers of the tensor-parallel layers."""

from __future__ import annotations

import torch

from megatron.core.utils import (
    divide,
    get_pg_rank,
    get_pg_size,
    get_tensor_model_parallel_group_if_none,
)

__all__ = [
    "VocabUtility",
    "divide",
    "gather_split_1d_tensor",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
]


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> list[torch.Tensor]:
    """Splits a tensor into ``num_partitions`` equal chunks along its last dimension.

    Args:
        tensor: The tensor to split; its last dimension must be divisible by ``num_partitions``.
        num_partitions: Number of chunks.
        contiguous_split_chunks: Return contiguous copies instead of strided views.

    Returns:
        The chunks, in order.
    """
    last_dim_size = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return [chunk.contiguous() for chunk in chunks]
    return list(chunks)


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, tp_group=None
):
    """This rank's equal share of ``tensor`` flattened, across the tensor-parallel group.

    Args:
        tensor: Any contiguous tensor; its element count must divide by the group size.
        new_buffer: Return a copy on the current CUDA device (CPU without CUDA) instead of a view.
        tp_group: The group; the global tensor-parallel group when None.

    Raises:
        ValueError: The element count does not divide by the group size.
    """
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    size, rank = get_pg_size(tp_group), get_pg_rank(tp_group)
    share = divide(tensor.numel(), size)
    chunk = tensor.view(-1)[rank * share : (rank + 1) * share]
    if not new_buffer:
        return chunk
    device = torch.cuda.current_device() if torch.cuda.is_available() else tensor.device
    return chunk.to(device=device, copy=True)


def gather_split_1d_tensor(tensor: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Inverse of :func:`split_tensor_into_1d_equal_chunks`: every rank's share, concatenated."""
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    size = get_pg_size(tp_group)
    if size == 1:
        return tensor.reshape(-1).clone()
    gathered = torch.empty(size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    torch.distributed.all_gather_into_tensor(gathered, tensor.contiguous(), group=tp_group)
    return gathered


class VocabUtility:
    """The ``[first, last)`` vocabulary indices of one rank's partition of the embedding."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """Range of ``rank`` when each of the ``world_size`` partitions holds the given size."""
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """Range of ``rank`` when ``global_vocab_size`` is split evenly over ``world_size``."""
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_partition, rank, world_size
        )
