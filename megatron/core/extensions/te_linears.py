"""Megatron's Transformer Engine linear layers: ``te.pytorch.Linear`` / ``LayerNormLinear`` /
``GroupedLinear`` with Megatron's constructor arguments and ``forward(x) -> (out, bias)``.

Without Transformer Engine the classes still exist (their base is a placeholder module) and
raise ``ImportError`` naming themselves and the install command when constructed. TE is read from
the import seam (``mcore_activations.te_import``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Optional

import torch

from mcore_activations import te_import
from mcore_activations.te_import import require_te
from megatron.core.extensions.te_public import public, require_te_min_version
from megatron.core.tensor_parallel.random import get_expert_parallel_rng_tracker_name
from megatron.core.utils import get_pg_size, get_tensor_model_parallel_group_if_none

__all__ = [
    "TEColumnParallelGroupedLinear",
    "TEColumnParallelLinear",
    "TEGroupedLinear",
    "TELayerNormColumnParallelLinear",
    "TELinear",
    "TERowParallelGroupedLinear",
    "TERowParallelLinear",
    "set_save_original_input",
]


class _MissingTEModule(torch.nn.Module):
    """Base class of the TE wrappers when TE is unusable; constructing one raises ImportError.

    Tests may still build wrapper instances with ``cls.__new__`` plus ``torch.nn.Module.__init__``
    and attach tensors by hand, as upstream's tests do.
    """

    def __init__(self, *args, **kwargs):
        require_te(type(self).__name__)
        super().__init__()


def _te_base(name: str) -> type:
    # Chosen once, at import: a class statement needs a real class as its base.
    if te_import.have_te():
        return getattr(te_import.te.pytorch, name)
    return type(f"_Missing{name}", (_MissingTEModule,), {})


def _is_empty(tensor: Optional[torch.Tensor]) -> bool:
    # TE registers an empty tensor, not None, as the bias of a bias-free layer.
    return tensor is None or tensor.numel() == 0


def _rng_tracker_function() -> Optional[Callable]:
    # TE forks the tracker while initializing weights; an unseeded tracker would raise there.
    get_tracker = public("get_cuda_rng_tracker")
    return get_tracker if get_tracker().is_initialized() else None


# ``weight`` / ``bias`` and TE's per-GEMM ``weight0``, ``bias12``...; not ``weight_scale``.
_PARTITIONABLE_PARAMETER = re.compile(r"(weight|bias)\d*")


def _set_expert_parameter_attributes(
    module: torch.nn.Module, parallel_mode: Optional[str], use_expert_pgs: bool
) -> None:
    """Marks ``module``'s own parameters with the process-group metadata of an expert layer.

    Every parameter gets ``allreduce = not use_expert_pgs`` (False: reduced over the expert
    data-parallel group, as the distributed optimizer reads it). Weights and biases (also TE's
    numbered per-GEMM ones) get ``tensor_model_parallel``: True for weights under ``"column"`` /
    ``"row"`` and for column-parallel biases (a row-parallel bias is replicated); partitioned
    ones also get ``partition_dim`` (0 column, 1 row) and ``partition_stride`` 1. TE leaves
    these as for an unsplit layer when Megatron does the expert communication itself.

    Args:
        module: The TE module; only its direct parameters are marked.
        parallel_mode: ``"column"``, ``"row"`` or None (not split).
        use_expert_pgs: The parameters belong to the expert process groups.
    """
    for name, param in module.named_parameters(recurse=False):
        param.allreduce = not use_expert_pgs
        match = _PARTITIONABLE_PARAMETER.fullmatch(name)
        if match is None:
            continue
        is_weight = match.group(1) == "weight"
        split = parallel_mode in ("column", "row") and (is_weight or parallel_mode == "column")
        param.tensor_model_parallel = split
        if split:
            param.partition_dim = 0 if parallel_mode == "column" else 1
            param.partition_stride = 1


def _te_common_kwargs(
    config, init_method: Optional[Callable], tp_comm_buffer_name, name: Optional[str]
) -> dict:
    """Keyword arguments every TE linear module takes from the config."""
    if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        device = "cpu"
    else:
        device = torch.cuda.current_device()
    kwargs = dict(
        fuse_wgrad_accumulation=bool(getattr(config, "gradient_accumulation_fusion", False)),
        get_rng_state_tracker=_rng_tracker_function(),
        # perform_initialization=False leaves the weights to be loaded; TE must not draw them.
        init_method=init_method
        if getattr(config, "perform_initialization", True)
        else (lambda weight: None),
        params_dtype=config.params_dtype,
        device=device,
    )
    if getattr(config, "tp_comm_overlap", False) and tp_comm_buffer_name:
        kwargs["ub_name"] = tp_comm_buffer_name
    # Newer TE keywords go in only when set, so older TE builds still construct.
    if name is not None:
        kwargs["name"] = name
    return kwargs


def _resolve_tp_group(tp_group, pg_collection, is_expert: bool):
    if tp_group is None and pg_collection is not None:
        tp_group = getattr(pg_collection, "expt_tp" if is_expert else "tp", None)
    return get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)


class _TEForwardReturnsBias:
    """Mixin giving TE linears Megatron's ``forward(x) -> (out, bias or None)`` contract."""

    def _mcore_output(self, out):
        if self.te_return_bias:
            out, bias = out
            return out, None if _is_empty(bias) else bias
        return out, None

    def backward_dw(self):
        """Computes deferred weight gradients (``delay_wgrad_compute``); TE no-ops otherwise."""
        parent = super()
        if hasattr(parent, "backward_dw"):
            parent.backward_dw()


