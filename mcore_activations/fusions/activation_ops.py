"""The activation kernels as ``torch.library`` custom ops, and the one place a backend is chosen.

Two ops, ``mcore_activations::activation_forward`` and ``mcore_activations::activation_backward``,
stand for the whole kernel family, plus ``activation_backward_in_place``, the backward that writes
the input gradient over its input (``mcore_activations.fusions.in_place``). A user's
``torch.compile`` or ``torch.export`` sees each as one opaque node (its shapes come from the fake
implementations below), so no tracer ever looks at the runtime scalars: they stay inside the
``params`` tensor, and one graph serves every clamp value. The ops are registered with the
low-level ``torch.library.Library`` API: the decorator API (``torch.library.custom_op``) costs
about 10 us more per call in Python, which is a measurable share of a small MoE expert's
activation.

Outside every tracer, on plain tensors, ``run_forward`` / ``run_backward`` call the backend
directly instead of going through the dispatcher (``plain_eager_call`` says when that is
exactly equivalent); the op's host cost is otherwise a large share of a small call.

Backends (``kernel_backend``):

- ``"triton"``: the Triton kernels (``triton_kernels``); the default for CUDA tensors when
  Triton imports. On CPU it needs ``TRITON_INTERPRET=1`` set before the first use (tests).
- ``"inductor"``: the torch reference math compiled by ``torch.compile`` (``activation_kernels``);
  the default elsewhere while megatron's ``jit_fuser`` is ``torch.compile``.
- ``"eager"``: the same reference math, uncompiled; the default when the fuser is disabled.

``MCORE_ACTIVATIONS_BACKEND=<name>`` or :func:`use_kernel_backend` overrides the choice for
debugging and tests. Every backend computes the same float32 math and is tested against the
float64 reference.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Optional

import torch

from mcore_activations import jit
from mcore_activations.fusions import activation_kernels
from mcore_activations.fusions.activation_kernels import KernelVariant

BACKENDS = ("triton", "inductor", "eager")

_ENV_VAR = "MCORE_ACTIVATIONS_BACKEND"
_HAVE_TRITON = importlib.util.find_spec("triton") is not None
# The default for non-CUDA tensors follows megatron's fuser as it was when this module loaded,
# like every other @jit_fuser function in megatron.core.
_DEFAULT_HOST_BACKEND = "inductor" if jit.jit_fuser is torch.compile else "eager"


def _check_backend(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(
            f"{source}={name!r} is not an activation kernel backend; use one of {BACKENDS}."
        )
    if name == "triton" and not _HAVE_TRITON:
        raise ValueError(
            f"{source}='triton' but Triton is not installed; install it (pip install triton) or "
            "choose 'inductor' or 'eager'."
        )
    return name


_override: Optional[str] = (
    _check_backend(os.environ[_ENV_VAR], _ENV_VAR) if os.environ.get(_ENV_VAR) else None
)


def kernel_backend(device: torch.device) -> str:
    """The backend that runs the activation kernels on ``device`` (see the module docstring)."""
    if _override is not None:
        return _override
    if device.type == "cuda" and _HAVE_TRITON:
        return "triton"
    return _DEFAULT_HOST_BACKEND


@contextlib.contextmanager
def use_kernel_backend(name: Optional[str]):
    """Runs the activation kernels on backend ``name`` inside the block (``None``: the default).

    Raises:
        ValueError: ``name`` is not one of :data:`BACKENDS`, or is ``"triton"`` without Triton.
    """
    global _override
    if name is not None:
        _check_backend(name, "backend")
    previous, _override = _override, name
    try:
        yield
    finally:
        _override = previous


def use_compiled_kernels(enabled: bool):
    """``use_kernel_backend("inductor")`` if ``enabled`` else ``use_kernel_backend("eager")``."""
    return use_kernel_backend("inductor" if enabled else "eager")


@functools.cache
def _triton_kernels():
    # Imported on first use: triton.jit reads TRITON_INTERPRET when the kernels are defined.
    from mcore_activations.fusions import triton_kernels

    return triton_kernels


def _forward(backend: str, variant, x, bias, probs, params, out=None) -> torch.Tensor:
    if backend == "triton":
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"the 'triton' activation backend got a {x.device.type} tensor; it runs on CUDA "
                "(or on CPU under TRITON_INTERPRET=1). Choose 'inductor' or 'eager' instead."
            )
        return _triton_kernels().triton_forward(variant, x, bias, probs, params, out=out)
    if backend == "inductor":
        result = activation_kernels.compiled_forward(variant, x, bias, probs, params)
    else:
        result = activation_kernels.forward_math(variant, x, bias, probs, params)
    return result if out is None else out.copy_(result)


def _backward(backend: str, variant, grad, x, bias, probs, params, in_place=False):
    if backend == "triton":
        kernels = _triton_kernels()
        return kernels.triton_backward(variant, grad, x, bias, probs, params, in_place)
    if backend == "inductor":
        return activation_kernels.compiled_backward(variant, grad, x, bias, probs, params, in_place)
    return activation_kernels.backward_math(variant, grad, x, bias, probs, params, in_place)


# ----------------------------------------------------------------------------- custom ops
_STRUCTURE = "str kind, bool gated, bool clamp, bool gate_tanh, bool linear_tanh, int interleave"
_LIB = torch.library.Library("mcore_activations", "DEF")
_LIB.define(
    f"activation_forward(Tensor x, Tensor? bias, Tensor? probs, Tensor params, {_STRUCTURE}) "
    "-> Tensor"
)
_LIB.define(
    f"activation_backward(Tensor grad, Tensor x, Tensor? bias, Tensor? probs, Tensor params, "
    f"{_STRUCTURE}) -> (Tensor, Tensor, Tensor)"
)
# The in-place backward: dx is written over x (declared mutated, so functionalization and the
# version counter see it); it returns the bias and probability gradients only.
_LIB.define(
    f"activation_backward_in_place(Tensor grad, Tensor(a!) x, Tensor? bias, Tensor? probs, "
    f"Tensor params, {_STRUCTURE}) -> (Tensor, Tensor)"
)


def structure_args(variant: KernelVariant) -> tuple:
    """The structural op arguments of ``variant`` (bias / probs presence is the tensors' own)."""
    return (
        variant.kind,
        variant.gated,
        variant.clamp,
        variant.gate_tanh,
        variant.linear_tanh,
        variant.interleave or 0,
    )


@functools.cache
def _variant_of(structure: tuple, has_bias: bool, has_probs: bool) -> KernelVariant:
    kind, gated, clamp, gate_tanh, linear_tanh, interleave = structure
    return KernelVariant(
        kind, gated, clamp, gate_tanh, linear_tanh, has_bias, has_probs, interleave or None
    )


def _variant(bias, probs, *structure):
    return _variant_of(structure, bias is not None, probs is not None)


def _forward_impl(x, bias, probs, params, *structure):
    variant = _variant(bias, probs, *structure)
    return _forward(kernel_backend(x.device), variant, x, bias, probs, params)


def _backward_impl(grad, x, bias, probs, params, *structure):
    variant = _variant(bias, probs, *structure)
    dx, dbias, dprobs = _backward(kernel_backend(x.device), variant, grad, x, bias, probs, params)
    # An op returns tensors only: an absent gradient travels as an empty tensor.
    return dx, _or_empty(dbias, x), _or_empty(dprobs, x)


def _backward_in_place_impl(grad, x, bias, probs, params, *structure):
    variant = _variant(bias, probs, *structure)
    backend = kernel_backend(x.device)
    _, dbias, dprobs = _backward(backend, variant, grad, x, bias, probs, params, True)
    return _or_empty(dbias, x), _or_empty(dprobs, x)


def _or_empty(t: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0)


def _forward_fake(x, bias, probs, params, kind, gated, *structure):
    return x.new_empty((x.shape[0], x.shape[1] // 2 if gated else x.shape[1]))


def _backward_fake(grad, x, bias, probs, params, *structure):
    dbias = torch.empty_like(bias) if bias is not None else x.new_empty(0)
    dprobs = torch.empty_like(probs) if probs is not None else x.new_empty(0)
    return torch.empty_like(x), dbias, dprobs


def _backward_in_place_fake(grad, x, bias, probs, params, *structure):
    dbias = torch.empty_like(bias) if bias is not None else x.new_empty(0)
    dprobs = torch.empty_like(probs) if probs is not None else x.new_empty(0)
    return dbias, dprobs


for _key in ("CPU", "CUDA"):
    _LIB.impl("activation_forward", _forward_impl, _key)
    _LIB.impl("activation_backward", _backward_impl, _key)
    _LIB.impl("activation_backward_in_place", _backward_in_place_impl, _key)
torch.library.register_fake("mcore_activations::activation_forward", _forward_fake, lib=_LIB)
torch.library.register_fake("mcore_activations::activation_backward", _backward_fake, lib=_LIB)
torch.library.register_fake(
    "mcore_activations::activation_backward_in_place", _backward_in_place_fake, lib=_LIB
)

activation_forward_op = torch.ops.mcore_activations.activation_forward.default
activation_backward_op = torch.ops.mcore_activations.activation_backward.default
activation_backward_in_place_op = torch.ops.mcore_activations.activation_backward_in_place.default


def plain_eager_call(*tensors) -> bool:
    """True when calling a backend directly is indistinguishable from calling the op.

    That holds for plain tensors outside every tracer: no torch.compile / export trace, no
    dispatch mode (fake tensors, FX proxies, functionalization, user modes) and no functorch
    transform (vmap, grad). Then the op would only forward to the same implementation, and its
    dispatch costs about as much as a small expert's kernel (docs/bench/history.md). Everything
    else goes through the op, which is what tracers and tensor subclasses see.
    """
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


def run_forward(variant: KernelVariant, x, bias, probs, params) -> torch.Tensor:
    """The forward op on a 2-D ``x`` (``probs`` ``[rows, 1]`` or None)."""
    if plain_eager_call(x, bias, probs, params):
        return _forward(kernel_backend(x.device), variant, x, bias, probs, params)
    return activation_forward_op(x, bias, probs, params, *structure_args(variant))


def run_forward_into(variant: KernelVariant, x, bias, probs, params, out) -> torch.Tensor:
    """:func:`run_forward` writing into ``out`` (contiguous ``[rows, F]``, ``x``'s dtype).

    The Triton kernels store straight into ``out``; the other backends, and calls a tracer or a
    tensor subclass sees, compute a new tensor and copy it over.
    """
    if plain_eager_call(x, bias, probs, params, out):
        return _forward(kernel_backend(x.device), variant, x, bias, probs, params, out)
    return out.copy_(run_forward(variant, x, bias, probs, params))


def run_backward(variant: KernelVariant, grad, x, bias, probs, params):
    """The backward op: ``(dx, dbias or None, dprobs or None)``."""
    if plain_eager_call(grad, x, bias, probs, params):
        return _backward(kernel_backend(x.device), variant, grad, x, bias, probs, params)
    dx, dbias, dprobs = activation_backward_op(
        grad, x, bias, probs, params, *structure_args(variant)
    )
    return dx, dbias if bias is not None else None, dprobs if probs is not None else None


def run_backward_in_place(variant: KernelVariant, grad, x, bias, probs, params):
    """The in-place backward op on a contiguous 2-D ``x``: ``(x, dbias or None, dprobs or None)``
    with the input gradient written over ``x``, whose version counter is then bumped (a later
    read of ``x`` saved by another autograd node fails instead of seeing the gradient)."""
    version = x._version
    if plain_eager_call(grad, x, bias, probs, params):
        _, dbias, dprobs = _backward(
            kernel_backend(x.device), variant, grad, x, bias, probs, params, True
        )
    else:
        dbias, dprobs = activation_backward_in_place_op(
            grad, x, bias, probs, params, *structure_args(variant)
        )
        dbias, dprobs = dbias if bias is not None else None, dprobs if probs is not None else None
    if x._version == version:  # the Triton kernels write through a pointer autograd never sees
        torch.autograd.graph.increment_version(x)
    return x, dbias, dprobs
