"""Shared experts: an MLP that every token of an MoE layer passes through, next to the routed ones.

``SharedExpertMLP`` is an :class:`MLP` sized by ``moe_shared_expert_intermediate_size``, with an
optional sigmoid gate per token. With ``moe_shared_expert_overlap`` the token dispatcher runs it
in pieces (communication, fc1 + activation, fc2, communication) between its own all-to-alls, on a
side CUDA stream, so the shared expert's compute hides the routed experts' communication.

``FusedSharedExpertMLP`` runs fc1, the activation and fc2 as one Transformer Engine grouped-op
sequence (``use_grouped_gemm_for_shared_expert``).

The activation is the MLP's: one :class:`ActivationSpec`, computed on the path the MLP selected
(or, in the fused class, lowered to a TE op at construction).
"""

from __future__ import annotations

import contextlib
import enum
from copy import deepcopy
from typing import Any, Optional

import torch
import torch.nn.functional as F

from mcore_activations import te_import
from mcore_activations.activation_spec import (
    ActivationSpec,
    fc1_weight_to_blocks,
    fc1_weight_to_halves,
)
from mcore_activations.te_import import TE_GROUPED_OPS_MIN_VERSION
from mcore_activations.te_lowering import lower_activation_to_te_op
from megatron.core.extensions.te_linears import TELinear, set_save_original_input
from megatron.core.extensions.te_recipes import (
    check_fused_recipe_runs_here,
    fused_recipe_autocast,
    fused_recipe_model_init,
    make_fused_recipe,
    resolve_fused_recipe,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig


def __getattr__(name: str):
    # Upstream's module globals ``te`` / ``HAVE_TE``, read from the TE import seam on each access.
    if name in ("te", "HAVE_TE"):
        return getattr(te_import, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FusedSharedExpertMLP", "SharedExpertMLP"]


class _OverlapState(enum.Enum):
    """Progress of one overlapped shared-expert forward (see ``SharedExpertMLP``)."""

    IDLE = 0
    PRE_FORWARD_COMM_DONE = 1
    FC1_FORWARD_DONE = 2
    FC2_FORWARD_DONE = 3
    POST_FORWARD_COMM_DONE = 4


def _run_backward_early(tensor: Optional[torch.Tensor]) -> None:
    """Gives ``tensor``'s autograd node the highest priority in the backward pass.

    The autograd engine runs ready nodes with larger sequence numbers first. Raising it makes the
    shared expert's communication gradient start as soon as it is ready, so it overlaps the
    routed experts' backward instead of queueing behind it.
    """
    grad_fn = getattr(tensor, "grad_fn", None)
    if grad_fn is not None and hasattr(grad_fn, "_set_sequence_nr"):
        grad_fn._set_sequence_nr(torch.iinfo(torch.int).max)


def _parameter_device(config: TransformerConfig) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class SharedExpertMLP(MLP):
    """The shared experts of an MoE layer, as one MLP.

    Its width is ``moe_shared_expert_intermediate_size`` (all shared experts together).

    With ``moe_shared_expert_overlap`` the forward is split into five calls, made in this order
    by the token dispatcher: :meth:`pre_forward_comm`, :meth:`linear_fc1_forward_and_act`,
    :meth:`linear_fc2_forward`, :meth:`post_forward_comm` and :meth:`get_output`. The layer
    then does its own tensor-parallel communication (its linears' is switched off). On CUDA the
    pieces run on a side stream shared by all shared experts; on CPU they run synchronously,
    with the same state checks.

    Args:
        config: Layer configuration. It is deep-copied, and the copy's ``ffn_hidden_size`` is
            set to ``moe_shared_expert_intermediate_size``.
        submodules: Classes of fc1, fc2 and (optionally) the TE activation module.
        gate: Multiply the output by ``sigmoid(hidden_states @ gate_weight.T)`` per token.
        pg_collection: Process groups; ``tp`` is the tensor-parallel group.
        name: Name of the layer.

    Raises:
        AssertionError: ``add_bias_linear`` is set (shared experts have no bias).
    """

    # The side stream: shared experts of different layers never run concurrently, so one serves
    # them all.
    stream: Optional[torch.cuda.Stream] = None

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        gate: bool,
        pg_collection: Optional[Any] = None,
        name: Optional[str] = None,
    ):
        config = deepcopy(config)
        assert not config.add_bias_linear, (
            "bias is not supported in the shared experts, please set '--disable-bias-linear' "
            "instead."
        )
        config.ffn_hidden_size = config.moe_shared_expert_intermediate_size
        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        super().__init__(
            config=config,
            submodules=submodules,
            ffn_hidden_size=config.ffn_hidden_size,
            tp_group=tp_group,
            name=name,
            pg_collection=pg_collection,
        )

        self.use_shared_expert_gate = gate
        if gate:
            weight = torch.empty((1, config.hidden_size), device=_parameter_device(config))
            if config.perform_initialization:
                config.init_method(weight)
            self.gate_weight = torch.nn.Parameter(weight.to(dtype=config.params_dtype))
            # Every rank holds the whole gate; under sequence parallelism each sees only part of
            # the tokens, so the gradient must be summed across the tensor-parallel group.
            self.gate_weight.sequence_parallel = config.sequence_parallel
        else:
            self.gate_weight = None

        self._maybe_save_original_fc1_input()

        self._overlap_state = _OverlapState.IDLE
        self.cached_fc1_input = None
        self.cached_fc2_input = None
        self.cached_fc2_output = None
        self.cached_output = None
        self.gate_score = None
        if config.moe_shared_expert_overlap:
            self._disable_linear_tp_comm()
            if torch.cuda.is_available() and SharedExpertMLP.stream is None:
                SharedExpertMLP.stream = torch.cuda.Stream()

    # ----------------------------------------------------------------------- plain forward
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Applies the shared experts (and the gate).

        Args:
            hidden_states: ``[sequence, batch, hidden]`` (the sequence split across ranks under
                sequence parallelism).

        Returns:
            The output, same shape as ``hidden_states``. Unlike :meth:`MLP.forward` this is a
            single tensor: shared experts have no bias to return.
        """
        if self.config.moe_shared_expert_overlap:
            # The linears' own communication is off; run the overlap pieces back to back.
            self.pre_forward_comm(hidden_states)
            self.linear_fc1_forward_and_act()
            self.linear_fc2_forward()
            self.post_forward_comm()
            return self.get_output()

        output, _ = super().forward(hidden_states)
        if self.use_shared_expert_gate:
            output = output * self._gate_score(hidden_states)
        return output

    def _gate_score(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(hidden_states, self.gate_weight))

    # ------------------------------------------------------------------- overlapped forward
    def pre_forward_comm(self, input: torch.Tensor, wait_current_stream: bool = True):
        """Step 1: computes the gate score and gathers the input for fc1.

        Args:
            input: The layer input, as for :meth:`forward`.
            wait_current_stream: Make the side stream wait for the work already queued on the
                current stream (which produced ``input``).
        """
        self._advance(_OverlapState.IDLE, _OverlapState.PRE_FORWARD_COMM_DONE)
        if wait_current_stream and self._side_stream() is not None:
            self._side_stream().wait_stream(torch.cuda.current_stream())
        with self._on_side_stream():
            if self.use_shared_expert_gate:
                self.gate_score = self._gate_score(input)
            if self.config.sequence_parallel:
                self.cached_fc1_input = gather_from_sequence_parallel_region(
                    input, tensor_parallel_output_grad=True, group=self.tp_group
                )
            else:
                self.cached_fc1_input = copy_to_tensor_model_parallel_region(
                    input, group=self.tp_group
                )
            _run_backward_early(self.cached_fc1_input)

    def linear_fc1_forward_and_act(self, overlapped_comm_output: Optional[torch.Tensor] = None):
        """Step 2: fc1 and the activation.

        Args:
            overlapped_comm_output: Output of the dispatcher communication this computation
                overlaps; its backward is scheduled early so that it overlaps in backward too.
        """
        self._advance(_OverlapState.PRE_FORWARD_COMM_DONE, _OverlapState.FC1_FORWARD_DONE)
        _run_backward_early(overlapped_comm_output)
        with self._on_side_stream():
            intermediate, bias = self.linear_fc1(self.cached_fc1_input)
            self.cached_fc1_input = None
            self.cached_fc2_input = self._activate(intermediate, bias, None)

    def linear_fc2_forward(self, overlapped_comm_output: Optional[torch.Tensor] = None):
        """Step 3: fc2.

        Args:
            overlapped_comm_output: As for :meth:`linear_fc1_forward_and_act`.
        """
        self._advance(_OverlapState.FC1_FORWARD_DONE, _OverlapState.FC2_FORWARD_DONE)
        _run_backward_early(overlapped_comm_output)
        with self._on_side_stream():
            self.cached_fc2_output, _ = self.linear_fc2(self.cached_fc2_input)
            self.cached_fc2_input = None

    def post_forward_comm(self):
        """Step 4: reduces fc2's partial sums across the tensor-parallel group; applies the gate."""
        self._advance(_OverlapState.FC2_FORWARD_DONE, _OverlapState.POST_FORWARD_COMM_DONE)
        with self._on_side_stream():
            if self.config.sequence_parallel:
                output = reduce_scatter_to_sequence_parallel_region(
                    self.cached_fc2_output, group=self.tp_group
                )
            else:
                output = reduce_from_tensor_model_parallel_region(
                    self.cached_fc2_output, group=self.tp_group
                )
            self.cached_fc2_output = None
            if self.use_shared_expert_gate:
                output = output * self.gate_score
                self.gate_score = None
            self.cached_output = output

    def get_output(self) -> torch.Tensor:
        """Step 5: waits for the side stream and returns the output of :meth:`forward`."""
        self._advance(_OverlapState.POST_FORWARD_COMM_DONE, _OverlapState.IDLE)
        if self._side_stream() is not None:
            torch.cuda.current_stream().wait_stream(self._side_stream())
        output, self.cached_output = self.cached_output, None
        return output

    def _advance(self, expected: _OverlapState, new: _OverlapState) -> None:
        if not self.config.moe_shared_expert_overlap:
            raise RuntimeError(
                f"{type(self).__name__}: the overlapped forward steps need "
                "moe_shared_expert_overlap=True; call forward() instead."
            )
        if self._overlap_state is not expected:
            raise RuntimeError(
                f"{type(self).__name__}: overlapped forward steps called out of order: in state "
                f"{self._overlap_state.name}, expected {expected.name}. The order is "
                "pre_forward_comm, linear_fc1_forward_and_act, linear_fc2_forward, "
                "post_forward_comm, get_output."
            )
        self._overlap_state = new

    def _side_stream(self) -> Optional[torch.cuda.Stream]:
        return SharedExpertMLP.stream if torch.cuda.is_available() else None

    def _on_side_stream(self):
        stream = self._side_stream()
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _disable_linear_tp_comm(self) -> None:
        # The overlapped steps communicate themselves, so the linears must not.
        for linear in (self.linear_fc1, self.linear_fc2):
            if hasattr(linear, "parallel_mode"):  # Transformer Engine linear
                linear.parallel_mode = None
            else:  # megatron.core tensor-parallel linear
                linear.explicit_expert_comm = True

    # --------------------------------------------------------------------- quantization
    def _maybe_save_original_fc1_input(self) -> None:
        """With blockwise FP8 / FP4, lets TE's fc1 keep its unquantized input for backward.

        The dispatcher overlap hands fc1 a tensor that is freed early; saving the original
        input instead of a quantized copy avoids requantizing it. Skipped when the shared
        experts are recomputed, which regenerates the input anyway.
        """
        config = self.config
        fp8 = getattr(config, "fp8", None)
        fp4 = getattr(config, "fp4", None)
        blockwise_fp8 = bool(fp8) and getattr(config, "fp8_recipe", "delayed") != "delayed"
        wanted = (blockwise_fp8 and te_import.is_te_min_version("2.6.0")) or (
            bool(fp4) and te_import.is_te_min_version("2.7.0")
        )
        if not wanted or "shared_experts" in (getattr(config, "recompute_modules", None) or ()):
            return
        if isinstance(self.linear_fc1, TELinear):
            set_save_original_input(self.linear_fc1)


class FusedSharedExpertMLP(SharedExpertMLP):
    """Shared experts as one Transformer Engine op sequence: grouped fc1, activation, grouped fc2.

    Selected by ``use_grouped_gemm_for_shared_expert``. The parameters stay those of the
    parent's TE linears (the ops alias them), so the two classes have identical ``state_dict``
    keys. The activation is lowered to a scaled TE op at construction by
    ``megatron.core.extensions.transformer_engine.lower_activation_to_te_op``, which computes
    the configured activation or refuses it; the ops themselves are built on the first forward.

    Args:
        config: As for :class:`SharedExpertMLP`.
        submodules: fc1 and fc2 must be Transformer Engine linears.
        gate: As for :class:`SharedExpertMLP`.
        pg_collection: As for :class:`SharedExpertMLP`.
        name: As for :class:`SharedExpertMLP`.

    Raises:
        RuntimeError: Transformer Engine is missing or older than 2.14, or the activation needs
            a newer one.
        ValueError: The configuration is unsupported (see :meth:`_validate_fused_grouped_swiglu`).
        TEFusedRecipeError: The quantization recipe is unknown (at construction), or this
            machine cannot run it (at the first forward).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        gate: bool,
        pg_collection: Optional[Any] = None,
        name: Optional[str] = None,
    ):
        super().__init__(config, submodules, gate, pg_collection=pg_collection, name=name)
        # Caches hold 1-tuples so the ops never become submodules (and never enter state_dict).
        self._fused_ops: Optional[tuple] = None
        self._unit_scales: Optional[torch.Tensor] = None
        self._recipe: Optional[tuple] = None
        self._validate_fused_grouped_swiglu()
        # An unknown recipe fails here; whether this machine can run it is asked at the first
        # forward (_quantization_recipe), as the model may be built on a CPU or the meta device.
        self.fused_recipe_name = resolve_fused_recipe(self.config, path=type(self).__name__)
        # The grouped fc1 op reads its weight rows block-interleaved ([g(k), u(k), ...]); the
        # parent reads [gate; linear] halves. Keep the interleaved layout in memory, convert in
        # state dicts, and make every inherited unfused step read the same layout, so weights
        # move between the two classes unchanged and both compute the same function.
        k = self._glu_interleave_size()
        self.glu_interleave_size = k
        self.activation_spec = self.activation_spec.with_interleave(k)
        self.layer_activation = self.layer_activation.with_spec(self.activation_spec)
        self.register_state_dict_post_hook(fc1_weight_to_halves)
        self.register_load_state_dict_pre_hook(fc1_weight_to_blocks)

    def _validate_fused_grouped_swiglu(self) -> None:
        """Refuses at construction what the fused op sequence cannot run.

        Reads ``self.config`` through ``getattr`` where a field may be missing, so it also works
        on instances built with ``__new__`` around a ``SimpleNamespace`` config (as tests do).
        """
        config = self.config
        name = type(self).__name__
        if not te_import.have_te():
            raise RuntimeError(
                f"{name} requires Transformer Engine when use_grouped_gemm_for_shared_expert=True."
            )
        if not te_import.is_te_min_version(TE_GROUPED_OPS_MIN_VERSION):
            raise RuntimeError(
                f"{name} requires Transformer Engine >= {TE_GROUPED_OPS_MIN_VERSION} "
                "(te.pytorch.ops.GroupedLinear and "
                "the scaled GLU ops)."
            )
        if getattr(config, "add_bias_linear", False):
            raise ValueError(
                f"{name} does not support add_bias_linear=True; set add_bias_linear=False."
            )
        # The activation: TE either has a scaled op for the spec or it refuses, naming why.
        self._lower_activation()
        if self._glu_interleave_size() is None:
            raise ValueError(
                f"{name} requires moe_shared_expert_glu_interleave_size (the GLU block layout of "
                "the grouped fc1 weight)."
            )
        linear_type = te_import.te.pytorch.Linear
        if not isinstance(self.linear_fc1, linear_type) or not isinstance(
            self.linear_fc2, linear_type
        ):
            raise ValueError(
                f"{name} expects FC1/FC2 to be Transformer Engine Linear modules "
                "(te.pytorch.Linear)."
            )

    def _glu_interleave_size(self) -> Optional[int]:
        return getattr(self.config, "moe_shared_expert_glu_interleave_size", None)

    def _lower_activation(self):
        """The scaled TE activation op of this layer's activation (raises if TE has none)."""
        return lower_activation_to_te_op(
            ActivationSpec.from_config(self.config),
            path=type(self).__name__,
            scaled=True,
            glu_interleave_size=self._glu_interleave_size(),
        )

    def _make_fused_ops(self):
        """Builds ``Sequential(GroupedLinear fc1, scaled activation, GroupedLinear fc2)``.

        Each grouped linear has one group and aliases the corresponding TE linear's weight.
        """
        ops = te_import.te.pytorch.ops

        def grouped_linear(linear, glu_interleave_size=None):
            out_features, in_features = linear.weight.shape
            op = ops.GroupedLinear(
                num_groups=1,
                in_features=in_features,
                out_features=out_features,
                device="meta",
                dtype=linear.weight.dtype,
                bias=False,
                rng_state_tracker_function=get_cuda_rng_tracker,
                accumulate_into_main_grad=getattr(linear, "fuse_wgrad_accumulation", False),
            )
            op.weight0 = linear.weight
            if glu_interleave_size is not None:
                op._glu_interleave_size = glu_interleave_size
            return op

        activation = self._lower_activation()
        # The per-row scales are all ones: the shared expert weights every token equally.
        activation._grouped_mlp_unit_activation_scale = True
        return ops.Sequential(
            grouped_linear(self.linear_fc1, self._glu_interleave_size()),
            activation,
            grouped_linear(self.linear_fc2),
        )

    def _quantization_recipe(self):
        # One recipe policy for every TE grouped fused class (resolve_fused_recipe): the config's
        # te_fused_recipe, else FP4_RECIPE, else MXFP8; "none" runs unquantized (e.g. on SM90).
        # Checked against the hardware once, on first use; a refusal leaves the cache empty.
        if self._recipe is None:
            check_fused_recipe_runs_here(self.fused_recipe_name, path=type(self).__name__)
            self._recipe = (make_fused_recipe(self.fused_recipe_name),)
        return self._recipe[0]

    def _recipe_context(self, kind: str):
        recipe = self._quantization_recipe()
        return fused_recipe_model_init(recipe) if kind == "init" else fused_recipe_autocast(recipe)

    def _get_fused_ops(self):
        if self._fused_ops is None:
            with self._recipe_context("init"):
                self._fused_ops = (self._make_fused_ops(),)
        return self._fused_ops[0]

    def _reset_fused_ops(self) -> None:
        """Drops the cached ops (e.g. after the linears' weights were replaced)."""
        self._fused_ops = None

    def _replay_linear_pre_hooks(self) -> None:
        # The ops bypass fc1/fc2's forward, so hooks on them (e.g. a distributed optimizer's
        # parameter all-gather) would never run; run them here instead.
        for linear in (self.linear_fc1, self.linear_fc2):
            for hook in list(linear._forward_pre_hooks.values()):
                if hook(linear, ()) is not None:
                    raise RuntimeError(
                        f"{type(self).__name__}: a forward pre-hook of {type(linear).__name__} "
                        "returned a value; the fused ops cannot apply modified inputs."
                    )

    def _row_scales(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        # One scale per row: TE 2.20.2's unfused scaled GLU asserts scales.numel() == rows.
        scales = self._unit_scales
        if scales is None or scales.numel() != rows or scales.device != like.device:
            scales = torch.ones(rows, dtype=torch.float32, device=like.device)
            self._unit_scales = scales
        return scales

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Applies the shared experts through the fused ops; same contract as the parent."""
        fused = self._get_fused_ops()
        self._replay_linear_pre_hooks()
        if self.config.sequence_parallel:
            x = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=True, group=self.tp_group
            )
        else:
            x = copy_to_tensor_model_parallel_region(hidden_states, group=self.tp_group)
        x2d = x.reshape(-1, x.shape[-1])
        rows = x2d.shape[0]
        split_sizes = torch.full((1,), rows, dtype=torch.long, device=x2d.device)
        with self._recipe_context("autocast"):
            out = fused(x2d, split_sizes, self._row_scales(rows, x2d), split_sizes)
        out = out.view(*x.shape[:-1], out.shape[-1])
        if self.config.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.use_shared_expert_gate:
            out = out * self._gate_score(hidden_states)
        return out
