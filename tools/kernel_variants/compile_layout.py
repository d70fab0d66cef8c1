"""Experiments ``compile`` and ``layout``: how the compiled-torch kernels are compiled, and
where the GLU backward's ``[dgate | dlinear]`` layout is assembled."""

from __future__ import annotations

import torch

from mcore_activations.activation_spec import ActivationKind, ActivationSpec
from mcore_activations.fusions import activation_kernels as ak
from tools.benchmark_activations import copy_ms, time_ms
from tools.kernel_variants.common import SPECS, check_formulation

COMPILE_SPECS = {name: SPECS[name] for name in ("SwiGLU", "SwiGLU(clamp=7)", "SiTU-GLU(4,25)")} | {
    "squared-ReLU(tanh=10)": ActivationSpec(ActivationKind.SQUARED_RELU, gate_tanh_scale=10.0)
}


def _pairs(dx: torch.Tensor, block):
    """``dx`` viewed with a size-2 (gate, linear) dimension, for slice assignment."""
    width = dx.shape[-1]
    if block is None:
        return dx.unflatten(-1, (2, width // 2))
    return dx.unflatten(-1, (width // (2 * block), 2, block))


def layout_formulations(v: ak.KernelVariant) -> dict:
    """GLU backward formulations, uncompiled: ``label -> (fn(grad, x, params), layout)``.

    ``layout`` says where ``dx`` gets its input layout: ``"in graph"`` (``fn`` returns ``dx``),
    ``"outside"`` (``fn`` returns the halves, laid out after the compiled call, as
    ``activation_kernels`` does) or ``None`` (the halves alone: a lower bound, not a ``dx``).
    """
    k = v.interleave

    def halves(grad, x, params):
        parts, _, _ = ak.backward_terms(v, grad, x, None, None, params)
        return parts

    def in_graph_cat(grad, x, params):
        return ak.backward_math(v, grad, x, None, None, params)[0]

    def slice_assign(grad, x, params):
        dgate, dlinear = halves(grad, x, params)
        dx = torch.empty_like(x)
        pairs = _pairs(dx, k)
        if k is None:
            pairs[:, 0, :], pairs[:, 1, :] = dgate, dlinear
        else:
            pairs[:, :, 0, :] = dgate.unflatten(-1, (-1, k))
            pairs[:, :, 1, :] = dlinear.unflatten(-1, (-1, k))
        return dx

    return {
        "in-graph cat": (in_graph_cat, "in graph"),
        "slice assignments": (slice_assign, "in graph"),
        "halves + copy outside": (halves, "outside"),
        "halves only": (halves, None),
    }


def bench_layout(spec, rows, ffn, dtype):
    """One row of the ``layout`` table: backward time / copy time per formulation."""
    v = ak.KernelVariant.of(spec, has_bias=False, has_probs=False)
    x = torch.randn(rows, 2 * ffn, device="cuda", dtype=dtype) * 4
    grad = torch.randn(rows, ffn, device="cuda", dtype=dtype)
    params = ak.params_tensor(ak.spec_params(spec), x.device)
    expected = ak.backward_math(v, grad, x, None, None, params)[0]
    copy = copy_ms(rows * 5 * ffn * dtype.itemsize)  # reads 3F, writes 2F elements per row
    row = {}
    for label, (fn, layout) in layout_formulations(v).items():
        torch._dynamo.reset()
        compiled = ak.compile_with_dynamic_rows(fn)
        if layout == "outside":
            inner = compiled

            def compiled(grad, x, params, inner=inner):
                return ak.assemble_backward(v, inner(grad, x, params), None, None)[0]

        out = compiled(grad, x, params)
        if layout is not None:
            check_formulation(f"{label}, {spec.name}", out, expected)
        row[label] = time_ms(lambda c=compiled: c(grad, x, params)) / copy
    return row


def bench_compile(spec, rows, ffn, dtype):
    """One row of the ``compile`` table: forward and backward time / copy time per mode."""
    v = ak.KernelVariant.of(spec, has_bias=False, has_probs=False)
    width = 2 * ffn if spec.gated else ffn
    x = torch.randn(rows, width, device="cuda", dtype=dtype) * 4
    grad = torch.randn(rows, ffn, device="cuda", dtype=dtype)
    params = ak.params_tensor(ak.spec_params(spec), x.device)
    copy_fwd = copy_ms(rows * (width + ffn) * dtype.itemsize)
    copy_bwd = copy_ms(rows * (2 * width + ffn) * dtype.itemsize)

    def fwd(x, bias, probs, params):
        return ak.forward_math(v, x, bias, probs, params)

    def bwd(grad, x, bias, probs, params):
        return ak.backward_terms(v, grad, x, bias, probs, params)

    modes = {
        "dynamic=True": lambda fn: torch.compile(fn, dynamic=True),
        "static": lambda fn: torch.compile(fn, dynamic=False),
        "rows dynamic": ak.compile_with_dynamic_rows,
    }
    row = {}
    for label, make in modes.items():
        torch._dynamo.reset()
        f, b = make(fwd), make(bwd)
        f(x[:1000], None, None, params)  # a second row count first, as MoE does
        b(grad[:1000], x[:1000], None, None, params)
        row[f"fwd {label}"] = time_ms(lambda f=f: f(x, None, None, params)) / copy_fwd
        row[f"bwd {label}"] = time_ms(lambda b=b: b(grad, x, None, None, params)) / copy_bwd
    return row
