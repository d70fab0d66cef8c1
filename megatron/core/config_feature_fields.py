"""Config fields of upstream features this fork does not implement.

Upstream's ``ModelParallelConfig`` and ``TransformerConfig`` carry the settings of the whole
training stack: attention variants, pipeline schedules, CUDA graphs, token dispatchers,
inference, Mamba layers. This fork builds the MLP / MoE-expert parts of a layer only, yet user
config code constructs the full upstream configs. So every upstream field is accepted here, with
upstream's name, type and default (``ModelParallelFeatureFields`` here and
``megatron.core.transformer.transformer_feature_fields.TransformerFeatureFields`` are bases of
the fork's configs),
checked against its declared choices, and, when set to anything but its default, reported once
per process with ``UnimplementedFeatureWarning``: the fork never silently drops a setting, and it
never changes its own math because of one.

Semantics of each field: upstream's documentation of the same name. The fields the fork's own
modules read (``FIELDS_READ_BY_FORK``) are implemented and never warned about.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch

__all__ = [
    "FIELDS_READ_BY_FORK",
    "ModelParallelFeatureFields",
    "UnimplementedFeatureWarning",
    "check_feature_field_choices",
    "feature_fields_enabled",
    "warn_unimplemented_features",
]


class UnimplementedFeatureWarning(UserWarning):
    """A config enables an upstream feature this fork accepts but does not implement."""


FIELDS_READ_BY_FORK = frozenset(
    {
        # Read by the fork's MLP / expert / shared-expert modules, with upstream's meaning.
        "fp8_recipe",
        "recompute_granularity",
        "recompute_modules",
        "offload_modules",
        "fine_grained_activation_offloading",
        # Read by TENorm: with has_residual, it builds TEFusedResidualRMSNorm (as upstream).
        "fused_residual_rmsnorm",
        # Weight rematerialisation: derived here as upstream derives it; the MLP refuses > 1.
        "tensor_parallel_num_weight_shards",
        "gtp_weight_remat_size",
        "expert_tensor_parallel_num_weight_shards",
        "expert_gtp_weight_remat_size",
        # Derived by __post_init__ exactly as upstream derives them (attention is not built).
        "num_query_groups",
        "autocast_dtype",
        "microbatch_group_size_per_vp_stage",
    }
)
"""Feature fields the fork implements or derives; setting them never warns."""

# Fields already warned about in this process: one warning per field, not per config (configs
# are copied and rebuilt many times per run).
_WARNED: set[str] = set()


def _feature_field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _default_of(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def feature_fields_enabled(config, feature_classes) -> dict[str, object]:
    """Returns ``{name: value}`` of the feature fields set to something other than the default.

    Args:
        config: A config instance, before its ``__post_init__`` derives any value.
        feature_classes: The feature-field dataclasses whose fields to inspect.
    """
    enabled = {}
    for cls in feature_classes:
        for f in dataclasses.fields(cls):
            if f.name in FIELDS_READ_BY_FORK:
                continue
            value = getattr(config, f.name)
            default = _default_of(f)
            try:
                same = value is default or value == default
                same = bool(same)
            except Exception:  # noqa: BLE001 - tensors and odd objects: compare by identity
                same = value is default
            if not same:
                enabled[f.name] = value
    return enabled


def warn_unimplemented_features(config_name: str, enabled: dict[str, object]) -> None:
    """Warns once per process for each enabled feature field this fork does not implement.

    Args:
        config_name: The config class name, for the message.
        enabled: ``{field name: value}`` from ``feature_fields_enabled``.
    """
    for name, value in enabled.items():
        if name in _WARNED:
            continue
        _WARNED.add(name)
        warnings.warn(
            f"{config_name}.{name}={value!r}: this megatron.core fork implements the MLP / MoE "
            "expert stack only and does not implement this upstream feature. The value is "
            "accepted and validated but changes nothing in the modules this fork builds; use "
            "upstream megatron-core (with mcore_activations.patch_megatron_core()) for it.",
            UnimplementedFeatureWarning,
            stacklevel=4,
        )


def _literal_choices(annotation) -> Optional[tuple]:
    """The allowed values of ``Literal[...]`` / ``Optional[Literal[...]]``, else None."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return typing.get_args(annotation)
    if origin is Union:
        choices = []
        for arg in typing.get_args(annotation):
            if arg is type(None):
                choices.append(None)
            elif typing.get_origin(arg) is Literal:
                choices.extend(typing.get_args(arg))
            else:
                return None
        return tuple(choices)
    return None


