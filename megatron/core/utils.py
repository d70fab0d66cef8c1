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

from mcore_activations.te_import import is_te_min_version  # noqa: F401 - upstream name
from mcore_activations.te_import import te_version as get_te_version  # noqa: F401 - upstream name
from mcore_activations.versions import (  # noqa: F401 - upstream names
    get_torch_version,
    is_torch_min_version,
)
from megatron.core.parallel_state_ranks import (
    get_data_parallel_rank,
    get_tensor_model_parallel_rank,
)
from megatron.core.parallel_state_store import group_of
from megatron.core.parallel_state_store import is_initialized as parallel_state_is_initialized

# parallel_state imports this module (GlobalMemoryBuffer), so the parallel-state lookups here come
# from the two modules below it, which read the same tables: no import cycle, same answers.


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
    # The group's own method, as upstream: any object with size() / rank() serves as a group.
    return group.size()


def get_pg_rank(group=None) -> int:
    """Returns this rank's index in ``group``; 0 without ``torch.distributed`` or a group."""
    if group is None or not torch.distributed.is_initialized():
        return 0
    return group.rank()


def get_tensor_model_parallel_group_if_none(tp_group=None, is_expert=False, check_initialized=True):
    """Returns ``tp_group``, or the global (expert) tensor-parallel group when it is None.

    Passing the group explicitly is preferred; falling back to ``parallel_state`` is deprecated
    upstream and warns once. Without ``torch.distributed``, or before ``parallel_state`` is
    initialized, there is no group and None comes back.

    Args:
        tp_group: The group to use, if the caller has one.
        is_expert: Fall back to the expert-tensor-parallel group instead.
        check_initialized: Raise if ``parallel_state`` has no such group yet.
    """
    if not torch.distributed.is_initialized():
        return None
    if tp_group is not None:
        return tp_group
    if not parallel_state_is_initialized():
        # As upstream: before initialize_model_parallel (e.g. a layer built in a process that
        # has a default group only) the layer gets no group and runs on this rank alone.
        return None

    if torch.distributed.get_rank() == 0:
        warnings.warn(
            "No tensor-parallel group was passed; using the global one from parallel_state. "
            "Pass tp_group= (or pg_collection=) explicitly.",
            DeprecationWarning,
            stacklevel=2,
        )
    # The same lookup as parallel_state.get_(expert_)tensor_(model_)parallel_group.
    return group_of("expt-tp" if is_expert else "tp", check_initialized)


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


logger = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------- small upstream helpers
def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Asserts that ``numerator`` is divisible by ``denominator`` (AssertionError, as upstream)."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"


