"""The compile boundary: an activation's runtime numbers as one float32 tensor on the device.

Every runtime number of an activation - clamp ``c``, tanh scales ``s_g`` / ``s_l``, linear offset -
reaches compiled code (Inductor graphs, Triton kernels) inside one float32 tensor, ``params``,
never as a Python float (design principle 2, docs/compile-safety.md). This module is the only
place that turns the numbers into that tensor. It imports nothing of the package, so every
layer above it - the upstream callables, the kernels, the entry points - can use it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

# Layout of the ``params`` tensor.
CLAMP, GATE_SCALE, LINEAR_SCALE, OFFSET = range(4)


def spec_params(spec) -> tuple[float, float, float, float]:
    """The runtime numbers of ``spec`` in ``params`` order (unused slots hold 1.0 / 0.0)."""
    return (
        spec.clamp_value if spec.clamp_value is not None else math.inf,
        spec.gate_tanh_scale if spec.gate_tanh_scale is not None else 1.0,
        spec.linear_tanh_scale if spec.linear_tanh_scale is not None else 1.0,
        spec.linear_offset,
    )


_PARAMS_CACHE: dict[tuple, torch.Tensor] = {}
_PARAMS_CACHE_SIZE = 256


def params_tensor(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A float32 tensor holding ``values`` on ``device``, cached per (values, device).

    Caching avoids a host-to-device copy per call, which also keeps the kernels capturable in a
    CUDA graph once a value has been seen.

    Inside a user's ``torch.compile`` region the tensor is built in the traced graph instead, so
    ``fullgraph=True`` holds. ``values`` are Python constants there, never symbolic floats: the
    entry points pass every number through :func:`scalar_argument` or :func:`constant_scalars`,
    and what reaches this function is specialized once more. The value is then part of the graph
    (and of every cache key derived from it) and guarded by Dynamo: a new value recompiles, and
    it can never be served code traced for an earlier one.

    Under a fake-tensor mode (``torch.export``, meta tracing) the tensor is made fresh in that
    mode and never cached: a fake tensor left in the cache would break every later real call.
    """
    if torch.compiler.is_compiling():
        return torch.tensor([_constant(v) for v in values], dtype=torch.float32, device=device)
    tensor = _PARAMS_CACHE.get((values, device))
    if tensor is not None and not _tracing_with_fake_tensors():
        return tensor
    return _make_params_tensor(values, device)


def _make_params_tensor(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    key = (values, device)
    with torch.inference_mode(False), torch.no_grad():
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float32, device=device)
    if not _tracing_with_fake_tensors():
        if len(_PARAMS_CACHE) >= _PARAMS_CACHE_SIZE:
            _PARAMS_CACHE.pop(next(iter(_PARAMS_CACHE)))  # the oldest entry
        _PARAMS_CACHE[key] = tensor
    return tensor


def scalar_argument(name: str, value):
    """The number an entry point's argument ``name`` holds, as a Python float (None stays None).

    Accepts what upstream's entry points compute with: Python and NumPy reals and one-element
    real tensors. Under ``torch.compile`` a symbolic float (a user's float argument that Dynamo
    made dynamic) is specialized to its value with a guard: a symbolic value would otherwise
    reach compiled code where a later value can be served stale code (docs/compile-safety.md).

    Raises:
        TypeError: ``value`` is not a real number (a string, a complex, a tensor of several
            elements or of a non-real dtype); the message names ``name``.
    """
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(
                f"{name} must be a real number, got a tensor of shape {tuple(value.shape)} "
                f"and dtype {value.dtype}."
            )
        return float(value)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__}).")
    return _constant(value) if torch.compiler.is_compiling() else float(value)


def _constant(value: float) -> float:
    # Inside a compile, a symbolic float (one Dynamo made dynamic) is guarded to its value, which
    # turns it into a constant of the graph; a Python float passes unchanged.
    return float(guard_scalar(float(value)))


_SPEC_SCALARS = ("clamp_value", "gate_tanh_scale", "linear_tanh_scale", "linear_offset")


def constant_scalars(spec):
    """``spec`` outside ``torch.compile``; inside it, a copy whose numbers are constants.

    A spec passed into a caller's compiled function carries its numbers as symbolic floats once
    Dynamo sees them change. Specialized here, at the entry point and before any autograd
    Function, they become constants of the caller's graph with a guard, like the floats that
    :func:`scalar_argument` takes: a new value recompiles, and none is ever served stale.
    """
    if not torch.compiler.is_compiling():
        return spec
    values = {name: getattr(spec, name) for name in _SPEC_SCALARS}
    return dataclasses.replace(
        spec, **{name: None if v is None else _constant(v) for name, v in values.items()}
    )


def _tracing_with_fake_tensors() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def check_kernel_args(name: str, args: tuple, kwargs: dict | None = None) -> None:
    """Refuses a Python number among the arguments of a compiled kernel.

    The runtime half of the compile-boundary rule (the static half is
    tools/check_compiled_scalars.py): a number that reaches compiled code as a Python ``int``,
    ``float`` or ``bool`` is traced as a constant or a dynamic scalar and can be served stale
    later. Tensors, None and other objects (structure) pass.

    Raises:
        TypeError: an argument is a Python number; it belongs in :func:`params_tensor`.
    """
    named = list(enumerate(args)) + list((kwargs or {}).items())
    for where, value in named:
        if isinstance(value, int | float | complex):
            raise TypeError(
                f"{name}: argument {where!r} is the Python number {value!r}; a compiled kernel "
                "takes runtime numbers inside a float32 tensor (kernel_params.params_tensor), "
                "never as Python numbers, or a stale value can be served (docs/compile-safety.md)."
            )


def tensor_arguments(fn: Callable) -> Callable:
    """Wraps the compiled function ``fn`` so that every call runs :func:`check_kernel_args`."""

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        check_kernel_args(getattr(fn, "__name__", repr(fn)), args, kwargs)
        return fn(*args, **kwargs)

    return guarded