class TELinear(_TEForwardReturnsBias, _te_base("Linear")):
    """Megatron wrapper of ``te.pytorch.Linear`` (column, row or duplicated).

    Args:
        input_size: Input features (global).
        output_size: Output features (global).
        parallel_mode: ``"column"``, ``"row"`` or ``"duplicated"`` (no tensor parallelism).
        config: Model configuration.
        init_method: Weight initializer (used only when ``config.perform_initialization``).
        bias: Whether the layer has a bias.
        skip_bias_add: Return the bias instead of adding it (when ``bias``).
        skip_weight_param_allocation: Not supported by TE layers; must be False.
        tp_comm_buffer_name: Userbuffers name (with ``config.tp_comm_overlap``).
        is_expert: The layer belongs to an MoE expert (expert-tensor-parallel group; with expert
            or expert-tensor parallelism the dispatcher does the communication, so TE's own is off).
        symmetric_ar_type: TE's symmetric all-reduce type.
        tp_group: Tensor-parallel group (default: from ``pg_collection``, then parallel_state).
        name: Layer name passed to TE.
        pg_collection: Process groups (``tp``, or ``expt_tp`` for experts).
        gtp_remat_group: Not supported; must be None.
        gtp_replica_group: Not supported; must be None.

    Raises:
        ImportError: Transformer Engine is unavailable.
        ValueError: An unsupported option is set.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: Optional[str],
        config,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool,
        tp_comm_buffer_name: Optional[str] = None,
        is_expert: bool = False,
        symmetric_ar_type: Optional[str] = None,
        tp_group=None,
        name: Optional[str] = None,
        pg_collection=None,
        gtp_remat_group=None,
        gtp_replica_group=None,
    ):
        require_te(type(self).__name__)
        if skip_weight_param_allocation:
            raise ValueError(
                "Transformer Engine linear layers do not support skip_weight_param_allocation."
            )
        if gtp_remat_group is not None or gtp_replica_group is not None:
            raise ValueError(
                f"{type(self).__name__} does not support GTP weight rematerialization."
            )
        self.config = config
        self.te_return_bias = bool(skip_bias_add and bias)
        self.is_expert = is_expert
        tp_group = _resolve_tp_group(tp_group, pg_collection, is_expert)
        tp_size = get_pg_size(tp_group)
        ep_size = getattr(config, "expert_model_parallel_size", 1) or 1
        # Experts under EP/ETP get their communication from the token dispatcher.
        self.explicit_expert_comm = is_expert and (tp_size > 1 or ep_size > 1)
        if parallel_mode == "duplicated":
            parallel_mode = None
        if self.explicit_expert_comm:
            if parallel_mode == "column":
                output_size //= tp_size
            elif parallel_mode == "row":
                input_size //= tp_size
            parallel_mode, tp_group, tp_size = None, None, 1
        extra = {}
        if symmetric_ar_type is not None:
            extra["symmetric_ar_type"] = symmetric_ar_type
        kwargs = _te_common_kwargs(config, init_method, tp_comm_buffer_name, name)
        if is_expert:
            kwargs["rng_tracker_name"] = get_expert_parallel_rng_tracker_name()
        super().__init__(
            in_features=input_size,
            out_features=output_size,
            sequence_parallel=bool(getattr(config, "sequence_parallel", False)) and tp_size > 1,
            tp_group=tp_group,
            tp_size=tp_size,
            bias=bias,
            return_bias=self.te_return_bias,
            parallel_mode=parallel_mode,
            **kwargs,
            **extra,
        )

    def forward(self, x: torch.Tensor):
        """Returns ``(output, bias)`` with ``bias`` None unless ``skip_bias_add`` and ``bias``."""
        # is_first_microbatch=None: TE re-quantizes weights every call, so a cached FP8 copy
        # can never outlive an optimizer step.
        return self._mcore_output(super().forward(x, is_first_microbatch=None))


class TELayerNormColumnParallelLinear(_TEForwardReturnsBias, _te_base("LayerNormLinear")):
    """Megatron wrapper of ``te.pytorch.LayerNormLinear``: the norm fused into a column linear.

    Args:
        input_size: Input features.
        output_size: Output features (global, split across tensor-parallel ranks).
        config: Model configuration (``normalization``, ``layernorm_epsilon``,
            ``layernorm_zero_centered_gamma``, ``sequence_parallel``, ...).
        init_method: Weight initializer.
        gather_output: Not supported; must be False.
        bias: Whether the linear has a bias.
        skip_bias_add: Return the bias instead of adding it.
        is_expert: Not supported; must be False.
        skip_weight_param_allocation: Not supported; must be False.
        tp_comm_buffer_name: Userbuffers name.
        tp_group: Tensor-parallel group.
        stride: Accepted for signature compatibility: TE initializes each rank's shard itself, so
            a gated fc1 is ``[gate shard; linear shard]`` on every rank without it.
        name: Layer name passed to TE.
        pg_collection: Process groups (``tp``).

    Raises:
        ImportError: Transformer Engine is unavailable.
        ValueError: An unsupported option is set.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group=None,
        stride: int = 1,
        name: Optional[str] = None,
        pg_collection=None,
    ):
        require_te(type(self).__name__)
        if gather_output:
            raise ValueError("Transformer Engine linear layers do not support gather_output = True")
        if is_expert:
            raise ValueError("Transformer Engine linear layers do not yet support MoE")
        if skip_weight_param_allocation:
            raise ValueError(
                "Transformer Engine linear layers do not support skip_weight_param_allocation"
            )
        del stride
        self.config = config
        self.te_return_bias = bool(skip_bias_add and bias)
        self.is_expert = False
        tp_group = _resolve_tp_group(tp_group, pg_collection, False)
        tp_size = get_pg_size(tp_group)
        super().__init__(
            in_features=input_size,
            out_features=output_size,
            eps=config.layernorm_epsilon,
            sequence_parallel=bool(getattr(config, "sequence_parallel", False)) and tp_size > 1,
            tp_group=tp_group,
            tp_size=tp_size,
            bias=bias,
            normalization=config.normalization,
            return_bias=self.te_return_bias,
            parallel_mode="column",
            return_layernorm_output=False,
            zero_centered_gamma=bool(getattr(config, "layernorm_zero_centered_gamma", False)),
            **_te_common_kwargs(config, init_method, tp_comm_buffer_name, name),
        )

    def forward(self, x: torch.Tensor):
        """Returns ``(output, bias)``; the input is cast to the norm weight's dtype first."""
        x = x.to(self.layer_norm_weight.dtype)
        return self._mcore_output(super().forward(x, is_first_microbatch=None))


