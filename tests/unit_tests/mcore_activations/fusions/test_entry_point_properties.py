"""Property test over the public fused entry points, input layouts, autograd modes and compile.

Every draw calls one upstream-named entry point (``bias_swiglu_impl``,
``weighted_bias_swiglu_impl``, ``bias_geglu_impl``, ``weighted_bias_quick_geglu_impl``,
``bias_gelu_impl``, ``weighted_squared_relu_impl`` and the raw ``swiglu`` / ``clamped_swiglu`` /
``geglu``) on an input of rank 1 to 5 that is contiguous, transposed or expanded (stride 0),
possibly with zero rows, under one autograd mode (no_grad, inference_mode, grad, backward twice
with retain_graph, double backward, an in-place op on the output) and one user compile (none,
``torch.compile``, ``torch.compile(fullgraph=True)``).

The result is either the float64 reference's answer, forward and gradients, or a refusal whose
message names the argument: the ``*_impl`` functions take 2-D or 3-D inputs, as upstream's
assert, and say so about the ``input``. Under ``fullgraph=True`` torch reports any exception
raised in the compiled region as ``Unsupported: Observed exception`` with the refusal's message
inside (upstream's assert surfaces the same way), and AOTAutograd cannot differentiate a compiled
backward again (a double backward under ``torch.compile`` is torch's refusal, upstream's too).

The user compile runs Dynamo and AOTAutograd (``backend="aot_eager"``): that is where graph
breaks, views made in custom Functions and specialized scalars live. Inductor's code generation
would add seconds per draw on the CI machine; test_entry_point_contracts and the compile-safety
scenarios run it. Every (autograd mode, compile) pair is a test of its own, so each is covered;
hypothesis draws the entry point, rank, layout and dtype, derandomized (the same draws on every
run) and few per pair; set ``PROPERTY_EXAMPLES`` to draw more.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import megatron.core.fusions.fused_bias_geglu as geglu_mod
import megatron.core.fusions.fused_bias_swiglu as swiglu_mod
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl
from megatron.core.transformer.activation_spec import ActivationKind, ActivationSpec
from tests.unit_tests.tolerances import assert_close_to_reference

CLAMP = 0.5  # exact in every dtype, and hit by most inputs of std 2


class Entry:
    """An entry point: how to call it and the spec its answer must match."""

    def __init__(self, name, spec, call, *, bias=False, weights=False, ranks=(1, 2, 3, 4, 5)):
        self.name, self.spec, self.call = name, spec, call
        self.bias, self.weights, self.ranks = bias, weights, ranks

    def __repr__(self) -> str:
        return self.name


_IMPL_RANKS = (2, 3)  # upstream's *_impl functions assert a 2-D or 3-D input
_SILU_GLU = ActivationSpec(ActivationKind.SILU, gated=True)
_CLAMPED = ActivationSpec(ActivationKind.SILU, gated=True, clamp_value=CLAMP)
_GEGLU = ActivationSpec(ActivationKind.GELU_TANH, gated=True)
_QUICK = ActivationSpec(ActivationKind.QUICK_GELU, gated=True, clamp_value=CLAMP, linear_offset=1.0)
_GELU = ActivationSpec(ActivationKind.GELU_TANH)
_SQRELU = ActivationSpec(ActivationKind.SQUARED_RELU, gate_tanh_scale=2.0)

ENTRIES = [
    Entry(
        "bias_swiglu_impl",
        _SILU_GLU,
        lambda x, b, w: swiglu_mod.bias_swiglu_impl(x, b),
        bias=True,
        ranks=_IMPL_RANKS,
    ),
    Entry(
        "bias_swiglu_impl clamp",
        _CLAMPED,
        lambda x, b, w: swiglu_mod.bias_swiglu_impl(x, b, clamp_value=CLAMP),
        bias=True,
        ranks=_IMPL_RANKS,
    ),
    Entry(
        "weighted_bias_swiglu_impl",
        _CLAMPED,
        lambda x, b, w: swiglu_mod.weighted_bias_swiglu_impl(x, None, w, clamp_value=CLAMP),
        weights=True,
        ranks=_IMPL_RANKS,
    ),
    Entry(
        "bias_geglu_impl",
        _GEGLU,
        lambda x, b, w: geglu_mod.bias_geglu_impl(x, b),
        bias=True,
        ranks=_IMPL_RANKS,
    ),
    Entry(
        "weighted_bias_quick_geglu_impl",
        _QUICK,
        lambda x, b, w: geglu_mod.weighted_bias_quick_geglu_impl(
            x, b, w, linear_offset=1.0, clamp_value=CLAMP
        ),
        bias=True,
        weights=True,
        ranks=_IMPL_RANKS,
    ),
    # upstream's bias_gelu_impl is its autograd Function's apply: any rank, bias required.
    Entry("bias_gelu_impl", _GELU, lambda x, b, w: bias_gelu_impl(x, b), bias=True),
    Entry(
        "weighted_squared_relu_impl",
        _SQRELU,
        lambda x, b, w: weighted_squared_relu_impl(x, w, clamp_scale=2.0),
        weights=True,
        ranks=_IMPL_RANKS,
    ),
    Entry("swiglu", _SILU_GLU, lambda x, b, w: swiglu_mod.swiglu(x)),
    Entry("clamped_swiglu", _CLAMPED, lambda x, b, w: swiglu_mod.clamped_swiglu(x, CLAMP)),
    Entry("geglu", _GEGLU, lambda x, b, w: geglu_mod.geglu(x)),
]

MODES = ["no_grad", "inference_mode", "grad", "retain_graph_twice", "double_backward", "in_place"]
COMPILES = ["none", "default", "fullgraph"]
LAYOUTS = ["contiguous", "transposed", "expanded"]


@st.composite
def cases(draw):
    entry = draw(st.sampled_from(ENTRIES))
    # Mostly ranks every entry takes; hypothesis starts from the first choice.
    rank = draw(st.sampled_from([2, 3, 2, 3, 2, 3, 1, 4, 5]))
    leading = [draw(st.integers(1, 3)) for _ in range(rank - 1)]
    if leading and draw(st.integers(0, 5)) == 0:
        leading[draw(st.integers(0, len(leading) - 1))] = 0  # zero-size
    layout = draw(st.sampled_from(LAYOUTS))
    # An expanded input's gradient is a sum over the broadcast rows, which autograd takes in the
    # input dtype: in bf16 that sum alone misses the float64 reference by more than bf16's
    # tolerance, on every path and upstream too.
    dtypes = [torch.float32] if layout == "expanded" else [torch.float32, torch.bfloat16]
    return dict(
        entry=entry,
        leading=leading,
        width=draw(st.sampled_from([4, 8])),
        layout=layout,
        dtype=draw(st.sampled_from(dtypes)),
        has_bias=entry.bias and (entry.name == "bias_gelu_impl" or draw(st.booleans())),
    )


def _lay_out(leaf, layout, leading):
    """The input the entry point sees, built from ``leaf`` so gradients reach the leaf."""
    if layout == "transposed" and len(leading) >= 1:
        # leaf is [width, *leading]-ish: move the last dim in front of the rows, then back.
        return leaf.movedim(0, -1)
    if layout == "expanded" and len(leading) >= 1:
        return leaf.expand(*leading, leaf.shape[-1])
    return leaf


def _leaf_shape(layout, leading, width):
    if layout == "transposed" and len(leading) >= 1:
        return (width, *leading)
    if layout == "expanded" and len(leading) >= 1:
        return (*([1] * len(leading)), width)
    return (*leading, width)


def _reference(entry, x64, bias64, weights64, rows):
    probs = weights64.reshape(*rows, 1) if weights64 is not None else None
    return entry.spec.reference(x64, bias=bias64, probs=probs)


def _run(case, fn, x_leaf, bias, weights, grad, second):
    """Runs ``fn`` in the case's autograd mode; returns (output, gradients of the leaves)."""
    mode = case["mode"]
    leaves = [t for t in (x_leaf, bias) if t is not None]
    if mode in ("no_grad", "inference_mode"):
        ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
        with ctx:
            return fn(x_leaf, bias, weights), None
    out = fn(x_leaf, bias, weights)
    if mode == "grad":
        out.backward(grad)
    elif mode == "retain_graph_twice":
        out.backward(grad, retain_graph=True)
        out.backward(grad)
    elif mode == "in_place":
        out = out.mul_(2)
        out.backward(grad)
    elif mode == "double_backward":
        (first,) = torch.autograd.grad(out, x_leaf, grad, create_graph=True)
        (first * second).sum().backward()
    return out, [t.grad for t in leaves]


