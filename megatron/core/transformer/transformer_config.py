"""TransformerConfig: the architecture settings the MLP / MoE-expert stack reads."""

from __future__ import annotations

import dataclasses
import logging
import math
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from mcore_activations.activation_spec import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    as_float32,
    check_clamps_exclusive,
    is_positive_finite_float32,
)
from mcore_activations.te_import import TE_GROUPED_OPS_MIN_VERSION
from megatron.core.config_feature_fields import (
    ModelParallelFeatureFields,
    check_feature_field_choices,
)
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.transformer_feature_fields import (
    TransformerFeatureFields,
    apply_transformer_feature_rules,
)

logger = logging.getLogger(__name__)


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Init method drawing from N(0, sigma)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable:
    """Init method drawing from N(0, sigma / sqrt(2 * num_layers)) (output projections)."""
    return init_method_normal(sigma / math.sqrt(2.0 * max(num_layers, 1)))


def _is_positive_finite(value) -> bool:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(value) and value > 0.0


def _require_float32_scale(name: str, value) -> None:
    """Refuses a clamp or scale finite in float64 but inf or ~0 in float32 (the kernels')."""
    if not is_positive_finite_float32(float(value)):
        raise ValueError(
            f"{name}={value!r} is {as_float32(float(value))!r} in float32, the precision the "
            f"activation kernels compute in; use a value between {FLOAT32_TINY:g} and "
            f"{FLOAT32_MAX:g}."
        )


_SIMPLE_TYPES = (bool, int, float, str)


def _simple_annotation(annotation) -> Optional[tuple[type, bool]]:
    """``(type, optional)`` for ``T`` or ``Optional[T]`` with T bool/int/float/str, else None."""
    args = typing.get_args(annotation)
    if annotation in _SIMPLE_TYPES:
        return annotation, False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 2:
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and inner[0] in _SIMPLE_TYPES:
            return inner[0], True
    return None


def _check_field_types(config) -> None:
    """Refuses a value whose type contradicts its field's annotation (bool, int, float, str).

    ``gated_linear_unit='False'`` would otherwise mean gated, a clamp ``'7'`` fail deep inside a
    kernel, and ``moe_mlp_glu_interleave_size='abc'`` only at the first forward. An int is
    accepted for a float field; a bool is not accepted for an int or float field.
    """
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        simple = _simple_annotation(hints.get(field.name))
        if simple is None:
            continue
        expected, optional = simple
        value = getattr(config, field.name)
        if value is None and (optional or field.default is None):
            continue
        if expected is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        elif expected is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, expected)
        if not ok:
            wanted = expected.__name__ + (" or None" if optional else "")
            raise TypeError(
                f"TransformerConfig.{field.name} must be {wanted}, got {value!r} "
                f"({type(value).__name__})."
            )


