"""Parallelism and precision settings shared by every megatron.core module."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ModelParallelConfig:
    """Model-parallel layout, initialization and precision settings.

    Only the fields the MLP / MoE-expert stack reads are modelled; names and defaults follow
    upstream megatron-core.
    """

    tensor_model_parallel_size: int = 1
    """Number of ranks a layer's weights are split across (tensor parallelism)."""

    pipeline_model_parallel_size: int = 1
    """Number of pipeline stages. This fork supports 1."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Interleaved pipeline chunks per stage (unused with one stage)."""

    sequence_parallel: bool = False
    """Shard layer-norm / dropout activations along the sequence dim across the TP group."""

    context_parallel_size: int = 1
    """Number of ranks the sequence is split across for attention."""

    expert_model_parallel_size: int = 1
    """Number of ranks the MoE experts are distributed across."""

    expert_tensor_parallel_size: Optional[int] = None
    """TP size inside each expert; defaults to ``tensor_model_parallel_size``."""

    perform_initialization: bool = True
    """Run the weight init methods (False leaves parameters uninitialized, e.g. when loading)."""

    use_cpu_initialization: bool = False
    """Create and initialize weights on the CPU (always the case on CPU-only machines)."""

    fp16: bool = False
    """Train in fp16 mixed precision."""

    bf16: bool = False
    """Train in bf16 mixed precision."""

    params_dtype: torch.dtype = torch.float32
    """dtype of the parameters a module allocates."""

    timers: Optional[Callable] = None
    """Timer factory (unused by the MLP stack)."""

    deterministic_mode: bool = False
    """Prefer deterministic implementations where a choice exists (e.g. the embedding lookup's
    backward). The fused activation kernels are deterministic in every mode."""

    gradient_accumulation_fusion: bool = False
    """Accumulate weight gradients into ``main_grad`` (needs APEX / TE); off by default."""

    tp_comm_overlap: bool = False
    """Overlap TP communication with GEMMs via Transformer Engine userbuffers."""

    cpu_offloading: bool = False
    """Offload activations to CPU memory during the forward pass."""

    cpu_offloading_activations: bool = True
    """With ``cpu_offloading``, offload activations (feeds the fused SwiGLU's offload flag)."""

    def __post_init__(self):
        if self.sequence_parallel and self.tensor_model_parallel_size <= 1:
            raise ValueError("Cannot use sequence parallelism without tensor parallelism")
        if self.pipeline_model_parallel_size != 1:
            raise ValueError(
                f"pipeline_model_parallel_size={self.pipeline_model_parallel_size}: this fork "
                "implements the MLP stack only and supports pipeline_model_parallel_size=1."
            )
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