def _compiled(fn, how):
    if how == "none":
        return fn
    torch._dynamo.reset()  # fresh budgets: the lambdas below share one code object
    return torch.compile(fn, backend="aot_eager", fullgraph=how == "fullgraph")


def _reference_fails_alike(case, x_leaf, b_leaf, weights, grad, second):
    """The error the float64 reference (plain torch ops), compiled as ``case`` says, raises in
    the same double backward on the same inputs; None if it raises none."""
    entry, layout, leading = case["entry"], case["layout"], case["leading"]
    leaves = [
        t.detach().double().requires_grad_() if t is not None else None for t in (x_leaf, b_leaf)
    ]
    w64 = weights.double() if weights is not None else None

    def reference(x, b, w):
        return _reference(entry, _lay_out(x, layout, leading), b, w, tuple(leading))

    try:
        _run(
            case,
            _compiled(reference, case["compile"]),
            *leaves,
            w64,
            grad.double(),
            second.double(),
        )
    except RuntimeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("compile_mode", COMPILES)
@pytest.mark.parametrize("mode", MODES)
@settings(
    max_examples=int(os.environ.get("PROPERTY_EXAMPLES", "4")),
    deadline=None,
    derandomize=os.environ.get("PROPERTY_RANDOM") != "1",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cases())