@dataclass
class TransformerConfig(TransformerFeatureFields, ModelParallelConfig):
    """Configuration of a transformer layer's MLP and MoE experts.

    Field names, defaults and validation follow upstream megatron-core. The activation fields are
    turned into one ``ActivationSpec`` (``megatron.core.transformer.activation_spec``) that every
    MLP path lowers or refuses; no module reads them directly to choose math.

    The fields declared here are the ones the MLP / MoE-expert stack reads. Every other upstream
    field (attention, pipeline split, recomputation, routing, CUDA graphs, inference...) is
    accepted with upstream's name, type and default from ``TransformerFeatureFields``, checked by
    upstream's value rules, and reported once with ``UnimplementedFeatureWarning`` when set
    (``megatron.core.config_feature_fields``).
    """

    # ---- model shape ----
    num_layers: int = 0
    """Number of transformer layers."""

    hidden_size: int = 0
    """Transformer hidden size."""

    num_attention_heads: int = 0
    """Number of attention heads (must divide by the TP size)."""

    kv_channels: Optional[int] = None
    """Projection size per head; defaults to ``hidden_size // num_attention_heads``."""

    ffn_hidden_size: Optional[int] = None
    """MLP hidden size; defaults to ``4 * hidden_size``."""

    hidden_dropout: float = 0.1
    """Dropout after the MLP / attention output."""

    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of the layer norms."""

    layernorm_zero_centered_gamma: bool = False
    """Layer-norm gamma stored as (gamma - 1)."""

    normalization: str = "LayerNorm"
    """"LayerNorm" or "RMSNorm"."""

    add_bias_linear: bool = True
    """Bias on every linear layer (QKV, projection and both MLP linears)."""

    # ---- activation ----
    gated_linear_unit: bool = False
    """Gated MLP: fc1 produces [gate, linear] halves, output ``act(gate) * linear``."""

    activation_func: Callable = F.gelu
    """Activation applied to the fc1 output (to the gate half when gated)."""

    activation_func_fp8_input_store: bool = False
    """Store the activation input in fp8 (e4m3) for the backward pass (SwiGLU only)."""

    glu_linear_offset: float = 0.0
    """Offset added to the linear half of a GLU: ``act(gate) * (linear + offset)``."""

    activation_func_clamp_value: Optional[float] = None
    """Clamp c of a gated activation: gate clamped to ``<= c``, linear half to ``[-c, c]``.

    DeepSeek-V4 clamped SwiGLU (MoE only) and gpt-oss quick-GEGLU use it.
    """

    activation_func_tanh_clamp_scale: Optional[float] = None
    """Tanh soft-clamp scale s_g. Gated SiLU becomes SiTU-GLU (gate ``s_g*tanh(g/s_g)*sigmoid(g)``);
    a non-gated activation is applied to ``s_g*tanh(x/s_g)``."""

    activation_func_tanh_clamp_scale_linear: Optional[float] = None
    """SiTU-GLU linear-half scale s_l: the linear half becomes ``s_l*tanh(u/s_l)``."""

    use_te_activation_func: bool = False
    """Use Transformer Engine's activation module in the unfused MLP."""

    bias_activation_fusion: bool = False
    """Fuse the fc1 bias add with the activation (compiled fused kernels)."""

    bias_dropout_fusion: bool = False
    """Fuse bias add, dropout and residual add."""

    use_fused_weighted_squared_relu: bool = False
    """Use the fused squared-ReLU kernel with per-token weights in the experts."""

    use_transformer_engine_op_fuser: bool = False
    """Run the MLP through Transformer Engine's fusible ops (TEFusedMLP)."""

    use_kitchen: bool = False
    """NVIDIA kitchen quantization (not supported by this fork)."""

    # ---- initialization ----
    init_method: Optional[Callable] = None
    """Init of input-side weights; defaults to N(0, init_method_std)."""

    output_layer_init_method: Optional[Callable] = None
    """Init of output-side weights; defaults to N(0, init_method_std / sqrt(2 * num_layers))."""

    init_method_std: float = 0.02
    """Standard deviation of the default init methods."""

    # ---- precision ----
    fp8: Optional[str] = None
    """FP8 format ("e4m3" / "hybrid") or None."""

    fp4: Optional[str] = None
    """FP4 format or None."""

    # ---- MoE ----
    num_moe_experts: Optional[int] = None
    """Number of experts; None for a dense model."""

    moe_layer_freq: Union[int, list[int]] = 1
    """MoE layer frequency (int) or per-layer pattern (list of 0/1)."""

    moe_ffn_hidden_size: Optional[int] = None
    """Expert hidden size; defaults to ``ffn_hidden_size``."""

    moe_router_topk: int = 2
    """Experts per token."""

    moe_router_score_function: str = "softmax"
    """Router score function: "softmax" or "sigmoid"."""

    moe_router_pre_softmax: bool = False
    """Apply softmax before top-k selection."""

    moe_router_load_balancing_type: str = "aux_loss"
    """Load-balancing strategy ("aux_loss", "seq_aux_loss", "sinkhorn", "none")."""

    moe_token_dispatcher_type: str = "allgather"
    """Token dispatcher: "allgather", "alltoall" or "flex"."""

    moe_grouped_gemm: bool = False
    """Run the experts as one grouped GEMM (TEGroupedMLP)."""

    moe_use_grouped_tensor: bool = False
    """Pass grouped tensors between the fused expert ops (set by the op fuser)."""

    moe_single_grouped_weight: bool = False
    """Keep all experts' fc weights in one grouped parameter (TE >= 2.14)."""

    moe_single_grouped_bias: bool = False
    """Keep all experts' biases in one grouped parameter (TE >= 2.14)."""

    moe_mlp_glu_interleave_size: Optional[int] = None
    """Routed experts' fc1 output interleaves gate/linear in blocks of this many columns."""

    moe_apply_probs_on_input: bool = False
    """Multiply the router probabilities into the expert input (top-1 only)."""

    moe_latent_size: Optional[int] = None
    """Width of the experts' latent input/output projection."""

    moe_shared_expert_intermediate_size: Optional[int] = None
    """Total FFN size of the shared experts."""

    moe_shared_expert_gate: bool = False
    """Gate the shared-expert output with ``sigmoid(x @ gate_weight.T)``."""

    moe_shared_expert_overlap: bool = False
    """Overlap the shared expert with the token dispatcher's communication."""

    use_grouped_gemm_for_shared_expert: bool = False
    """Run the shared expert through TE grouped ops (FusedSharedExpertMLP)."""

    moe_shared_expert_glu_interleave_size: Optional[int] = None
    """GLU block interleave of the fused shared expert's fc1 (required by FusedSharedExpertMLP)."""

    use_grouped_gemm_for_dense_mlp: bool = False
    """With the op fuser, run dense MLPs through TE grouped ops (TEFusedMLPWithGroupedLinear)."""

    te_fused_recipe: Optional[str] = None
    """Quantization recipe of the TE grouped fused ops (TEFusedMLPWithGroupedLinear,
    FusedSharedExpertMLP): "mxfp8", "nvfp4" or "none" (unquantized, the same math as the unfused
    MLP; the only choice on GPUs older than SM100). None: env ``FP4_RECIPE``, else "mxfp8"."""

    def _feature_field_classes(self) -> tuple:
        return (ModelParallelFeatureFields, TransformerFeatureFields)

    def __post_init__(self):
        _check_field_types(self)
        self._upstream_post_init()
        apply_transformer_feature_rules(self)

        if self.num_attention_heads and self.num_attention_heads % self.tensor_model_parallel_size:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size})."
            )
        if self.kv_channels is None and self.num_attention_heads:
            self.kv_channels = self.hidden_size // self.num_attention_heads

        if self.use_transformer_engine_op_fuser and self.moe_grouped_gemm:
            self.moe_use_grouped_tensor = True
        if self.moe_use_grouped_tensor and not self.moe_grouped_gemm:
            raise ValueError("moe_use_grouped_tensor=True requires moe_grouped_gemm=True.")

        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size

        self._validate_moe()
        self._validate_activation()
        if self.te_fused_recipe not in (None, "mxfp8", "nvfp4", "none"):
            raise ValueError(
                f"te_fused_recipe={self.te_fused_recipe!r} is not a recipe; use 'mxfp8', "
                "'nvfp4', 'none' (unquantized) or None (FP4_RECIPE, else 'mxfp8')."
            )

        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(
                self.init_method_std, self.num_layers
            )
        # Last, so that upstream's own checks (and their exception types) fire first: the
        # declared-choice checks, then what only this fork refuses (e.g. pipeline parallelism).
        check_feature_field_choices(self, self._feature_field_classes())
        self._refuse_unsupported()

    # ------------------------------------------------------------------ MoE
    def _validate_moe(self):
        if self.num_moe_experts is not None and self.num_moe_experts <= 0:
            raise ValueError("num_moe_experts must be non-negative.")

        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
            warnings.warn("moe_ffn_hidden_size is not set, using ffn_hidden_size instead.")

        if self.num_moe_experts is None and self.moe_ffn_hidden_size is not None:
            freq = self.moe_layer_freq
            mixed = (isinstance(freq, list) and 0 in freq) or (isinstance(freq, int) and freq > 1)
            if mixed:
                warnings.warn(
                    "moe_ffn_hidden_size is set on a model whose dense layers do not use it; "
                    "resetting it to None."
                )
                self.moe_ffn_hidden_size = None
            else:
                raise ValueError("moe_ffn_hidden_size is set but num_moe_experts is None.")

        if self.moe_single_grouped_weight or self.moe_single_grouped_bias:
            from megatron.core.utils import is_te_min_version

            if not self.moe_grouped_gemm:
                raise ValueError(
                    "moe_single_grouped_weight / moe_single_grouped_bias require "
                    "moe_grouped_gemm=True."
                )
            if not is_te_min_version(TE_GROUPED_OPS_MIN_VERSION):
                raise ValueError(
                    "moe_single_grouped_weight / moe_single_grouped_bias require "
                    "Transformer Engine >= 2.14.0."
                )
            if self.moe_single_grouped_bias and not self.add_bias_linear:
                raise ValueError("moe_single_grouped_bias=True requires add_bias_linear=True.")

        # A GLU block size is read by the grouped expert classes only (TEGroupedMLP,
        # FusedSharedExpertMLP), where one of 0 or below would fail at layer build as a
        # ZeroDivisionError naming nothing. Upstream's other classes ignore the field, so it is
        # refused only where a class would read it.
        for name, used in (
            ("moe_mlp_glu_interleave_size", self.moe_grouped_gemm),
            ("moe_shared_expert_glu_interleave_size", self.use_grouped_gemm_for_shared_expert),
        ):
            block = getattr(self, name)
            if used and block is not None and block <= 0:
                raise ValueError(
                    f"{name} must be a positive number of columns per gate / linear block, or "
                    f"None for the two-halves layout; got {block}."
                )

        size = self.moe_shared_expert_intermediate_size
        if size is not None:
            if size <= 0:
                raise ValueError(
                    f"moe_shared_expert_intermediate_size must be num_shared_experts * ffn_size "
                    f"of each shared expert and > 0, but got {size}."
                )
            if self.moe_shared_expert_overlap and self.moe_token_dispatcher_type not in (
                "alltoall",
                "flex",
            ):
                raise ValueError(
                    "moe_shared_expert_overlap only works with the alltoall or flex token "
                    f"dispatcher, got moe_token_dispatcher_type={self.moe_token_dispatcher_type!r}."
                )

        if self.num_moe_experts is not None and self.add_bias_linear:
            assert self.expert_tensor_parallel_size == 1, (
                "Bias in Moe is only supported when ETP==1"
            )

        if (
            self.num_moe_experts is not None
            and self.moe_router_topk == 1
            and self.moe_router_score_function == "softmax"
            and not self.moe_router_pre_softmax
            and self.moe_router_load_balancing_type != "sinkhorn"
        ):
            raise ValueError("Please use --moe-router-pre-softmax when topk is 1.")

    # ------------------------------------------------------------ activation
    def _validate_activation(self):
        # Imported here: the fusions import nothing from the config, but keeping the dependency
        # local avoids import cycles for tools that only need the dataclass.
        from mcore_activations.fusions.fused_bias_geglu import quick_gelu

        act = self.activation_func
        gated = self.gated_linear_unit
        if not callable(act):
            raise ValueError(
                f"activation_func must be a callable such as torch.nn.functional.silu, got "
                f"{act!r} ({type(act).__name__})."
            )

        if self.bias_activation_fusion:
            if act not in (F.gelu, F.silu, quick_gelu):
                raise ValueError(
                    "When bias_activation_fusion is True, activation function should be either "
                    "gelu, swiglu, or quick_geglu"
                )
            if act == F.gelu and not gated and not self.add_bias_linear:
                raise ValueError(
                    "When bias_activation_fusion is True, gated_linear_unit is False and "
                    "activation function is gelu, add_bias_linear must also be True."
                )
            if act == quick_gelu and not gated:
                raise ValueError(
                    "When bias_activation_fusion is True and activation function is quick_gelu, "
                    "gated_linear_unit must be True."
                )
            if self.glu_linear_offset != 0.0 and act != quick_gelu:
                raise ValueError(
                    "When bias_activation_fusion is True and glu_linear_offset is non-zero, "
                    "activation function must be quick_gelu."
                )
            if self.use_te_activation_func:
                raise ValueError(
                    "bias_activation_fusion and use_te_activation_func cannot be both true. "
                    "If you use bias in MLP FC1, we recommend setting bias_activation_fusion to "
                    "True and use_te_activation_func to False."
                )

        if self.use_te_activation_func and act not in (F.gelu, F.silu, F.relu):
            raise ValueError(
                "TransformerEngine only support gelu, geglu, silu, swiglu, relu, reglu. If you "
                "don't want to use TransformerEngine activation function, set "
                "use_te_activation_func to False"
            )

        if self.activation_func_fp8_input_store and (act != F.silu or not gated):
            raise ValueError("Storing activation input in FP8 is supported only for SwiGLU.")

        if not math.isfinite(as_float32(float(self.glu_linear_offset))):
            raise ValueError(
                f"glu_linear_offset must be finite (in float32, the kernels' precision), got "
                f"{self.glu_linear_offset!r}."
            )
        if self.glu_linear_offset != 0.0 and not gated:
            raise ValueError(
                f"glu_linear_offset={self.glu_linear_offset!r} only applies to gated linear "
                "units; set gated_linear_unit=True or leave glu_linear_offset at 0.0."
            )

        self._validate_clamp(act, gated)
        self._validate_tanh_clamp(act, gated)

    def _validate_clamp(self, act, gated):
        clamp = self.activation_func_clamp_value
        if clamp is None:
            return
        if act == F.silu and gated:
            # Upstream's messages, matched by upstream tests.
            if not _is_positive_finite(clamp):
                raise ValueError(
                    "activation_func_clamp_value for SwiGLU must be finite and greater than zero."
                    f" Got {clamp!r}."
                )
            _require_float32_scale("activation_func_clamp_value", clamp)
            if self.num_moe_experts is None:
                raise ValueError(
                    "activation_func_clamp_value for SwiGLU is only supported with MoE. "
                    "Set num_moe_experts or leave activation_func_clamp_value=None."
                )
            if self.glu_linear_offset != 0.0:
                raise ValueError(
                    "glu_linear_offset must be zero when activation_func_clamp_value is set for "
                    f"SwiGLU (got glu_linear_offset={self.glu_linear_offset!r})."
                )
            if self.use_te_activation_func:
                raise ValueError(
                    "use_te_activation_func must be False when activation_func_clamp_value is "
                    "not None for SwiGLU"
                )
            return
        if not gated:
            raise ValueError(
                f"activation_func_clamp_value={clamp!r} applies to gated linear units only "
                "(gate clamped to <= c, linear half to [-c, c]). With gated_linear_unit=False use "
                "activation_func_tanh_clamp_scale for a soft clamp, or leave the clamp at None."
            )
        if not _is_positive_finite(clamp):
            raise ValueError(
                f"activation_func_clamp_value must be finite and greater than zero, got {clamp!r}."
            )
        _require_float32_scale("activation_func_clamp_value", clamp)
        if self.use_te_activation_func:
            raise ValueError(
                "use_te_activation_func must be False when activation_func_clamp_value is set: "
                "Transformer Engine's activation modules take no clamp."
            )

    def _validate_tanh_clamp(self, act, gated):
        s_g = self.activation_func_tanh_clamp_scale
        s_l = self.activation_func_tanh_clamp_scale_linear
        for name, value in (
            ("activation_func_tanh_clamp_scale", s_g),
            ("activation_func_tanh_clamp_scale_linear", s_l),
        ):
            if value is not None and not _is_positive_finite(value):
                raise ValueError(f"{name} must be finite and greater than zero, got {value!r}.")
            if value is not None:
                _require_float32_scale(name, value)
        if s_l is not None and s_g is None:
            raise ValueError(
                f"activation_func_tanh_clamp_scale_linear={s_l!r} requires "
                "activation_func_tanh_clamp_scale (SiTU-GLU's gate scale); set both or neither."
            )
        if s_g is None:
            return
        check_clamps_exclusive(
            self.activation_func_clamp_value,
            s_g,
            ("activation_func_clamp_value", "activation_func_tanh_clamp_scale"),
        )
        if gated and act != F.silu:
            raise ValueError(
                f"activation_func_tanh_clamp_scale={s_g!r} with gated_linear_unit=True defines "
                "SiTU-GLU and requires activation_func=F.silu; for other gated activations use "
                "activation_func_clamp_value or no clamp."
            )
        if s_l is not None and not gated:
            raise ValueError(
                f"activation_func_tanh_clamp_scale_linear={s_l!r} scales the linear half of a "
                "gated unit; it requires gated_linear_unit=True with activation_func=F.silu."
            )
        if self.use_te_activation_func:
            raise ValueError(
                "use_te_activation_func must be False when activation_func_tanh_clamp_scale is "
                "set: Transformer Engine's activation modules take no tanh clamp."
            )


