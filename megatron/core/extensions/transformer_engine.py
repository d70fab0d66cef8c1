"""Transformer Engine backend: linear wrappers, the activation lowering and the fused MLPs.

Transformer Engine (TE) is optional. When it cannot be imported this module still imports:
``HAVE_TE`` is False, ``te`` is a placeholder, the names upstream exports as None without TE
(``TEFusedMLP``, ``TEGroupedLinear``, ...; see ``TE_ONLY_CLASSES``) are None, and every other
TE-backed class raises ``ImportError`` naming itself and the install command when it is
constructed.

**One lowering.** Every TE path that computes an MLP activation (``TEFusedMLP``,
``TEFusedMLPWithGroupedLinear``, ``TEActivationOp``, and in ``moe/`` ``FusedSharedExpertMLP`` and
the fused ``TEGroupedMLP``) asks :func:`lower_activation_to_te_op`
(``mcore_activations.te_lowering``, re-exported here) for its op. It maps an
:class:`ActivationSpec` to the ``te.pytorch.ops`` operation with the arguments that compute
exactly ``spec.reference``, or raises :class:`UnsupportedActivationError` naming the path, the
activation, the reason and what to configure instead. Upstream chose the op separately in each
class, and three of them silently ran plain SwiGLU for a clamped or SiTU-GLU config.

**Late binding for tests.** ``te``, ``HAVE_TE``, ``get_pg_size`` and ``get_cuda_rng_tracker`` are
module globals read at call time, so tests can monkeypatch them (a fake ``te`` namespace on CPU),
as upstream's tests do; the lowering's own globals live in ``mcore_activations.te_lowering``.

The table of what lowers to what, and why the rest is refused, is in ``docs/te-paths.md``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch

from mcore_activations.activation_spec import ActivationSpec
from mcore_activations.te_lowering import (  # noqa: F401 - upstream names re-exported here
    HAVE_TE,
    TE_CACHE_QUANTIZED_INPUT_MIN_VERSION,
    TE_CLAMPED_GLU_MIN_VERSION,
    TE_GLU_INTERLEAVE_MIN_VERSION,
    TE_GROUPED_OPS_MIN_VERSION,
    TE_INSTALL_HINT,
    TE_OPS_MIN_VERSION,
    TE_SILU_MIN_VERSION,
    TE_SITU_GLU_MIN_VERSION,
    TEActivationLowering,
    TEActivationOp,
    TEVersionError,
    _make_te_ops_activation,
    _require_te,
    _TEPlaceholder,
    lower_activation_to_te_op,
    plan_te_activation,
    te,
)
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.utils import (
    get_pg_size,
    get_tensor_model_parallel_group_if_none,
)

__all__ = [
    "HAVE_TE",
    "FUSED_RECIPES",
    "TEActivationLowering",
    "TEActivationOp",
    "TEColumnParallelGroupedLinear",
    "TEColumnParallelLinear",
    "TECudaRNGStatesTracker",
    "TEFusedMLP",
    "TEFusedMLPWithGroupedLinear",
    "TEFusedOpsMixin",
    "TEFusedRecipeError",
    "TEGroupedLinear",
    "TELayerNormColumnParallelLinear",
    "TELinear",
    "TERowParallelGroupedLinear",
    "TERowParallelLinear",
    "TEVersionError",
    "fused_recipe_autocast",
    "fused_recipe_model_init",
    "lower_activation_to_te_op",
    "make_fused_recipe",
    "plan_te_activation",
    "resolve_fused_recipe",
    "set_save_original_input",
]


class _MissingTEModule(torch.nn.Module):
    """Base class of the TE wrappers when TE is unusable; constructing one raises ImportError.

    Tests may still build wrapper instances with ``cls.__new__`` plus ``torch.nn.Module.__init__``
    and attach tensors by hand, as upstream's tests do.
    """

    def __init__(self, *args, **kwargs):
        _require_te(type(self).__name__)
        super().__init__()


def _te_base(name: str) -> type:
    # Chosen once, at import: a class statement needs a real class as its base.
    if HAVE_TE:
        return getattr(te.pytorch, name)
    return type(f"_Missing{name}", (_MissingTEModule,), {})


# ------------------------------------------------------------------------------------ recipes

FUSED_RECIPES = ("mxfp8", "nvfp4", "none")
# Upstream always quantized the grouped fused paths: NVFP4 when FP4_RECIPE=nvfp4, else MXFP8.
_DEFAULT_FUSED_RECIPE = "mxfp8"
_RECIPE_ENV_VAR = "FP4_RECIPE"


class TEFusedRecipeError(ValueError):
    """The quantization recipe chosen for a grouped fused path is invalid or unavailable."""


def resolve_fused_recipe(
    config_or_env: Any = None,
    *,
    path: str = "TE grouped fused ops",
    check_available: bool = True,
) -> str:
    """Decides which quantization recipe a grouped fused path runs under.

    The grouped fused paths (``TEFusedMLPWithGroupedLinear``, ``FusedSharedExpertMLP``) run
    under an MXFP8 or NVFP4 recipe upstream, always. Here the choice is explicit, and includes
    unquantized execution:

    1. ``config.te_fused_recipe`` when the config has it and it is not None;
    2. else the environment variable ``FP4_RECIPE`` (upstream's switch) when set and non-empty;
    3. else ``"mxfp8"``, upstream's default.

    Values: ``"mxfp8"`` (``MXFP8BlockScaling``), ``"nvfp4"`` (``NVFP4BlockScaling``), ``"none"``
    (no quantization: the ops run in the parameters' dtype). A quantized recipe that the GPU
    cannot run (MXFP8 and NVFP4 need SM100+; an H100/H200 has neither) is an error at
    construction that asks for ``"none"``, never a silent switch to other math.

    Args:
        config_or_env: A config (read for ``te_fused_recipe``), or a mapping standing for the
            environment (tests); None reads ``os.environ`` only.
        path: The class asking, named in errors.
        check_available: Also check that this machine's TE and GPU can run the recipe.

    Returns:
        One of :data:`FUSED_RECIPES`.

    Raises:
        TEFusedRecipeError: Unknown value, or a recipe this machine cannot run.
    """
    if isinstance(config_or_env, Mapping):
        config, environ = None, config_or_env
    else:
        config, environ = config_or_env, os.environ
    value = getattr(config, "te_fused_recipe", None) if config is not None else None
    source = "config.te_fused_recipe"
    if value is None:
        env_value = environ.get(_RECIPE_ENV_VAR, "")
        if env_value.strip():
            value, source = env_value, f"environment variable {_RECIPE_ENV_VAR}"
        else:
            value, source = _DEFAULT_FUSED_RECIPE, "the default (upstream's MXFP8)"
    name = str(value).strip().lower()
    if name not in FUSED_RECIPES:
        raise TEFusedRecipeError(
            f"{path}: unknown quantization recipe {value!r} from {source}; choose one of "
            f"{', '.join(FUSED_RECIPES)}."
        )
    if check_available and name != "none":
        available, reason = _recipe_available(name)
        if not available:
            raise TEFusedRecipeError(
                f"{path}: the {name!r} recipe (from {source}) cannot run on this machine "
                f"({reason}). Set te_fused_recipe='none' in the config (or {_RECIPE_ENV_VAR}=none) "
                "to run the fused ops unquantized, which computes the same math as the "
                "unfused MLP."
            )
    return name


def _recipe_available(name: str) -> tuple[bool, str]:
    if not HAVE_TE:
        return False, "Transformer Engine cannot be imported"
    probe = getattr(te.pytorch, f"is_{name}_available", None)
    if callable(probe):
        result = probe(return_reason=True)
        if isinstance(result, tuple):
            return bool(result[0]), str(result[1] or "unsupported by this GPU")
        return bool(result), "unsupported by this GPU"
    # Older TE: both block-scaled recipes need a Blackwell-class GPU (SM 10.0+).
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major < 10:
        return False, f"needs compute capability 10.0+, this GPU is {major}.{minor}"
    return True, ""


def make_fused_recipe(name: str):
    """The TE recipe object for a :func:`resolve_fused_recipe` name (None for ``"none"``)."""
    if name == "none":
        return None
    recipe_module = te.common.recipe
    if name == "mxfp8":
        return recipe_module.MXFP8BlockScaling()
    if name == "nvfp4":
        return recipe_module.NVFP4BlockScaling()
    raise TEFusedRecipeError(f"unknown fused recipe {name!r}; choose one of {FUSED_RECIPES}.")


def fused_recipe_model_init(recipe):
    """Context for building ops under ``recipe`` (a no-op for None)."""
    if recipe is None:
        return contextlib.nullcontext()
    init = getattr(te.pytorch, "quantized_model_init", None)
    if init is not None:
        return init(enabled=True, recipe=recipe)
    return te.pytorch.fp8_model_init(enabled=True, recipe=recipe)


def fused_recipe_autocast(recipe):
    """Context for running ops under ``recipe`` (a no-op for None)."""
    if recipe is None:
        return contextlib.nullcontext()
    autocast = getattr(te.pytorch, "autocast", None)
    if autocast is not None:
        return autocast(enabled=True, recipe=recipe)
    return te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe)


# --------------------------------------------------------------------------- linear wrappers


def _is_empty(tensor: Optional[torch.Tensor]) -> bool:
    # TE registers an empty tensor, not None, as the bias of a bias-free layer.
    return tensor is None or tensor.numel() == 0


def _rng_tracker_function() -> Optional[Callable]:
    # TE forks the tracker while initializing weights; an unseeded tracker would raise there.
    tracker = get_cuda_rng_tracker()
    return get_cuda_rng_tracker if tracker.is_initialized() else None


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
        _require_te(type(self).__name__)
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
        _require_te(type(self).__name__)
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


class TEGroupedLinear(_TEForwardReturnsBias, _te_base("GroupedLinear")):
    """Megatron wrapper of ``te.pytorch.GroupedLinear``: one GEMM per local expert.

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
        RuntimeError: Transformer Engine is older than 1.9.0.dev0.
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
        _require_te(type(self).__name__, "1.9.0.dev0")
        if not is_expert:
            raise ValueError("TEGroupedLinear only serves MoE experts: pass is_expert=True.")
        self.config = config
        self.te_return_bias = bool(skip_bias_add and bias)
        self.is_expert = True
        tp_group = _resolve_tp_group(None, pg_collection, True)
        tp_size = get_pg_size(tp_group)
        ep_size = getattr(config, "expert_model_parallel_size", 1) or 1
        self.explicit_expert_comm = tp_size > 1 or ep_size > 1
        if self.explicit_expert_comm:
            if parallel_mode == "column":
                output_size //= tp_size
            elif parallel_mode == "row":
                input_size //= tp_size
            parallel_mode, tp_group, tp_size = None, None, 1
        kwargs = _te_common_kwargs(config, init_method, tp_comm_buffer_name, name)
        kwargs["rng_tracker_name"] = get_expert_parallel_rng_tracker_name()
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


def _te_rng_tracker_base() -> type:
    if HAVE_TE:
        return te.pytorch.distributed.CudaRNGStatesTracker
    return type("_MissingCudaRNGStatesTracker", (), {"__init__": _MissingTEModule.__init__})


class TECudaRNGStatesTracker(_te_rng_tracker_base()):
    """TE's RNG tracker (graph-safe under TE's CUDA graphs) with Megatron's ``is_initialized``.

    Args:
        is_inference_rng_tracker: Not supported; must be False.
        use_cudagraphable_rng: Not supported; must be False.
    """

    def __init__(self, is_inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False):
        _require_te(type(self).__name__)
        if is_inference_rng_tracker or use_cudagraphable_rng:
            raise ValueError(
                "TECudaRNGStatesTracker: inference / cudagraphable RNG trackers are not supported."
            )
        super().__init__()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        """Whether a state was added or set since the last reset."""
        return self._is_initialized

    def reset(self):
        """Forgets every stream."""
        super().reset()
        self._is_initialized = False

    def set_states(self, states):
        """Replaces every stream with ``states``."""
        super().set_states(states)
        self._is_initialized = True

    def add(self, name, seed):
        """Registers the stream ``name`` starting from ``seed``."""
        super().add(name, seed)
        self._is_initialized = True


# ----------------------------------------------------------------------------- activation op


# --------------------------------------------------------------------------- fused-ops mixin


def _is_ddp_hook(hook: Callable) -> bool:
    # Megatron's DDP / distributed optimizer register forward pre-hooks that wait for parameter
    # all-gathers; those are expected on fused modules and replayed without a warning.
    func = getattr(hook, "func", hook)  # functools.partial
    module = getattr(func, "__module__", "") or ""
    return "distributed" in module


class TEFusedOpsMixin:
    """Runs a Megatron module through one ``te.pytorch.ops.Sequential`` built from its parts.

    Put it before the concrete class (``class X(TEFusedOpsMixin, MLP)``). The subclass defines
    :meth:`_make_fused_impl`; ops are built lazily on the first :meth:`_get_fused_impl` call and
    alias the module's own parameters, so the module's ``state_dict`` and ``parameters()`` are
    unchanged. The cache is a 1-tuple: an ``nn.Module`` stored in a tuple is not a submodule, so
    the ops never appear in ``state_dict``, ``parameters`` or ``named_modules``.

    The fused forward bypasses the submodules' ``forward``, so their forward hooks would not run.
    When the ops are built, the submodules' forward pre-hooks are replayed (with empty args) before
    each fused forward, and their forward post-hooks (captured at build time) after it, with a
    warning. Backward hooks on submodules cannot be honoured and are refused.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fused_impl: Optional[tuple[Any]] = None

    def _make_fused_impl(self):
        """Builds the ``te.pytorch.ops.Sequential`` computing this module."""
        raise NotImplementedError(f"{type(self).__name__} must implement _make_fused_impl().")

    def _get_fused_impl(self):
        """The cached ops, built (and hooked) on first use."""
        if self._fused_impl is None:
            fused = self._make_fused_impl()
            self._register_hooks_on_fused_impl(fused)
            self._fused_impl = (fused,)
        return self._fused_impl[0]

    def _reset_fused_impl(self) -> None:
        """Drops the cached ops (e.g. after replacing a parameter); the next call rebuilds them."""
        self._fused_impl = None

    def _register_hooks_on_fused_impl(self, fused, *, pre_hook_target=None) -> None:
        """Makes ``fused`` run the submodules' hooks (see the class docstring).

        Args:
            fused: The ops; the replayed forward post-hooks run after it.
            pre_hook_target: The module that runs first, when it is not ``fused`` (e.g. a norm
                run separately); the replayed forward pre-hooks run before it.
        """
        descendants = [(name, m) for name, m in self.named_modules() if m is not self]
        for name, module in descendants:
            if module._backward_hooks or module._backward_pre_hooks:
                raise RuntimeError(
                    f"{type(self).__name__}: submodule {name!r} has backward hooks, which the "
                    "fused Transformer Engine ops cannot run (they bypass the submodule)."
                )
        post_hooks = [
            (name, module, hook)
            for name, module in descendants
            for hook in module._forward_hooks.values()
        ]
        if post_hooks:
            warnings.warn(
                f"{type(self).__name__}: forward hooks of {sorted({n for n, _, _ in post_hooks})} "
                "run after the fused forward, with no arguments and no output (the fused ops "
                "bypass those submodules).",
                stacklevel=3,
            )
        warned: set = set()
        owner = type(self).__name__

        def replay_pre_hooks(_fused, _args):
            # Read the hooks now, not at build time: DDP may install or remove them later.
            for name, module in descendants:
                for hook_id, hook in list(module._forward_pre_hooks.items()):
                    if hook_id in module._forward_pre_hooks_with_kwargs:
                        result = hook(module, (), {})
                    else:
                        result = hook(module, ())
                    if result is not None:
                        raise RuntimeError(
                            f"{owner}: forward pre-hook {hook!r} of submodule {name!r} returned "
                            "a value; the fused ops cannot pass modified inputs to a submodule."
                        )
                    if not _is_ddp_hook(hook) and (name, hook_id) not in warned:
                        warned.add((name, hook_id))
                        warnings.warn(
                            f"{owner}: replaying forward pre-hook {hook!r} of submodule {name!r} "
                            "with empty arguments before the fused forward.",
                            stacklevel=2,
                        )

        def replay_post_hooks(_fused, _args, _output):
            for _name, module, hook in post_hooks:
                hook(module, (), None)

        (pre_hook_target if pre_hook_target is not None else fused).register_forward_pre_hook(
            replay_pre_hooks
        )
        if post_hooks:
            fused.register_forward_hook(replay_post_hooks)

    # -- helpers shared by the fused classes (here and in moe/) --------------------------------

    def _get_te_ops_tensor_parallel_context(self) -> tuple[int, Any]:
        """``(tp_size, tp_group or None)`` of this module (its own group, else fc1's)."""
        group = getattr(self, "tp_group", None)
        if group is None:
            group = getattr(getattr(self, "linear_fc1", None), "tp_group", None)
        size = get_pg_size(group)
        return size, (group if size > 1 else None)

    def _get_te_ops_rng_state_tracker_function(self) -> Optional[Callable]:
        """The RNG tracker getter TE ops would fork for weight init, once it is seeded."""
        return _rng_tracker_function()

    @staticmethod
    def _require_attrs(module, module_name: str, names) -> None:
        missing = [n for n in names if not hasattr(module, n)]
        if missing:
            raise ValueError(
                f"{module_name} ({type(module).__name__}) must be a Megatron Core Transformer "
                f"Engine wrapper; it lacks {', '.join(missing)}."
            )

    def _make_te_ops_norm_from_mcore_te_layernorm_linear(self, module, module_name: str):
        """A ``LayerNorm`` / ``RMSNorm`` op aliasing the norm parameters of a LayerNorm linear."""
        self._require_attrs(module, module_name, ("layer_norm_weight", "normalization", "eps"))
        weight = module.layer_norm_weight
        kwargs = dict(
            eps=module.eps,
            device="meta",
            dtype=weight.dtype,
            zero_centered_gamma=bool(getattr(module, "zero_centered_gamma", False)),
        )
        ops = te.pytorch.ops
        if module.normalization == "RMSNorm":
            op = ops.RMSNorm(weight.size(0), **kwargs)
        elif module.normalization == "LayerNorm":
            op = ops.LayerNorm(weight.size(0), **kwargs)
            op.bias = module.layer_norm_bias
        else:
            raise ValueError(f"{module_name}: unsupported normalization {module.normalization!r}.")
        op.weight = weight
        return op

    def _make_te_ops_basic_linear_from_mcore_te_linear(
        self,
        module,
        *,
        module_name: str,
        output_features: Optional[int] = None,
        tensor_parallel_mode: Optional[str] = None,
        tensor_parallel_group=None,
        sequence_parallel: Optional[bool] = None,
        rng_state_tracker_function: Optional[Callable] = None,
    ):
        """A ``BasicLinear`` op aliasing ``module.weight``.

        ``BasicLinear`` takes global feature counts: the split side is multiplied back by the
        tensor-parallel size.
        """
        self._require_attrs(module, module_name, ("weight",))
        weight = module.weight
        local_out, local_in = weight.shape
        tp_size = get_pg_size(tensor_parallel_group) if tensor_parallel_mode else 1
        in_features = local_in * (tp_size if tensor_parallel_mode == "row" else 1)
        if output_features is None:
            output_features = local_out * (tp_size if tensor_parallel_mode == "column" else 1)
        if sequence_parallel is None:
            sequence_parallel = bool(getattr(module, "sequence_parallel", False))
        op = te.pytorch.ops.BasicLinear(
            in_features,
            output_features,
            device="meta",
            dtype=weight.dtype,
            tensor_parallel_mode=tensor_parallel_mode,
            tensor_parallel_group=tensor_parallel_group,
            sequence_parallel=bool(sequence_parallel) and tensor_parallel_mode is not None,
            rng_state_tracker_function=rng_state_tracker_function,
            accumulate_into_main_grad=bool(getattr(module, "fuse_wgrad_accumulation", False)),
        )
        op.weight = weight
        return op

    def _make_te_ops_grouped_linear_from_mcore_te_linear(
        self, module, *, module_name: str, rng_state_tracker_function: Optional[Callable] = None
    ):
        """A one-group ``GroupedLinear`` op (no bias) aliasing ``module.weight`` as ``weight0``."""
        self._require_attrs(module, module_name, ("weight",))
        weight = module.weight
        op = te.pytorch.ops.GroupedLinear(
            1,
            weight.size(1),
            weight.size(0),
            bias=False,
            device="meta",
            dtype=weight.dtype,
            rng_state_tracker_function=rng_state_tracker_function,
            accumulate_into_main_grad=bool(getattr(module, "fuse_wgrad_accumulation", False)),
        )
        op.weight0 = weight
        return op

    @staticmethod
    def _make_te_ops_bias_from_tensor(bias: Optional[torch.Tensor]):
        """A ``Bias`` op aliasing ``bias``, or None for a missing or empty bias."""
        if _is_empty(bias):
            return None
        op = te.pytorch.ops.Bias(bias.numel(), device="meta", dtype=bias.dtype)
        op.bias = bias
        return op


# --------------------------------------------------------------------------------- fused MLPs


class TEFusedMLP(TEFusedOpsMixin, MLP):
    """``MLP`` computed by one chain of Transformer Engine ops.

    The ops are ``[norm] -> BasicLinear(fc1) -> [Bias] -> activation -> BasicLinear(fc2) ->
    [AllReduce | ReduceScatter] -> [Bias]``, aliasing the parameters of the module's own TE
    linears: the state dict is exactly :class:`MLP`'s, so weights move between the two freely.

    The activation is lowered in ``__init__`` (:func:`plan_te_activation`) and the linear types
    are checked there too: a config the ops cannot compute exactly fails at construction, never at
    the first forward and never silently. fc1 must be a :class:`TELayerNormColumnParallelLinear`
    (or :class:`TEColumnParallelLinear`) and fc2 a :class:`TERowParallelLinear`.

    Args: as :class:`MLP`.

    Raises:
        ImportError: Transformer Engine is unavailable.
        RuntimeError: Transformer Engine is older than 1.13.
        UnsupportedActivationError: TE cannot compute the configured activation
            (:class:`TEVersionError`, also a RuntimeError, when only the TE version is at fault).
        ValueError: fc1 or fc2 is not one of the TE linear wrappers above.
    """

    def __init__(
        self,
        config,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        tp_group=None,
        name: Optional[str] = None,
        pg_collection=None,
    ):
        _require_te(type(self).__name__, TE_OPS_MIN_VERSION)
        super().__init__(
            config,
            submodules,
            is_expert=is_expert,
            input_size=input_size,
            ffn_hidden_size=ffn_hidden_size,
            tp_group=tp_group,
            name=name,
            pg_collection=pg_collection,
        )
        # Both checks run now: the ops are built lazily, but a config they cannot run must fail
        # at model build.
        self._setup_fused_activation()
        self._check_fused_linears()

    def _setup_fused_activation(self) -> None:
        """Lowers the activation once, at construction; the ops are built from the result."""
        self._te_activation: Optional[TEActivationLowering] = plan_te_activation(
            self._fused_activation_spec(),
            path=type(self).__name__,
            scaled=False,
            cache_quantized_input=bool(self.config.activation_func_fp8_input_store),
        )

    def _fused_activation_spec(self) -> ActivationSpec:
        spec = getattr(self, "activation_spec", None)
        return spec if spec is not None else ActivationSpec.from_config(self.config)

    def _check_fused_linears(self) -> None:
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if not isinstance(fc1, TELayerNormColumnParallelLinear | TEColumnParallelLinear):
            raise ValueError(
                f"{type(self).__name__} needs linear_fc1 to be a TELayerNormColumnParallelLinear "
                f"or TEColumnParallelLinear, got {type(fc1).__name__}."
            )
        if not isinstance(fc2, TERowParallelLinear):
            raise ValueError(
                f"{type(self).__name__} needs linear_fc2 to be a TERowParallelLinear, got "
                f"{type(fc2).__name__}."
            )

    def _make_fused_impl(self):
        self._check_fused_linears()
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        tp_size, tp_group = self._get_te_ops_tensor_parallel_context()
        rng = self._get_te_ops_rng_state_tracker_function()
        ops = te.pytorch.ops
        chain = []
        if isinstance(fc1, TELayerNormColumnParallelLinear):
            chain.append(self._make_te_ops_norm_from_mcore_te_layernorm_linear(fc1, "linear_fc1"))
        chain.append(
            self._make_te_ops_basic_linear_from_mcore_te_linear(
                fc1,
                module_name="linear_fc1",
                tensor_parallel_mode="column" if tp_size > 1 else None,
                tensor_parallel_group=tp_group,
                rng_state_tracker_function=rng,
            )
        )
        fc1_bias = self._make_te_ops_bias_from_tensor(getattr(fc1, "bias", None))
        if fc1_bias is not None:
            chain.append(fc1_bias)
        chain.append(self._te_activation.build())
        # fc2 runs on the local shard; the reduction is its own op so fc2's bias is added once,
        # after it.
        chain.append(
            self._make_te_ops_basic_linear_from_mcore_te_linear(
                fc2, module_name="linear_fc2", rng_state_tracker_function=rng
            )
        )
        if tp_size > 1:
            if getattr(fc2, "sequence_parallel", False):
                chain.append(ops.ReduceScatter(tp_group))
            else:
                chain.append(ops.AllReduce(tp_group))
        if not getattr(fc2, "te_return_bias", False):
            fc2_bias = self._make_te_ops_bias_from_tensor(getattr(fc2, "bias", None))
            if fc2_bias is not None:
                chain.append(fc2_bias)
        return ops.Sequential(*chain)

    def _returned_bias(self) -> Optional[torch.Tensor]:
        fc2 = self.linear_fc2
        bias = getattr(fc2, "bias", None)
        if getattr(fc2, "te_return_bias", False) and not _is_empty(bias):
            return bias
        return None

    def _refuse_per_token_scale(self, per_token_scale) -> None:
        if per_token_scale is not None:
            raise ValueError(
                f"{type(self).__name__} does not apply per_token_scale (MoE router "
                "probabilities); use MLP or the MoE expert classes for scaled tokens."
            )

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs):
        """Returns ``(output, fc2 bias or None)`` like :meth:`MLP.forward`.

        Raises:
            ValueError: ``per_token_scale`` is given (the fused ops would ignore it).
        """
        self._refuse_per_token_scale(per_token_scale)
        fc1 = self.linear_fc1
        if isinstance(fc1, TELayerNormColumnParallelLinear):
            # As the TE LayerNorm linear does in MLP: the norm runs in its weight's dtype.
            hidden_states = hidden_states.to(fc1.layer_norm_weight.dtype)
        return self._get_fused_impl()(hidden_states), self._returned_bias()


class TEFusedMLPWithGroupedLinear(TEFusedMLP):
    """Dense ``MLP`` computed by TE's grouped-MLP ops (one group), optionally quantized.

    With tensor parallelism 1 the ops are ``GroupedLinear(fc1) -> Scaled<activation> ->
    GroupedLinear(fc2)`` with unit row scales, the chain TE fuses into one grouped-MLP kernel on
    SM100 GPUs under an MXFP8/NVFP4 recipe; the norm of a LayerNorm fc1 runs before it,
    unquantized. With tensor parallelism > 1 the class runs :class:`TEFusedMLP`'s ops.

    The recipe is chosen at construction by :func:`resolve_fused_recipe` (``"mxfp8"`` by
    default, as upstream; ``"none"`` runs unquantized and is what a GPU without MXFP8/NVFP4, such
    as an H200, must use). The activation is lowered at construction to its ``Scaled*`` op.

    Args:
        config, submodules, is_expert, input_size, ffn_hidden_size, tp_group, name,
        pg_collection: as :class:`MLP`.
        glu_interleave_size: Store fc1's gated rows block-interleaved (blocks of this many rows,
            a multiple of 32) so that the Scaled GLU op reads them in TE's interleaved layout, as
            TE's fused grouped-MLP kernel requires (32). The state dict stays in MLP's
            ``[gate; linear]`` layout: it is converted on save and load. Default None: fc1 is
            kept in MLP's layout and read as halves (the SM100 kernel then declines to fuse).

    Raises:
        RuntimeError: Transformer Engine is older than 2.14.
        ValueError: ``add_bias_linear`` is set; ``glu_interleave_size`` does not divide the
            per-rank FFN width.
        TEFusedRecipeError: The chosen recipe is unknown or cannot run on this GPU.
        UnsupportedActivationError: TE's grouped ops cannot compute the activation.
    """

    def __init__(
        self,
        config,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        tp_group=None,
        name: Optional[str] = None,
        pg_collection=None,
        *,
        glu_interleave_size: Optional[int] = None,
    ):
        _require_te(type(self).__name__, TE_GROUPED_OPS_MIN_VERSION)
        if config.add_bias_linear:
            raise ValueError(
                f"{type(self).__name__} does not support add_bias_linear=True: TE's grouped "
                "fused ops here carry no biases."
            )
        if glu_interleave_size is not None and not config.gated_linear_unit:
            raise ValueError(
                f"{type(self).__name__}: glu_interleave_size applies to gated activations only."
            )
        # Resolved before the linears are allocated, so a bad recipe fails fast. Plain attributes
        # may be set before nn.Module.__init__; TEFusedMLP.__init__ reads them back.
        self.fused_recipe_name = resolve_fused_recipe(config, path=type(self).__name__)
        self.glu_interleave_size = glu_interleave_size
        super().__init__(
            config,
            submodules,
            is_expert=is_expert,
            input_size=input_size,
            ffn_hidden_size=ffn_hidden_size,
            tp_group=tp_group,
            name=name,
            pg_collection=pg_collection,
        )
        self._norm_seq: Optional[tuple[Any]] = None
        self._fused_recipe: Optional[tuple[Any]] = None
        if glu_interleave_size is not None:
            self._check_interleave_divides_ffn(glu_interleave_size)
            self.register_state_dict_post_hook(_fc1_weight_to_halves)
            self.register_load_state_dict_pre_hook(_fc1_weight_from_halves)

    def _setup_fused_activation(self) -> None:
        spec = self._fused_activation_spec()
        name = type(self).__name__
        tp_size, _ = self._get_te_ops_tensor_parallel_context()
        if tp_size > 1:
            # TEFusedMLP's unscaled ops run instead (see forward).
            self._te_activation = plan_te_activation(
                spec,
                path=f"{name} (tensor-parallel, TEFusedMLP ops)",
                scaled=False,
                glu_interleave_size=self.glu_interleave_size,
                cache_quantized_input=bool(self.config.activation_func_fp8_input_store),
            )
            self._grouped_te_activation = None
        else:
            self._te_activation = None
            self._grouped_te_activation = plan_te_activation(
                spec, path=name, scaled=True, glu_interleave_size=self.glu_interleave_size
            )

    def _check_interleave_divides_ffn(self, k: int) -> None:
        rows = self.linear_fc1.weight.size(0)  # local [gate; linear] rows
        if (rows // 2) % k:
            raise ValueError(
                f"{type(self).__name__}: glu_interleave_size={k} must divide the per-rank FFN "
                f"width {rows // 2}."
            )

    def _reset_fused_impl(self) -> None:
        super()._reset_fused_impl()
        self._norm_seq = None

    def _register_hooks_on_fused_impl(self, fused, *, pre_hook_target=None) -> None:
        # The norm runs before the grouped ops and reads fc1's norm parameters, so the replayed
        # pre-hooks (e.g. a parameter all-gather) must run before it.
        if pre_hook_target is None and self._norm_seq is not None:
            pre_hook_target = self._norm_seq[0]
        super()._register_hooks_on_fused_impl(fused, pre_hook_target=pre_hook_target)

    def _tensor_parallel(self) -> bool:
        return self._get_te_ops_tensor_parallel_context()[0] > 1

    def _recipe(self):
        if self._fused_recipe is None:
            self._fused_recipe = (make_fused_recipe(self.fused_recipe_name),)
        return self._fused_recipe[0]

    def _make_fused_impl(self):
        if self._tensor_parallel():
            return super()._make_fused_impl()
        self._check_fused_linears()
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        rng = self._get_te_ops_rng_state_tracker_function()
        ops = te.pytorch.ops
        with fused_recipe_model_init(self._recipe()):
            if isinstance(fc1, TELayerNormColumnParallelLinear):
                norm = self._make_te_ops_norm_from_mcore_te_layernorm_linear(fc1, "linear_fc1")
                self._norm_seq = (ops.Sequential(norm),)
            else:
                self._norm_seq = None
            fc1_op = self._make_te_ops_grouped_linear_from_mcore_te_linear(
                fc1, module_name="linear_fc1", rng_state_tracker_function=rng
            )
            activation = self._grouped_te_activation.build()
            # The row scales are always ones here; TE's fused kernel may then skip them.
            activation._grouped_mlp_unit_activation_scale = True
            fc2_op = self._make_te_ops_grouped_linear_from_mcore_te_linear(
                fc2, module_name="linear_fc2", rng_state_tracker_function=rng
            )
        return ops.Sequential(fc1_op, activation, fc2_op)

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs):
        """Returns ``(output, None)`` like :meth:`MLP.forward` (the class has no biases).

        Raises:
            ValueError: ``per_token_scale`` is given.
        """
        if self._tensor_parallel():
            return super().forward(hidden_states, per_token_scale, **kwargs)
        self._refuse_per_token_scale(per_token_scale)
        fused = self._get_fused_impl()
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        rows = x.size(0)
        split_sizes = torch.full((1,), rows, dtype=torch.int64, device=x.device)
        scales = torch.ones(rows, dtype=x.dtype, device=x.device)
        if self._norm_seq is not None:
            # The norm stays outside the recipe, as upstream: its output feeds the quantized GEMM.
            x = self._norm_seq[0](x.to(self.linear_fc1.layer_norm_weight.dtype))
        with fused_recipe_autocast(self._recipe()):
            out = fused(x, split_sizes, scales, split_sizes)
        return out.reshape(*shape[:-1], out.size(-1)), None


def _fc1_weight_key(prefix: str) -> str:
    return f"{prefix}linear_fc1.weight"


def _fc1_weight_to_halves(module, state_dict, prefix, local_metadata):
    key = _fc1_weight_key(prefix)
    if key in state_dict:
        state_dict[key] = _deinterleave_rows(state_dict[key], module.glu_interleave_size)


def _fc1_weight_from_halves(module, state_dict, prefix, *args):
    key = _fc1_weight_key(prefix)
    if key in state_dict:
        state_dict[key] = _interleave_rows(state_dict[key], module.glu_interleave_size)


def _interleave_rows(weight: torch.Tensor, k: int) -> torch.Tensor:
    """``[gate rows; linear rows]`` -> blocks ``[g(k), u(k), g(k), u(k), ...]`` along dim 0."""
    rows = weight.size(0)
    blocks = weight.reshape(2, rows // (2 * k), k, *weight.shape[1:])
    return blocks.transpose(0, 1).reshape(weight.shape)


def _deinterleave_rows(weight: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`_interleave_rows`."""
    rows = weight.size(0)
    blocks = weight.reshape(rows // (2 * k), 2, k, *weight.shape[1:])
    return blocks.transpose(0, 1).reshape(weight.shape)


# ----------------------------------------------------------------------------- exports without TE
# Upstream exports these names as None when Transformer Engine is missing, and code guards on
# that (``if TEFusedMLP is None: ...``). The classes stay reachable through TE_ONLY_CLASSES, which
# is how tests running a fake TE on CPU put them back.
TE_ONLY_CLASSES = {
    "TEActivationOp": TEActivationOp,
    "TEGroupedLinear": TEGroupedLinear,
    "TEColumnParallelGroupedLinear": TEColumnParallelGroupedLinear,
    "TERowParallelGroupedLinear": TERowParallelGroupedLinear,
    "TEFusedMLP": TEFusedMLP,
    "TEFusedMLPWithGroupedLinear": TEFusedMLPWithGroupedLinear,
}
if not HAVE_TE:
    globals().update(dict.fromkeys(TE_ONLY_CLASSES))