class TEColumnParallelLinear(TELinear):
    """``TELinear`` split along the output features (same keywords as the LayerNorm variant)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group=None,
        stride: int = 1,
        name: Optional[str] = None,
        pg_collection=None,
    ):
        if gather_output:
            raise ValueError("Transformer Engine linear layers do not support gather_output = True")
        del stride  # see TELayerNormColumnParallelLinear
        super().__init__(
            input_size,
            output_size,
            parallel_mode="column",
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            skip_weight_param_allocation=skip_weight_param_allocation,
            tp_comm_buffer_name=tp_comm_buffer_name,
            is_expert=is_expert,
            tp_group=tp_group,
            name=name,
            pg_collection=pg_collection,
        )


class TERowParallelLinear(TELinear):
    """``TELinear`` split along the input features; the output is reduced across ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group=None,
        name: Optional[str] = None,
        pg_collection=None,
    ):
        if not input_is_parallel:
            raise ValueError(
                "Transformer Engine linear layers do not support input_is_parallel = False"
            )
        super().__init__(
            input_size,
            output_size,
            parallel_mode="row",
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            skip_weight_param_allocation=False,
            tp_comm_buffer_name=tp_comm_buffer_name,
            is_expert=is_expert,
            tp_group=tp_group,
            name=name,
            pg_collection=pg_collection,
        )


