"""Small helpers shared across megatron.core; version checks come from mcore_activations."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import warnings
from collections.abc import Callable
from typing import Optional

import torch

from mcore_activations.versions import (  # noqa: F401 - upstream names
    get_te_version,
    get_torch_version,
    is_te_min_version,
    is_torch_min_version,
)


def divide(numerator: int, denominator: int) -> int:
    """Integer division that raises ``ValueError`` unless ``denominator`` divides ``numerator``."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def get_pg_size(group=None) -> int:
    """Returns the size of ``group``; 1 without ``torch.distributed`` or without a group.

    ``group=None`` means "no group" (a single rank), not the default group: layers built outside
    a distributed job pass None and must behave as one rank.
    """
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


def get_pg_rank(group=None) -> int:
    """Returns this rank's index in ``group``; 0 without ``torch.distributed`` or a group."""
    if group is None or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank(group=group)


def get_tensor_model_parallel_group_if_none(tp_group=None, is_expert=False, check_initialized=True):
    """Returns ``tp_group``, or the global (expert) tensor-parallel group when it is None.

    Passing the group explicitly is preferred; falling back to ``parallel_state`` is deprecated
    upstream and warns once. Without ``torch.distributed`` there is no group and None comes back.

    Args:
        tp_group: The group to use, if the caller has one.
        is_expert: Fall back to the expert-tensor-parallel group instead.
        check_initialized: Raise if ``parallel_state`` has no such group yet.
    """
    if not torch.distributed.is_initialized():
        return None
    if tp_group is not None:
        return tp_group

    from megatron.core import parallel_state

    if torch.distributed.get_rank() == 0:
        warnings.warn(
            "No tensor-parallel group was passed; using the global one from parallel_state. "
            "Pass tp_group= (or pg_collection=) explicitly.",
            DeprecationWarning,
            stacklevel=2,
        )
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


# ----------------------------------------------------------------------------- initialisation
def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init method that fills a tensor in place from ``N(0, sigma**2)``."""
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma)


def scaled_init_method_normal(
    sigma: float, num_layers: int, multiplier: float = 2.0
) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init method drawing from ``N(0, (sigma / sqrt(multiplier * num_layers))**2)``.

    The output layers of each residual branch use it, so that the residual stream's variance
    does not grow with depth.
    """
    return init_method_normal(sigma / math.sqrt(multiplier * num_layers))


