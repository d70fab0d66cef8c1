"""``VocabParallelEmbedding``: an embedding table split by vocabulary rows across ranks.

``megatron.core.tensor_parallel.layers`` re-exports it, where upstream defines it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.parameter_setup import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    _resolve_tp_group,
    _use_cpu_initialization,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.utils import VocabUtility
from megatron.core.utils import (
    get_pg_rank,
    get_pg_size,
)


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose vocabulary rows are split across the tensor-parallel group.

    Rank r holds rows ``[r * V/tp, (r + 1) * V/tp)``. A token outside the rank's range looks up
    zeros there, so summing the ranks' lookups (all-reduce) gives every token its one row; with
    ``reduce_scatter_embeddings`` the sum is reduce-scattered along the sequence instead (the
    input of a sequence-parallel model), after moving the sequence to dim 0.

    Args:
        num_embeddings: Vocabulary size, divisible by the tensor-parallel size.
        embedding_dim: Hidden size.
        init_method: Fills the weight (the full weight, sliced, on CPU initialization).
        reduce_scatter_embeddings: Reduce-scatter the ``[batch, seq]`` lookup as ``[seq, batch]``.
        config: ``params_dtype``, ``use_cpu_initialization``, ``perform_initialization`` and
            ``deterministic_mode`` (index instead of ``F.embedding``, whose backward adds
            atomically).
        tp_group: The tensor-parallel group; the global one when None.
        pg_collection: Its ``tp`` group is used when ``tp_group`` is None.

    Raises:
        ValueError: ``num_embeddings`` is not divisible by the tensor-parallel size.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: Callable,
        reduce_scatter_embeddings: bool = False,
        config: ModelParallelConfig,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        pg_collection=None,
    ):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.config = config
        self.deterministic_mode = bool(getattr(config, "deterministic_mode", False))
        self.tp_group = _resolve_tp_group(tp_group, pg_collection, False, "VocabParallelEmbedding")
        rank, size = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)
        if num_embeddings % size:
            raise ValueError(
                f"VocabParallelEmbedding: num_embeddings={num_embeddings} is not divisible by "
                f"the tensor-parallel size {size}; pad the vocabulary to a multiple of it."
            )
        self.vocab_start_index, self.vocab_end_index = (
            VocabUtility.vocab_range_from_global_vocab_size(num_embeddings, rank, size)
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        cpu_init = _use_cpu_initialization(config)
        device = torch.device("cpu") if cpu_init else torch.cuda.current_device()
        self.weight = Parameter(
            torch.empty(
                self.num_embeddings_per_partition,
                embedding_dim,
                device=device,
                dtype=config.params_dtype,
            )
        )
        if config.perform_initialization and cpu_init:
            _initialize_affine_weight_cpu(
                self.weight,
                num_embeddings,
                embedding_dim,
                self.num_embeddings_per_partition,
                partition_dim=0,
                init_method=init_method,
                params_dtype=config.params_dtype,
                rank=rank,
                world_size=size,
            )
        elif config.perform_initialization:
            _initialize_affine_weight_gpu(self.weight, init_method, partition_dim=0)
        else:
            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Embeds token ids ``[batch, seq]``: ``[batch, seq, hidden]``, or ``[seq / tp, batch,
        hidden]`` with ``reduce_scatter_embeddings``."""
        parallel = get_pg_size(self.tp_group) > 1
        if parallel:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        else:
            local_ids = input_
        if self.deterministic_mode:
            output = self.weight[local_ids]
        else:
            output = F.embedding(local_ids, self.weight)
        if parallel:
            output = output.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output = output.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output, group=self.tp_group)
        if parallel:
            return reduce_from_tensor_model_parallel_region(output, group=self.tp_group)
        return output

    def extra_repr(self) -> str:
        """``num_embeddings``, this rank's share, and ``embedding_dim``."""
        return (
            f"num_embeddings={self.num_embeddings}, per_partition="
            f"{self.num_embeddings_per_partition}, embedding_dim={self.embedding_dim}"
        )