# (TE GroupedLinear keyword, config field) of the single grouped parameter layout.
_SINGLE_GROUPED_KEYWORDS = (
    ("single_grouped_weight", "moe_single_grouped_weight"),
    ("single_grouped_bias", "moe_single_grouped_bias"),
)


class TEGroupedLinear(_TEForwardReturnsBias, _te_base("GroupedLinear")):
    """Megatron wrapper of ``te.pytorch.GroupedLinear``: one GEMM per local expert.

    The parameters come in one of TE's two layouts: one tensor per GEMM (``weight0`` ..
    ``weight{num_gemms-1}``, ``bias0`` ..) or, with ``config.moe_single_grouped_weight`` /
    ``moe_single_grouped_bias`` on a TE whose ``GroupedLinear`` takes ``single_grouped_weight`` /
    ``single_grouped_bias``, a single grouped tensor (``weight``, ``bias``). ``state_dict`` saves
    the layout the module has; ``load_state_dict`` accepts either (a load pre-hook converts).

    Args:
        num_gemms: Number of local experts.
        input_size: Input features (global).
        output_size: Output features (global).
        parallel_mode: ``"column"`` or ``"row"``.
        config: Model configuration.
        init_method: Weight initializer.
        bias: Whether each GEMM has a bias.
        skip_bias_add: Return the biases instead of adding them.
        is_expert: Must be True: grouped linears only serve MoE experts.
        tp_comm_buffer_name: Userbuffers name.
        pg_collection: Process groups (``expt_tp``).
        name: Layer name passed to TE.

    Raises:
        ImportError: Transformer Engine is unavailable.
        RuntimeError: Transformer Engine is older than 1.9.0.dev0; or, when loading a state dict,
            a grouped tensor cannot be split into ``num_gemms`` GEMMs, or per-GEMM tensors of
            different shapes would be grouped.
        ValueError: ``is_expert`` is False.
    """

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: Optional[str],
        config,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        pg_collection=None,
        name: Optional[str] = None,
    ):
        require_te_min_version(type(self).__name__, "1.9.0.dev0")
        if not is_expert:
            raise ValueError("TEGroupedLinear only serves MoE experts: pass is_expert=True.")
        self.config = config
        self.te_return_bias = bool(skip_bias_add and bias)
        self.is_expert = True
        tp_group = _resolve_tp_group(None, pg_collection, True)
        tp_size = get_pg_size(tp_group)
        ep_size = getattr(config, "expert_model_parallel_size", 1) or 1
        self.explicit_expert_comm = tp_size > 1 or ep_size > 1
        original_parallel_mode = parallel_mode
        expert_tp = getattr(config, "expert_tensor_parallel_size", None)
        use_expert_pgs = ep_size > 1 or (
            expert_tp is not None and expert_tp != getattr(config, "tensor_model_parallel_size", 1)
        )
        if self.explicit_expert_comm:
            if parallel_mode == "column":
                output_size //= tp_size
            elif parallel_mode == "row":
                input_size //= tp_size
            parallel_mode, tp_group, tp_size = None, None, 1
        kwargs = _te_common_kwargs(config, init_method, tp_comm_buffer_name, name)
        kwargs["rng_tracker_name"] = get_expert_parallel_rng_tracker_name()
        # Some TE builds of the version that introduced the single grouped parameter lack the
        # keywords, so the constructor's signature decides, not the version. Without them the
        # per-GEMM layout is the only one TE has, whatever the config asks for (as upstream).
        accepted = inspect.signature(super().__init__).parameters
        for keyword, field in _SINGLE_GROUPED_KEYWORDS:
            if keyword in accepted:
                kwargs[keyword] = bool(getattr(config, field, False))
        super().__init__(
            num_gemms=num_gemms,
            in_features=input_size,
            out_features=output_size,
            sequence_parallel=bool(getattr(config, "sequence_parallel", False)) and tp_size > 1,
            tp_group=tp_group,
            tp_size=tp_size,
            bias=bias,
            return_bias=self.te_return_bias,
            parallel_mode=parallel_mode,
            **kwargs,
        )
        # TE was told "not split" above when Megatron communicates; the parameters must still
        # say how they are split, for checkpoint resharding and the gradient norm.
        _set_expert_parameter_attributes(self, original_parallel_mode, use_expert_pgs)
        self.register_load_state_dict_pre_hook(type(self)._normalize_grouped_parameter_keys)

    def _normalize_grouped_parameter_keys(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        """Rewrites ``state_dict``'s weight / bias keys into the layout this module holds.

        A load-state-dict pre-hook: a checkpoint saved with one tensor per GEMM loads into a
        single-grouped module (the tensors are stacked along a new leading dim), and a single
        grouped tensor loads into a per-GEMM module (split along its leading dim). Keys already
        in this module's layout, or an incomplete set of per-GEMM keys, are left alone, so
        ``load_state_dict`` reports them as usual.

        Args:
            state_dict: The state dict being loaded, modified in place.
            prefix: This module's key prefix in ``state_dict``.
            local_metadata, strict, missing_keys, unexpected_keys, error_msgs: Unused; the
                pre-hook signature of ``torch.nn.Module.load_state_dict``.

        Raises:
            RuntimeError: A grouped tensor cannot be split into ``num_gemms`` GEMMs, or per-GEMM
                tensors of different shapes would be stacked into one.
        """
        del local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        self._remap_grouped_parameter(
            state_dict, prefix, "weight", bool(getattr(self, "single_grouped_weight", False))
        )
        # A bias-free TE layer registers empty placeholders; a checkpoint's bias keys must then
        # stay as they are, to surface as unexpected keys.
        if getattr(self, "use_bias", False):
            self._remap_grouped_parameter(
                state_dict, prefix, "bias", bool(getattr(self, "single_grouped_bias", False))
            )

    def _remap_grouped_parameter(
        self, state_dict, prefix: str, name: str, single_grouped: bool
    ) -> None:
        grouped_key = f"{prefix}{name}"
        indexed_keys = [f"{prefix}{name}{index}" for index in range(self.num_gemms)]
        present = [key in state_dict for key in indexed_keys]
        if single_grouped:
            if grouped_key in state_dict or not all(present):
                return
            shapes = {key: tuple(state_dict[key].shape) for key in indexed_keys}
            if len(set(shapes.values())) > 1:
                listed = ", ".join(f"{key} {shape}" for key, shape in shapes.items())
                raise RuntimeError(
                    f"Cannot group the per-GEMM checkpoint tensors {listed} into {grouped_key}: "
                    "every GEMM of one grouped linear has the same shape. The checkpoint comes "
                    "from another model shape (e.g. ffn_hidden_size / moe_ffn_hidden_size or the "
                    "tensor-parallel size); load it into a model of that shape."
                )
            state_dict[grouped_key] = torch.stack([state_dict.pop(key) for key in indexed_keys])
        else:
            if any(present) or grouped_key not in state_dict:
                return
            parts = self._split_grouped_checkpoint_tensor(state_dict.pop(grouped_key), grouped_key)
            state_dict.update(zip(indexed_keys, parts))

    def _split_grouped_checkpoint_tensor(self, tensor, checkpoint_key: str) -> list:
        """Splits a checkpoint's single grouped tensor into one tensor per GEMM.

        Args:
            tensor: The grouped tensor: a TE quantized grouped tensor (split into its members),
                or a tensor whose leading dim is ``num_gemms`` (stacked, unbound along it) or a
                multiple of it (concatenated, chunked along it).
            checkpoint_key: The tensor's key, named in errors.

        Returns:
            ``num_gemms`` tensors, in GEMM order.

        Raises:
            RuntimeError: The tensor does not hold ``num_gemms`` GEMMs.
        """
        n = self.num_gemms
        remedy = (
            f"The checkpoint was saved with another number of local experts per rank than this "
            f"{type(self).__name__} has (num_gemms={n}); load it into a model with the same "
            "num_moe_experts / expert_model_parallel_size, or convert the checkpoint first."
        )
        split_members = getattr(tensor, "split_into_quantized_tensors", None)
        if callable(split_members):
            # TE's quantized grouped tensor keeps its members; splitting its raw data would mix
            # data and scales.
            members = getattr(tensor, "quantized_tensors", None)
            if members is None:
                members = split_members()
            if len(members) != n:
                raise RuntimeError(
                    f"Grouped checkpoint tensor {checkpoint_key} has {len(members)} groups, "
                    f"expected {n}. {remedy}"
                )
            return list(members)
        rows = tensor.shape[0] if tensor.ndim > 0 else 0
        if rows == 0 or rows % n:
            raise RuntimeError(
                f"Cannot split checkpoint tensor {checkpoint_key} with shape "
                f"{tuple(tensor.shape)} into {n} GEMM shards: its leading dim must be num_gemms "
                f"({n}, stacked) or a multiple of it (concatenated). {remedy}"
            )
        if rows == n:
            return list(tensor.unbind(0))
        return list(tensor.chunk(n, dim=0))

    def forward(self, x: torch.Tensor, m_splits):
        """Returns ``(output, biases)``, ``biases`` None unless ``skip_bias_add`` and ``bias``."""
        out = super().forward(x, m_splits, is_first_microbatch=None)
        if self.te_return_bias:
            return out
        return out, None


class TEColumnParallelGroupedLinear(TEGroupedLinear):
    """``TEGroupedLinear`` split along the output features."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: Optional[str] = None,
        pg_collection=None,
        name: Optional[str] = None,
    ):
        super().__init__(
            num_gemms,
            input_size,
            output_size,
            parallel_mode="column",
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            tp_comm_buffer_name=tp_comm_buffer_name,
            pg_collection=pg_collection,
            name=name,
        )


class TERowParallelGroupedLinear(TEGroupedLinear):
    """``TEGroupedLinear`` split along the input features."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: Optional[str] = None,
        pg_collection=None,
        name: Optional[str] = None,
    ):
        super().__init__(
            num_gemms,
            input_size,
            output_size,
            parallel_mode="row",
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            tp_comm_buffer_name=tp_comm_buffer_name,
            pg_collection=pg_collection,
            name=name,
        )


def set_save_original_input(module) -> None:
    """Makes a TE linear save its unquantized input for backward instead of a quantized copy.

    Used by the shared experts under blockwise FP8 / FP4 recipes, whose input is requantized
    column-wise in backward anyway (TE >= 2.6).

    Raises:
        ValueError: ``module`` is not a TE linear that has the option.
    """
    if not hasattr(module, "save_original_input"):
        raise ValueError(
            f"set_save_original_input: {type(module).__name__} has no save_original_input option "
            "(a Transformer Engine >= 2.6 Linear / GroupedLinear is required)."
        )
    module.save_original_input = True
