"""Small tensor helpers of the tensor-parallel layers."""

from __future__ import annotations

import torch

from megatron.core.utils import divide

__all__ = ["divide", "split_tensor_along_last_dim"]


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