# ----------------------------------------------------------------------------- viewless tensors
# A view keeps its base tensor alive through ``._base``. Pipeline schedules free a layer's
# output data early; a viewless alias (same storage, no ``._base``) lets them do so.
def _viewless_alias(inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data
    return out


class MakeViewlessTensor(torch.autograd.Function):
    """Autograd-aware :func:`make_viewless_tensor`: the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, inp, requires_grad):
        """A viewless alias of ``inp``."""
        return _viewless_alias(inp, requires_grad)

    @staticmethod
    def backward(ctx, grad_output):
        """Identity."""
        return grad_output, None


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool):
    """Returns ``inp`` if it is not a view, else an alias of its data without ``._base``.

    Args:
        inp: Any tensor.
        requires_grad: ``requires_grad`` of the alias made when no graph is kept.
        keep_graph: Keep ``inp``'s autograd history (through :class:`MakeViewlessTensor`).
    """
    if inp._base is None:
        return inp
    if keep_graph:
        return MakeViewlessTensor.apply(inp, requires_grad)
    return _viewless_alias(inp, requires_grad)


def safely_set_viewless_tensor_data(tensor: torch.Tensor, new_data_tensor: torch.Tensor) -> None:
    """Sets ``tensor.data``, refusing a view: a view's data would stay tied to its base."""
    if tensor._base is not None:
        raise ValueError(
            "safely_set_viewless_tensor_data: the tensor is a view of another tensor "
            f"(shape {tuple(tensor._base.shape)}); make it viewless first (make_viewless_tensor)."
        )
    tensor.data = new_data_tensor


# ----------------------------------------------------------------------------- wrapped models
def get_attr_wrapped_model(model, attr: str, allow_none: bool = True, return_model_obj=False):
    """Reads ``attr`` through wrappers (DDP, Float16Module, ...) that hold the model as ``.module``.

    Args:
        model: The outermost wrapper (not a list of model chunks).
        attr: The attribute to find.
        allow_none: Stop at the first object that has ``attr``, even if it is None; otherwise
            keep unwrapping while the value is None.
        return_model_obj: Return the object holding ``attr`` instead of its value.

    Raises:
        RuntimeError: ``model`` is a list, or no wrapper level has ``attr``.
    """
    if isinstance(model, list):
        raise RuntimeError("get_attr_wrapped_model takes one model chunk, got a list")
    while (not hasattr(model, attr)) if allow_none else (getattr(model, attr, None) is None):
        if not hasattr(model, "module"):
            raise RuntimeError(f"get_attr_wrapped_model: no wrapper level has attribute {attr!r}")
        model = model.module
    return model if return_model_obj else getattr(model, attr)


def get_model_config(model):
    """The ``config`` of a (possibly wrapped) model; a wrapper's None config is skipped."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


# ----------------------------------------------------------------------------- logging, NVTX
def log_single_rank(logger: logging.Logger, *args, rank: int = 0, **kwargs) -> None:
    """``logger.log(*args, **kwargs)`` on global rank ``rank`` only (always without distributed)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == rank:
        logger.log(*args, **kwargs)


_nvtx_enabled = False
_nvtx_open_ranges: list[str] = []


def configure_nvtx_profiling(enabled: bool) -> None:
    """Turns :func:`nvtx_range_push` / :func:`nvtx_range_pop` on or off (off by default)."""
    global _nvtx_enabled
    _nvtx_enabled = bool(enabled)


def _caller_path(depth: int = 2) -> str:
    frame = inspect.stack(context=0)[depth]
    module = frame.frame.f_globals.get("__name__", "?")
    return f"{module}.{frame.function}"


def _nvtx_message(msg: Optional[str], suffix: Optional[str]) -> str:
    msg = msg if msg is not None else _caller_path(depth=3)
    return f"{msg}.{suffix}" if suffix is not None else msg


def nvtx_range_push(msg: Optional[str] = None, suffix: Optional[str] = None) -> None:
    """Opens an NVTX range named ``msg`` (default: the caller's ``module.function``) when
    profiling is on (:func:`configure_nvtx_profiling`)."""
    if not _nvtx_enabled:
        return
    msg = _nvtx_message(msg, suffix)
    _nvtx_open_ranges.append(msg)
    torch.cuda.nvtx.range_push(msg)


def nvtx_range_pop(msg: Optional[str] = None, suffix: Optional[str] = None) -> None:
    """Closes the innermost NVTX range, which must be the one named ``msg``.

    Raises:
        RuntimeError: No range is open.
        ValueError: The innermost range has another name (pushes and pops are unbalanced).
    """
    if not _nvtx_enabled:
        return
    msg = _nvtx_message(msg, suffix)
    if not _nvtx_open_ranges:
        raise RuntimeError("nvtx_range_pop: no NVTX range is open")
    innermost = _nvtx_open_ranges.pop()
    if msg != innermost:
        raise ValueError(f"nvtx_range_pop({msg!r}) but the innermost open range is {innermost!r}")
    torch.cuda.nvtx.range_pop()


def deprecate_inference_params(inference_context, inference_params):
    """Maps the deprecated ``inference_params`` argument onto ``inference_context`` (warns)."""
    if inference_context is None and inference_params is not None:
        warnings.warn(
            "`inference_params` is deprecated; pass `inference_context` instead.",
            DeprecationWarning,
            stacklevel=3,
        )
        return inference_params
    return inference_context


# ----------------------------------------------------------------------------- scratch memory
class GlobalMemoryBuffer:
    """Named scratch tensors reused across calls, to avoid an allocation per call.

    ``get_tensor(shape, dtype, name)`` returns a view of the ``(name, dtype)`` buffer, growing it
    when it is too small. Callers must not use two views of one name at the same time.
    """

    def __init__(self):
        self.buffer: dict = {}

    def get_tensor(self, tensor_shape, dtype: torch.dtype, name: str, mem_alloc_context=None):
        """A ``tensor_shape`` view of the ``(name, dtype)`` buffer (on the current CUDA device,
        else the CPU), allocated inside ``mem_alloc_context()`` when it must grow."""
        needed = math.prod(tensor_shape)
        key = (name, dtype)
        if key not in self.buffer or self.buffer[key].numel() < needed:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            with (mem_alloc_context or contextlib.nullcontext)():
                self.buffer[key] = torch.empty(needed, dtype=dtype, device=device)
        return self.buffer[key][:needed].view(*tensor_shape)