def check_feature_field_choices(config, feature_classes) -> None:
    """Refuses a feature field whose value is outside the choices its annotation declares.

    Upstream declares these choices as ``Literal`` annotations and enforces them through its
    argument parser; a config built in code skips the parser, so a typo would be carried along
    silently. Here it fails at construction, naming the field, the value and the choices.

    Args:
        config: The config instance.
        feature_classes: The feature-field dataclasses whose fields to check.

    Raises:
        ValueError: A value is not among its field's declared choices.
    """
    for cls in feature_classes:
        hints = typing.get_type_hints(cls)
        for name in _feature_field_names(cls):
            choices = _literal_choices(hints.get(name))
            if choices is None:
                continue
            value = getattr(config, name)
            # None is upstream's "unset" for every option, also where the annotation omits it.
            if value is not None and value not in choices:
                raise ValueError(
                    f"{type(config).__name__}.{name}={value!r} is not one of its choices "
                    f"{choices!r}; pick one of them."
                )


@dataclass
class ModelParallelFeatureFields:
    """Upstream ``ModelParallelConfig`` fields of features outside this fork (see module doc)."""

    # ---- Weight shards across the tensor-parallel and GTP weight-rematerialisation axes ----
    tensor_parallel_num_weight_shards: Optional[int] = None
    gtp_weight_remat_size: int = 1

    # ---- Pipeline / context-parallel layout (this fork runs one pipeline stage) ----
    pipeline_model_parallel_comm_backend: Optional[Literal["nccl", "ucc"]] = None
    hierarchical_context_parallel_sizes: Optional[list[int]] = None
    max_seqlen_per_dp_cp_rank: Optional[int] = None
    hybrid_context_parallel: bool = False

    # ---- Expert weight shards across the expert tensor-parallel and GTP axes ----
    expert_tensor_parallel_num_weight_shards: Optional[int] = None
    expert_gtp_weight_remat_size: int = 1

    # ---- Training-loop callbacks, read by upstream's schedules and DDP wrappers ----
    finalize_model_grads_func: Optional[Callable] = None
    grad_scale_func: Optional[Callable] = None
    moe_grad_scale_func: Optional[Callable] = None
    mtp_grad_scale_func: Optional[Callable] = None
    no_sync_func: Optional[Callable] = None
    grad_sync_func: Optional[Callable] = None
    param_sync_func: Optional[Callable] = None

    # ---- Autocast and partial activation checkpointing in the schedules ----
    enable_autocast: bool = False
    autocast_dtype: Optional[torch.dtype] = None
    num_microbatches_with_partial_activation_checkpoints: Optional[int] = None

    # ---- RNG tracker choice (Transformer Engine's tracker for CUDA graphs) ----
    use_te_rng_tracker: bool = False

    # ---- Tensor-parallel communication overlap through Transformer Engine userbuffers ----
    tp_comm_bulk_wgrad: bool = True
    tp_comm_bulk_dgrad: bool = True
    tp_comm_overlap_ag: bool = True
    tp_comm_overlap_rs: bool = True
    tp_comm_overlap_rs_dgrad: bool = False
    tp_comm_split_ag: bool = True
    tp_comm_atomic_ag: bool = False
    tp_comm_split_rs: bool = True
    tp_comm_atomic_rs: bool = False

    # ---- Fused cross-entropy loss ----
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: Literal["native", "te"] = "native"

    # ---- Tensor-parallel overlap exceptions and bootstrap ----
    tp_comm_overlap_disable_qkv: bool = False
    tp_comm_overlap_disable_fc1: bool = False
    tp_comm_bootstrap_backend: Literal["nccl", "mpi", "gloo"] = "nccl"

    # ---- Expert-parallel communication overlap and deferred weight gradients ----
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    overlap_dispatch_backward_with_experts_wgrad: bool = False
    ep_overlap_early_attn_memory_release: bool = False

    # ---- Pipeline-parallel schedule ----
    pipeline_dtype: torch.dtype = None
    variable_seq_lengths: bool = False
    overlap_p2p_comm: bool = False
    batch_p2p_comm: bool = True
    batch_p2p_sync: bool = True
    use_ring_exchange_p2p: bool = False
    deallocate_pipeline_outputs: bool = False
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    overlap_p2p_comm_warmup_flush: bool = False
    microbatch_group_size_per_vp_stage: Optional[int] = None
    mtp_standalone: bool = False

    # ---- CPU offloading of layers and weights ----
    cpu_offloading_num_layers: int = 0
    _cpu_offloading_context: Optional[AbstractContextManager] = None
    cpu_offloading_weights: bool = False
    cpu_offloading_double_buffering: bool = False
    cpu_offloading_retain_pinned_cpu_buffers: bool = False

    # ---- Timers ----
    barrier_with_L1_time: bool = True
