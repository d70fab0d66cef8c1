"""Routed experts of an MoE layer: the local experts that run the tokens dispatched to this rank.

Input is the dispatcher's output: the tokens of all local experts, sorted by expert
(``tokens_per_expert`` gives the counts), and one router probability per token. Each token's
expert output is weighted by its probability, bias included.

- :class:`SequentialMLP` runs one :class:`MLP` per expert, one after the other.
- :class:`TEGroupedMLP` runs all experts' fc1 and fc2 as grouped GEMMs. Its activation runs on
  the MLP's paths (TE module, fused kernels, unfused), with the probabilities folded into the
  activation; with ``use_transformer_engine_op_fuser`` the whole expert runs as one Transformer
  Engine op sequence instead.

Both compute the activation of one :class:`ActivationSpec`. A gated expert's fc1 output may
interleave gate and linear columns in blocks of ``moe_mlp_glu_interleave_size`` (the layout the
fused grouped kernels read); the spec carries that layout, so every path reads it the same way.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Sequence
from copy import deepcopy
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from mcore_activations import te_import
from mcore_activations.activation_path import LayerActivation, select_layer_activation
from mcore_activations.activation_spec import ActivationKind, ActivationSpec, deinterleave_glu
from mcore_activations.fusions import fc2_chunks
from mcore_activations.te_import import TE_GROUPED_OPS_MIN_VERSION
from mcore_activations.te_lowering import lower_activation_to_te_op
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput, get_cuda_rng_tracker
from megatron.core.transformer.mlp import MLP, MLPSubmodules, _child_name, te_activation_factory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_size

__all__ = [
    "GroupedMLPSubmodules",
    "InferenceGroupedMLP",
    "SequentialMLP",
    "TEGroupedMLP",
]


def __getattr__(name: str):
    # Upstream's module globals ``te`` / ``HAVE_TE``, read from the TE import seam on each access.
    if name in ("te", "HAVE_TE"):
        return getattr(te_import, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class GroupedMLPSubmodules:
    """The classes (or ModuleSpecs) a :class:`TEGroupedMLP` builds its parts from.

    Attributes:
        linear_fc1: Column-parallel grouped linear, called as ``linear_fc1(num_gemms,
            input_size, output_size, *, config, init_method, bias, skip_bias_add, is_expert,
            tp_comm_buffer_name, pg_collection, name)``; ``forward(x, m_splits)`` returns
            ``(output, bias)``.
        linear_fc2: Row-parallel grouped linear, called like ``linear_fc1``. With
            ``skip_bias_add`` its forward returns the per-expert biases as a sequence.
        activation_func: Transformer Engine activation module, called as
            ``activation_func(config=config)``; used only with ``use_te_activation_func``.
    """

    linear_fc1: Union[ModuleSpec, type, None] = None
    linear_fc2: Union[ModuleSpec, type, None] = None
    activation_func: Union[ModuleSpec, type, None] = None


def _split_sizes(tokens_per_expert: Union[torch.Tensor, Sequence[int]]) -> list[int]:
    if isinstance(tokens_per_expert, torch.Tensor):
        return [int(n) for n in tokens_per_expert.tolist()]
    return [int(n) for n in tokens_per_expert]


def _routed_split(owner: str, num_experts: int, hidden, tokens_per_expert, probs) -> list[int]:
    """Token counts per local expert, after checking that they and ``probs`` fit ``hidden``.

    A count list of the wrong length would silently drop tokens, and ``[tokens, 1]``
    probabilities would broadcast against the expert outputs.
    """
    split_sizes = _split_sizes(tokens_per_expert)
    tokens = hidden.shape[0]
    if len(split_sizes) != num_experts:
        raise ValueError(
            f"{owner} has {num_experts} local experts but tokens_per_expert has "
            f"{len(split_sizes)} entries ({split_sizes}); pass one count per local expert."
        )
    if sum(split_sizes) != tokens:
        raise ValueError(
            f"{owner}: tokens_per_expert sums to {sum(split_sizes)} but the input has {tokens} "
            "tokens."
        )
    if probs is None or tuple(probs.shape) != (tokens,):
        shape = None if probs is None else tuple(probs.shape)
        raise ValueError(
            f"{owner}: permuted_probs must hold one probability per token, shape ({tokens},); "
            f"got {shape}."
        )
    return split_sizes


def _apply_probs_on_input(config, hidden_states, probs):
    """Moves the router weight from the output to the input (``moe_apply_probs_on_input``).

    Only exact for top-1 routing, where each token reaches one expert: the output is then
    ``expert(p * x)`` instead of ``p * expert(x)``.
    """
    assert config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with topk=1."
    hidden_states = (hidden_states * probs.unsqueeze(-1)).to(hidden_states.dtype)
    return hidden_states, torch.ones_like(probs)


def _remove_glu_interleaving(x: torch.Tensor, glu_interleave_size: int) -> torch.Tensor:
    """Turns a block-interleaved GLU input (``ActivationSpec.glu_interleave_size``) into the
    two-halves layout that ``torch.chunk(x, 2, -1)`` splits."""
    return torch.cat(deinterleave_glu(x, glu_interleave_size), dim=-1)


def _apply_bias(
    output: torch.Tensor,
    bias: Optional[Sequence[torch.Tensor]],
    tokens_per_expert: list[int],
    probs: torch.Tensor,
) -> torch.Tensor:
    """Adds each expert's fc2 bias to its tokens, weighted by their router probabilities.

    Args:
        output: fc2 output ``[tokens, hidden]``, tokens sorted by expert.
        bias: One bias per expert, or None.
        tokens_per_expert: Token count of each expert.
        probs: ``[tokens, 1]`` router probabilities.
    """
    if bias is None:
        return output
    pieces = []
    for tokens, expert_bias, expert_probs in zip(
        torch.split(output, tokens_per_expert), bias, torch.split(probs, tokens_per_expert)
    ):
        pieces.append(tokens + (expert_bias * expert_probs).to(tokens.dtype))
    return torch.cat(pieces, dim=0)


def _quantization_alignment(config) -> Optional[int]:
    """Rows per GEMM that FP8 / FP4 kernels need (None without quantization)."""
    if getattr(config, "fp4", None):
        return 32
    if getattr(config, "fp8", None):
        return 32 if getattr(config, "fp8_recipe", None) == "mxfp8" else 16
    return None


class SequentialMLP(MegatronModule):
    """Local experts as a list of :class:`MLP` modules, run one after the other.

    Args:
        num_local_experts: Number of experts on this rank.
        config: Layer configuration; the experts' width is ``moe_ffn_hidden_size``.
        submodules: Classes of each expert's fc1, fc2 and (optionally) TE activation module.
        pg_collection: Process groups; ``ep`` (expert parallel) and ``expt_tp`` (the experts'
            tensor-parallel group) are used.
        name: Name of the layer; expert ``i`` is ``<name>.local_experts.<i>``.
    """

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        pg_collection: Optional[Any] = None,
        name: Optional[str] = None,
    ):
        if config.moe_ffn_hidden_size != config.ffn_hidden_size:
            # MLP sizes fc2's input from config.ffn_hidden_size, so the experts get a config
            # whose ffn_hidden_size is theirs.
            config = deepcopy(config)
            config.ffn_hidden_size = config.moe_ffn_hidden_size
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        self.add_bias = config.add_bias_linear
        self.ep_group = getattr(pg_collection, "ep", None) if pg_collection is not None else None
        self.tp_group = (
            getattr(pg_collection, "expt_tp", None) if pg_collection is not None else None
        )

        self.local_experts = torch.nn.ModuleList(
            MLP(
                config,
                submodules,
                ffn_hidden_size=config.moe_ffn_hidden_size,
                is_expert=True,
                tp_group=self.tp_group,
                name=_child_name(name, f"local_experts.{index}"),
            )
            for index in range(num_local_experts)
        )

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: Union[torch.Tensor, Sequence[int]],
        permuted_probs: torch.Tensor,
    ):
        """Runs each expert on its tokens.

        Args:
            permuted_local_hidden_states: ``[tokens, hidden]``, sorted by expert.
            tokens_per_expert: Token count of each local expert (tensor or sequence).
            permuted_probs: ``[tokens]`` router probability of each token.

        Returns:
            ``(output, None)``: ``output`` is ``[tokens, hidden]``, each row weighted by its
            probability (bias included).
        """
        hidden_states, probs = permuted_local_hidden_states, permuted_probs
        split_sizes = _routed_split(
            type(self).__name__, self.num_local_experts, hidden_states, tokens_per_expert, probs
        )
        if self.config.moe_apply_probs_on_input:
            hidden_states, probs = _apply_probs_on_input(self.config, hidden_states, probs)

        alignment = _quantization_alignment(self.config)
        outputs = []
        for expert, tokens, token_probs in zip(
            self.local_experts,
            torch.split(hidden_states, split_sizes),
            torch.split(probs, split_sizes),
        ):
            rows = tokens.shape[0]
            if alignment is not None and rows % alignment:
                # Zero rows with zero probability: they change no real row and are cut below.
                pad = alignment - rows % alignment
                tokens = torch.nn.functional.pad(tokens, (0, 0, 0, pad))
                token_probs = torch.nn.functional.pad(token_probs, (0, pad))
            output, output_bias = expert(tokens, token_probs)
            # With a per-token scale MLP folds its fc2 bias into the output.
            assert output_bias is None
            outputs.append(output[:rows])
        return torch.cat(outputs, dim=0), None

    def backward_dw(self):
        """Computes the deferred weight gradients of every expert."""
        for expert in self.local_experts:
            expert.backward_dw()


class TEGroupedMLP(MegatronModule):
    """Local experts as grouped GEMMs: one grouped fc1, the activation, one grouped fc2.

    Each expert's fc2 bias is added to its tokens weighted by their probabilities (fc2 returns
    the biases unadded). With ``use_transformer_engine_op_fuser`` the expert runs as a Transformer
    Engine op sequence (grouped fc1, scaled activation, grouped fc2), which this class requires
    to be supported for the configuration (see :meth:`_is_fused_impl_supported`).

    Args:
        num_local_experts: Number of experts on this rank.
        config: Layer configuration; the experts' width is ``moe_ffn_hidden_size``.
        submodules: Classes of the grouped linears and (optionally) the TE activation module.
        pg_collection: Process groups; ``ep`` and ``expt_tp`` are used.
        name: Name of the layer.

    Raises:
        AssertionError: ``add_bias_linear`` with ``bias_dropout_fusion``, or the op fuser for a
            configuration its op sequence cannot run.
        UnsupportedActivationError: The selected unfused activation path cannot compute the
            configured activation.
        ValueError: The fc2-chunks option is on (``mcore_activations.fusions.fc2_chunks``) and
            the config cannot run fc2 on row blocks.
    """

    # Upstream also exposes the layout helper on the class.
    _remove_glu_interleaving = staticmethod(_remove_glu_interleaving)

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: GroupedMLPSubmodules,
        pg_collection: Optional[Any] = None,
        name: Optional[str] = None,
    ):
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        self.input_size = config.hidden_size
        assert not (config.add_bias_linear and config.bias_dropout_fusion), (
            "bias_dropout_fusion is not supported in TEGroupedMLP when add_bias_linear=True"
        )
        self.ep_group = getattr(pg_collection, "ep", None) if pg_collection is not None else None
        self.tp_group = (
            getattr(pg_collection, "expt_tp", None) if pg_collection is not None else None
        )

        ffn_hidden_size = config.moe_ffn_hidden_size
        fc1_output_size = 2 * ffn_hidden_size if config.gated_linear_unit else ffn_hidden_size
        self.use_latent = config.moe_latent_size is not None
        # Width of the experts' input and output: the router's latent, or the hidden state.
        io_size = config.moe_latent_size if self.use_latent else self.input_size

        # fc1 adds its own per-expert bias (skip_bias_add=False); fc2 returns its biases so they
        # can be weighted by the probabilities.
        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            num_local_experts,
            io_size,
            fc1_output_size,
            config=config,
            init_method=config.init_method,
            bias=config.add_bias_linear,
            skip_bias_add=False,
            is_expert=True,
            tp_comm_buffer_name="fc1",
            pg_collection=pg_collection,
            name=_child_name(name, "linear_fc1"),
        )

        self.glu_interleave_size = (
            config.moe_mlp_glu_interleave_size if config.gated_linear_unit else None
        )
        k = self.glu_interleave_size
        local_half = ffn_hidden_size // get_pg_size(self.tp_group)
        if k is not None and local_half % k:
            # Each rank's fc1 output holds whole [gate block, linear block] pairs; otherwise the
            # first forward fails deep inside the de-interleave.
            raise ValueError(
                f"moe_mlp_glu_interleave_size={k} must divide each expert's GLU half on one rank, "
                f"moe_ffn_hidden_size / expert_tensor_parallel_size = {ffn_hidden_size} / "
                f"{get_pg_size(self.tp_group)} = {local_half}; choose a divisor of {local_half}."
            )
        self.activation_spec = ActivationSpec.from_config(
            config, glu_interleave_size=self.glu_interleave_size
        )
        # Upstream's selective recompute of the MoE activation: on the fused path the layer
        # frees fc2's input after the forward and the kernel writes it again before fc2's
        # backward (output_recompute), from fc1's output itself, not a detached copy, so the
        # in-place backward may run with it.
        self.activation_recompute = config.recompute_granularity == "selective" and "moe_act" in (
            config.recompute_modules or ()
        )
        self.layer_activation: LayerActivation = select_layer_activation(
            config,
            self.activation_spec,
            type(self).__name__,
            te_module_factory=te_activation_factory(submodules, config),
            fused_kernel_opt_in=self._uses_fused_weighted_squared_relu(),
            recompute_output=True if self.activation_recompute else None,
        )
        self.activation_path = self.layer_activation.path
        self.activation_func = self.layer_activation.func

        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            num_local_experts,
            ffn_hidden_size,
            io_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            skip_bias_add=True,
            is_expert=True,
            tp_comm_buffer_name="fc2",
            pg_collection=pg_collection,
            name=_child_name(name, "linear_fc2"),
        )
        if self.activation_recompute and (config.fp8 or getattr(config, "fp4", None)):
            # A quantizing fc2 would save its own FP8 copy and keep it: freeing the output
            # saves memory only when fc2 saves the original.
            from megatron.core.extensions.te_linears import set_save_original_input

            set_save_original_input(self.linear_fc2)

        self._fused_ops: Optional[tuple] = None  # a 1-tuple: never a submodule
        self.use_fused_impl = bool(config.use_transformer_engine_op_fuser)
        # The op fuser's chain runs fc2 once, whatever the fc2-chunks option says.
        self._fc2_chunks_conflicts = (
            ()
            if self.use_fused_impl
            else fc2_chunks.check_layer(
                config, type(self).__name__, self.layer_activation, is_expert=True
            )
        )
        if self.use_fused_impl:
            reason = self._fused_impl_unsupported_reason()
            assert reason is None, (
                f"Fused GroupedMLP is not supported for this configuration: {reason}."
            )

    def _uses_fused_weighted_squared_relu(self) -> bool:
        # Upstream's opt-in for the weighted squared-ReLU kernel: with it, non-gated squared ReLU
        # (tanh-clamped or not) runs on the fused kernels even without bias_activation_fusion.
        spec = self.activation_spec
        return (
            bool(self.config.use_fused_weighted_squared_relu)
            and not spec.gated
            and spec.kind == ActivationKind.SQUARED_RELU
        )

    # -------------------------------------------------------------------------- forward
    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: Union[torch.Tensor, Sequence[int]],
        permuted_probs: torch.Tensor,
        output_buffer: Optional[torch.Tensor] = None,
        grad_input_buffer: Optional[torch.Tensor] = None,
    ):
        """Runs the local experts.

        Args:
            permuted_local_hidden_states: ``[tokens, hidden]``, sorted by expert.
            tokens_per_expert: Token count of each local expert.
            permuted_probs: ``[tokens]`` router probability of each token.
            output_buffer: Accepted for signature compatibility; unused.
            grad_input_buffer: Accepted for signature compatibility; unused.

        Returns:
            ``(output, None)`` with ``output`` ``[tokens, hidden]``.
        """
        del output_buffer, grad_input_buffer
        hidden_states, probs = permuted_local_hidden_states, permuted_probs
        split_sizes = _routed_split(
            type(self).__name__, self.num_local_experts, hidden_states, tokens_per_expert, probs
        )
        if self.use_fused_impl:
            return self._fused_forward(hidden_states, tokens_per_expert, probs), None

        if self.config.moe_apply_probs_on_input:
            hidden_states, probs = _apply_probs_on_input(self.config, hidden_states, probs)
        probs = probs.unsqueeze(-1)

        fc1_output, fc1_bias = self.linear_fc1(hidden_states, split_sizes)
        activation = self._current_activation()
        if self.activation_recompute and not activation.recomputes_fused_output():
            return self._forward_with_checkpointed_activation(
                activation, fc1_output, fc1_bias, probs, split_sizes
            )
        # The activation and fc2, in row blocks with the fc2-chunks option (fusions.fc2_chunks);
        # with the output-recompute option (or 'moe_act') fc2 saves a recipe of its input.
        output, fc2_bias = fc2_chunks.activation_and_fc2(
            activation,
            self.linear_fc2,
            fc1_output,
            fc1_bias,
            probs,
            self.activation_func,
            conflicts=self._fc2_chunks_conflicts,
            owner=type(self).__name__,
            tokens_per_expert=split_sizes,
        )
        return _apply_bias(output, fc2_bias, split_sizes, probs), None

    def _forward_with_checkpointed_activation(
        self, activation, fc1_output, fc1_bias, probs, split_sizes
    ):
        """'moe_act' where the fused recipe cannot serve (the unfused and TE-module paths, FP8
        input store, offloading): upstream's output-discarding checkpoint of the activation."""
        checkpoint = CheckpointWithoutOutput()
        intermediate = checkpoint.checkpoint(
            functools.partial(activation, func=self.activation_func), fc1_output, fc1_bias, probs
        )
        output, fc2_bias = self.linear_fc2(intermediate, split_sizes)
        checkpoint.discard_output_and_register_recompute(output)
        return _apply_bias(output, fc2_bias, split_sizes, probs), None

    def _activate(
        self, x: torch.Tensor, bias: Optional[torch.Tensor], probs: torch.Tensor
    ) -> torch.Tensor:
        """The activation of fc1's output, weighted by ``probs`` (``[tokens, 1]``)."""
        return self._current_activation()(x, bias, probs, func=self.activation_func)

    def _current_activation(self) -> LayerActivation:
        activation = self.layer_activation
        if activation.spec is not self.activation_spec:
            # activation_spec was assigned after construction; the layer computes what it names.
            activation = self.layer_activation = activation.with_spec(self.activation_spec)
        return activation

    # ------------------------------------------------------------ Transformer Engine ops
    def _is_fused_impl_supported(self) -> bool:
        """Whether the Transformer Engine op sequence can run this configuration."""
        return self._fused_impl_unsupported_reason() is None

    def _fused_impl_unsupported_reason(self) -> Optional[str]:
        """Why the op sequence cannot run this configuration, or None when it can."""
        config = self.config
        if not te_import.have_te():
            return "Transformer Engine is not available"
        ops = getattr(te_import.te.pytorch, "ops", None)
        if ops is None or not hasattr(ops, "GroupedLinear"):
            return "this Transformer Engine has no te.pytorch.ops.GroupedLinear"
        if not te_import.is_te_min_version(TE_GROUPED_OPS_MIN_VERSION):
            return f"the grouped MLP ops need Transformer Engine >= {TE_GROUPED_OPS_MIN_VERSION}"
        if get_pg_size(self.tp_group) > 1:
            return "expert tensor parallelism is not supported"
        offloaded = set(getattr(config, "offload_modules", None) or ())
        if getattr(config, "fine_grained_activation_offloading", False) and offloaded & {
            "expert_fc1",
            "moe_act",
        }:
            return "offloading expert_fc1 / moe_act activations is not supported"
        if config.moe_apply_probs_on_input:
            return "moe_apply_probs_on_input is not supported"
        grouped_linear = te_import.te.pytorch.GroupedLinear
        if not isinstance(self.linear_fc1, grouped_linear) or not isinstance(
            self.linear_fc2, grouped_linear
        ):
            return "fc1 and fc2 must be Transformer Engine GroupedLinear modules"
        if _has_bias(self.linear_fc2) and "scale_bias" not in _init_parameters(ops.GroupedLinear):
            return "this Transformer Engine's GroupedLinear op cannot scale the fc2 bias"
        spec = self.activation_spec
        if not spec.gated and not self._uses_fused_weighted_squared_relu():
            return "a non-gated activation is fused only with use_fused_weighted_squared_relu"
        try:
            self._lower_activation()
        except (ValueError, RuntimeError) as error:
            return str(error)
        if spec.gated and int(os.environ.get("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "0")) <= 0:
            return "the fused grouped GLU kernel needs NVTE_CUTEDSL_FUSED_GROUPED_MLP=1"
        return None

    def _lower_activation(self):
        """The scaled TE op of this layer's activation (raises if TE has none)."""
        return lower_activation_to_te_op(
            self.activation_spec.with_interleave(None),
            path=type(self).__name__,
            scaled=True,
            glu_interleave_size=self.glu_interleave_size,
        )

    def _make_fused_ops(self):
        """Builds ``Sequential(GroupedLinear fc1, scaled activation, GroupedLinear fc2)``.

        The grouped-linear ops alias the weights (and biases) of fc1 / fc2, so the parameters,
        and the state dict, stay those of this module.
        """
        ops = te_import.te.pytorch.ops

        def grouped_linear(linear, **extra):
            weight0 = linear.weight0
            has_bias = _has_bias(linear)
            op = ops.GroupedLinear(
                num_groups=self.num_local_experts,
                in_features=weight0.shape[1],
                out_features=weight0.shape[0],
                bias=has_bias,
                device="meta",
                dtype=weight0.dtype,
                rng_state_tracker_function=get_cuda_rng_tracker,
                accumulate_into_main_grad=getattr(linear, "fuse_wgrad_accumulation", False),
                **extra,
            )
            for index in range(self.num_local_experts):
                setattr(op, f"weight{index}", getattr(linear, f"weight{index}"))
                if has_bias:
                    setattr(op, f"bias{index}", getattr(linear, f"bias{index}"))
            return op

        fc1 = grouped_linear(self.linear_fc1)
        if self.glu_interleave_size is not None:
            fc1._glu_interleave_size = self.glu_interleave_size
        fc2_extra = {"scale_bias": True} if _has_bias(self.linear_fc2) else {}
        return ops.Sequential(
            fc1, self._lower_activation(), grouped_linear(self.linear_fc2, **fc2_extra)
        )

    def _fused_forward(self, hidden_states, tokens_per_expert, probs):
        if not self.config.moe_use_grouped_tensor:
            raise RuntimeError(
                f"The fused {type(self).__name__} path requires moe_use_grouped_tensor=True."
            )
        if self._fused_ops is None:
            self._fused_ops = (self._make_fused_ops(),)
        # Extra inputs: fc1's split sizes, the activation's scales, fc2's split sizes (and its
        # bias scales when it has a bias).
        fc2_extra = (
            (tokens_per_expert, probs) if _has_bias(self.linear_fc2) else (tokens_per_expert,)
        )
        return self._fused_ops[0](hidden_states, tokens_per_expert, probs, *fc2_extra)

    def backward_dw(self):
        """Computes the deferred weight gradients of fc2, then fc1."""
        self.linear_fc2.backward_dw()
        self.linear_fc1.backward_dw()


def _has_bias(linear) -> bool:
    bias = getattr(linear, "bias0", None)
    if bias is None:
        bias = getattr(linear, "bias", None)
    # TE exposes an empty tensor for a disabled bias.
    return isinstance(bias, torch.Tensor) and bias.numel() > 0


def _init_parameters(cls) -> Sequence[str]:
    try:
        return tuple(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return ()


class InferenceGroupedMLP(TEGroupedMLP):
    """:class:`TEGroupedMLP` under the name inference code builds.

    It computes exactly what its parent computes; upstream's inference-only optimisations are not
    part of this fork.
    """
