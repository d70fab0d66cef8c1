"""Builders of ``te.pytorch.ops`` operations that alias the parameters of existing modules.

A fused Transformer Engine class (``TEFusedMLP``, ``TEFusedResidualRMSNorm``, ...) computes its
module through a ``te.pytorch.ops.Sequential`` whose operations share the module's own
parameters: each builder here makes one operation on the meta device and then points its
parameters at the source module's, so the module's ``state_dict`` and ``parameters()`` stay the
only source of truth. ``megatron.core.extensions.transformer_engine`` re-exports these functions
under upstream's names, and ``TEFusedOpsMixin`` delegates to them.

Each builder first checks that its source module has the attributes it reads (dotted paths such
as ``config.tp_comm_overlap`` included) and raises ``ValueError`` naming the module, its class and
what is missing, so a plain TE module handed where a Megatron wrapper belongs fails clearly.
TE is read from the import seam (``mcore_activations.te_import``) at call time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from mcore_activations import te_import
from megatron.core.extensions.te_linears import _is_empty, _rng_tracker_function
from megatron.core.extensions.te_public import public
from megatron.core.parallel_state import get_tensor_model_parallel_group
from megatron.core.utils import get_pg_size

__all__: list = []  # private helpers; transformer_engine.py re-exports them under these names

# What the builders read from their source modules (validated before anything is built).
_RMSNORM_ATTRS = ("eps", "weight", "zero_centered_gamma")
_LAYERNORM_LINEAR_ATTRS = (
    "eps",
    "layer_norm_bias",
    "layer_norm_weight",
    "normalization",
    "weight",
    "zero_centered_gamma",
)
_LINEAR_ATTRS = ("config.tp_comm_overlap", "fuse_wgrad_accumulation", "ub_name", "weight")
_GROUPED_LINEAR_ATTRS = ("fuse_wgrad_accumulation", "weight")


def _te_ops_has_nested_attr(module: Any, attr_name: str) -> bool:
    """Whether ``module`` has ``attr_name``, which may be a dotted path (``"config.x"``)."""
    current = module
    for part in attr_name.split("."):
        if not hasattr(current, part):
            return False
        current = getattr(current, part)
    return True


def _validate_te_ops_adapter_module(
    module: Any, module_name: str, required_attrs: Sequence[str]
) -> None:
    """Checks that ``module`` has every attribute an adapter reads from it.

    Args:
        module: The source module.
        module_name: How the caller refers to it (e.g. ``"linear_fc1"``), named in the error.
        required_attrs: Attribute names, possibly dotted.

    Raises:
        ValueError: Some are missing; the message names ``module_name``, the module's class and
            every missing attribute.
    """
    missing = [name for name in required_attrs if not _te_ops_has_nested_attr(module, name)]
    if missing:
        raise ValueError(
            f"{module_name}: a Megatron Core Transformer Engine wrapper is needed here; "
            f"{type(module).__name__} lacks {', '.join(missing)}."
        )


def _get_te_ops_tensor_parallel_context(
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> tuple[int, Optional[torch.distributed.ProcessGroup]]:
    """``(tensor-parallel size, group)`` for TE ops; the group is None at size 1.

    Args:
        tp_group: The module's own group. Default: parallel_state's global tensor-parallel group
            (upstream's only behaviour).
    """
    if tp_group is None:
        size = public("get_tensor_model_parallel_world_size")()
        group = get_tensor_model_parallel_group(check_initialized=False) if size > 1 else None
        return size, group
    size = get_pg_size(tp_group)
    return size, (tp_group if size > 1 else None)


def _get_te_ops_rng_state_tracker_function() -> Optional[Callable]:
    """The CUDA RNG tracker getter for TE ops' weight initialization, or None while it is
    unseeded (TE would fork an uninitialized tracker and fail)."""
    return _rng_tracker_function()


def _norm_op_kwargs(module: Any, weight: torch.Tensor) -> dict:
    # What every TE norm op takes from its source module: built on the meta device, then aliased.
    return dict(
        eps=module.eps,
        device="meta",
        dtype=weight.dtype,
        zero_centered_gamma=module.zero_centered_gamma,
    )


def _make_te_ops_rmsnorm_from_te_rmsnorm(module: Any, module_name: str):
    """An ``ops.RMSNorm`` computing ``module`` (a ``te.pytorch.RMSNorm``) with its weight.

    The SM margins of ``module`` are passed on when it has them (TE builds that keep them).

    Raises:
        ValueError: ``module`` lacks ``eps``, ``weight`` or ``zero_centered_gamma``.
    """
    _validate_te_ops_adapter_module(module, module_name, _RMSNORM_ATTRS)
    weight = module.weight
    kwargs = _norm_op_kwargs(module, weight)
    if hasattr(module, "_sm_margins"):
        kwargs["sm_margin"] = module._sm_margins
    op = te_import.te.pytorch.ops.RMSNorm(weight.shape, **kwargs)
    op.weight = weight
    return op


def _make_te_ops_norm_from_mcore_te_layernorm_linear(module: Any, module_name: str):
    """An ``ops.LayerNorm`` / ``ops.RMSNorm`` with the norm parameters of a LayerNorm linear
    (``TELayerNormColumnParallelLinear``), normalizing its input features.

    Raises:
        ValueError: ``module`` lacks a norm attribute, or its ``normalization`` is neither
            ``"LayerNorm"`` nor ``"RMSNorm"``.
    """
    _validate_te_ops_adapter_module(module, module_name, _LAYERNORM_LINEAR_ATTRS)
    norm_weight = module.layer_norm_weight
    kwargs = _norm_op_kwargs(module, norm_weight)
    ops = te_import.te.pytorch.ops
    features = module.weight.size(1)
    if module.normalization == "LayerNorm":
        op = ops.LayerNorm(features, **kwargs)
        op.bias = module.layer_norm_bias
    elif module.normalization == "RMSNorm":
        op = ops.RMSNorm(features, **kwargs)
    else:
        raise ValueError(
            f"{module_name}: Unsupported normalization ({module.normalization}); TE's ops have "
            "'LayerNorm' and 'RMSNorm'."
        )
    op.weight = norm_weight
    return op


def _te_ops_userbuffers_options(module: Any) -> Optional[dict]:
    """``{"comm_name": ub_name}`` when ``module`` overlaps its communication through TE's
    Userbuffers (``config.tp_comm_overlap`` and a buffer name), as the module itself would;
    None otherwise.

    Raises:
        RuntimeError: The overlap is configured but this TE's ``ops.BasicLinear`` cannot take it
            (the ops would silently run without the overlap).
    """
    config = getattr(module, "config", None)
    ub_name = getattr(module, "ub_name", None)
    if not (getattr(config, "tp_comm_overlap", False) and ub_name is not None):
        return None
    accepted = inspect.signature(te_import.te.pytorch.ops.BasicLinear.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    if "userbuffers_options" not in accepted and not takes_any:
        raise RuntimeError(
            f"tp_comm_overlap=True: this Transformer Engine ({te_import.te_version()}) has no "
            "userbuffers_options on ops.BasicLinear, so the fused TE ops would run without "
            "the Userbuffers overlap. Upgrade Transformer Engine or set tp_comm_overlap=False."
        )
    return {"comm_name": ub_name}


def _make_te_ops_basic_linear_from_mcore_te_linear(
    module: Any,
    *,
    module_name: str,
    output_features: Optional[int] = None,
    tensor_parallel_mode: Optional[str] = None,
    tensor_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    sequence_parallel: Optional[bool] = None,
    rng_state_tracker_function: Optional[Callable] = None,
):
    """An ``ops.BasicLinear`` with the weight of a Megatron TE linear wrapper.

    ``BasicLinear`` takes global feature counts and divides the split side by the group size, so
    the split side of the local weight is multiplied back when a tensor-parallel mode is given:
    the input features for ``"row"``, and the output features for ``"column"`` unless
    ``output_features`` is passed. A linear that overlaps its communication through Userbuffers
    passes its buffer name on (``userbuffers_options``); without it the keyword is left out, so
    TE builds without it still construct.

    Args:
        module: The wrapper (``TELinear`` and its column / row variants, or the LayerNorm one).
        module_name: Its name in the caller, named in errors.
        output_features: Global output features (default: from the weight, as above).
        tensor_parallel_mode: ``"column"``, ``"row"`` or None.
        tensor_parallel_group: The group the mode splits over.
        sequence_parallel: TE's sequence-parallel flag (default False).
        rng_state_tracker_function: The RNG tracker getter TE forks for initialization.

    Raises:
        ValueError: ``module`` lacks ``config.tp_comm_overlap``, ``fuse_wgrad_accumulation``,
            ``ub_name`` or ``weight`` (e.g. a plain ``te.pytorch.Linear``), or a
            ``tensor_parallel_mode`` comes without its ``tensor_parallel_group``.
        RuntimeError: The Userbuffers overlap is configured and this TE cannot run it.
    """
    _validate_te_ops_adapter_module(module, module_name, _LINEAR_ATTRS)
    if tensor_parallel_mode is not None and tensor_parallel_group is None:
        # TE would split over the whole world, which need not be the group the weight was split
        # over; the op's feature counts would then disagree with the aliased weight.
        raise ValueError(
            f"{module_name}: tensor_parallel_mode={tensor_parallel_mode!r} needs the "
            "tensor_parallel_group the weight is split over; pass it (or leave the mode None at "
            "tensor-parallel size 1)."
        )
    weight = module.weight
    local_out, local_in = weight.shape
    tp_size = get_pg_size(tensor_parallel_group) if tensor_parallel_mode is not None else 1
    in_features = local_in * (tp_size if tensor_parallel_mode == "row" else 1)
    if output_features is None:
        output_features = local_out * (tp_size if tensor_parallel_mode == "column" else 1)
    userbuffers = _te_ops_userbuffers_options(module)
    extra = {} if userbuffers is None else {"userbuffers_options": userbuffers}
    op = te_import.te.pytorch.ops.BasicLinear(
        in_features,
        output_features,
        device="meta",
        dtype=weight.dtype,
        tensor_parallel_mode=tensor_parallel_mode,
        tensor_parallel_group=tensor_parallel_group,
        sequence_parallel=bool(sequence_parallel),
        rng_state_tracker_function=rng_state_tracker_function,
        accumulate_into_main_grad=bool(module.fuse_wgrad_accumulation),
        **extra,
    )
    op.weight = weight
    return op


def _make_te_ops_grouped_linear_from_mcore_te_linear(
    module: Any, *, module_name: str, rng_state_tracker_function: Optional[Callable] = None
):
    """A one-group ``ops.GroupedLinear`` (no bias) with ``module.weight`` as its ``weight0``.

    Raises:
        ValueError: ``module`` lacks ``fuse_wgrad_accumulation`` or ``weight``.
    """
    _validate_te_ops_adapter_module(module, module_name, _GROUPED_LINEAR_ATTRS)
    weight = module.weight
    op = te_import.te.pytorch.ops.GroupedLinear(
        1,
        weight.size(1),
        weight.size(0),
        bias=False,
        device="meta",
        dtype=weight.dtype,
        rng_state_tracker_function=rng_state_tracker_function,
        accumulate_into_main_grad=bool(module.fuse_wgrad_accumulation),
    )
    op.weight0 = weight
    return op


def _make_te_ops_bias_from_tensor(bias: Optional[torch.Tensor]):
    """An ``ops.Bias`` adding ``bias``, or None for a missing or empty bias (TE registers an
    empty tensor as the bias of a bias-free layer)."""
    if _is_empty(bias):
        return None
    op = te_import.te.pytorch.ops.Bias(bias.numel(), device="meta", dtype=bias.dtype)
    op.bias = bias
    return op
