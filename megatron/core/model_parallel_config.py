"""Parallelism and precision settings shared by every megatron.core module."""

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.config_feature_fields import (
    ModelParallelFeatureFields,
    check_feature_field_choices,
    feature_fields_enabled,
    warn_unimplemented_features,
)


def resolve_tensor_parallel_weight_shards(
    tensor_model_parallel_size: int,
    tensor_parallel_num_weight_shards: Optional[int],
    gtp_weight_remat_size: int,
    shards_field: str = "tensor_parallel_num_weight_shards",
    tp_field: str = "tensor_model_parallel_size",
) -> tuple:
    """Reconciles the total weight-shard count with the GTP weight-rematerialisation size.

    A weight is split ``tensor_model_parallel_size * gtp_weight_remat_size`` ways. The shard
    count, when given, decides: ``gtp_weight_remat_size = shards // tensor_model_parallel_size``.
    When None it is derived from the other two. Calling it again on its result changes nothing.

    Args:
        tensor_model_parallel_size: The tensor-parallel size (or expert tensor-parallel size).
        tensor_parallel_num_weight_shards: Total shards per weight, or None.
        gtp_weight_remat_size: The rematerialisation size used when the shard count is None.
        shards_field: Name of the shard-count option, for error messages.
        tp_field: Name of the tensor-parallel size option, for error messages.

    Returns:
        ``(tensor_parallel_num_weight_shards, gtp_weight_remat_size)``, consistent.

    Raises:
        ValueError: The shard count is below, or not a multiple of, the tensor-parallel size.
    """
    tp = tensor_model_parallel_size
    if tensor_parallel_num_weight_shards is None:
        return tp * gtp_weight_remat_size, gtp_weight_remat_size
    if tensor_parallel_num_weight_shards < tp:
        raise ValueError(
            f"{shards_field} ({tensor_parallel_num_weight_shards}) must be >= {tp_field} ({tp}): "
            "each tensor-parallel rank holds at least one shard."
        )
    if tensor_parallel_num_weight_shards % tp:
        raise ValueError(
            f"{shards_field} ({tensor_parallel_num_weight_shards}) must be divisible by "
            f"{tp_field} ({tp}); use a multiple of it."
        )
    return tensor_parallel_num_weight_shards, tensor_parallel_num_weight_shards // tp


@dataclass
class ModelParallelConfig(ModelParallelFeatureFields):
    """Model-parallel layout, initialization and precision settings.

    The fields below are the ones the MLP / MoE-expert stack reads. Every other upstream field
    (schedules, communication overlap, offloading...) is accepted too, with upstream's name, type
    and default, from ``ModelParallelFeatureFields``; setting one warns once that this fork does
    not implement it (``megatron.core.config_feature_fields``).
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

    def _feature_field_classes(self) -> tuple:
        """The feature-field bases of this config class (extended by subclasses)."""
        return (ModelParallelFeatureFields,)

    def __post_init__(self):
        self._upstream_post_init()
        check_feature_field_choices(self, (ModelParallelFeatureFields,))
        self._refuse_unsupported()

    def _refuse_unsupported(self):
        """Refuses what this fork cannot build. Runs after every upstream check (also in
        subclasses), so a config upstream refuses reports upstream's error first."""
        if self.pipeline_model_parallel_size != 1:
            raise ValueError(
                f"pipeline_model_parallel_size={self.pipeline_model_parallel_size}: this fork "
                "implements the MLP stack only and supports pipeline_model_parallel_size=1."
            )

    def _upstream_post_init(self):
        """Upstream's checks and derived values, in upstream's order."""
        # Checked before anything below derives a value, so "enabled" means "set by the user".
        feature_classes = self._feature_field_classes()
        warn_unimplemented_features(
            type(self).__name__, feature_fields_enabled(self, feature_classes)
        )

        if self.sequence_parallel and self.tensor_model_parallel_size <= 1:
            raise ValueError("Cannot use sequence parallelism without tensor parallelism")
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size

        _, self.gtp_weight_remat_size = resolve_tensor_parallel_weight_shards(
            self.tensor_model_parallel_size,
            self.tensor_parallel_num_weight_shards,
            self.gtp_weight_remat_size,
        )
        _, self.expert_gtp_weight_remat_size = resolve_tensor_parallel_weight_shards(
            self.expert_tensor_parallel_size,
            self.expert_tensor_parallel_num_weight_shards,
            self.expert_gtp_weight_remat_size,
            shards_field="expert_tensor_parallel_num_weight_shards",
            tp_field="expert_tensor_parallel_size",
        )
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            raise ValueError(
                "When using pipeline parallelism, pipeline_dtype must be specified "
                "(e.g. pipeline_dtype=torch.bfloat16)."
            )
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        if self.microbatch_group_size_per_vp_stage is None:
            self.microbatch_group_size_per_vp_stage = self.pipeline_model_parallel_size
        self._check_schedule_options()

    def _check_schedule_options(self):
        """Upstream's value rules for the schedule options (accepted, not implemented here)."""
        if self.cross_entropy_loss_fusion and self.cross_entropy_fusion_impl == "te":
            warnings.warn(
                "cross_entropy_fusion_impl='te' with cross_entropy_loss_fusion: Transformer "
                "Engine's fused cross entropy has known stability issues; use 'native'.",
                UserWarning,
                stacklevel=3,
            )
        if self.defer_embedding_wgrad_compute:
            if self.pipeline_model_parallel_size == 1:
                raise ValueError(
                    "defer_embedding_wgrad_compute=True needs pipeline parallelism "
                    "(pipeline_model_parallel_size > 1); leave it False."
                )
            if not self.gradient_accumulation_fusion:
                raise ValueError(
                    "defer_embedding_wgrad_compute=True needs gradient_accumulation_fusion=True."
                )
            if self.wgrad_deferral_limit < 0:
                raise ValueError(
                    f"wgrad_deferral_limit={self.wgrad_deferral_limit} must be >= 0 when "
                    "defer_embedding_wgrad_compute is enabled."
                )
        if (
            self.expert_model_parallel_size > 1
            and self.tensor_model_parallel_size > 1
            and not self.sequence_parallel
        ):
            warnings.warn(
                "Expert parallelism with tensor parallelism needs sequence_parallel=True for "
                "training (as upstream).",
                UserWarning,
                stacklevel=3,
            )
        if self.overlap_p2p_comm_warmup_flush and (
            not self.overlap_p2p_comm or self.batch_p2p_comm
        ):
            raise ValueError(
                "overlap_p2p_comm_warmup_flush=True works with overlap_p2p_comm=True and "
                "batch_p2p_comm=False only."
            )
