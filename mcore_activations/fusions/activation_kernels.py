"""The torch reference math of every activation an ActivationSpec describes.

One forward and one backward body cover all kinds; what varies per call site is a
:class:`KernelVariant` (structure: kind, gated, which clamps exist, bias / probs present, GLU
layout). These bodies are the readable reference the Triton kernels (``triton_kernels``) mirror
term by term, and they are two backends themselves (``activation_ops``): run eagerly, or compiled
by ``torch.compile`` per variant, so structure is always a compile-time constant.

Compile safety (design principle 2): every runtime number - clamp ``c``, tanh scales ``s_g`` /
``s_l``, linear offset - reaches compiled code inside one float32 tensor ``params`` on the input's
device, never as a Python float. Dynamo does not guard on tensor values, so one graph serves every
value, and the AOTAutograd cache cannot hand back code specialised to an earlier value (the
upstream stale-clamp bug, docs/compile-safety.md).

Numerics: inputs are upcast to float32, all math is float32, results are cast back to the input
dtype (probability gradients to the probability dtype). Backward recomputes the forward from the
saved input. Clamp gradient masks are inclusive at the boundary (``g <= c``, ``-c <= u <= c``),
as ``torch.clamp``'s are; NaN inputs propagate NaN (``torch.clamp`` keeps NaN, and the masks are
multiplied, not used to select).
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch

from mcore_activations.activation_spec import (
    GELU_TANH_COEF,
    QUICK_GELU_ALPHA,
    ActivationKind,
    ActivationSpec,
    deinterleave_glu,
    interleave_glu,
)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

# The compile boundary lives in its own leaf module; its names are re-exported here.
from mcore_activations.kernel_params import (  # noqa: E402, F401
    CLAMP,
    GATE_SCALE,
    LINEAR_SCALE,
    OFFSET,
    check_kernel_args,
    params_tensor,
    spec_params,
)


class KernelVariant(NamedTuple):
    """The structural (compile-time) part of an activation call."""

    kind: str
    gated: bool
    clamp: bool
    gate_tanh: bool
    linear_tanh: bool
    has_bias: bool
    has_probs: bool
    interleave: Optional[int]

    @classmethod
    def of(cls, spec: ActivationSpec, has_bias: bool, has_probs: bool) -> KernelVariant:
        """The variant that runs ``spec`` with or without a bias / per-row probabilities."""
        if spec.kind == ActivationKind.CUSTOM:
            raise ValueError(f"{spec.name} has no fused kernel; only the eager path can run it.")
        return cls(
            kind=spec.kind.value,
            gated=spec.gated,
            clamp=spec.clamp_value is not None,
            gate_tanh=spec.gate_tanh_scale is not None,
            linear_tanh=spec.linear_tanh_scale is not None,
            has_bias=has_bias,
            has_probs=has_probs,
            interleave=spec.glu_interleave_size,
        )

    @property
    def tag(self) -> str:
        """Identifier used to name the compiled function (visible in profiles and logs)."""
        flags = [
            self.kind,
            "glu" if self.gated else "unary",
            "clamp" if self.clamp else "",
            "tanh" if self.gate_tanh else "",
            "ltanh" if self.linear_tanh else "",
            "bias" if self.has_bias else "",
            "probs" if self.has_probs else "",
            f"il{self.interleave}" if self.interleave else "",
        ]
        return "_".join(f for f in flags if f)


# ----------------------------------------------------------------------------- elementwise math
def _base_and_grad(kind: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``act(x)`` and ``act'(x)`` in float32."""
    if kind == "silu":
        sig = torch.sigmoid(x)
        return x * sig, sig * (1.0 + x * (1.0 - sig))
    if kind == "quick_gelu":
        sig = torch.sigmoid(QUICK_GELU_ALPHA * x)
        return x * sig, sig * (1.0 + QUICK_GELU_ALPHA * x * (1.0 - sig))
    if kind == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(x * _INV_SQRT_2))
        pdf = torch.exp(-0.5 * x * x) * _INV_SQRT_2PI
        return x * cdf, cdf + x * pdf
    if kind == "gelu_tanh":
        inner = _SQRT_2_OVER_PI * (x + GELU_TANH_COEF * x * x * x)
        t = torch.tanh(inner)
        d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_COEF * x * x)
        return 0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner
    if kind == "relu":
        pos = (x > 0).to(x.dtype)
        return torch.relu(x), pos
    if kind == "squared_relu":
        r = torch.relu(x)
        return r * r, 2.0 * r
    raise AssertionError(f"unknown activation kind {kind!r}")


