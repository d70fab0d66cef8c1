"""Fused activation: autograd.Function and functional API over the activation ops.

``fused_activation(x, spec, bias=..., probs=...)`` computes ``spec`` (an ``ActivationSpec``) in
one fused forward kernel and one fused backward kernel, through the custom ops of
``activation_ops`` (which pick the backend: Triton on CUDA). The upstream-named entry points
(``bias_swiglu_impl``, ``weighted_bias_swiglu_impl``, ``weighted_bias_quick_geglu_impl``,
``bias_geglu_impl``, ``bias_gelu_impl``, ``weighted_squared_relu_impl``) and the MLP / expert
fused paths all come here, so they share one implementation per activation.

With the in-place backward option (``in_place_backward``, :mod:`.in_place`) the backward writes
the input gradient over the saved input; the rules that keep that safe are applied here, around
the autograd Function: refused in the forward or the backward where it is unsafe, and run out of
place where it would save nothing (no input gradient wanted, a double backward, a traced graph).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from mcore_activations.activation_spec import (
    ActivationKind,
    ActivationSpec,
    UnsupportedActivationError,
)
from mcore_activations.fusions import in_place
from mcore_activations.fusions.activation_kernels import (
    KernelVariant,
    backward_math,
    forward_math,
    params_tensor,
    spec_params,
)
from mcore_activations.fusions.activation_ops import (
    plain_eager_call,
    run_backward,
    run_backward_in_place,
    run_forward,
    run_forward_into,
)
from mcore_activations.kernel_params import constant_scalars

FP8_STORE_DTYPE = torch.float8_e4m3fn


def activation_forward(
    spec: ActivationSpec,
    x,
    bias=None,
    probs=None,
    *,
    eager: bool = False,
    in_place_backward: Optional[bool] = False,
) -> torch.Tensor:
    """Forward of ``spec`` on any-rank ``x``; ``probs`` has one value per row.

    Differentiable, like the ``@jit_fuser`` functions upstream names this way: with gradients
    required it runs through :class:`FusedActivationFunction` (the fused backward kernel),
    otherwise straight through the forward op. ``eager=True`` runs the torch reference math
    instead (the eager twin of the compiled entry points; autograd differentiates it). The
    inputs are checked first (:func:`check_inputs`), as in every public entry point.
    ``in_place_backward``: as in :func:`fused_activation`, but off by default, not the process
    default: upstream's raw functions are plain differentiable functions whose backward leaves
    their input alone, and callers rely on it (Megatron's JIT warmup runs ``bias_swiglu`` and
    ``bias_gelu`` on leaf tensors that want a gradient, which an in-place backward refuses).
    """
    spec = constant_scalars(spec)
    check_inputs(spec, x, bias, probs)
    write_over_input = in_place.resolve(in_place_backward)
    if not eager and torch.is_grad_enabled() and _any_requires_grad(x, bias, probs):
        return _apply_fused(spec, x, bias, probs, False, False, write_over_input)
    return _forward_no_autograd(spec, x, bias, probs, eager)


def _apply_fused(
    spec, x, bias, probs, fp8_input_store, cpu_offload_input, in_place_backward, plan=None
):
    # The rows are flattened outside the autograd Function, as upstream's impls do: an output
    # reshaped inside it would be a view made in a custom Function, and autograd refuses in-place
    # ops on those (``bias_swiglu_impl(x3d, None).mul_(2)``).
    x2d, probs2d = _flatten(x, probs)
    out = FusedActivationFunction.apply(
        x2d, bias, probs2d, spec, fp8_input_store, cpu_offload_input, in_place_backward, plan
    )
    return out if x2d is x else _unflatten(out, x.shape)


def _kernel_args(spec, plan, x, bias, probs):
    """The kernel variant and ``params`` of a call: derived from ``spec``, or read from ``plan``
    (a ``kernel_plan.KernelPlan`` of ``spec``) where the caller built one."""
    if plan is not None:
        return plan.variant(bias, probs), plan.params(x.device)
    variant = KernelVariant.of(spec, has_bias=bias is not None, has_probs=probs is not None)
    return variant, params_tensor(spec_params(spec), x.device)


def fused_activation_into(plan, out, x, bias=None, probs=None) -> torch.Tensor:
    """Writes the forward of ``plan.spec`` on ``x`` into ``out``, without autograd.

    For the output recompute, which computes in fc2's backward the output fc2 saved a recipe
    of: the same kernel and the same bits as the forward that made it (the inputs were checked
    then).

    Args:
        plan: The layer's ``kernel_plan.KernelPlan``.
        out: A contiguous tensor shaped and typed as the forward's output.
        x, bias, probs: The forward's inputs.

    Returns:
        ``out``.
    """
    variant, params = _kernel_args(plan.spec, plan, x, bias, probs)
    x2d, probs2d = _flatten(x, probs)
    with torch.no_grad():
        run_forward_into(variant, x2d, bias, probs2d, params, out.view(x2d.shape[0], -1))
    return out


def _forward_no_autograd(spec, x, bias, probs, eager=False, plan=None):
    variant, params = _kernel_args(spec, plan, x, bias, probs)
    x2d, probs2d = _flatten(x, probs)
    fn = forward_math if eager else run_forward
    out = fn(variant, x2d, bias, probs2d, params)
    return out.view(*x.shape[:-1], out.shape[-1])


def activation_backward(spec: ActivationSpec, grad, x, bias=None, probs=None, *, eager=False):
    """Raw backward kernel on any-rank inputs: ``(dx, dbias or None, dprobs or None)``.

    Checks its inputs as :func:`activation_forward` does, and ``grad`` against the output shape.
    """
    spec = constant_scalars(spec)
    check_inputs(spec, x, bias, probs)
    check_grad(spec, grad, x)
    variant = KernelVariant.of(spec, has_bias=bias is not None, has_probs=probs is not None)
    x2d, probs2d = _flatten(x, probs)
    grad2d = grad.reshape(x2d.shape[0], grad.shape[-1])
    params = params_tensor(spec_params(spec), x.device)
    fn = backward_math if eager else run_backward
    dx, dbias, dprobs = fn(variant, grad2d.contiguous(), x2d, bias, probs2d, params)
    if dprobs is not None:
        dprobs = dprobs.view(probs.shape)
    return dx.view(x.shape), dbias, dprobs


# The kernels compute in float32 and store in the input dtype; integer, boolean, complex and fp8
# inputs would come back truncated, real-only or not at all.
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_inputs(spec: ActivationSpec, x, bias=None, probs=None) -> None:
    """Refuses inputs for which the kernels would compute something other than ``spec``.

    Raises:
        TypeError: an argument that is not a tensor, or a tensor that is not float32, bfloat16,
            float16 or float64.
        ValueError: a last dimension that is 0, odd for a GLU or not a multiple of twice the
            GLU interleave block; a bias that is not ``[width]``; probabilities that are not
            one per row (``x.shape[:-1]``, optionally with a trailing 1, or flattened).
    """
    for name, tensor in (("input", x), ("bias", bias), ("probs", probs)):
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"fused activation {name} must be a torch.Tensor, got {type(tensor).__name__}."
            )
        if tensor is not None and tensor.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"fused activation {name} must be float32, bfloat16, float16 or float64, got "
                f"{tensor.dtype}; convert it first (e.g. {name}.float())."
            )
    width = x.shape[-1] if x.dim() else 0
    if width == 0:
        raise ValueError(f"the activation input's last dimension is 0 (shape {tuple(x.shape)}).")
    k = spec.glu_interleave_size
    if spec.gated and width % 2:
        raise ValueError(
            f"a gated activation ({spec.name}) reads [gate, linear] halves, so the last "
            f"dimension must be even: got {width} (shape {tuple(x.shape)})."
        )
    if spec.gated and k is not None and width % (2 * k):
        raise ValueError(
            f"with glu_interleave_size={k} the last dimension must be a multiple of {2 * k}: "
            f"got {width}."
        )
    if bias is not None and tuple(bias.shape) != (width,):
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not match input width {width}.")
    if probs is not None:
        rows = tuple(x.shape[:-1])
        n = math.prod(rows)
        # One probability per row: shaped like the rows, or like the flattened rows (upstream's
        # weighted entry points take [s*b, 1] weights for an [s, b, 2F] input).
        allowed = {rows, (*rows, 1), (n,), (n, 1)}
        if tuple(probs.shape) not in allowed:
            raise ValueError(
                f"probs of shape {tuple(probs.shape)} do not match the activation input "
                f"{tuple(x.shape)}: expected {rows}, {(*rows, 1)} or {(n, 1)}, one probability "
                "per row."
            )


def check_grad(spec: ActivationSpec, grad, x) -> None:
    """Refuses an output gradient the backward kernels would misread (after :func:`check_inputs`).

    Raises:
        TypeError: ``grad`` is not a float32, bfloat16, float16 or float64 tensor.
        ValueError: ``grad`` does not have one value per output element (``[..., F]``).
    """
    if not isinstance(grad, torch.Tensor) or grad.dtype not in _FLOAT_DTYPES:
        got = grad.dtype if isinstance(grad, torch.Tensor) else type(grad).__name__
        raise TypeError(
            f"fused activation grad must be a float32, bfloat16, float16 or float64 tensor, got "
            f"{got}."
        )
    width = x.shape[-1] // 2 if spec.gated else x.shape[-1]
    rows_match = grad.numel() * x.shape[-1] == x.numel() * width
    if grad.dim() == 0 or grad.shape[-1] != width or not rows_match:
        raise ValueError(
            f"grad of shape {tuple(grad.shape)} does not match the activation output of the "
            f"input {tuple(x.shape)}: expected {(*x.shape[:-1], width)}."
        )


def _unflatten(out, input_shape):
    return out.view(*input_shape[:-1], out.shape[-1])


def _flatten(x, probs):
    # Already-2-D inputs (the MoE experts' [tokens, width] and [tokens, 1]) skip the reshape.
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    probs2d = probs
    if probs is not None and not (probs.dim() == 2 and probs.shape[1] == 1):
        probs2d = probs.reshape(-1, 1)
    return x2d, probs2d


def save_and_forward(
    ctx,
    spec,
    x,
    bias,
    probs,
    fp8_input_store=False,
    cpu_offload_input=False,
    in_place_backward: Optional[bool] = None,
):
    """Forward half of every activation ``autograd.Function`` in megatron.core.fusions.

    Checks the inputs (:func:`check_inputs`), runs the kernel on 2-D inputs and saves only the
    activation input (optionally as fp8 e4m3, which is lossy: the backward then differentiates
    at the rounded input) plus bias and probabilities; the backward kernel recomputes the forward.
    ``in_place_backward`` None means the process default (the upstream-named Functions, whose
    ``forward`` signatures are upstream's, take it that way).
    """
    check_inputs(spec, x, bias, probs)
    write_over_input = in_place.resolve(in_place_backward)
    return _run_and_save(
        ctx, spec, x, bias, probs, fp8_input_store, cpu_offload_input, write_over_input
    )


# ctx.in_place: what the backward writes its input gradient over.
_OUT_OF_PLACE, _OVER_INPUT, _OVER_UPCAST = 0, 1, 2


def _in_place_mode(x, fp8_input_store, cpu_offload_input) -> int:
    """How an in-place backward runs for input ``x``, after the forward-time refusals."""
    if not x.requires_grad or not plain_eager_call(x):
        # No input gradient is wanted (the caller's tensor stays untouched), or a tracer or a
        # tensor subclass is recording the graph and plans its memory itself.
        return _OUT_OF_PLACE
    if fp8_input_store:
        # The backward upcasts the saved fp8 copy into a buffer of its own; writing over that
        # buffer is safe whatever else holds the input (and a second backward still works).
        return _OVER_UPCAST
    in_place.check_forward(x, cpu_offload_input)
    return _OVER_INPUT


def _run_and_save(
    ctx,
    spec,
    x,
    bias,
    probs,
    fp8_input_store,
    cpu_offload_input,
    in_place_backward=False,
    plan=None,
):
    # Refusals come before any work; the mode is the backward's to read.
    ctx.in_place = (
        _in_place_mode(x, fp8_input_store, cpu_offload_input)
        if in_place_backward
        else _OUT_OF_PLACE
    )
    ctx.in_place_ran = False
    variant, params = _kernel_args(spec, plan, x, bias, probs)
    # The kernels work on rows; any leading shape is flattened here and restored on the way out.
    ctx.input_shape = x.shape
    ctx.probs_shape = probs.shape if probs is not None else None
    x2d, probs2d = _flatten(x, probs)
    out = run_forward(variant, x2d, bias, probs2d, params)
    # The caller's tensors are saved, not their 2-D views: a view made in here is not part of
    # the autograd graph, and a double backward through it would never reach the inputs.
    stored = x.to(FP8_STORE_DTYPE) if fp8_input_store else x
    if cpu_offload_input:
        for tensor in (stored, bias, probs):
            if tensor is not None:
                tensor.activation_offloading = True
    ctx.save_for_backward(stored, bias, probs)
    # ``params`` is cached across calls and may be an inference tensor; it is read-only and never
    # needs a gradient, so it is kept as a plain attribute rather than a saved tensor.
    ctx.params = params
    ctx.variant = variant
    ctx.input_dtype = x.dtype
    if x2d is x:
        return out
    # An upstream-named Function applied to an N-D input (``bias_gelu_impl`` is one) returns a
    # tensor of that rank. A view made here would be a view created in a custom Function, which
    # autograd forbids modifying in place; ``detach`` gives the same memory as a plain tensor.
    return _unflatten(out, ctx.input_shape).detach()


def saved_backward(ctx, grad):
    """Backward half matching :func:`save_and_forward`: ``(dx, dbias, dprobs)``."""
    if ctx.in_place == _OVER_INPUT:
        # Before the saved tensors are unpacked: on a second backward their version check
        # would fail first, with a message that does not say why.
        in_place.check_backward(ctx.in_place_ran)
    stored, bias, probs = ctx.saved_tensors
    x = stored.to(ctx.input_dtype) if stored.dtype != ctx.input_dtype else stored
    # A double backward (create_graph=True) differentiates this backward, which reads x: it
    # runs out of place.
    write = ctx.in_place and ctx.needs_input_grad[0] and not torch.is_grad_enabled()
    if write:
        # detach(): the same memory and version counter, without the forward graph's history.
        x = x.detach()
    x, probs = _flatten(x, probs)
    # The kernels make their operands contiguous themselves (free when they already are).
    grad2d = grad if grad.dim() == 2 else grad.reshape(x.shape[0], grad.shape[-1])
    if write:
        # A non-contiguous input is copied first and the copy overwritten: the same result,
        # without the memory saving.
        x = x if x.is_contiguous() else x.contiguous()
        dx, dbias, dprobs = run_backward_in_place(ctx.variant, grad2d, x, bias, probs, ctx.params)
        ctx.in_place_ran = ctx.in_place == _OVER_INPUT
        if ctx.in_place_ran:
            in_place.note_written(stored)
    else:
        dx, dbias, dprobs = run_backward(ctx.variant, grad2d, x, bias, probs, ctx.params)
    # Views only where the caller's shapes were not already the kernels' 2-D ones: each costs
    # microseconds of host time, a share of a small expert's call.
    if dprobs is not None and dprobs.shape != ctx.probs_shape:
        dprobs = dprobs.view(ctx.probs_shape)
    if dx.shape != ctx.input_shape:
        dx = dx.view(ctx.input_shape)
    return dx, dbias, dprobs


class FusedActivationFunction(torch.autograd.Function):
    """Autograd wrapper of the activation kernels (see :func:`save_and_forward`).

    It does not check its inputs: :func:`fused_activation` and :func:`activation_forward` do,
    on the caller's shapes, before applying it to the flattened rows.
    """

    @staticmethod
    def forward(
        ctx,
        x,
        bias,
        probs,
        spec,
        fp8_input_store,
        cpu_offload_input,
        in_place_backward=False,
        plan=None,
    ):
        """Runs the forward kernel of ``spec`` on inputs its callers have checked.

        ``in_place_backward`` is a resolved bool here (the functional API resolves None);
        ``plan``: the caller's ``KernelPlan`` of ``spec``, or None to derive the kernel's
        arguments from ``spec``.
        """
        return _run_and_save(
            ctx, spec, x, bias, probs, fp8_input_store, cpu_offload_input, in_place_backward, plan
        )

    @staticmethod
    def backward(ctx, grad):
        """Gradients for x, bias and probs."""
        dx, dbias, dprobs = saved_backward(ctx, grad)
        return dx, dbias, dprobs, None, None, None, None, None


def _any_requires_grad(*tensors) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


def check_impl_input(input: torch.Tensor) -> None:
    """The upstream ``*_impl`` entry points take ``[tokens, width]`` or ``[seq, batch, width]``."""
    if input.dim() not in (2, 3):
        raise ValueError(f"expected a 2-D or 3-D activation input, got shape {tuple(input.shape)}")


def lower_to_fused_kernel(spec: ActivationSpec, path: str) -> ActivationSpec:
    """Checks that the fused kernels can compute ``spec``; returns it unchanged.

    Raises:
        UnsupportedActivationError: for a custom activation function, which only the unfused
            eager path can run.
    """
    if spec.kind == ActivationKind.CUSTOM:
        raise UnsupportedActivationError(
            path,
            spec,
            "the fused kernels implement only silu, gelu, fast_gelu, quick_gelu, relu and "
            "squared_relu",
            "Use one of those activation functions or disable bias_activation_fusion.",
        )
    return spec


def fused_activation(
    x: torch.Tensor,
    spec: ActivationSpec,
    *,
    bias: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
    fp8_input_store: bool = False,
    cpu_offload_input: bool = False,
    in_place_backward: Optional[bool] = None,
) -> torch.Tensor:
    """Applies ``spec`` to ``x`` with fused forward and backward kernels.

    Args:
        x: Activation input ``[..., 2F]`` for a GLU (layout per ``spec.glu_interleave_size``) or
            ``[..., F]``.
        spec: The activation.
        bias: Optional bias ``[x.shape[-1]]`` added to ``x`` first (in float32).
        probs: Optional per-row probabilities, ``x.shape[:-1]`` or ``x.shape[:-1] + (1,)``;
            differentiable.
        fp8_input_store: Save the input as fp8 e4m3 for the backward pass.
        cpu_offload_input: Tag the saved tensors for activation offloading.
        in_place_backward: Write the input gradient over the saved input instead of a new
            buffer (same numbers, one input-sized buffer less at the backward's peak). None:
            the process default (``MCORE_ACTIVATIONS_IN_PLACE_BACKWARD``,
            ``in_place.set_in_place_backward``), off unless set. After the backward, ``x``
            holds its gradient.

    Returns:
        ``[..., F]`` in ``x.dtype``.

    Raises:
        TypeError: ``in_place_backward`` is not True, False or None.
        ValueError: ``in_place_backward`` with ``cpu_offload_input``.
        in_place.InPlaceBackwardError: ``in_place_backward`` where writing over ``x`` is unsafe
            (a leaf ``x``, saved-tensor hooks, CUDA graph capture, ``x`` saved by another
            in-place activation; in the backward: a second backward through a retained graph).
    """
    lower_to_fused_kernel(spec, "fused_activation")
    spec = constant_scalars(spec)
    check_inputs(spec, x, bias, probs)
    write_over_input = in_place.resolve(in_place_backward)
    if not (torch.is_grad_enabled() and _any_requires_grad(x, bias, probs)):
        # Nothing to differentiate: skip the autograd function and what it saves (its host
        # cost is a large part of a small call's time).
        return _forward_no_autograd(spec, x, bias, probs)
    return _apply_fused(spec, x, bias, probs, fp8_input_store, cpu_offload_input, write_over_input)


def fused_activation_with_plan(
    plan,
    x: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
    *,
    fp8_input_store: bool = False,
    cpu_offload_input: bool = False,
    in_place_backward: Optional[bool] = None,
) -> torch.Tensor:
    """:func:`fused_activation` of ``plan.spec``, with the kernel's arguments read from ``plan``.

    For a layer, which lowers its spec and builds its ``kernel_plan.KernelPlan`` once, at
    construction: the same checks, refusals and numbers as :func:`fused_activation`, without
    deriving the variant or the parameters again. Inside a caller's ``torch.compile`` it is
    :func:`fused_activation` itself, which makes the spec's numbers constants of the graph.
    """
    if torch.compiler.is_compiling():
        return fused_activation(
            x,
            plan.spec,
            bias=bias,
            probs=probs,
            fp8_input_store=fp8_input_store,
            cpu_offload_input=cpu_offload_input,
            in_place_backward=in_place_backward,
        )
    spec = plan.spec
    check_inputs(spec, x, bias, probs)
    write_over_input = in_place.resolve(in_place_backward)
    if not (torch.is_grad_enabled() and _any_requires_grad(x, bias, probs)):
        return _forward_no_autograd(spec, x, bias, probs, plan=plan)
    return _apply_fused(
        spec, x, bias, probs, fp8_input_store, cpu_offload_input, write_over_input, plan
    )
