"""The transformer MLP: ``fc2(activation(fc1(x)))``, with tensor-parallel linears.

The layer is API-compatible with upstream megatron-core's ``MLP``. ``__init__`` turns the config
into one :class:`ActivationSpec` and builds the layer's activation for it, once
(``mcore_activations.activation_path.select_layer_activation``: TE module, fused kernels or
unfused); a spec the path cannot compute is refused at construction, and a forward only calls
the activation built then. Every path computes what :meth:`ActivationSpec.reference` defines.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from mcore_activations.activation_path import (  # noqa: F401 - path names, as before
    FUSED_KERNEL_PATH,
    TE_MODULE_PATH,
    UNFUSED_PATH,
    LayerActivation,
    add_weighted_output_bias,
    per_token_probs,
    select_activation_path,
    select_layer_activation,
)
from mcore_activations.activation_spec import ActivationSpec
from mcore_activations.fusions import fc2_chunks
from megatron.core.transformer.mlp_interfaces import (  # noqa: F401 - upstream's import path
    LinearFc1Builder,
    LinearFc1Interface,
    LinearFc2Builder,
    LinearFc2Interface,
    TEActivationFunctionBuilder,
    TEActivationFunctionInterface,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_tensor_model_parallel_group_if_none


@dataclass
class MLPSubmodules:
    """The classes (or ModuleSpecs) an :class:`MLP` builds its parts from.

    The builders' contracts are the Protocols of ``mlp_interfaces``.

    Attributes:
        linear_fc1: Column-parallel linear, called as ``linear_fc1(input_size, output_size, *,
            config, init_method, gather_output, bias, skip_bias_add, is_expert,
            tp_comm_buffer_name, tp_group, stride, name, pg_collection)``.
        linear_fc2: Row-parallel linear, called as ``linear_fc2(input_size, output_size, *,
            config, init_method, bias, input_is_parallel, skip_bias_add, is_expert,
            tp_comm_buffer_name, tp_group, name, pg_collection)``.
        activation_func: Transformer Engine activation module, called as
            ``activation_func(config=config)``; used only with ``use_te_activation_func``.
    """

    linear_fc1: Union[ModuleSpec, LinearFc1Builder, None] = None
    linear_fc2: Union[ModuleSpec, LinearFc2Builder, None] = None
    activation_func: Union[ModuleSpec, TEActivationFunctionBuilder, None] = None


def te_activation_factory(submodules, config) -> Optional[Callable[[], torch.nn.Module]]:
    """Builds the TE activation module ``submodules`` name (None when they name none)."""
    if submodules.activation_func is None:
        return None
    return functools.partial(build_module, submodules.activation_func, config=config)


def _child_name(name: Optional[str], child: str) -> Optional[str]:
    return f"{name}.{child}" if name else None


class MLP(MegatronModule):
    """Transformer MLP: a column-parallel fc1, an activation and a row-parallel fc2.

    The input has ``input_size`` (default ``config.hidden_size``) features. fc1 projects it to
    ``ffn_hidden_size`` features, split across the tensor-parallel group (twice that for a gated
    linear unit, whose fc1 output holds the ``[gate, linear]`` halves); fc2 projects back and
    reduces across the group. See the module docstring for how the activation is computed.

    Args:
        config: Layer configuration.
        submodules: Classes of fc1, fc2 and (optionally) the TE activation module.
        is_expert: The MLP is an MoE expert (expert-tensor-parallel group, latent projection).
        input_size: fc1 input width; default ``config.hidden_size``.
        ffn_hidden_size: Intermediate width. Required for experts; for a dense MLP None falls
            back to ``config.ffn_hidden_size`` with a DeprecationWarning. fc2's input width is
            always ``config.ffn_hidden_size`` (as upstream), so callers keep the two equal.
        tp_group: Tensor-parallel group; default from ``parallel_state`` (deprecated).
        name: Name of the layer; its linears are named ``<name>.linear_fc1`` / ``.linear_fc2``.
        pg_collection: Process groups, passed on to the linears.

    Raises:
        ValueError: ``is_expert`` without ``ffn_hidden_size``.
        UnsupportedActivationError: The selected activation path cannot compute the configured
            activation (e.g. a custom callable with ``bias_activation_fusion``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        name: Optional[str] = None,
        pg_collection: Optional[Any] = None,
    ):
        super().__init__(config=config)
        self.input_size = input_size if input_size is not None else config.hidden_size
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)

        if ffn_hidden_size is None:
            if is_expert:
                raise ValueError("MoE MLP requires `ffn_hidden_size`, but it was not provided.")
            warnings.warn(
                "MLP requires ffn_hidden_size, but it was not provided. Using "
                "config.ffn_hidden_size by default.",
                DeprecationWarning,
                stacklevel=2,
            )
            ffn_hidden_size = config.ffn_hidden_size
        if ffn_hidden_size != config.ffn_hidden_size:
            # fc2's input width comes from the config (as upstream's does), so fc1 and fc2 would
            # disagree and the first forward would fail inside the fc2 GEMM.
            raise ValueError(
                f"{type(self).__name__}(ffn_hidden_size={ffn_hidden_size}) disagrees with "
                f"config.ffn_hidden_size={config.ffn_hidden_size}: fc2 is built from the config. "
                "Pass a config whose ffn_hidden_size is the layer's width (SequentialMLP and "
                "SharedExpertMLP build such a copy), or omit ffn_hidden_size."
            )

        # A gated fc1 holds [gate; linear]. stride=2 makes each tensor-parallel rank keep a slice
        # of both halves, so the local output is [gate shard; linear shard] and splits locally.
        fc1_output_size = ffn_hidden_size
        fc1_stride = 1
        if config.gated_linear_unit:
            fc1_output_size *= 2
            fc1_stride = 1 if config.use_kitchen else 2

        # A latent MoE expert reads and writes the router's low-rank latent, not the hidden state.
        self.use_latent = getattr(config, "moe_latent_size", None) is not None and is_expert
        fc1_input_size = config.moe_latent_size if self.use_latent else self.input_size
        fc2_output_size = config.moe_latent_size if self.use_latent else config.hidden_size

        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            fc1_input_size,
            fc1_output_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear,
            skip_bias_add=True,
            is_expert=is_expert,
            tp_comm_buffer_name="fc1",
            tp_group=self.tp_group,
            stride=fc1_stride,
            name=_child_name(name, "linear_fc1"),
            pg_collection=pg_collection,
        )

        self.activation_spec = ActivationSpec.from_config(config)
        self.layer_activation: LayerActivation = select_layer_activation(
            config,
            self.activation_spec,
            type(self).__name__,
            te_module_factory=te_activation_factory(submodules, config),
            offload_input=True,
        )
        self.activation_path = self.layer_activation.path
        self.activation_func = self.layer_activation.func

        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            config.ffn_hidden_size,
            fc2_output_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=is_expert,
            tp_comm_buffer_name="fc2",
            tp_group=self.tp_group,
            name=_child_name(name, "linear_fc2"),
            pg_collection=pg_collection,
        )
        self._check_fc2_chunks(is_expert)

    def forward(
        self,
        hidden_states: torch.Tensor,
        per_token_scale: Optional[torch.Tensor] = None,
        **kwargs,
    ):
        """Applies the MLP.

        Args:
            hidden_states: ``[..., input_size]``, typically ``[sequence, batch, hidden]``.
            per_token_scale: Optional per-token weights ``hidden_states.shape[:-1]`` (MoE router
                probabilities). They multiply the activation output, and the fc2 bias is scaled
                by them and added here, so the returned bias is then None.
            **kwargs: Ignored; accepted for call-site compatibility with other MLP classes.

        Returns:
            ``(output, output_bias)``: ``output`` is ``[..., hidden]``; ``output_bias`` is fc2's
            bias for the caller to add (fused with dropout upstream), or None when the layer has
            no bias or ``per_token_scale`` was given.
        """
        fc1_output, fc1_bias = self.linear_fc1(hidden_states)
        probs = per_token_probs(per_token_scale, fc1_output)
        activation = self._current_activation()
        # The activation and fc2, in row blocks with the fc2-chunks option (fusions.fc2_chunks);
        # with the output-recompute option fc2 saves a recipe of its input, not the input.
        output, output_bias = fc2_chunks.activation_and_fc2(
            activation,
            self.linear_fc2,
            fc1_output,
            fc1_bias,
            probs,
            self.activation_func,
            conflicts=getattr(self, "_fc2_chunks_conflicts", ()),
            owner=type(self).__name__,
        )

        if per_token_scale is not None and output_bias is not None:
            # Every token's contribution, bias included, is weighted by its router probability.
            output = add_weighted_output_bias(output, output_bias, per_token_scale)
            output_bias = None
        return output, output_bias

    def _check_fc2_chunks(self, is_expert: bool) -> None:
        """Refuses, at construction, a layer whose forward cannot run fc2 on row blocks while the
        fc2-chunks option is on (``mcore_activations.fusions.fc2_chunks``); keeps the config's
        conflicts for a forward after the option was turned on."""
        self._fc2_chunks_conflicts = fc2_chunks.check_layer(
            self.config, type(self).__name__, self.layer_activation, is_expert=is_expert
        )

    def _activate(
        self,
        x: torch.Tensor,
        bias: Optional[torch.Tensor],
        per_token_scale: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """The activation of fc1's output ``x`` (and fc1's unadded ``bias``) on this layer's path.

        The result is in ``x.dtype``; ``per_token_scale`` multiplies each row.
        """
        probs = per_token_probs(per_token_scale, x)
        return self._current_activation()(x, bias, probs, func=self.activation_func)

    def _current_activation(self) -> LayerActivation:
        activation = self.layer_activation
        if activation.spec is not self.activation_spec:
            # activation_spec was assigned after construction; the layer computes what it names.
            activation = self.layer_activation = activation.with_spec(self.activation_spec)
        return activation

    def backward_dw(self):
        """Computes the deferred weight gradients of fc2, then fc1 (delayed wgrad compute)."""
        self.linear_fc2.backward_dw()
        self.linear_fc1.backward_dw()

    @classmethod
    def as_mlp_submodule(
        cls,
        submodules: MLPSubmodules,
        config: TransformerConfig,
        pg_collection: Any,
        is_mtp_layer: bool,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        name: Optional[str] = None,
    ) -> MLP:
        """Builds this class as the ``mlp`` part of a transformer layer.

        Args:
            submodules: Classes of the MLP's parts.
            config: Layer configuration.
            pg_collection: Process groups; must provide ``tp``.
            is_mtp_layer: The layer belongs to a multi-token-prediction block. Accepted for
                signature compatibility; the MLP is built the same way.
            is_expert: Build an MoE expert.
            input_size: fc1 input width; default ``config.hidden_size``.
            ffn_hidden_size: Intermediate width (see :class:`MLP`).
            name: Name of the layer.

        Raises:
            ValueError: ``pg_collection`` lacks the ``tp`` group.
        """
        del is_mtp_layer
        if pg_collection is None or pg_collection.tp is None:
            raise ValueError(
                f"{cls.__name__}.as_mlp_submodule needs a pg_collection with a tp group."
            )
        if hasattr(cls, "_make_fused_impl"):
            # Fused implementations alias the linears' weights and cannot rematerialize them.
            assert getattr(config, "gtp_weight_remat_size", 1) <= 1, (
                f"{cls.__name__} does not support gtp_weight_remat_size > 1."
            )
        return cls(
            config,
            submodules,
            is_expert=is_expert,
            input_size=input_size,
            ffn_hidden_size=ffn_hidden_size,
            tp_group=pg_collection.tp,
            name=name,
            pg_collection=pg_collection,
        )