def _gated_terms(v: KernelVariant, h: torch.Tensor, params: torch.Tensor):
    """Forward terms of a GLU: activation a, linear factor L (offset included), and the local
    derivatives da/dg and dL/du with the clamp masks folded in."""
    gate, lin = deinterleave_glu(h, v.interleave)
    if v.clamp:
        c = params[CLAMP]
        gate_mask = (gate <= c).to(h.dtype)
        lin_mask = ((lin >= -c) & (lin <= c)).to(h.dtype)
        gate = torch.clamp(gate, max=c)
        lin = torch.clamp(lin, min=-c, max=c)
    if v.gate_tanh:  # SiTU-GLU gate: s_g * tanh(g / s_g) * sigmoid(g)
        s_g = params[GATE_SCALE]
        t = torch.tanh(gate / s_g)
        sig = torch.sigmoid(gate)
        act = s_g * t * sig
        d_act = (1.0 - t * t) * sig + act * (1.0 - sig)
    else:
        act, d_act = _base_and_grad(v.kind, gate)
    if v.linear_tanh:
        s_l = params[LINEAR_SCALE]
        t_l = torch.tanh(lin / s_l)
        lin = s_l * t_l
        d_lin = 1.0 - t_l * t_l
    else:
        d_lin = None
    lin = lin + params[OFFSET]
    if v.clamp:
        d_act = d_act * gate_mask
        d_lin = lin_mask if d_lin is None else d_lin * lin_mask
    return act, lin, d_act, d_lin


def _unary_terms(v: KernelVariant, h: torch.Tensor, params: torch.Tensor):
    """Forward value and derivative of a non-gated activation (tanh soft clamp included)."""
    if v.gate_tanh:
        s = params[GATE_SCALE]
        t = torch.tanh(h / s)
        out, d_out = _base_and_grad(v.kind, s * t)
        return out, d_out * (1.0 - t * t)
    return _base_and_grad(v.kind, h)


def _prepare(v, x, bias):
    h = x.float()
    if v.has_bias:
        h = h + bias.float()
    return h


def forward_math(v: KernelVariant, x, bias, probs, params) -> torch.Tensor:
    """Forward of variant ``v`` on a 2-D ``x``; result in ``x.dtype``."""
    h = _prepare(v, x, bias)
    if v.gated:
        act, lin, _, _ = _gated_terms(v, h, params)
        out = act * lin
    else:
        out, _ = _unary_terms(v, h, params)
    if v.has_probs:
        out = out * probs.float()
    return out.to(x.dtype)


def backward_math(v: KernelVariant, grad, x, bias, probs, params, in_place: bool = False):
    """Backward of variant ``v``: ``(dx, dbias or None, dprobs or None)``.

    ``dbias`` is the float32 row-sum of ``dx`` cast to the bias dtype; ``dprobs`` is the row-wise
    dot product of the incoming gradient with the unscaled activation. With ``in_place``, ``dx``
    is written over ``x`` (see :func:`assemble_backward`).
    """
    terms = backward_terms(v, grad, x, bias, probs, params)
    return assemble_backward(v, *terms, out=x if in_place else None)


def backward_terms(v: KernelVariant, grad, x, bias, probs, params):
    """The elementwise part of :func:`backward_math`: ``(dx_parts, dbias, dprobs)``.

    For a GLU ``dx_parts`` is ``(dgate, dlinear)``, each ``[rows, F]`` in ``x.dtype``, and
    :func:`assemble_backward` lays them out as the input was; otherwise it is ``(dx,)``. The
    compiled backward stops here on purpose (see ``_run_backward``).
    """
    h = _prepare(v, x, bias)
    g = grad.float()
    g_scaled = g * probs.float() if v.has_probs else g
    if v.gated:
        act, lin, d_act, d_lin = _gated_terms(v, h, params)
        d_gate = g_scaled * lin * d_act
        d_linear = g_scaled * act
        if d_lin is not None:
            d_linear = d_linear * d_lin
        parts = (d_gate, d_linear)
        unscaled = act * lin
    else:
        unscaled, d_out = _unary_terms(v, h, params)
        parts = (g_scaled * d_out,)
    dbias = None
    if v.has_bias:
        sums = [part.sum(dim=0) for part in parts]
        dbias = (interleave_glu(*sums, v.interleave) if v.gated else sums[0]).to(bias.dtype)
    dprobs = (g * unscaled).sum(dim=-1, keepdim=True).to(probs.dtype) if v.has_probs else None
    return tuple(part.to(x.dtype) for part in parts), dbias, dprobs