def test_entry_points_answer_as_the_reference_or_refuse_by_name(mode, compile_mode, case):
    case = dict(case, mode=mode, compile=compile_mode)
    entry, leading, width, dtype = case["entry"], case["leading"], case["width"], case["dtype"]
    rows = tuple(leading)
    gen = torch.Generator().manual_seed(len(rows) * 7 + width)
    base = (torch.randn(_leaf_shape(case["layout"], leading, width), generator=gen) * 2).to(dtype)
    bias = torch.randn(width, generator=gen).to(dtype) if case["has_bias"] else None
    n = math.prod(rows)
    weights = torch.rand(n, 1, generator=gen) if entry.weights else None
    out_width = width // 2 if entry.spec.gated else width
    grad = torch.randn(*rows, out_width, generator=gen).to(dtype)
    second = torch.randn(base.shape, generator=gen).to(dtype)  # weighs d(out)/d(leaf)

    wants_grad = case["mode"] not in ("no_grad", "inference_mode")
    x_leaf = base.clone().requires_grad_(wants_grad)
    b_leaf = bias.clone().requires_grad_(wants_grad) if bias is not None else None
    layout = case["layout"]

    def fn(x, b, w):
        return entry.call(_lay_out(x, layout, leading), b, w)

    what = f"{entry.name} {case}"
    try:
        out, grads = _run(
            case, _compiled(fn, case["compile"]), x_leaf, b_leaf, weights, grad, second
        )
    except (ValueError, TypeError, torch._dynamo.exc.Unsupported) as err:
        if isinstance(err, torch._dynamo.exc.Unsupported):
            assert case["compile"] == "fullgraph" and "ValueError" in str(err), f"{what}: {err}"
        # A refusal: only of what upstream refuses too, and naming the argument.
        event("refused")
        assert len(rows) + 1 not in entry.ranks, f"{what}: refused {err}"
        assert "input" in str(err), f"{what}: unclear refusal {err}"
        return
    except RuntimeError as err:
        # AOTAutograd compiles a graph's backward once, so it cannot differentiate it again. torch
        # 2.13 says so; 2.11 hands back a first gradient without a graph, and the second backward
        # fails on it. Either way the reference (plain torch ops), compiled alike, fails too.
        if case["mode"] == "double_backward" and case["compile"] != "none":
            if "double backward" not in str(err):
                plain = _reference_fails_alike(case, x_leaf, b_leaf, weights, grad, second)
                assert plain is not None, f"{what}: {err} (plain torch compiled alike: no error)"
            event("double backward through torch.compile: unsupported by torch")
            return
        raise
    event(f"computed ({case['mode']}, {case['compile']})")
    assert len(rows) + 1 in entry.ranks, f"{what}: accepted a rank upstream refuses"

    x64 = base.double().requires_grad_(wants_grad)
    b64 = bias.double().requires_grad_(wants_grad) if bias is not None else None
    w64 = weights.double() if weights is not None else None
    ref = _reference(entry, _lay_out(x64, layout, leading), b64, w64, rows)
    if case["mode"] == "in_place":
        ref = ref * 2
    assert out.dtype == dtype and out.shape == ref.shape, what
    assert_close_to_reference(out, ref, dtype, f"{what} out")
    if grads is None:
        return
    if case["mode"] == "double_backward":
        (first,) = torch.autograd.grad(ref, x64, grad.double(), create_graph=True)
        (first * second.double()).sum().backward()
    else:
        for _ in range(2 if case["mode"] == "retain_graph_twice" else 1):
            ref.backward(grad.double(), retain_graph=True)
    assert_close_to_reference(grads[0], x64.grad, dtype, f"{what} dx")
    if b_leaf is not None and case["mode"] != "double_backward":
        assert_close_to_reference(grads[1], b64.grad, dtype, f"{what} dbias")


@pytest.mark.parametrize("rank", [1, 4, 5])
def test_impl_entry_points_refuse_other_ranks_by_naming_the_input(rank):
    x = torch.randn(*([2] * (rank - 1)), 8)
    with pytest.raises(ValueError, match="input"):
        swiglu_mod.bias_swiglu_impl(x, None)
