"""Benchmark how the activation kernels are compiled, one design choice at a time.

Usage (GPU): ``python tools/benchmark_kernel_variants.py [--rows 16384 --ffn 8192]``

Times the raw kernels (no autograd) on a bf16 ``[rows, 2 * ffn]`` GLU input and reports each
time divided by a device copy of the same bytes, all in one run (docs/bench/history.md):

- ``compile``: the forward and the compiled part of the backward (``backward_terms``) compiled
  with ``dynamic=True``, with static shapes, and with dynamic rows and static widths (what
  ``activation_kernels`` does).
- ``layout``: the GLU backward with ``[dgate | dlinear]`` assembled inside the compiled graph,
  with two slice assignments inside the graph, with the halves returned and laid out outside
  (what ``activation_kernels`` does), and the halves alone (a lower bound: no layout at all).

Every layout formulation is checked against ``backward_math`` (to bf16 rounding: compiled code
may contract multiply-adds differently from eager) before it is timed.

- ``tiles``: the Triton kernels' launch shape (tile elements, warps, widest column block) for
  forward and backward, unweighted and weighted, gated and not: the sweep behind the constants
  in ``triton_kernels``.
- ``path``: where the time of a whole forward+backward through ``fused_activation`` goes: the
  raw kernels next to the full autograd path, and a profiler table of every CUDA kernel the
  path launches (finds work around the kernels, e.g. copies or reductions); ``--bias`` gives
  every call a bias.
- ``flat``: the non-gated kernels as one flat stream of elements per program
  (``_unary_fwd_flat_kernel``, and ``_unary_bwd_flat_kernel`` where no reduction is needed)
  against the 2-D tile kernels GLUs use, for several flat block sizes, with and without bias and
  probabilities, next to plain ``torch.compile`` of the same forward math: the measurement
  behind ``triton_kernels._FLAT_UNARY``.
- ``glu``: every GLU kind's raw forward and backward at the current launch shape and at the
  widest column block of 2048, next to plain ``torch.compile`` and TE's forward, all timed in
  turns within one repeat (``time_interleaved``), so the kinds and the columns compare like with
  like, and the division each runs (the hardware reciprocal or div.full; the measurement behind
  ``_FWD_MAX_BLOCK_N`` and ``triton_kernels._fast_div``).
- ``reduce``: the GLU backward's plans with and without probabilities (tile and warps; rows per
  program, widest column block, columns per warp, register cap), all in the same turns, and the
  forward with and without: the probability gradient is a per-row sum, with a barrier wherever
  a row spans several warps, so its best shape can differ from the unweighted one.
- ``launch``: GLU forward and backward launch shapes (bf16 kinds and float32) next to
  torch.compile and TE, in turns (run 15's ``fp32`` experiment, grown).
- ``turns``: the raw forward and backward against the path's forward and forward+backward,
  torch.compile and TE, and two copies (the floor of two kernels), with more repeats.
- ``host-at-shape``: the host time of one forward+backward at the given shape, with the GPU
  idle and busy (does a call wait for the GPU?), next to its GPU time, and a cProfile.
- ``weighted``: forward+backward through ``fused_activation`` with and without probabilities,
  in turns and alone (the weighted-within-5 % target), with the host time per call.
- ``host``: per-call host cost of each layer on a tiny input (the kernel launch, the op, the
  functional API, with and without autograd) and a cProfile of the functional API.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_activations.activation_spec import (  # noqa: E402
    ActivationKind,
    ActivationSpec,
)
from mcore_activations.fusions import activation_kernels as ak  # noqa: E402
from tools.benchmark_activations import (  # noqa: E402
    copy_fn,
    copy_ms,
    sleep_cycles,
    te_candidate,
    time_interleaved,
    time_ms,
)

_SILU, _QGELU = ActivationKind.SILU, ActivationKind.QUICK_GELU
SPECS = {
    "SwiGLU": ActivationSpec(_SILU, gated=True),
    "SwiGLU, interleave 32": ActivationSpec(_SILU, gated=True, glu_interleave_size=32),
    "quick-GEGLU(gpt-oss)": ActivationSpec(_QGELU, gated=True, clamp_value=7.0, linear_offset=1.0),
    "SwiGLU(clamp=7)": ActivationSpec(_SILU, gated=True, clamp_value=7.0),
    "SwiGLU(clamp=7), interleave 32": ActivationSpec(
        _SILU, gated=True, clamp_value=7.0, glu_interleave_size=32
    ),
    "SiTU-GLU(4,25)": ActivationSpec(
        _SILU, gated=True, gate_tanh_scale=4.0, linear_tanh_scale=25.0
    ),
    "SiTU-GLU(4,25), interleave 32": ActivationSpec(
        _SILU, gated=True, gate_tanh_scale=4.0, linear_tanh_scale=25.0, glu_interleave_size=32
    ),
}
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


def check_formulation(
    label: str, out: torch.Tensor, expected: torch.Tensor, units: int = 2
) -> None:
    """Raises unless ``out`` equals ``expected`` to within the rounding of ``expected.dtype``:
    two units of it per element, or ``units`` units of the largest value."""
    scale = expected.abs().max().float().clamp_min(1e-30).item()
    eps = torch.finfo(expected.dtype).eps
    torch.testing.assert_close(
        out.float(), expected.float(), rtol=2 * eps, atol=units * eps * scale, msg=label
    )


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


TILE_CASES = {
    "SwiGLU(clamp=7)": (SPECS["SwiGLU(clamp=7)"], False),
    "SwiGLU(clamp=7), probs": (SPECS["SwiGLU(clamp=7)"], True),
    "SiTU-GLU(4,25)": (SPECS["SiTU-GLU(4,25)"], False),
    "squared-ReLU": (ActivationSpec(ActivationKind.SQUARED_RELU), False),
}
FWD_CONFIGS = [
    (2048, 4, 1024),
    (4096, 4, 1024),
    (4096, 8, 1024),
    (8192, 8, 1024),
    (2048, 4, 2048),
    (4096, 4, 2048),
    (4096, 8, 2048),
    (8192, 8, 4096),
    (16384, 16, 4096),
]
BWD_CONFIGS = [
    # One row per program at widths whose column block is 512 (e.g. --ffn 1536, where the
    # weighted backward's 1024-element tile holds two rows, the shape measured slow with probs).
    (512, 4, 1024),
    (1024, 4, 1024),
    (2048, 4, 1024),
    (2048, 8, 1024),
    (4096, 8, 1024),
    (4096, 8, 2048),
    (8192, 16, 4096),
]


def _raw_inputs(spec, weighted, rows, ffn, dtype):
    """Inputs at std 4 (the clamps bite), probabilities, params and the two copy floors."""
    width = 2 * ffn if spec.gated else ffn
    x = torch.randn(rows, width, device="cuda", dtype=dtype) * 4
    grad = torch.randn(rows, ffn, device="cuda", dtype=dtype)
    probs = torch.rand(rows, 1, device="cuda") if weighted else None
    params = ak.params_tensor(ak.spec_params(spec), x.device)
    copy_fwd = copy_ms(rows * (width + ffn) * dtype.itemsize)
    copy_bwd = copy_ms(rows * (2 * width + ffn) * dtype.itemsize)
    return x, grad, probs, params, copy_fwd, copy_bwd


def bench_tiles(spec, weighted, rows, ffn, dtype):
    """Raw Triton forward / backward time over the copy floor for each (tile, warps, max block)."""
    from mcore_activations.fusions import triton_kernels as tk

    variant = ak.KernelVariant.of(spec, has_bias=False, has_probs=weighted)
    x, grad, probs, params, copy_fwd, copy_bwd = _raw_inputs(spec, weighted, rows, ffn, dtype)
    names = ("_FWD_TILE", "_FWD_WARPS", "_BWD_TILE", "_BWD_WARPS", "_BWD_TILE_ROW")
    names += ("_BWD_WARPS_ROW", "_FWD_MAX_BLOCK_N", "_BWD_MAX_BLOCK_N", "_FLAT_UNARY")
    saved = {name: getattr(tk, name) for name in names}
    row = {}
    try:
        tk._FLAT_UNARY = False  # the 2-D tile for every kind (the flat experiment covers the rest)
        for tile, warps, max_n in FWD_CONFIGS:
            tk._FWD_TILE, tk._FWD_WARPS, tk._FWD_MAX_BLOCK_N = tile, warps, max_n
            t = time_ms(lambda: tk.triton_forward(variant, x, None, probs, params))
            row[f"fwd {tile}/{warps}/{max_n}"] = t / copy_fwd
        for tile, warps, max_n in BWD_CONFIGS:
            tk._BWD_TILE, tk._BWD_WARPS, tk._BWD_MAX_BLOCK_N = tile, warps, max_n
            tk._BWD_TILE_ROW, tk._BWD_WARPS_ROW = tile, warps
            t = time_ms(lambda: tk.triton_backward(variant, grad, x, None, probs, params))
            row[f"bwd {tile}/{warps}/{max_n}"] = t / copy_bwd
    finally:
        for name, value in saved.items():
            setattr(tk, name, value)
    return row


FLAT_CASES = {
    "squared-ReLU": (ActivationSpec(ActivationKind.SQUARED_RELU), False, False),
    "squared-ReLU, probs": (ActivationSpec(ActivationKind.SQUARED_RELU), False, True),
    "squared-ReLU(tanh=10)": (
        ActivationSpec(ActivationKind.SQUARED_RELU, gate_tanh_scale=10.0),
        False,
        False,
    ),
    "GELU": (ActivationSpec(ActivationKind.GELU_TANH), False, False),
    "GELU, bias": (ActivationSpec(ActivationKind.GELU_TANH), True, False),
}
FLAT_CONFIGS = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]


def bench_flat(spec, has_bias, weighted, rows, ffn, dtype):
    """Non-gated kernels: 2-D tiles, flat blocks (elements / warps) and torch.compile.

    The backward columns appear for the calls the flat backward serves (no bias, no probs)."""
    from mcore_activations.fusions import triton_kernels as tk
    from tools.benchmark_activations import compile_candidate

    variant = ak.KernelVariant.of(spec, has_bias=has_bias, has_probs=weighted)
    x, grad, probs, params, copy_fwd, copy_bwd = _raw_inputs(spec, weighted, rows, ffn, dtype)
    bias = torch.randn(ffn, device="cuda", dtype=dtype) if has_bias else None
    with_backward = not has_bias and not weighted

    def forward():
        return tk.triton_forward(variant, x, bias, probs, params)

    def backward():
        return tk.triton_backward(variant, grad, x, None, None, params)[0]

    names = ("_FLAT_UNARY", "_FLAT_BLOCK", "_FLAT_WARPS")
    names += ("_FLAT_BLOCK_SOFT_CLAMP", "_FLAT_WARPS_SOFT_CLAMP")
    saved = {name: getattr(tk, name) for name in names}
    fwd, bwd = {}, {}
    try:
        tk._FLAT_UNARY = False
        tiled, tiled_dx = forward(), backward() if with_backward else None
        fwd["2-D tile"] = time_ms(forward)
        if with_backward:
            bwd["bwd 2-D tile"] = time_ms(backward)
        tk._FLAT_UNARY = True
        for block, warps in FLAT_CONFIGS:
            tk._FLAT_BLOCK, tk._FLAT_WARPS = block, warps
            tk._FLAT_BLOCK_SOFT_CLAMP, tk._FLAT_WARPS_SOFT_CLAMP = block, warps
            check_formulation(f"flat {block}/{warps}", forward(), tiled)
            fwd[f"flat {block}/{warps}"] = time_ms(forward)
            if with_backward:
                check_formulation(f"flat backward {block}/{warps}", backward(), tiled_dx)
                bwd[f"bwd flat {block}/{warps}"] = time_ms(backward)
    finally:
        for name, value in saved.items():
            setattr(tk, name, value)
    if not has_bias:
        compiled = compile_candidate(spec, weighted)
        fwd["torch.compile"] = time_ms(lambda: compiled(x, probs))
    return {label: t / copy_fwd for label, t in fwd.items()} | {
        label: t / copy_bwd for label, t in bwd.items()
    }


GLU_CASES = {
    "SwiGLU": (SPECS["SwiGLU"], torch.bfloat16),
    "SwiGLU(clamp=7)": (SPECS["SwiGLU(clamp=7)"], torch.bfloat16),
    "ReGLU": (ActivationSpec(ActivationKind.RELU, gated=True), torch.bfloat16),
    "GEGLU": (ActivationSpec(ActivationKind.GELU_TANH, gated=True), torch.bfloat16),
    "quick-GEGLU(gpt-oss)": (SPECS["quick-GEGLU(gpt-oss)"], torch.bfloat16),
    "SiTU-GLU(4)": (ActivationSpec(_SILU, gated=True, gate_tanh_scale=4.0), torch.bfloat16),
    "SiTU-GLU(4,25)": (SPECS["SiTU-GLU(4,25)"], torch.bfloat16),
    "SwiGLU(clamp=7), fp32": (SPECS["SwiGLU(clamp=7)"], torch.float32),
    "SiTU-GLU(4,25), fp32": (SPECS["SiTU-GLU(4,25)"], torch.float32),
}


def _with_constants(tk, constants: dict, fn):
    """``fn`` run with the module constants of ``triton_kernels`` set to ``constants``."""

    def call():
        saved = {name: getattr(tk, name) for name in constants}
        for name, value in constants.items():
            setattr(tk, name, value)
        try:
            fn()
        finally:
            for name, value in saved.items():
                setattr(tk, name, value)

    return call


def _glu_inputs(spec, rows, ffn, dtype):
    """``(variant, x, grad, params, fwd_bwd)`` for an unweighted GLU ``[rows, 2 * ffn]`` input:
    ``fwd_bwd(fn)`` is a call that runs ``fn`` forward and backward on a leaf copy of ``x``."""
    variant = ak.KernelVariant.of(spec, has_bias=False, has_probs=False)
    x = torch.randn(rows, 2 * ffn, device="cuda", dtype=dtype) * 4
    grad = torch.randn(rows, ffn, device="cuda", dtype=dtype)
    xg = x.clone().requires_grad_()
    params = ak.params_tensor(ak.spec_params(spec), x.device)

    def fwd_bwd(fn):
        def call():
            xg.grad = None
            fn(xg).backward(grad)

        return call

    return variant, x, grad, params, fwd_bwd


def bench_glu(spec, rows, ffn, dtype):
    """Raw GLU kernels at two widest column blocks, torch.compile and TE, timed in turns."""
    from mcore_activations.fusions import triton_kernels as tk

    variant, x, grad, params, _ = _glu_inputs(spec, rows, ffn, dtype)

    def forward():
        return tk.triton_forward(variant, x, None, None, params)

    def backward():
        return tk.triton_backward(variant, grad, x, None, None, params)[0]

    reference_out, reference_dx = forward(), backward()
    fwd = {"floor": copy_fn(rows * 3 * ffn * dtype.itemsize)}
    bwd = {"floor": copy_fn(rows * 5 * ffn * dtype.itemsize)}
    rcp = {"_fast_div": lambda itemsize: tk._HAS_PTX}
    div_full = {"_fast_div": lambda itemsize: False}
    forward_cases = {
        "fwd max 1024": {"_FWD_MAX_BLOCK_N": 1024},
        "fwd max 2048": {"_FWD_MAX_BLOCK_N": 2048},
        "fwd 2048 rcp": {"_FWD_MAX_BLOCK_N": 2048} | rcp,
        "fwd 2048 div.full": {"_FWD_MAX_BLOCK_N": 2048} | div_full,
    }
    for label, constants in forward_cases.items():
        check_formulation(label, _result(tk, constants, forward), reference_out)
        fwd[label] = _with_constants(tk, constants, forward)
    row_1024 = {"_BWD_TILE_ROW": 1024, "_BWD_WARPS_ROW": 4, "_BWD_MAX_BLOCK_N": 1024}
    backward_cases = {
        "bwd 1024/4/1024": row_1024,
        "bwd 1024 rcp": row_1024 | rcp,
        "bwd 1024 div.full": row_1024 | div_full,
        "bwd 2048/8/2048": {"_BWD_TILE_ROW": 2048, "_BWD_WARPS_ROW": 8, "_BWD_MAX_BLOCK_N": 2048},
    }
    for label, constants in backward_cases.items():
        check_formulation(label, _result(tk, constants, backward), reference_dx)
        bwd[label] = _with_constants(tk, constants, backward)
    _add_compile_and_te(fwd, spec, x)
    return _over_floor(fwd) | _over_floor(bwd)


def _over_floor(group: dict) -> dict:
    """``{label: time / floor}`` for a group of candidates that includes ``"floor"``, timed in
    turns without gradients."""
    with torch.no_grad():
        times = time_interleaved(group)
    floor = times.pop("floor")
    return {label: t / floor for label, t in times.items()}


def _add_compile_and_te(group: dict, spec, x) -> None:
    """Adds torch.compile's forward of ``spec`` on ``x`` and TE's (when TE has the op)."""
    from tools.benchmark_activations import compile_candidate

    compiled = compile_candidate(spec, False)
    group["torch.compile"] = lambda: compiled(x, None)
    te = te_candidate(spec, False)
    if te is not None:
        group["TE"] = lambda: te(x, None)


def _result(tk, constants, fn):
    out = []
    _with_constants(tk, constants, lambda: out.append(fn()))()
    return out[0]


REDUCE_SPECS = ("SwiGLU(clamp=7)", "SwiGLU")
# (tile elements, warps) of the unweighted GLU backward's one-row plan, widest block 1024.
REDUCE_CONFIGS = [(1024, 4), (512, 2), (1024, 2), (2048, 4)]
# (rows per program, widest column block, columns per warp, register cap) of the weighted
# backward's plan: the current one first, then with register caps, then other shapes (run 30's
# sweep); one warp per row where a warp holds the whole block (no cross-warp sum).
PROBS_CONFIGS = [(1, 1024, 256, None), (1, 1024, 256, 48), (1, 1024, 256, 40)]
PROBS_CONFIGS += [(1, 1024, 128, None), (1, 1024, 512, None), (1, 1024, 1024, None)]
PROBS_CONFIGS += [(2, 512, 256, None), (2, 256, 256, None), (4, 256, 256, None)]
PROBS_CONFIGS += [(8, 256, 256, None), (1, 2048, 256, None)]


def bench_reduce(spec, rows, ffn, dtype):
    """The GLU backward's plans with and without probabilities, all in the same turns.

    With probabilities the backward also reduces each row's ``grad * act`` to one value: where
    the row's block spans several warps, a cross-warp sum with a barrier in every program. The
    weighted candidates vary the rows per program, the widest column block, the columns per
    warp and the register cap; the unweighted ones the tile and warps, so the weighted-within-5 %
    target compares in one group. A second group times the forward with and without
    probabilities. Each candidate is checked against the current plan's result first (to
    rounding: the sum's order follows the tile).
    """
    from mcore_activations.fusions import triton_kernels as tk

    x = torch.randn(rows, 2 * ffn, device="cuda", dtype=dtype) * 4
    grad = torch.randn(rows, ffn, device="cuda", dtype=dtype)
    probs = torch.rand(rows, 1, device="cuda")
    params = ak.params_tensor(ak.spec_params(spec), x.device)
    plain = ak.KernelVariant.of(spec, has_bias=False, has_probs=False)
    weighted = ak.KernelVariant.of(spec, has_bias=False, has_probs=True)

    def backward(v=plain, p=None):
        return tk.triton_backward(v, grad, x, None, p, params)

    def weighted_backward():
        return backward(weighted, probs)

    # The floor is the unweighted bytes: the weighted call also reads probs and writes their
    # gradient, 8 bytes per row (0.1 % at F = 1536).
    group = {"floor": copy_fn(rows * 5 * ffn * dtype.itemsize)}
    reference = backward()
    for t, w in REDUCE_CONFIGS:
        constants = {"_BWD_TILE_ROW": t, "_BWD_WARPS_ROW": w}
        label = f"bwd {t}/{w}"
        check_formulation(label, _result(tk, constants, backward)[0], reference[0])
        group[label] = _with_constants(tk, constants, backward)
    reference = weighted_backward()
    # A float32 sum of ffn products in another order: rounding well above 2 ulp.
    scale = reference[2].abs().max().item()
    for r, n, c, cap in PROBS_CONFIGS:
        constants = {"_BWD_PROBS_ROWS": r, "_BWD_PROBS_MAX_BLOCK_N": n}
        constants |= {"_BWD_PROBS_COLUMNS_PER_WARP": c, "_BWD_PROBS_MAX_REGISTERS": cap}
        label = f"probs bwd {r} x {n}, {c}/warp, {cap or 'any'} regs"
        out = _result(tk, constants, weighted_backward)
        check_formulation(label, out[0], reference[0])
        torch.testing.assert_close(out[2], reference[2], rtol=1e-4, atol=1e-4 * scale)
        group[label] = _with_constants(tk, constants, weighted_backward)
    row = _over_floor(group)
    forwards = {
        "floor": copy_fn(rows * 3 * ffn * dtype.itemsize),
        "fwd": lambda: tk.triton_forward(plain, x, None, None, params),
        "probs fwd": lambda: tk.triton_forward(weighted, x, None, probs, params),
    }
    return row | _over_floor(forwards)


# (tile elements, warps, widest column block). Forward: the current plan first, then
# Inductor-like one-row blocks of 8 elements per thread, and wider or taller tiles.
LAUNCH_FWD_CONFIGS = [(4096, 8, 2048), (1024, 4, 1024), (2048, 8, 2048), (2048, 4, 2048)]
LAUNCH_FWD_CONFIGS += [(4096, 4, 2048), (8192, 8, 2048), (2048, 4, 1024), (1024, 2, 1024)]
# Backward of an unweighted GLU (the one-row plan's tile, warps, widest block): current first.
LAUNCH_BWD_CONFIGS = [(1024, 4, 1024), (512, 2, 512), (1024, 2, 1024), (2048, 8, 2048)]
LAUNCH_BWD_CONFIGS += [(2048, 4, 1024), (512, 1, 512)]
# Five GLUs, bf16 and float32, for the launch-shape and path experiments.
SAMPLE_GLU_CASES = {
    name: GLU_CASES[name]
    for name in ("SwiGLU", "ReGLU", "SwiGLU(clamp=7)", "GEGLU", "SwiGLU(clamp=7), fp32")
}


def bench_launch(spec, rows, ffn, dtype):
    """GLU forward and backward launch shapes next to torch.compile and TE, in turns.

    The forward candidates vary the tile (``_FWD_TILE``, ``_FWD_WARPS``, ``_FWD_MAX_BLOCK_N``),
    the backward ones the unweighted GLU plan (``_BWD_TILE_ROW``, ``_BWD_WARPS_ROW``,
    ``_BWD_MAX_BLOCK_N``), and the current plans also run with row blocks fastest
    (``_COLUMNS_FASTEST``); each is checked against the current plan's result first.
    """
    from mcore_activations.fusions import triton_kernels as tk

    variant, x, grad, params, _ = _glu_inputs(spec, rows, ffn, dtype)

    def forward():
        return tk.triton_forward(variant, x, None, None, params)

    def backward():
        return tk.triton_backward(variant, grad, x, None, None, params)[0]

    fwd = {"floor": copy_fn(rows * 3 * ffn * dtype.itemsize)}
    reference = forward()
    for tile, warps, max_n in LAUNCH_FWD_CONFIGS:
        constants = {"_FWD_TILE": tile, "_FWD_WARPS": warps, "_FWD_MAX_BLOCK_N": max_n}
        label = f"fwd {tile}/{warps}/{max_n}"
        check_formulation(label, _result(tk, constants, forward), reference)
        fwd[label] = _with_constants(tk, constants, forward)
    rows_fastest = {"_COLUMNS_FASTEST": False}
    check_formulation("rows fastest", _result(tk, rows_fastest, forward), reference)
    fwd["fwd current, rows fastest"] = _with_constants(tk, rows_fastest, forward)
    _add_compile_and_te(fwd, spec, x)
    bwd = {"floor": copy_fn(rows * 5 * ffn * dtype.itemsize)}
    reference = backward()
    for tile, warps, max_n in LAUNCH_BWD_CONFIGS:
        constants = {"_BWD_TILE_ROW": tile, "_BWD_WARPS_ROW": warps, "_BWD_MAX_BLOCK_N": max_n}
        label = f"bwd {tile}/{warps}/{max_n}"
        check_formulation(label, _result(tk, constants, backward), reference)
        bwd[label] = _with_constants(tk, constants, backward)
    check_formulation("rows fastest", _result(tk, rows_fastest, backward), reference)
    bwd["bwd current, rows fastest"] = _with_constants(tk, rows_fastest, backward)
    row = {}
    for group in (fwd, bwd):
        with torch.no_grad():
            times = time_interleaved(group, repeats=11)
        floor = times.pop("floor")
        row |= {label: t / floor for label, t in times.items()}
    return row


def bench_turns(spec, rows, ffn, dtype, repeats=15):
    """The raw kernels against the whole path, in turns, with more repeats than elsewhere.

    Three groups, each timed in turns with its own copy floor: the raw forward next to the
    path's forward (``fused_activation`` without gradients), torch.compile and TE; the raw
    backward; forward+backward through ``fused_activation`` next to TE's and to two copies (a
    forward- and a backward-sized one: the floor of two kernels). Where the path reads slower
    than its raw kernels, the difference is in the path or in how it is timed, not in the kernels.
    Every group is timed twice: primed, as ``time_interleaved`` does by default, and unprimed.
    """
    from mcore_activations.fusions import triton_kernels as tk
    from mcore_activations.fusions.fused_activation import fused_activation

    variant, x, grad, params, fwd_bwd = _glu_inputs(spec, rows, ffn, dtype)

    size = dtype.itemsize
    copy_fwd, copy_bwd = copy_fn(rows * 3 * ffn * size), copy_fn(rows * 5 * ffn * size)
    fwd = {
        "floor": copy_fwd,
        "raw fwd": lambda: tk.triton_forward(variant, x, None, None, params),
        "path fwd": lambda: fused_activation(x, spec),
    }
    _add_compile_and_te(fwd, spec, x)
    bwd = {
        "floor": copy_bwd,
        "raw bwd": lambda: tk.triton_backward(variant, grad, x, None, None, params),
    }
    both = {
        "floor": copy_fn(rows * 8 * ffn * size),
        "two copies": lambda: (copy_fwd(), copy_bwd()),
        "path f+b": fwd_bwd(lambda t: fused_activation(t, spec)),
    }
    te = te_candidate(spec, False)
    if te is not None:
        both["TE f+b"] = fwd_bwd(lambda t: te(t, None))
    row = {}
    groups = ((fwd, torch.no_grad), (bwd, torch.no_grad), (both, torch.enable_grad))
    for prime, suffix in ((True, ""), (False, ", unprimed")):
        for group, grad_mode in groups:
            with grad_mode():
                times = time_interleaved(group, repeats=repeats, prime=prime)
            floor = times.pop("floor")
            row |= {f"{label}{suffix}": t / floor for label, t in times.items()}
    return row


def bench_host_at_shape(spec, rows, ffn, dtype):
    """Host time of one forward+backward at a large shape, and whether the host waits for the GPU.

    For the path (``fused_activation``), the raw kernels and TE's op: the GPU time per call in
    turns, primed and unprimed (``time_interleaved``); the host's wall time per call over 50 calls
    without synchronising, once right after a synchronisation (``host us``) and once behind 200
    ms of queued GPU sleep (``host us, GPU busy``). If the second is much larger than the first,
    a call waits for the GPU somewhere (a hidden synchronisation); if both exceed the GPU time,
    the path is host-bound at this shape. Prints a cProfile of the path's calls behind the sleep.
    """
    import cProfile
    import pstats
    import time

    from mcore_activations.fusions import triton_kernels as tk
    from mcore_activations.fusions.fused_activation import fused_activation

    variant, x, grad, params, fwd_bwd = _glu_inputs(spec, rows, ffn, dtype)

    def raw():
        tk.triton_forward(variant, x, None, None, params)
        tk.triton_backward(variant, grad, x, None, None, params)

    group = {
        "floor": copy_fn(rows * 8 * ffn * dtype.itemsize),
        "path": fwd_bwd(lambda t: fused_activation(t, spec)),
        "raw": raw,
    }
    te = te_candidate(spec, False)
    if te is not None:
        group["TE"] = fwd_bwd(lambda t: te(t, None))
    row = {}
    for prime, suffix in ((True, ", primed"), (False, ", unprimed")):
        times = time_interleaved(group, repeats=11, prime=prime)
        floor = times.pop("floor")
        row |= {f"{label} / floor{suffix}": t / floor for label, t in times.items()}
    busy = sleep_cycles(200.0)
    for label, fn in group.items():
        if label == "floor":
            continue
        for ahead, suffix in ((False, ""), (True, ", GPU busy")):
            torch.cuda.synchronize()
            if ahead:
                torch.cuda._sleep(busy)
            start = time.perf_counter()
            for _ in range(50):
                fn()
            row[f"{label} host us{suffix}"] = (time.perf_counter() - start) / 50 * 1e6
            torch.cuda.synchronize()
    torch.cuda._sleep(busy)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(50):
        group["path"]()
    profile.disable()
    torch.cuda.synchronize()
    print(f"\n50 forward+backward calls of {spec.name}, {rows} x {ffn}, GPU busy")
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)
    return row


def bench_weighted(spec, rows, ffn, dtype):
    """Forward+backward through ``fused_activation`` with and without probabilities, in turns.

    Only this project's path, so the weighted and unweighted calls share the card and the
    allocator with nothing else in between (the side-by-side benchmark interleaves TE and
    torch.compile too). Also the host time per call, measured without synchronising: below the
    device time the path is bound by the GPU.
    """
    import time

    from mcore_activations.fusions.fused_activation import fused_activation

    x = torch.randn(rows, 2 * ffn, device="cuda", dtype=dtype) * 4
    grad = torch.randn(rows, ffn, device="cuda", dtype=dtype)
    probs = torch.rand(rows, 1, device="cuda")
    xg, pg = x.clone().requires_grad_(), probs.clone().requires_grad_()

    def call(p):
        def run():
            xg.grad = pg.grad = None
            fused_activation(xg, spec, probs=p).backward(grad)

        return run

    cases = {"unweighted": call(None), "probs": call(pg), "probs without grad": call(probs)}
    row = {f"{label} ms": ms for label, ms in time_interleaved(cases).items()}
    row["probs / unweighted"] = row["probs ms"] / row["unweighted ms"]
    for label, run in cases.items():
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            run()
        row[f"{label} host us"] = (time.perf_counter() - start) / 50 * 1e6
        torch.cuda.synchronize()
    return row


PATH_CASES = TILE_CASES | {
    "GELU": (ActivationSpec(ActivationKind.GELU_TANH), False),
    "squared-ReLU, probs": (ActivationSpec(ActivationKind.SQUARED_RELU), True),
}


def bench_path(spec, weighted, rows, ffn, dtype, has_bias=False):
    """Raw kernels against the whole autograd path: GPU time, host time, allocations, kernels.

    ``host us`` is the wall time per call of 50 calls with one synchronisation at the end: when
    it exceeds the GPU time, the path is bound by its host side at this shape (when the GPU is
    the bound, the launch queue fills and the host waits, so host time reads as GPU time).
    ``device allocs`` counts the caching allocator's cudaMalloc calls during those calls (each
    one can synchronise the device). ``has_bias``: a bias of the input's width, with its
    gradient. The profiler table lists every kernel the path launches, by GPU time.
    """
    import time

    from mcore_activations.fusions import triton_kernels as tk
    from mcore_activations.fusions.fused_activation import fused_activation

    variant = ak.KernelVariant.of(spec, has_bias=has_bias, has_probs=weighted)
    x, grad, probs, params, copy_fwd, copy_bwd = _raw_inputs(spec, weighted, rows, ffn, dtype)
    xg = x.clone().requires_grad_()
    pg = probs.clone().requires_grad_() if weighted else None
    bias = None
    if has_bias:
        bias = torch.randn(x.shape[1], device="cuda", dtype=dtype).requires_grad_()

    def fwd_bwd():
        for leaf in (xg, pg, bias):
            if leaf is not None:
                leaf.grad = None
        fused_activation(xg, spec, bias=bias, probs=pg).backward(grad)

    def raw():
        tk.triton_forward(variant, x, bias, probs, params)
        tk.triton_backward(variant, grad, x, bias, probs, params)

    row = {}
    for label, fn in (("raw", raw), ("path", fwd_bwd)):
        row[f"{label} f+b / floor"] = time_ms(fn) / (copy_fwd + copy_bwd)
        torch.cuda.synchronize()
        allocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
        start = time.perf_counter()
        for _ in range(50):
            fn()
        host = (time.perf_counter() - start) / 50
        torch.cuda.synchronize()
        row[f"{label} host us"] = host * 1e6
        allocs = torch.cuda.memory_stats().get("num_device_alloc", 0) - allocs
        row[f"{label} device allocs"] = allocs
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            fwd_bwd()
        torch.cuda.synchronize()
    print(
        f"\n10 forward+backward calls of {spec.name}, {rows} x {ffn}, weighted={weighted}, "
        f"bias={has_bias}"
    )
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    return row


def bench_host(rounds: int = 5, calls: int = 1000):
    """Microseconds per call of each layer on a tiny input; prints a cProfile of the top.

    Every layer is timed once per round, the rounds one after another, and the least of the
    rounds is kept: host noise only adds time, and interleaving spreads a slow spell of the
    host over all layers instead of one. The bias rows time the backward with a bias and, apart,
    the three torch calls around its kernel (the partial-sum buffer, its sum over programs, the
    cast to the bias's dtype)."""
    import cProfile
    import pstats
    import time

    from mcore_activations.fusions import activation_ops
    from mcore_activations.fusions import triton_kernels as tk
    from mcore_activations.fusions.fused_activation import fused_activation

    spec = SPECS["SwiGLU(clamp=7)"]
    variant = ak.KernelVariant.of(spec, has_bias=False, has_probs=False)
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    grad = torch.randn(8, 32, device="cuda", dtype=torch.bfloat16)
    params = ak.params_tensor(ak.spec_params(spec), x.device)
    out = torch.empty(8, 32, device="cuda", dtype=torch.bfloat16)
    biased = ak.KernelVariant.of(spec, has_bias=True, has_probs=False)
    bias = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    biasg = bias.clone().requires_grad_()
    partials = torch.randn(8, 64, device="cuda")
    summed = partials.sum(dim=0)

    def launch():
        kwargs = tk._forward_plan(variant, 32, x.element_size())[2]
        tk._activation_fwd_kernel[(2, 1)](x, None, None, params, out, 8, 32, **kwargs)

    def fwd_bwd():
        xg.grad = None
        fused_activation(xg, spec).backward(grad)

    def fwd_bwd_bias():
        xg.grad = biasg.grad = None
        fused_activation(xg, spec, bias=biasg).backward(grad)

    class _PassThrough(torch.autograd.Function):
        # The least a Python autograd.Function costs: one output allocation each way, no kernel.
        @staticmethod
        def forward(ctx, x):
            return torch.empty(8, 32, device=x.device, dtype=x.dtype)

        @staticmethod
        def backward(ctx, grad):
            return torch.empty(8, 64, device=grad.device, dtype=grad.dtype)

    def autograd_floor():
        xg.grad = None
        _PassThrough.apply(xg).backward(grad)

    class _Bare(torch.autograd.Function):
        # The same two Triton calls behind a minimal autograd.Function: what this project's
        # layers add to a forward+backward is "fused_activation fwd+bwd" less this.
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return tk.triton_forward(variant, x, None, None, params)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return tk.triton_backward(variant, grad, x, None, None, params)[0]

    def bare_fwd_bwd():
        xg.grad = None
        _Bare.apply(xg).backward(grad)

    def native_fwd_bwd():
        # One native op each way (silu on the first half), no Python autograd.Function.
        xg.grad = None
        torch.nn.functional.silu(xg[:, :32]).backward(grad)

    layers = {
        "torch.empty": lambda: torch.empty(8, 32, device="cuda", dtype=torch.bfloat16),
        "triton launch": launch,
        "triton_forward": lambda: tk.triton_forward(variant, x, None, None, params),
        "forward op": lambda: activation_ops.run_forward(variant, x, None, None, params),
        "fused_activation (no grad)": lambda: fused_activation(x, spec),
        "triton_backward": lambda: tk.triton_backward(variant, grad, x, None, None, params),
        "fused_activation fwd+bwd": fwd_bwd,
        "triton_backward, bias": lambda: tk.triton_backward(biased, grad, x, bias, None, params),
        "bias partials: torch.empty": lambda: torch.empty((8, 64), device="cuda"),
        "bias partials: sum(dim=0)": lambda: partials.sum(dim=0),
        "bias partials: sum cast to bf16": lambda: summed.to(torch.bfloat16),
        "fused_activation fwd+bwd, bias": fwd_bwd_bias,
        "autograd floor: Python Function, no kernels, fwd+bwd": autograd_floor,
        "bare Function around the two Triton calls, fwd+bwd": bare_fwd_bwd,
        "autograd floor: one native op, fwd+bwd": native_fwd_bwd,
    }
    te = te_candidate(spec, False)
    if te is not None:

        def te_fwd_bwd():
            xg.grad = None
            te(xg, None).backward(grad)

        layers["TE op (no grad)"] = lambda: te(x, None)
        layers["TE op fwd+bwd"] = te_fwd_bwd
    times = {label: [] for label in layers}
    for _ in range(rounds):
        for label, fn in layers.items():
            with torch.no_grad() if "bwd" not in label else torch.enable_grad():
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            times[label].append((time.perf_counter() - start) / calls * 1e6)
    row = {}
    for label, spread in times.items():
        row[label] = min(spread)
        print(f"{label}: {row[label]:.1f} us/call (rounds: {max(spread):.1f} at most)", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(500):
        fwd_bwd()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    pstats.Stats(profile).sort_stats("cumulative").print_stats("mcore_activations", 25)
    return row


def _print_table(title, rows, unit="time / copy of the same bytes", digits=2):
    print(f"\n{title} ({unit})")
    columns = list(dict.fromkeys(c for row in rows.values() for c in row))  # a row may lack some
    print("| activation | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in rows.items():
        cells = (f"{row[c]:.{digits}f}" if c in row else "-" for c in columns)
        print(f"| {name} | " + " | ".join(cells) + " |")


def _experiments(rows: int, ffn: int, bias: bool = False) -> dict:
    """``name -> (title, run, table options)``; ``run()`` returns ``{case: result row}``
    (``bias``: the ``path`` experiment's calls take a bias)."""
    bf16 = torch.bfloat16
    weighted_unit = {"unit": "ms, host us per call, ratio", "digits": 3}
    return {
        "compile": (
            "compile modes",
            lambda: {n: bench_compile(s, rows, ffn, bf16) for n, s in COMPILE_SPECS.items()},
            {},
        ),
        "layout": (
            "GLU backward layout",
            lambda: {n: bench_layout(s, rows, ffn, bf16) for n, s in SPECS.items()},
            {},
        ),
        "tiles": (
            "Triton launch shapes: tile/warps/max column block",
            lambda: {n: bench_tiles(s, w, rows, ffn, bf16) for n, (s, w) in TILE_CASES.items()},
            {},
        ),
        "flat": (
            "non-gated forward: 2-D tiles vs flat blocks",
            lambda: {
                n: bench_flat(s, b, w, rows, ffn, bf16) for n, (s, b, w) in FLAT_CASES.items()
            },
            {},
        ),
        "glu": (
            "GLU kinds: widest column block, compile and TE, in turns",
            lambda: {n: bench_glu(s, rows, ffn, d) for n, (s, d) in GLU_CASES.items()},
            {},
        ),
        "reduce": (
            "GLU backward row plans, with and without probs, in turns",
            lambda: {n: bench_reduce(SPECS[n], rows, ffn, bf16) for n in REDUCE_SPECS},
            {},
        ),
        "launch": (
            "GLU launch shapes, compile and TE, in turns",
            lambda: {n: bench_launch(s, rows, ffn, d) for n, (s, d) in SAMPLE_GLU_CASES.items()},
            {},
        ),
        "weighted": (
            "forward+backward with and without probs, in turns",
            lambda: {n: bench_weighted(SPECS[n], rows, ffn, bf16) for n in REDUCE_SPECS},
            weighted_unit,
        ),
        "turns": (
            "raw kernels against the path, in turns",
            lambda: {n: bench_turns(s, rows, ffn, d) for n, (s, d) in SAMPLE_GLU_CASES.items()},
            {},
        ),
        "host-at-shape": (
            "forward+backward at this shape: GPU time and host time per call",
            lambda: {n: bench_host_at_shape(SPECS[n], rows, ffn, bf16) for n in REDUCE_SPECS},
            {"unit": "ratio, us"},
        ),
        "path": (
            "raw kernels vs the autograd path",
            lambda: {
                n: bench_path(s, w, rows, ffn, bf16, bias) for n, (s, w) in PATH_CASES.items()
            },
            {},
        ),
    }


def main(argv=None):
    """Runs the selected experiments and prints markdown tables (and JSON on request)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--ffn", type=int, default=8192)
    names = [*_experiments(1, 1), "host", "all"]
    parser.add_argument("--experiment", choices=names, default="all")
    parser.add_argument(
        "--bias", action="store_true", help="path: every call with a bias of the input's width"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_kernel_variants needs a CUDA GPU")
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(json.dumps(env))
    results = {"env": env}
    for name, (title, run, table) in _experiments(args.rows, args.ffn, args.bias).items():
        if args.experiment in (name, "all"):
            results[name] = run()
            _print_table(title, results[name], **table)
    if args.experiment in ("host", "all"):
        results["host"] = bench_host()  # prints its own lines and a cProfile
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