def assemble_backward(v: KernelVariant, dx_parts, dbias, dprobs, out=None):
    """``(dx, dbias, dprobs)`` from :func:`backward_terms`: a GLU's halves in the input layout.

    With ``out`` (the input itself, for an in-place backward) the parts are copied into ``out``
    and ``out`` is ``dx``. Every term was computed from the input before this point, so the
    copy changes no value; it only reuses the input's memory.
    """
    if out is None:
        dx = interleave_glu(*dx_parts, v.interleave) if v.gated else dx_parts[0]
        return dx, dbias, dprobs
    with torch.no_grad():
        if not v.gated:
            out.copy_(dx_parts[0])
        elif v.interleave is None:
            gate, lin = out.chunk(2, dim=-1)
            gate.copy_(dx_parts[0])
            lin.copy_(dx_parts[1])
        else:
            # [rows, pairs, (gate, linear), block]: the interleaved layout as views of ``out``.
            k = v.interleave
            blocks = out.unflatten(-1, (out.shape[-1] // (2 * k), 2, k))
            blocks[..., 0, :].copy_(dx_parts[0].unflatten(-1, (-1, k)))
            blocks[..., 1, :].copy_(dx_parts[1].unflatten(-1, (-1, k)))
    return out, dbias, dprobs


# ----------------------------------------------------------------------------- compilation
def _own_code_object(fn: Callable, name: str) -> Callable:
    """``fn`` with a private copy of its code object.

    Dynamo keys its cache and its recompile limit (8) on the code object. Without a copy, every
    compiled kernel would share one code object and, past eight structures x dtypes x shapes,
    Dynamo would silently fall back to eager. A private code object per (variant, direction,
    width) gives each its own budget: one graph per dtype, plus one for single-row inputs.
    """
    names = {"co_name": name}
    if hasattr(fn.__code__, "co_qualname"):  # Python >= 3.11
        names["co_qualname"] = name
    code = fn.__code__.replace(**names)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@functools.cache
def _compiled(variant: KernelVariant, direction: str, width: int) -> Callable:
    """The compiled kernel of ``variant`` for inputs ``width`` wide, rows dynamic.

    Shapes: row counts change every step in MoE (tokens per expert), so the row dimension is
    marked dynamic; widths are fixed by the model config and are compiled as constants, one code
    object per width. With symbolic widths (``dynamic=True``) Inductor splits every flat index
    into (row, column) with a runtime integer division and cannot prove the alignment it needs
    for vectorised loads: the kernels ran 2-3x slower on an H200 (docs/bench/history.md). Sharing
    one code object across widths would not keep them static either: after a second width,
    Dynamo's automatic dynamic shapes make the width symbolic for every later call.
    ``maybe_mark_dynamic`` (not ``mark_dynamic``) lets a one-row input specialise instead of
    failing.
    """
    if direction == "fwd":

        def kernel(x, bias, probs, params):
            return forward_math(variant, x, bias, probs, params)

    else:

        def kernel(grad, x, bias, probs, params):
            return backward_terms(variant, grad, x, bias, probs, params)

    return compile_with_dynamic_rows(
        _own_code_object(kernel, f"{direction}_{variant.tag}_w{width}")
    )


def compile_with_dynamic_rows(fn: Callable) -> Callable:
    """``torch.compile(fn)``, called with dim 0 of every 2-D tensor argument marked dynamic.

    Every call first refuses a Python number among the arguments (``check_kernel_args``): the
    runtime half of the compile-boundary rule, for the kernels the static checker cannot prove.
    """
    compiled = torch.compile(fn)
    name = fn.__name__

    def run(*args):
        check_kernel_args(name, args)
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.dim() == 2:
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return compiled(*args)

    return run


def compiled_forward(variant: KernelVariant, x, bias, probs, params) -> torch.Tensor:
    """:func:`forward_math` compiled by ``torch.compile`` (the ``"inductor"`` backend)."""
    if x.shape[0] == 0:  # nothing to compute; a graph for it would only cost compile time
        return forward_math(variant, x, bias, probs, params)
    return _compiled(variant, "fwd", x.shape[-1])(x, bias, probs, params)


def compiled_backward(variant: KernelVariant, grad, x, bias, probs, params, in_place=False):
    """:func:`backward_math` compiled by ``torch.compile`` (the ``"inductor"`` backend)."""
    if x.shape[0] == 0:
        return backward_math(variant, grad, x, bias, probs, params, in_place)
    terms = _compiled(variant, "bwd", x.shape[-1])(grad, x, bias, probs, params)
    # A GLU's halves are laid out as the input outside the compiled graph: inside it, Inductor
    # lowers the concatenation of two computed halves as one pointwise kernel that evaluates
    # both halves' math for every output element (1.8-6.6x the copy floor on an H200, against
    # 1.9-2.5x with the layout done here; docs/bench/history.md). The Triton backend has neither
    # cost: it writes dx in place.
    return assemble_backward(variant, *terms, out=x if in_place else None)
