"""Upstream ``TransformerConfig`` fields of features this fork does not implement.

See ``megatron.core.config_feature_fields`` for how they are accepted, checked and reported.
Kept apart from that module because the annotations name the transformer enums, and the
model-parallel config must import without the transformer package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import torch

from megatron.core.transformer.enums import (
    AttnBackend,
    CudaGraphModule,
    CudaGraphScope,
    InferenceCudaGraphScope,
)

__all__ = ["TransformerFeatureFields"]


@dataclass
class TransformerFeatureFields:
    """Upstream ``TransformerConfig`` fields of features outside this fork.

    How they are accepted, checked and reported: ``megatron.core.config_feature_fields``.
    """

    # ---- Multi-token prediction ----
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: Optional[float] = 0.1
    mtp_use_repeated_layer: bool = False
    mtp_detach_heads: bool = False
    mtp_hsm: bool = False
    mtp_hybrid_override_pattern: Optional[str] = None

    # ---- Pipeline layer split ----
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    pipeline_model_parallel_layout: Optional[Union[str, list, object]] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    # ---- Attention, norms and their fusions ----
    attention_backend: AttnBackend = AttnBackend.auto
    flash_attention_version: Optional[Literal[2, 3, 4]] = None
    softmax_scale: Optional[float] = None
    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = "vanilla"
    num_query_groups: Optional[int] = None
    fp32_residual_connection: bool = False
    apply_residual_connection_post_layernorm: bool = False
    add_qkv_bias: bool = False
    rotary_interleaved: bool = False
    window_size: Optional[tuple[int, int]] = None
    window_attn_skip_freq: Optional[Union[int, list[int]]] = None
    qk_layernorm: bool = False
    qk_l2_norm: bool = False
    qk_clip: bool = False
    qk_clip_alpha: float = 0.5
    qk_clip_threshold: float = 100
    log_max_attention_logit: bool = False
    attention_output_gate: bool = False
    test_mode: bool = False
    calculate_per_token_loss: bool = False
    multi_latent_attention: bool = False
    no_rope_freq: Optional[Union[int, list[int]]] = None

    # ---- Experimental attention variants ----
    experimental_attention_variant: Optional[Literal["gdn", "gdn2", "dsa", "gated_delta_net"]] = (
        None
    )
    experimental_attention_variant_loss_scale_func: Optional[Callable[[torch.Tensor], None]] = None

    # ---- Experimental attention variants: DeepSeek sparse attention indexer ----
    dsa_indexer_n_heads: Optional[int] = None
    dsa_indexer_head_dim: Optional[int] = None
    dsa_indexer_topk: Optional[int] = None
    dsa_indexer_topk_freq: int = 1
    dsa_indexer_skip_topk_offset: int = 0
    dsa_indexer_loss_coeff: Optional[float] = None
    dsa_indexer_use_sparse_loss: bool = False
    dsa_kernel_backend: Literal["none", "tilelang", "cudnn"] = "none"
    dsa_indexer_rope_interleaved: bool = False
    dsa_indexer_rotate_activation: bool = True
    dsa_indexer_scoring_relu: bool = True
    dsa_indexer_k_norm_epsilon: Optional[float] = None
    dsa_indexer_k_norm_fp32: bool = False

    # ---- Experimental attention variants: linear attention ----
    linear_attention_freq: Optional[Union[int, list[int]]] = None
    linear_conv_kernel_dim: Optional[int] = 4
    linear_key_head_dim: Optional[int] = 128
    linear_value_head_dim: Optional[int] = 128
    linear_num_key_heads: Optional[int] = 16
    linear_num_value_heads: Optional[int] = 32

    # ---- Initialization ----
    embedding_init_method: Optional[Callable] = None
    embedding_init_method_std: Optional[float] = None
    init_model_with_meta_device: bool = False

    # ---- muP (maximal update) parametrization ----
    use_mup: bool = False
    mup_width_mult: float = 1.0
    mup_base_hidden_size: Optional[int] = None
    mup_embedding_mult: float = 1.0
    mup_output_mult: float = 1.0
    mup_base_head_dim: Optional[float] = None
    mup_attn_scale_power: float = 1.0

    # ---- Attention, norms and their fusions ----
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True
    disable_bf16_reduced_precision_matmul: bool = False
    masked_softmax_fusion: bool = False
    persist_layer_norm: bool = False
    memory_efficient_layer_norm: bool = False
    apply_rope_fusion: bool = False
    fused_single_qkv_rope: bool = False
    fused_residual_rmsnorm: bool = False

    # ---- Activation recomputation ----
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    recompute_method: Optional[Literal["uniform", "block"]] = None
    recompute_num_layers: Optional[int] = None
    distribute_saved_activations: Optional[bool] = False
    recompute_modules: Optional[list[str]] = None

    # ---- FP8 / FP4 / mixed-precision layers ----
    fp8_recipe: Optional[Literal["tensorwise", "delayed", "mxfp8", "blockwise", "custom"]] = (
        "delayed"
    )
    fp8_param: bool = False
    fp8_quantizer_factory: Optional[str] = None
    fp8_margin: int = 0
    fp8_interval: int = 1
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: Literal["most_recent", "max"] = "most_recent"
    fp8_wgrad: bool = True
    fp8_output_proj: bool = False
    fp8_dot_product_attention: bool = False
    fp8_multi_head_attention: bool = False
    tp_only_amax_red: bool = False
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    use_kitchen_attention: bool = False
    kitchen_attention_backend: Literal["sdpa", "fa"] = "sdpa"
    fp4_recipe: Optional[Literal["nvfp4", "custom"]] = "nvfp4"
    fp4_param: bool = False
    fp4_quantizer_factory: Optional[str] = None

    # ---- MoE routing, token dispatch and capacity ----
    high_priority_a2a_comm_stream: bool = False
    moe_enable_routing_replay: bool = False
    moe_router_topk_limited_devices: Optional[int] = None
    moe_router_padding_for_quantization: Optional[bool] = False
    moe_router_padding_for_fp8: Optional[bool] = False
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 0.001
    moe_router_quantile_balancing_ema: float = 0.0
    moe_router_force_load_balancing: bool = False
    moe_router_force_biased: Optional[float] = None
    moe_aux_loss_coeff: Union[float, list[float]] = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_input_jitter_eps: Optional[float] = None
    moe_token_dropping: bool = False
    moe_enable_deepep: bool = False
    moe_flex_dispatcher_backend: Literal["deepep", "hybridep", "ncclep"] = "deepep"
    moe_permute_fusion_into_hybridep: bool = False
    moe_hybridep_pad_uneven_dispatch_inputs: bool = False
    moe_per_layer_logging: bool = False
    moe_expert_capacity_factor: Optional[float] = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_pad_experts_for_cuda_graph_inference: bool = False
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    moe_layer_recompute: bool = False
    moe_permute_fusion: bool = False
    moe_router_fusion: bool = False
    gtp_remat_opt_in_modules: list[str] = field(default_factory=list)
    moe_flex_dispatcher_num_sms: Optional[int] = None
    moe_deepep_num_sms: Optional[int] = None
    moe_hybridep_num_sms: Optional[int] = None
    moe_hybridep_num_blocks_permute: Optional[int] = None
    moe_hybridep_num_blocks_unpermute: Optional[int] = None
    moe_hybridep_num_sms_preprocessing: int = 108
    moe_ncclep_zero_copy: bool = False
    moe_dispatch_fwd_dtype: Literal["bf16", "mxfp8"] = "bf16"
    moe_combine_bwd_dtype: Literal["bf16", "mxfp8"] = "bf16"
    moe_expert_rank_capacity_factor: Optional[float] = None

    # ---- Context parallelism ----
    cp_comm_type: Optional[Union[str, list[str]]] = None

    # ---- CUDA graphs ----
    enable_cuda_graph: bool = False
    cuda_graph_use_single_mempool: bool = True
    cuda_graph_retain_backward_graph: bool = False
    cuda_graph_warmup_steps: int = 3
    external_cuda_graph: bool = False
    cuda_graph_impl: Literal["none", "local", "transformer_engine", "full_iteration"] = "none"
    cuda_graph_modules: Union[str, CudaGraphModule, list[str], list[CudaGraphModule]] = "full"
    inference_cuda_graph_scope: Optional[InferenceCudaGraphScope] = None
    cuda_graph_scope: Optional[
        Union[
            str, CudaGraphModule, CudaGraphScope, list[Union[str, CudaGraphModule, CudaGraphScope]]
        ]
    ] = None

    # ---- Manifold hyper-connections ----
    enable_mhc_connections: bool = False
    mhc_num_residual_streams: int = 4
    mhc_sinkhorn_iterations: int = 20
    mhc_init_gating_factor: float = 0.01
    mhc_recompute_layer_num: Optional[int] = None

    # ---- Attention, norms and their fusions ----
    clone_scatter_output_in_embedding: bool = True
    disable_parameter_transpose_cache: bool = False
    config_logger_dir: str = ""

    # ---- Inference ----
    flash_decode: bool = False

    # ---- Batch-invariant (deterministic across batch sizes) kernels ----
    batch_invariant_mode: bool = False
    batch_invariant_backend: Literal["te_native", "deepgemm", "triton"] = "te_native"

    # ---- Inference ----
    inference_rng_tracker: bool = False
    inference_sampling_seed: int = 42
    symmetric_ar_type: Optional[Literal["two_shot", "one_shot", "multimem_all_reduce"]] = None
    nccl_all_reduce_for_prefill: bool = False
    use_inference_optimized_layers: bool = False
    inference_fuse_tp_communication: bool = False
    inference_disable_triton_nvls_kernels: bool = False
    inference_grouped_gemm_backend: Literal["flashinfer", "torch", "vllm"] = "vllm"
    inference_moe_disable_fused_quant_kernels: bool = False
    inference_moe_token_dispatcher_type: Literal["nccl", "nvls"] = "nvls"

    # ---- Hybrid (Mamba / gated delta product) models ----
    mrope_section: Optional[list[int]] = None
    is_hybrid_model: bool = False
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: Optional[int] = None
    gdp_num_householder: int = 3
    mamba_training_ssm_states_dtype: Optional[torch.dtype] = None

    # ---- Attention, norms and their fusions ----
    use_mamba_mem_eff_path: bool = True

    # ---- Hybrid (Mamba / gated delta product) models ----
    gdp_cutedsl_kernel: bool = False
    gdp_num_chunk_states_to_recompute: int = 2

    # ---- MLP chunking ----
    mlp_chunks_for_prefill: int = 1
    mlp_chunks_for_training: int = 1

    # ---- Heterogeneous layers ----
    heterogeneous_block_specs: bool = False
    hetereogenous_dist_checkpoint: bool = False

    # ---- Quantization recipe and implementation choice ----
    quant_recipe: Optional[object] = None
    transformer_impl: Literal["local", "transformer_engine", "inference_optimized"] = (
        "transformer_engine"
    )

    # ---- Fine-grained activation offloading ----
    fine_grained_activation_offloading: bool = False
    offload_modules: Optional[list[str]] = field(default_factory=list)
    min_offloaded_tensor_size: int = 1024 * 1024
    delay_offload_until_cuda_graph: bool = False
    delta_offload_bytes_across_pp_ranks: int = 0
    activation_offload_fraction: float = 1.0

    # ---- MoE paged stash of expert activations ----
    moe_paged_stash: bool = False
    moe_paged_stash_page_size: int = 64
    moe_paged_stash_buffer_size_factor_cuda: float = 1.1
    moe_paged_stash_buffer_size_factor_cpu: float = 0.0

    # ---- Fine-grained activation offloading ----
    fine_grained_offloading_max_inflight_offloads: Optional[int] = None


def apply_transformer_feature_rules(config) -> None:
    """Upstream's value rules and derived defaults for the feature fields of ``config``.

    These features are not implemented by this fork, but a config upstream refuses is refused
    here too (same exception type, the same key phrase in the message), and the values upstream
    derives are derived the same way, so code that reads them sees upstream's values.

    Args:
        config: A ``TransformerConfig`` whose base ``__post_init__`` has run.

    Raises:
        ValueError / AssertionError: As upstream raises for the same configuration.
    """
    if config.mtp_hsm and (config.mtp_num_layers is None or config.mtp_num_layers < 2):
        raise ValueError("mtp_hsm=True requires mtp_num_layers >= 2.")
    if config.fp32_residual_connection and config.pipeline_dtype is not None:
        # The residual stream crosses pipeline stages in fp32, so the p2p dtype must follow.
        config.pipeline_dtype = torch.float
    if config.fp16 and config.bf16:
        raise ValueError(
            f"Only one of fp16 ({config.fp16}) and bf16 ({config.bf16}) can be True; choose one."
        )
    if config.gdp_num_householder < 1:
        raise ValueError(f"gdp_num_householder must be positive, got {config.gdp_num_householder}.")

    if config.num_query_groups is None:
        config.num_query_groups = config.num_attention_heads
    tp = config.tensor_model_parallel_size
    if config.num_query_groups and config.num_query_groups % tp and tp % config.num_query_groups:
        raise ValueError(
            f"num_query_groups ({config.num_query_groups}) must be a multiple or divisor of "
            f"tensor_model_parallel_size ({tp})."
        )

    if config.fp8_param and not config.fp8:
        raise ValueError("fp8_param must be used together with fp8 mode (set fp8).")
    if config.fp8_output_proj and not config.fp8:
        raise ValueError("fp8_output_proj must be used together with fp8 mode (set fp8).")

    _apply_moe_dispatch_rules(config)
    _apply_recompute_rules(config)
    _apply_overlap_and_determinism_rules(config)


def _apply_moe_dispatch_rules(config) -> None:
    if config.moe_enable_deepep:
        if config.moe_token_dispatcher_type != "flex":
            raise ValueError("DeepEP backend is only supported with flex token dispatcher.")
        if config.moe_flex_dispatcher_backend == "hybridep":
            raise ValueError("Only one backend is supported for flex token dispatcher.")
        # Upstream's deprecated spelling: moe_enable_deepep selects the deepep flex backend.
        config.moe_flex_dispatcher_backend = "deepep"
    ncclep = config.moe_flex_dispatcher_backend == "ncclep"
    if ncclep and config.moe_token_dispatcher_type != "flex":
        raise ValueError(
            "moe_flex_dispatcher_backend='ncclep' requires moe_token_dispatcher_type='flex'."
        )
    if config.moe_dispatch_fwd_dtype != "bf16" or config.moe_combine_bwd_dtype != "bf16":
        if config.moe_token_dispatcher_type != "flex" or config.moe_flex_dispatcher_backend != (
            "ncclep"
        ):
            raise ValueError(
                "moe_dispatch_fwd_dtype / moe_combine_bwd_dtype require the 'ncclep' flex "
                "dispatcher backend (moe_token_dispatcher_type='flex', "
                "moe_flex_dispatcher_backend='ncclep')."
            )
        if not (config.use_transformer_engine_op_fuser and config.moe_grouped_gemm):
            raise ValueError(
                "moe_dispatch_fwd_dtype / moe_combine_bwd_dtype = 'mxfp8' require BOTH "
                "use_transformer_engine_op_fuser and moe_grouped_gemm (the fused grouped GEMM is "
                "the consumer of the MXFP8 payload)."
            )
    if config.moe_expert_capacity_factor is not None and config.moe_expert_capacity_factor < 0:
        # Upstream reads a negative capacity factor as "no capacity limit".
        config.moe_expert_capacity_factor = None
    if config.moe_router_group_topk:
        if config.moe_router_topk_limited_devices:
            raise ValueError(
                "moe_router_topk_limited_devices is deprecated and replaced by "
                "moe_router_group_topk and moe_router_num_groups; set only those."
            )
        if not config.moe_router_num_groups:
            raise ValueError(
                "When using group limited routing, moe_router_num_groups must be specified."
            )
        assert config.num_moe_experts % config.moe_router_num_groups == 0, (
            f"num_moe_experts ({config.num_moe_experts}) should be divisible by "
            f"moe_router_num_groups ({config.moe_router_num_groups})."
        )
    if config.moe_router_enable_expert_bias and config.moe_router_score_function not in (
        "sigmoid",
        "sqrtsoftplus",
    ):
        raise ValueError(
            "Expert bias for aux-loss-free routing only supports 'sigmoid' and 'sqrtsoftplus' "
            "score functions; set moe_router_score_function to one of them."
        )


def _apply_recompute_rules(config) -> None:
    granularity = config.recompute_granularity
    if granularity is not None:
        if config.recompute_method is None and granularity != "selective":
            raise ValueError(
                f"Using recompute_granularity: {granularity} so recompute_method must be "
                '"block" or "uniform".'
            )
        if granularity != "selective" and config.recompute_num_layers is None:
            raise ValueError(
                f"When using recompute_granularity: {granularity} recompute_num_layers must be "
                f"between 1 and the layers per pipeline rank ({config.num_layers})."
            )
    if config.recompute_modules is None:
        config.recompute_modules = ["core_attn"]
    if config.moe_layer_recompute:
        if granularity == "full":
            raise ValueError("Do not set moe_layer_recompute with full recompute granularity.")
        config.recompute_granularity = "selective"
        if "moe" not in config.recompute_modules:
            config.recompute_modules.append("moe")


def _apply_overlap_and_determinism_rules(config) -> None:
    if config.overlap_moe_expert_parallel_comm:
        assert config.expert_model_parallel_size > 1, (
            "overlap_moe_expert_parallel_comm is only supported with expert model parallelism"
        )
        assert config.moe_token_dispatcher_type in ("alltoall", "flex"), (
            "overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher"
        )
        assert config.recompute_granularity != "full", (
            "disable full recomputation when enabling overlap_moe_expert_parallel_comm"
        )
        assert config.recompute_method is None, (
            "disable recomputation method when enabling overlap_moe_expert_parallel_comm"
        )
        assert config.recompute_num_layers is None, (
            "recompute_num_layers must be None when enabling overlap_moe_expert_parallel_comm"
        )
        assert "moe" not in config.recompute_modules, (
            "disable moe in recompute_modules when enabling overlap_moe_expert_parallel_comm"
        )
        assert config.bf16 or config.fp16, (
            "overlap_moe_expert_parallel_comm is only supported with bf16 or fp16 model"
        )
        assert not config.moe_shared_expert_overlap, (
            "disable moe_shared_expert_overlap when enabling overlap_moe_expert_parallel_comm"
        )
        assert config.mtp_num_layers in (None, 0, 1), (
            "MTP supports at most one layer when enabling overlap_moe_expert_parallel_comm."
        )
    if config.batch_invariant_mode:
        backends = ("te_native", "deepgemm", "triton")
        assert config.batch_invariant_backend in backends, (
            f"Unknown batch_invariant_backend {config.batch_invariant_backend!r}; "
            f"expected one of {backends}."
        )
        assert config.params_dtype == torch.bfloat16, (
            f"Batch invariant mode supports BF16 model parameters only; got {config.params_dtype}."
        )
        assert config.attention_backend == AttnBackend.flash, (
            "Batch invariant mode only supports FlashAttention (AttnBackend.flash)"
        )
        assert config.flash_attention_version in (3, 4), (
            "Batch invariant mode requires flash_attention_version 3 or 4."
        )