@dataclass
class MLATransformerConfig(TransformerConfig):
    """``TransformerConfig`` with the settings of multi-latent attention (MLA) and its YaRN RoPE.

    This fork does not build attention, so these fields configure nothing it computes; the
    class exists so that upstream config code for MLA models (DeepSeek-V3 style MoE) constructs
    unchanged and its MLP / expert settings build here. ``multi_latent_attention`` defaults to
    True, so constructing one reports (once) that MLA itself is not implemented.

    Attributes:
        q_lora_rank: Rank of the query's low-rank projection.
        kv_lora_rank: Rank of the key / value low-rank projection.
        qk_head_dim: Head dimension of the QK projection (without the positional part).
        qk_pos_emb_head_dim: Head dimension of the positional (RoPE) part of Q and K.
        v_head_dim: Head dimension of V.
        rope_type: "yarn" or "rope".
        rotary_base, rotary_percent, rotary_scaling_factor, original_max_position_embeddings,
            beta_fast, beta_slow, mscale, mscale_all_dim: RoPE / YaRN parameters.
        cache_mla_latents: Cache the low-rank latents instead of the full KV cache (inference).
        mla_down_proj_fusion: Fuse the q / kv down-projections with the input norm.
    """

    multi_latent_attention: bool = True
    q_lora_rank: int = 512
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    normalization: str = "RMSNorm"
    rope_type: str = "yarn"
    rotary_base: float = 10000
    rotary_percent: float = 1.0
    rotary_scaling_factor: float = 40
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    cache_mla_latents: bool = False
    mla_down_proj_fusion: bool = False

    def __post_init__(self):
        super().__post_init__()
        # Upstream's MLA rules.
        if self.multi_latent_attention and self.apply_rope_fusion and self.rope_type != "yarn":
            raise ValueError("apply_rope_fusion for MLA only works with YARN RoPE.")
        if self.attention_output_gate:
            raise NotImplementedError("Output gate is not supported for MLA yet.")
        if self.cache_mla_latents:
            assert self.apply_rope_fusion is False, (
                "Rope Fusion is not compatible with caching latents"
            )