def round_up_to_nearest_multiple(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def null_decorator(*args, **kwargs):
    """A decorator that changes nothing, usable bare (``@null_decorator``) or with arguments."""
    if not kwargs and len(args) == 1 and callable(args[0]):
        return args[0]
    return lambda func: func


def accepts_parameter(func: Callable, name: str) -> bool:
    """Whether ``func`` takes a parameter called ``name`` (or any keyword, via ``**kwargs``)."""
    return any(
        p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD
        for p in inspect.signature(func).parameters.values()
    )


def is_submodule(module, parent_module, strict: bool = True) -> bool:
    """Whether ``module`` is ``parent_module`` or inside it (``strict``: not the parent itself)."""
    if strict and module is parent_module:
        return False
    return any(m is module for m in parent_module.modules())


# Wrapper classes unwrap_model strips by default. The wrappers register themselves where they
# are defined (transformer.module adds Float16Module), so this module imports none of them.
_MODEL_WRAPPER_CLASSES: list[type] = []


def unwrap_model(model, module_instances=None):
    """Strips wrapper modules (each keeps the wrapped model in ``.module``).

    Args:
        model: A module or a list of modules.
        module_instances: Wrapper classes to strip; default: this fork's wrappers
            (``Float16Module``).

    Returns:
        The unwrapped module, or a list of them for a list.
    """
    if module_instances is None:
        module_instances = tuple(_MODEL_WRAPPER_CLASSES)
    models = model if isinstance(model, list) else [model]
    unwrapped = []
    for module in models:
        while isinstance(module, module_instances):
            module = module.module
        unwrapped.append(module)
    return unwrapped if isinstance(model, list) else unwrapped[0]


def get_model_type(model):
    """The ``model_type`` attribute of a (possibly wrapped) model."""
    return get_attr_wrapped_model(model, "model_type")


def get_model_xattn(model) -> bool:
    """The ``xattn_needed`` attribute of a (possibly wrapped) model; False when it has none."""
    try:
        return get_attr_wrapped_model(model, "xattn_needed")
    except RuntimeError:
        return False


def assert_viewless_tensor(tensor, extra_msg: Optional[str] = None):
    """Asserts that ``tensor`` (or each tensor of a list) is not a view; returns it.

    A view kept in a buffer or assigned through ``.data`` keeps its base alive: a memory leak.
    """
    if isinstance(tensor, list):
        for item in tensor:
            assert_viewless_tensor(item, extra_msg)
        return tensor
    if isinstance(tensor, torch.Tensor):
        assert tensor._base is None, (
            "Ensure tensor._base is None before setting tensor.data or storing the tensor in a "
            f"memory buffer; a view keeps its base alive (a memory leak). {extra_msg}"
        )
    return tensor


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def to_local_if_dtensor(tensor):
    """This rank's shard of a ``DTensor``; any other tensor unchanged."""
    dtensor = _dtensor_class()
    with torch.no_grad():
        return tensor.to_local() if dtensor and isinstance(tensor, dtensor) else tensor


def get_data_parallel_group_if_dtensor(tensor, data_parallel_group=None):
    """The process group of a ``DTensor``'s device mesh, or None for a plain tensor.

    Raises:
        AssertionError: ``data_parallel_group`` is given and is not the mesh's group.
    """
    dtensor = _dtensor_class()
    if dtensor and isinstance(tensor, dtensor):
        group = tensor.device_mesh.get_group()
        assert data_parallel_group is None or group == data_parallel_group
        return group
    return None


def get_pg_src_rank(group=None) -> int:
    """The global rank of ``group``'s first member (0 without a group or distributed)."""
    if group is None or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_process_group_ranks(group)[0]


def log_on_each_pipeline_stage(
    logger: logging.Logger, level: int, msg, *args, tp_group=None, dp_cp_group=None, **kwargs
) -> None:
    """Logs once per pipeline stage: on the rank that is first in its tensor- and data x
    context-parallel groups (the given ones, or ``parallel_state``'s).

    Raises:
        ValueError: Only one of ``tp_group`` and ``dp_cp_group`` is given.
    """
    assert torch.distributed.is_initialized()
    if (tp_group is None) != (dp_cp_group is None):
        raise ValueError("tp_group and dp_cp_group must be provided or not provided together")
    if not logger.isEnabledFor(level):
        return
    if tp_group is None:
        first = get_tensor_model_parallel_rank() == 0 and (
            get_data_parallel_rank(with_context_parallel=True) == 0
        )
    else:
        first = tp_group.rank() == 0 and dp_cp_group.rank() == 0
    if first:
        logger.log(level, msg, *args, **kwargs)


_ASYNC_IO_LOOP = None


def get_asyncio_loop(loop=None):
    """``loop``, else the running event loop, else one process-wide loop created on first use."""
    import asyncio

    global _ASYNC_IO_LOOP
    if loop is not None:
        return loop
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        if _ASYNC_IO_LOOP is None:
            _ASYNC_IO_LOOP = asyncio.new_event_loop()
            asyncio.set_event_loop(_ASYNC_IO_LOOP)
        return _ASYNC_IO_LOOP


@functools.cache
def _installed_version(import_name: str, distribution: str):
    # The module's own __version__ wins (editable or vendored builds); else the pip metadata.
    from importlib.metadata import version

    from packaging.version import Version

    module = __import__(import_name)
    return Version(str(getattr(module, "__version__", None) or version(distribution)))


def _min_version(import_name: str, distribution: str, wanted: str, check_equality: bool) -> bool:
    from packaging.version import Version

    installed = _installed_version(import_name, distribution)
    return installed >= Version(wanted) if check_equality else installed > Version(wanted)


def get_fa_version():
    """The installed flash-attn version (ImportError when it is not installed)."""
    return _installed_version("flash_attn", "flash-attn")


def is_fa_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether flash-attn is at least ``version`` (strictly newer without ``check_equality``)."""
    return _min_version("flash_attn", "flash-attn", version, check_equality)


def get_mamba_version():
    """The installed mamba_ssm version (ImportError when it is not installed)."""
    return _installed_version("mamba_ssm", "mamba_ssm")


def is_mamba_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether mamba_ssm is at least ``version``."""
    return _min_version("mamba_ssm", "mamba_ssm", version, check_equality)


def get_causal_conv1d_version():
    """The installed causal_conv1d version (ImportError when it is not installed)."""
    return _installed_version("causal_conv1d", "causal_conv1d")


def is_causal_conv1d_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether causal_conv1d is at least ``version``."""
    return _min_version("causal_conv1d", "causal_conv1d", version, check_equality)


def get_flashinfer_version():
    """The installed flashinfer version (ImportError when it is not installed)."""
    return _installed_version("flashinfer", "flashinfer-python")


def is_flashinfer_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether flashinfer is at least ``version``."""
    return _min_version("flashinfer", "flashinfer-python", version, check_equality)


def get_emerging_optimizers_version():
    """The installed emerging_optimizers version (ImportError when it is not installed)."""
    return _installed_version("emerging_optimizers", "emerging_optimizers")


def is_emerging_optimizers_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether emerging_optimizers is at least ``version``."""
    return _min_version("emerging_optimizers", "emerging_optimizers", version, check_equality)


# ------------------------------------------------------------------- API lifecycle markers
class ExperimentalNotEnabledError(Exception):
    """An experimental API was called while ``megatron.core.config.ENABLE_EXPERIMENTAL`` is off."""


def _require_experimental(name: str) -> None:
    from megatron.core import config

    if config.is_experimental_enabled() is not True:
        raise ExperimentalNotEnabledError(
            f"{name} is experimental and config.ENABLE_EXPERIMENTAL is not enabled; call "
            "megatron.core.config.set_experimental_flag(True) to use it."
        )


def experimental_fn(introduced_with_version: str):
    """Marks a function experimental: calling it needs the experimental flag.

    Args:
        introduced_with_version: The megatron-core version that introduced it (recorded).

    Raises:
        ExperimentalNotEnabledError: At call time, when the flag is off.
    """

    def decorate(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            _require_experimental(func.__qualname__)
            return func(*args, **kwargs)

        wrapper._experimental_since = introduced_with_version
        return wrapper

    return decorate


def experimental_cls(introduced_with_version: str):
    """Marks a class experimental: creating an instance needs the experimental flag.

    Args:
        introduced_with_version: The megatron-core version that introduced it (recorded).

    Raises:
        ExperimentalNotEnabledError: At construction, when the flag is off.
    """

    def decorate(cls):
        original_init = cls.__init__

        @functools.wraps(original_init)
        def __init__(self, *args, **kwargs):
            _require_experimental(cls.__qualname__)
            original_init(self, *args, **kwargs)

        cls.__init__ = __init__
        cls._experimental_since = introduced_with_version
        return cls

    return decorate


def internal_api(func):
    """Marks a function or class as internal (``_internal_api = True``); behaviour unchanged."""
    func._internal_api = True
    return func


def experimental_api(func):
    """Marks a function or class as experimental API (``_experimental_api = True``); behaviour
    unchanged (unlike :func:`experimental_fn`, no flag is needed)."""
    func._experimental_api = True
    return func


def deprecated(
    version: str,
    removal_version: Optional[str] = None,
    alternative: Optional[str] = None,
    reason: Optional[str] = None,
):
    """Marks a function deprecated: each call warns with ``DeprecationWarning``.

    Args:
        version: The version that deprecated it.
        removal_version: The version that will remove it.
        alternative: What to use instead.
        reason: Why.
    """

    def decorate(func):
        func._deprecated = True
        func._deprecated_version = version
        func._removal_version = removal_version
        func._alternative = alternative
        func._deprecation_reason = reason
        parts = [f"{func.__name__} is deprecated since version {version}."]
        if alternative:
            parts.append(f"Use {alternative} instead.")
        if removal_version:
            parts.append(f"Will be removed in version {removal_version}.")
        if reason:
            parts.append(f"Reason: {reason}")
        message = " ".join(parts)

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return func(*args, **kwargs)

        return wrapper

    return decorate


def deprecate_args(
    *deprecated_keys: str,
    message: str = "Argument '{name}' has been deprecated and should not be used.",
):
    """Makes a function refuse the named keyword arguments with ``TypeError(message)``.

    Args:
        *deprecated_keys: The refused argument names.
        message: The error message; ``{name}`` is replaced by the argument's name.
    """

    def decorate(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            for key in deprecated_keys:
                if key in kwargs:
                    raise TypeError(message.format(name=key))
            return func(*args, **kwargs)

        return wrapper

    return decorate


def nvtx_decorator(message: Optional[str] = None):
    """Wraps a function in an NVTX range (``message``, default its ``module.qualname``).

    Whether profiling is on is read at call time (:func:`configure_nvtx_profiling`), so the
    decorator can be applied at import.
    """

    def decorate(func):
        name = message or f"{func.__module__}.{func.__qualname__}"

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            nvtx_range_push(name)
            try:
                return func(*args, **kwargs)
            finally:
                nvtx_range_pop(name)

        return wrapper

    return decorate


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
