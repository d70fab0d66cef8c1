"""The Triton activation kernels' entry points and their launcher (the kernel layer on CUDA).

``triton_forward`` and ``triton_backward`` run one activation call on CUDA tensors (or on CPU
tensors under ``TRITON_INTERPRET=1``): they allocate the outputs and the partial sums, take the
launch plan from ``triton_plans`` and launch ``triton_jit``'s kernels through :class:`_Launcher`,
which caches each compiled kernel and calls it directly. This module is the seam the custom ops
(``activation_ops``) and the tools import; ``triton_plans.LaunchOptions`` is how a benchmark runs
them with other launch plans.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
import triton

from mcore_activations.fusions import triton_plans as plans
from mcore_activations.fusions.triton_jit import (
    _activation_bwd_kernel,
    _activation_fwd_kernel,
    _unary_bwd_flat_kernel,
    _unary_fwd_flat_kernel,
)
from mcore_activations.fusions.triton_plans import DEFAULT_OPTIONS, LaunchOptions, cdiv


def _contiguous(*tensors):
    # The kernels index rows as ``row * width``; contiguous() is free for the usual inputs.
    return tuple(t.contiguous() if t is not None else None for t in tensors)


def _device_guard(x: torch.Tensor):
    # Triton launches on the current CUDA device; an input on another device needs a guard.
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return _NO_GUARD


_NO_GUARD = contextlib.nullcontext()  # reusable: it holds no state


# ROCm stays on Triton's entry point: its AMD backend also specialises a pointer on whether the
# tensor's storage fits buffer instructions (2 GiB), which the launcher's key does not model.
_DIRECT_LAUNCH = (
    os.environ.get("MCORE_ACTIVATIONS_TRITON_DIRECT_LAUNCH", "1") != "0" and not torch.version.hip
)
# Triton's launch hooks (profilers such as proton install them), or None before Triton had knobs.
_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)


def _int_key(n: int) -> tuple[bool, bool, bool]:
    # What Triton specialises an integer argument on: == 1, divisible by 16, 64-bit. (Triton
    # also tells negative values below -2**31 and unsigned ones of 2**63 or more apart; the
    # kernels' integers are sizes and counts, never either.)
    return n == 1, n % 16 == 0, n >= 2**31


def _unspecialised_arguments(kernel) -> set[str]:
    # The names the kernel's @triton.jit(do_not_specialize=...) lists: Triton keeps them on the
    # JIT function, the interpreter (TRITON_INTERPRET=1) among the decorator's keyword arguments.
    listed = getattr(kernel, "do_not_specialize", None)
    if listed is None:
        listed = getattr(kernel, "kwargs", {}).get("do_not_specialize")
    names = list(kernel.arg_names)
    return {names[i] if isinstance(i, int) else i for i in listed or ()}


def _no_launch_hooks() -> bool:
    # A hook chain with nothing in it, or no hook: the compiled kernel's launcher then needs no
    # launch metadata (Triton builds it on every launch when the chain exists at all).
    if _RUNTIME_KNOBS is None:
        return False
    for hook in (_RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


class _Launcher:
    """Runs a ``@triton.jit`` kernel; repeated calls launch its compiled binary directly.

    ``kernel[grid](...)`` re-derives Triton's specialisation key from every argument in Python on
    each call, and the compiled kernel's own ``[grid]`` entry asks for the current device and
    stream and builds launch metadata for hooks nobody set: together about 20 of the 30 us a
    launch costs on the H200 host, where a small MoE expert's activation takes 10-20 us on the
    GPU. The first call of each specialisation goes through Triton (compiling if needed) and keeps
    the compiled kernel under a key made of what Triton specialises on (device, the plan's
    compile-time values, each pointer's dtype and 16-byte alignment, each integer's value class,
    or only its width for the kernel's ``do_not_specialize`` integers); later calls with the same
    key call its launcher with the current stream and raw pointers, which Triton's C launcher
    takes as they are instead of asking the driver about each tensor. Tensors on another device
    than the first are refused first: a raw pointer is not checked downstream. Where launch hooks
    are set (a profiler's, which may also instrument the code it compiles), every launch goes
    through Triton's own entry point, which compiles for them and calls them.
    ``MCORE_ACTIVATIONS_TRITON_DIRECT_LAUNCH=0`` turns all this off (every call goes through
    Triton), as does ROCm.
    """

    def __init__(self, kernel):
        names = list(kernel.arg_names)
        self.kernel = kernel
        self.names = [name.removesuffix("_ptr") for name in names]  # for error messages
        unspecialised = _unspecialised_arguments(kernel)
        self.unspecialised = frozenset(i for i, name in enumerate(names) if name in unspecialised)
        self.compiled: dict = {}

    def __call__(self, grid, tensors: tuple, ints: tuple, plan: plans.LaunchPlan) -> None:
        """Launches over ``grid`` with the kernel's pointer arguments ``tensors`` (None where
        absent), then its integer arguments ``ints``, then the plan's compile-time values."""
        global _DIRECT_LAUNCH
        device = tensors[0].get_device()
        pointers, tensor_key = [], []
        for i, t in enumerate(tensors):
            if t is None:
                pointers.append(None)
                tensor_key.append(None)
                continue
            if t.get_device() != device:
                raise RuntimeError(
                    f"the activation kernel's {self.names[i]} is on {t.device} but its "
                    f"{self.names[0]} is on {tensors[0].device}; move them to one CUDA device."
                )
            pointer = t.data_ptr()
            pointers.append(pointer)
            tensor_key.append((t.dtype, pointer % 16 == 0))
        first_int = len(tensors)
        int_key = tuple(
            n >= 2**31 if first_int + i in self.unspecialised else _int_key(n)
            for i, n in enumerate(ints)
        )
        options = plan[2]
        key = (device, plan[3], options["num_warps"], options.get("maxnreg"))
        key += (tuple(tensor_key), int_key)
        direct = _DIRECT_LAUNCH and _no_launch_hooks()
        compiled = self.compiled.get(key) if direct else None
        if compiled is not None:
            try:
                # Positional in signature order, as Triton's own launch passes them: runtime
                # arguments, then the compile-time values (which its launcher skips).
                compiled.run(
                    *grid,
                    torch._C._cuda_getCurrentRawStream(device),
                    compiled.function,
                    compiled.packed_metadata,
                    None,  # no launch metadata and no enter / exit hooks
                    None,
                    None,
                    *pointers,
                    *ints,
                    *plan[3],
                )
                return
            except (TypeError, AttributeError):
                # A Triton whose compiled kernels launch differently: the launch was refused
                # before any kernel ran, so go through Triton's own entry point, now and from
                # here on.
                _DIRECT_LAUNCH = False
        compiled = self.kernel[grid](*tensors, *ints, **options)
        if direct and _DIRECT_LAUNCH and isinstance(compiled, triton.compiler.CompiledKernel):
            # Triton 3.7's launcher reads as many arguments as the signature has without
            # counting them: a launch that passed fewer would read past them, not fail.
            assert len(tensors) + len(ints) + len(plan[3]) == len(self.names), self.names
            self.compiled[key] = compiled


_forward_launcher = _Launcher(_activation_fwd_kernel)
_flat_launcher = _Launcher(_unary_fwd_flat_kernel)
_flat_backward_launcher = _Launcher(_unary_bwd_flat_kernel)
_backward_launcher = _Launcher(_activation_bwd_kernel)


def triton_forward(
    v,
    x,
    bias,
    probs,
    params,
    *,
    options: LaunchOptions = DEFAULT_OPTIONS,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Forward of a kernel variant on a contiguous 2-D input.

    Args:
        v: the :class:`~mcore_activations.fusions.activation_kernels.KernelVariant`.
        x: the input, ``[rows, 2F]`` for a GLU, else ``[rows, F]``.
        bias: the bias of ``x``'s width, or None.
        probs: the per-row probabilities ``[rows, 1]``, or None.
        params: the float32 parameter tensor (``kernel_params``) on ``x``'s device.
        options: the launch plans' numbers; production passes none.
        out: a contiguous ``[rows, F]`` tensor of ``x``'s dtype to write the activation into
            (the output recompute hands it the tensor fc2 will read); None allocates one.

    Returns:
        The activation, ``[rows, F]`` in ``x``'s dtype (``out`` when given).
    """
    x, bias, probs = _contiguous(x, bias, probs)
    rows, width = x.shape
    F = width // 2 if v.gated else width
    if out is None:
        out = torch.empty((rows, F), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if plans.uses_flat_kernel(v, False, options):
        n = rows * F
        plan = plans.flat_plan(v, False, n, x.element_size(), options)
        with _device_guard(x):
            _flat_launcher((cdiv(n, plan[0]), 1, 1), (x, bias, probs, params, out), (n, F), plan)
        return out
    plan = plans.forward_plan(v, F, x.element_size(), options)
    grid = plans.tile_grid(cdiv(rows, plan[0]), cdiv(F, plan[1]), plan)
    with _device_guard(x):
        _forward_launcher(grid, (x, bias, probs, params, out), (rows, F), plan)
    return out


def triton_backward(
    v,
    grad,
    x,
    bias,
    probs,
    params,
    in_place: bool = False,
    *,
    options: LaunchOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Backward of a kernel variant: ``(dx, dbias or None, dprobs or None)``, dx laid out as x.

    With ``in_place`` the kernels write ``dx`` over ``x`` (which must be contiguous) and return
    ``x``. Both kernels allow it: every input element is read only by the program that writes
    its gradient (a GLU's output column maps to one gate and one linear input column, and row
    ranges are split between programs), that program loads a tile before it stores the tile's
    gradients, and what it loads ahead (the next trip's rows, or Triton's pipelined stages) are
    rows it has not written yet. The bias and probability gradients are reduced from values in
    registers, never read back from ``dx``. So the same code computes the same bits either way.

    Args:
        v: the :class:`~mcore_activations.fusions.activation_kernels.KernelVariant`.
        grad: the output gradient, ``[rows, F]``.
        x, bias, probs, params: the forward's inputs (see :func:`triton_forward`).
        in_place: write ``dx`` over ``x``.
        options: the launch plans' numbers; production passes none.

    Returns:
        ``(dx, dbias, dprobs)``; ``dbias`` / ``dprobs`` are None without a bias / probabilities.

    Raises:
        ValueError: ``in_place`` with a non-contiguous ``x``.
    """
    if in_place and not x.is_contiguous():
        raise ValueError(
            f"an in-place activation backward needs a contiguous input; got strides "
            f"{x.stride()} for shape {tuple(x.shape)} (make it contiguous first)."
        )
    grad, x, bias, probs = _contiguous(grad, x, bias, probs)
    rows, width = x.shape
    F = width // 2 if v.gated else width
    dx = x if in_place else torch.empty_like(x)
    if rows == 0:
        dbias = torch.zeros_like(bias) if bias is not None else None
        dprobs = torch.zeros_like(probs) if probs is not None else None
        return dx, dbias, dprobs
    if plans.uses_flat_kernel(v, True, options):
        n = rows * F
        plan = plans.flat_plan(v, True, n, x.element_size(), options)
        with _device_guard(x):
            _flat_backward_launcher((cdiv(n, plan[0]), 1, 1), (grad, x, params, dx), (n,), plan)
        return dx, None, None
    return _tiled_backward(v, grad, x, bias, probs, params, dx, options)


def _tiled_backward(v, grad, x, bias, probs, params, dx, options):
    # The tiled kernel's launch: the row split, the partial-sum buffers and their sums.
    rows, width = x.shape
    F = width // 2 if v.gated else width
    itemsize = x.element_size()
    plan = plans.backward_plan(v, F, itemsize, options)
    # An aligned plan's split is a multiple of 16 (row_split), which its kernel relies on.
    col_blocks, rows_per_program, row_programs = plans.row_split(
        v, rows, F, plan, itemsize, options
    )
    dbias_part = None
    if v.has_bias:
        dbias_part = torch.empty((row_programs, width), dtype=torch.float32, device=x.device)
    # Per-column-block partial sums of the probability gradient, [col_blocks, rows, 1]. With one
    # column block the kernel writes the finished [rows, 1] gradient and no index, sum or cast
    # follows: each costs microseconds of host time, a share of a small expert's call.
    dprobs_part = None
    if v.has_probs:
        part_shape = (rows, 1) if col_blocks == 1 else (col_blocks, rows, 1)
        dprobs_part = torch.empty(part_shape, dtype=torch.float32, device=x.device)
    tensors = (grad, x, bias, probs, params, dx, dbias_part, dprobs_part)
    grid = plans.tile_grid(row_programs, col_blocks, plan)
    with _device_guard(x):
        _backward_launcher(grid, tensors, (rows, F, rows_per_program), plan)
    dbias = dbias_part.sum(dim=0).to(bias.dtype) if v.has_bias else None
    dprobs = None
    if v.has_probs:
        dprobs = dprobs_part if col_blocks == 1 else dprobs_part.sum(dim=0)
        if dprobs.dtype != probs.dtype:
            dprobs = dprobs.to(probs.dtype)
    return dx, dbias, dprobs
