"""Triton kernels for every activation an ActivationSpec describes (the kernel layer on CUDA).

One forward and one backward kernel body cover every kernel variant
(:class:`~mcore_activations.fusions.activation_kernels.KernelVariant`); the structure (kind,
gated, clamps, bias / probs present, GLU interleave) arrives as ``tl.constexpr`` arguments, so
each variant compiles to straight-line code. The runtime numbers (clamp ``c``, tanh scales,
linear offset) are read from the float32 ``params`` tensor on the device, never baked into the
code: one compiled kernel serves every value, which is what makes the path immune to the
stale-constant class of bug (docs/compile-safety.md) and CUDA-graph capturable.

Numerics follow the torch reference in ``activation_kernels``: the same formulas, loads upcast
to float32, all math in float32, stores cast to the output dtype. One is rearranged: GELU's
``0.5 * (1 + tanh(z))`` is evaluated as ``sigmoid(2z)``, which costs one exponential and one
division instead of a tanh and is accurate where ``1 + tanh(z)`` cancels. Exponentials are
``tl.exp2`` of a log2(e)-scaled argument, which on NVIDIA GPUs flushes results below 2**-126
to 0 (``_LOG2_E`` says where that can show: nowhere above 1e-35). Every division (the
sigmoid's, tanh's; SiTU-GLU's forward shares one among its fractions, ``_situ_glu``) has a
divisor ``>= 1``; for 16-bit inputs on CUDA it runs as a hardware reciprocal and a multiply
(within 1.5 ulp), otherwise as div.full.f32 (within 2 ulp; ``_div`` says why). Clamps are ``where``
selects that keep NaN (as ``torch.clamp`` does; ``tl.minimum`` would drop it), gradient masks are
inclusive at the boundary and multiplied in, so NaN inputs give NaN outputs and gradients.

Layout: a GLU input row is ``[gate | linear]`` or, with interleave ``k``, blocks of ``k`` gate
columns followed by ``k`` linear columns. Each program owns a ``BLOCK_M x BLOCK_N`` tile of
*output* columns and reads (backward: writes) the matching gate and linear columns directly, so
``dx`` is produced in its final layout with no concatenation or copy.
Programs are numbered with a row's column blocks fastest (``_tile_ids``), so the programs the GPU
runs together stream consecutive memory.

Reductions are deterministic: the probability gradient is summed per row inside a program and
the per-column-block partials are added by one ``torch.sum`` of fixed shape; the bias gradient
is accumulated element-wise over a fixed row range per program (the ranges depend only on the
shape), summed over the tile's rows at the end, and the per-range partials are added the same
way. No atomics anywhere.

With ``TRITON_INTERPRET=1`` set before this module is imported the same kernels run on CPU
tensors (the CPU test tier does this).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from mcore_activations.activation_spec import GELU_TANH_COEF, QUICK_GELU_ALPHA

_QUICK_GELU_ALPHA = tl.constexpr(QUICK_GELU_ALPHA)
_SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
_INV_SQRT_2 = tl.constexpr(1.0 / math.sqrt(2.0))
_INV_SQRT_2PI = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
_GELU_TANH_COEF = tl.constexpr(GELU_TANH_COEF)
# (Constants multiply from the right: the Triton 3.7 interpreter mis-types constexpr * tensor.)


# ----------------------------------------------------------------------------- elementwise math
# rcp.approx is PTX: the interpreter and ROCm always take the portable division.
_HAS_PTX = os.environ.get("TRITON_INTERPRET") != "1" and not torch.version.hip
# Every exponential is ``tl.exp2`` of an argument already scaled by log2(e), never ``tl.exp``.
# On NVIDIA GPUs (Triton 3.6 and 3.7) ``tl.exp2`` is one ``ex2.approx.ftz`` instruction, while
# ``tl.exp`` adds a multiply by log2(e) and a guard that rescales arguments below -126 so that
# subnormal results survive (a compare and two predicated multiplies): 3-4 instructions per
# exponential, in kernels that SiTU-GLU's three per element make bound by instruction issue
# (docs/bench/history.md, session 10). The call sites fold log2(e) into a constant they multiply
# by anyway; scaling it by -1, -2 or -0.5 is exact, so every argument is the one ``tl.exp`` saw.
# Results at or above 2**-126 are therefore the same, smaller ones flush to 0. In the sigmoid and
# the tanh an exponential only enters as ``1 + e`` or ``1 - e``, which a subnormal ``e`` leaves
# unchanged. GELU's density and GELU-tanh's ``sigmoid(-|2z|)`` are used in products; there a
# result changes only where it is itself below about 1e-35 (the largest factor on an underflowed
# exponential is GELU-tanh's derivative near x = -10, about 230).
_LOG2_E = tl.constexpr(math.log2(math.e))


@triton.jit
def _div(a, b, FAST_DIV: tl.constexpr):
    """``a / b`` for divisors ``b >= 1`` (every division here is by ``1 + exp(...)`` or a
    product of such terms).

    ``FAST_DIV``: ``a * rcp.approx(b)``, one special-function reciprocal (within 1 ulp) and a
    multiply, within 1.5 ulp of ``a / b``. Otherwise ``tl.math.fdiv``, the full-range
    div.full.f32 (within 2 ulp). Triton's ``/`` and ``tl.sigmoid`` emit IEEE division, a
    multi-instruction sequence per element that made SiTU-GLU compute-bound on an H200. The
    launch plan picks ``FAST_DIV`` for 16-bit inputs, where it measured faster (SiTU-GLU(4,25)
    bf16 forward 1.61x -> 1.47x the copy floor); fp32 inputs keep div.full, which measured
    faster there (1.04x against 1.17x). With b > 2**126 the reciprocal flushes to 0, where
    a / b would be below 1e-38.
    """
    if FAST_DIV:
        r = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [b], dtype=tl.float32, is_pure=True, pack=1
        )
        return a * r
    else:
        return tl.math.fdiv(a, b)


@triton.jit
def _sigmoid(x, FAST_DIV: tl.constexpr):
    # 1 / (1 + exp(-x)); exp(-x) overflows to inf for x < -88, giving 0, and NaN stays NaN.
    return _div(1.0, 1.0 + tl.exp2(x * -_LOG2_E), FAST_DIV)


@triton.jit
def _tanh_small(x):
    # tanh(x) for |x| < 1/16, where the exponential forms cancel: the odd Taylor polynomial to x^5
    # (the x^7 term, 17/315 x^7, is below 4e-9 of x there: under float32's half ulp).
    x2 = x * x
    return x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0)))


@triton.jit
def _tanh(x, FAST_DIV: tl.constexpr):
    # tanh from exp, so the CPU interpreter and the GPU compute the same formula (libdevice's
    # tanh has no interpreter implementation): (1 - e) / (1 + e) with e = exp(-2|x|) <= 1, and
    # the sign put back. SiTU-GLU's gate in the backward and the soft clamp of non-gated kinds
    # use it (the forwards take _tanh_fraction).
    ax = tl.abs(x)
    e = tl.exp2(ax * (-2.0 * _LOG2_E))
    t = _div(1.0 - e, 1.0 + e, FAST_DIV)
    # NaN fails both comparisons and falls through to t, which is NaN.
    return tl.where(ax < 0.0625, _tanh_small(x), tl.where(x < 0.0, -t, t))


@triton.jit
def _tanh_via_sigmoid(x, FAST_DIV: tl.constexpr):
    # tanh(x) = 2 sigmoid(2x) - 1 = 1 - 2 / (1 + exp(2x)): no sign split, since exp(2x)
    # overflows to inf above x = 44 (giving 1) and flushes to 0 below -44 (giving -1); NaN stays
    # NaN. The subtraction cancels as |x| -> 0: at the Taylor branch's switch (1/16) it costs a
    # factor of 16, up to about 30 float32 ulp of the result (against _tanh's 7). Two
    # instructions fewer than _tanh; SiTU-GLU's linear half uses it in the backward and the
    # 16-bit forward. H200, bf16 SiTU-GLU(4,25), raw backward / copy floor at 16384 x 8192
    # (docs/bench/history.md, session 11): 1.115 -> 1.094 with it for both halves, 1.136 with it
    # for the linear half only; but SiTU-GLU(4), whose only tanh is the gate's, lost 0.03-0.05
    # weighted or with a bias when its gate took this form, so the gate keeps _tanh.
    t = 1.0 - 2.0 * _div(1.0, 1.0 + tl.exp2(x * (2.0 * _LOG2_E)), FAST_DIV)
    # NaN fails the comparison and falls through to t, which is NaN.
    return tl.where(tl.abs(x) < 0.0625, _tanh_small(x), t)


@triton.jit
def _tanh_fraction(x):
    """``(n, d)`` with ``tanh(x) == n / d`` and ``1 <= d <= 2``: the division left to the caller,
    which can share one reciprocal among several fractions."""
    ax = tl.abs(x)
    e = tl.exp2(ax * (-2.0 * _LOG2_E))
    d = 1.0 + e
    # As in _tanh; NaN falls through to 1 - e, which is NaN.
    n = tl.where(ax < 0.0625, _tanh_small(x) * d, tl.where(x < 0.0, e - 1.0, 1.0 - e))
    return n, d


@triton.jit
def _sigmoid_fraction(x):
    """``(n, d)`` with ``sigmoid(x) == n / d`` and ``1 <= d <= 2``: e = exp(-|x|) never overflows
    (x < 0 gives e / (1 + e)), so the denominators of several fractions can be multiplied
    without reaching inf. e flushes to 0 below x = -87, where sigmoid(x) < 2**-126."""
    e = tl.exp2(tl.abs(x) * -_LOG2_E)
    # NaN: e is NaN and so is d.
    return tl.where(x < 0.0, e, 1.0), 1.0 + e


@triton.jit
def _base_and_grad(x, KIND: tl.constexpr, FAST_DIV: tl.constexpr):
    """``act(x)`` and ``act'(x)`` for the base activation ``KIND``."""
    if KIND == "silu":
        s = _sigmoid(x, FAST_DIV)
        y = x * s
        d = s * (1.0 + x * (1.0 - s))
    elif KIND == "quick_gelu":
        s = _sigmoid(x * _QUICK_GELU_ALPHA, FAST_DIV)
        y = x * s
        d = s * (1.0 + x * _QUICK_GELU_ALPHA * (1.0 - s))
    elif KIND == "gelu":
        cdf = 0.5 * (1.0 + tl.erf(x * _INV_SQRT_2))
        pdf = tl.exp2(x * x * (-0.5 * _LOG2_E)) * _INV_SQRT_2PI
        y = x * cdf
        d = cdf + x * pdf
    elif KIND == "gelu_tanh":
        # 0.5 * (1 + tanh(z)) == sigmoid(2z): one exponential and one division, and accurate
        # where 1 + tanh(z) cancels (x << 0). sigmoid of -|2z| and its complement come from the
        # same exp(-|2z|), which never overflows, so 1 - s is accurate for x >> 0 as well.
        z2 = (x + x * x * x * _GELU_TANH_COEF) * (2.0 * _SQRT_2_OVER_PI)
        e = tl.exp2(tl.abs(z2) * -_LOG2_E)
        hi = _div(1.0, 1.0 + e, FAST_DIV)  # sigmoid(|2z|)
        lo = e * hi  # sigmoid(-|2z|) == 1 - sigmoid(|2z|)
        s = tl.where(z2 < 0.0, lo, hi)  # NaN selects hi, which is NaN
        one_minus_s = tl.where(z2 < 0.0, hi, lo)
        d_inner = (1.0 + x * x * (3.0 * _GELU_TANH_COEF)) * (2.0 * _SQRT_2_OVER_PI)
        y = x * s
        d = s + x * s * one_minus_s * d_inner
    elif KIND == "relu":
        # where(x < 0, 0, x) keeps NaN, as torch.relu does; the derivative (x > 0) is 0 at NaN.
        y = tl.where(x < 0.0, 0.0, x)
        d = tl.where(x > 0.0, 1.0, 0.0)
    else:
        tl.static_assert(KIND == "squared_relu", "unknown activation kind")
        r = tl.where(x < 0.0, 0.0, x)
        y = r * r
        d = 2.0 * r
    return y, d


@triton.jit
def _glu_terms(
    gate,
    lin,
    params_ptr,
    KIND: tl.constexpr,
    CLAMP: tl.constexpr,
    GATE_TANH: tl.constexpr,
    LINEAR_TANH: tl.constexpr,
    FAST_DIV: tl.constexpr,
):
    """Activation ``a``, linear factor ``L`` (offset added) and their local derivatives with the
    clamp masks folded in (``da/dgate``, ``dL/dlinear``)."""
    if CLAMP:
        c = tl.load(params_ptr + 0)
        gate_mask = tl.where(gate <= c, 1.0, 0.0)
        lin_mask = tl.where((lin >= -c) & (lin <= c), 1.0, 0.0)
        gate = tl.where(gate > c, c, gate)
        lin = tl.where(lin > c, c, tl.where(lin < -c, -c, lin))
    if GATE_TANH:  # SiTU-GLU gate: s_g * tanh(g / s_g) * sigmoid(g)
        s_g = tl.load(params_ptr + 1)
        # One scalar reciprocal per program instead of a division per element: the special-
        # function unit, not memory, bounds SiTU-GLU on an H200, and every division costs one.
        t = _tanh(gate * (1.0 / s_g), FAST_DIV)
        sig = _sigmoid(gate, FAST_DIV)
        act = s_g * t * sig
        d_act = (1.0 - t * t) * sig + act * (1.0 - sig)
    else:
        act, d_act = _base_and_grad(gate, KIND, FAST_DIV)
    if LINEAR_TANH:
        s_l = tl.load(params_ptr + 2)
        t_l = _tanh_via_sigmoid(lin * (1.0 / s_l), FAST_DIV)
        lin = s_l * t_l
        d_lin = 1.0 - t_l * t_l
    else:
        d_lin = tl.full(lin.shape, 1.0, tl.float32)
    lin = lin + tl.load(params_ptr + 3)
    if CLAMP:
        d_act = d_act * gate_mask
        d_lin = d_lin * lin_mask
    return act, lin, d_act, d_lin


@triton.jit
def _situ_glu(
    gate,
    lin,
    params_ptr,
    LINEAR_TANH: tl.constexpr,
    SHORT_INPUT: tl.constexpr,
    FAST_DIV: tl.constexpr,
):
    """SiTU-GLU's forward value ``s_g * tanh(g / s_g) * sigmoid(g) * (s_l * tanh(u / s_l) + o)``
    (``u + o`` without ``s_l``), its fractions multiplied out over one denominator (in [1, 4];
    in float32 the linear tanh's joins it too, [1, 8]).

    _glu_terms spends a division on each fraction, and the forward has no gradient terms to
    share them with: on an H200 the bf16 forward was bound by the special-function unit, which
    runs reciprocals and exponentials at an eighth of the FMA rate (6.2 of its 49 instructions
    per element), and in float32 each div.full is several instructions. Raw forward / copy floor,
    SiTU-GLU(4,25) at 16384 x 8192: bf16 1.39 -> 1.24, float32 1.12 -> 0.97-0.98
    (docs/bench/history.md, session 11). The extra rounding is a few float32 ulp.

    ``SHORT_INPUT`` (16-bit inputs) picks the linear tanh's form. On a GPU it coincides with
    ``FAST_DIV``; it is kept apart so the CPU interpreter, which has no hardware reciprocal,
    still runs the 16-bit form (with full divisions).
    """
    s_g = tl.load(params_ptr + 1)
    n_t, d_t = _tanh_fraction(gate * (1.0 / s_g))
    n_s, d_s = _sigmoid_fraction(gate)
    num = n_t * n_s
    den = d_t * d_s
    # s_g is folded into the linear factor's per-program constants: one multiply less each.
    offset = tl.load(params_ptr + 3)
    if LINEAR_TANH:
        s_l = tl.load(params_ptr + 2)
        if SHORT_INPUT:
            # A hardware reciprocal is one instruction, fewer than folding the linear tanh into
            # the shared denominator costs (bf16, sm_90, Triton 3.6: 45.5 instructions per
            # element against 49.5, measured with tools/inspect_kernel_sass.py, session 11).
            t_l = _tanh_via_sigmoid(lin * (1.0 / s_l), FAST_DIV)
            num = num * (t_l * (s_g * s_l) + s_g * offset)
        else:
            # div.full is several instructions: one division for all three fractions.
            n_l, d_l = _tanh_fraction(lin * (1.0 / s_l))
            num = num * (n_l * (s_g * s_l) + d_l * (s_g * offset))
            den = den * d_l
    else:
        # The gate factor is finished before the unbounded linear factor multiplies it, so a
        # |u| near the float32 maximum cannot overflow the product (or turn 0 * inf into NaN).
        return _div(num * s_g, den, FAST_DIV) * (lin + offset)
    return _div(num, den, FAST_DIV)


@triton.jit
def _unary_terms(
    h, params_ptr, KIND: tl.constexpr, SOFT_CLAMP: tl.constexpr, FAST_DIV: tl.constexpr
):
    """Value and derivative of a non-gated activation (``s * tanh(h / s)`` applied first)."""
    if SOFT_CLAMP:
        s = tl.load(params_ptr + 1)
        t = _tanh(h * (1.0 / s), FAST_DIV)
        y, d = _base_and_grad(s * t, KIND, FAST_DIV)
        d = d * (1.0 - t * t)
    else:
        y, d = _base_and_grad(h, KIND, FAST_DIV)
    return y, d


@triton.jit
def _glu_columns(cols, F, INTERLEAVE: tl.constexpr):
    """Input columns of the gate and linear halves that produce output columns ``cols``."""
    if INTERLEAVE == 0:
        gcol = cols
        lcol = cols + F
    else:
        gcol = (cols // INTERLEAVE) * (2 * INTERLEAVE) + cols % INTERLEAVE
        lcol = gcol + INTERLEAVE
    return gcol, lcol


@triton.jit
def _tile_ids(F, BLOCK_N: tl.constexpr, COLUMNS_FASTEST: tl.constexpr):
    """``(row block, column block)`` of this program.

    ``COLUMNS_FASTEST``: a 1-D grid whose consecutive programs take a row's column blocks in
    turn, so programs that run together read and write consecutive memory, as a copy kernel
    does. Otherwise a 2-D grid with row blocks fastest (rows on axis 0, which has no 65535
    limit), whose neighbours sit a whole row apart.
    """
    if COLUMNS_FASTEST:
        col_blocks = tl.cdiv(F, BLOCK_N)
        pid = tl.program_id(0)
        return pid // col_blocks, pid % col_blocks
    else:
        return tl.program_id(0), tl.program_id(1)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _activation_fwd_kernel(
    x_ptr,
    bias_ptr,
    probs_ptr,
    params_ptr,
    out_ptr,
    rows,
    F,
    KIND: tl.constexpr,
    GATED: tl.constexpr,
    CLAMP: tl.constexpr,
    GATE_TANH: tl.constexpr,
    LINEAR_TANH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    FAST_DIV: tl.constexpr,
    COLUMNS_FASTEST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(F, BLOCK_N, COLUMNS_FASTEST)
    row = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = row < rows
    col_ok = cols < F
    mask = row_ok[:, None] & col_ok[None, :]
    # int64 row offsets: rows * width passes 2**31 for large token counts.
    row64 = row.to(tl.int64)[:, None]
    if GATED:
        x_row = x_ptr + row64 * (2 * F)
        gcol, lcol = _glu_columns(cols, F, INTERLEAVE)
        gate = tl.load(x_row + gcol[None, :], mask=mask, other=0.0).to(tl.float32)
        lin = tl.load(x_row + lcol[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            gate += tl.load(bias_ptr + gcol, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            lin += tl.load(bias_ptr + lcol, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATE_TANH:
            # _situ_glu has no clamp; ActivationSpec refuses a clamp with a gate tanh.
            tl.static_assert(not CLAMP, "SiTU-GLU with a clamp has no fused forward")
            short_input: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth <= 16
            y = _situ_glu(gate, lin, params_ptr, LINEAR_TANH, short_input, FAST_DIV)
        else:
            act, lin, _, _ = _glu_terms(
                gate, lin, params_ptr, KIND, CLAMP, GATE_TANH, LINEAR_TANH, FAST_DIV
            )
            y = act * lin
    else:
        h = tl.load(x_ptr + row64 * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            h += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y, _ = _unary_terms(h, params_ptr, KIND, GATE_TANH, FAST_DIV)
    if HAS_PROBS:
        y = y * tl.load(probs_ptr + row, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + row64 * F + cols[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _unary_fwd_flat_kernel(
    x_ptr,
    bias_ptr,
    probs_ptr,
    params_ptr,
    out_ptr,
    n,
    F,
    KIND: tl.constexpr,
    SOFT_CLAMP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    WIDE: tl.constexpr,
    FAST_DIV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # A non-gated activation is elementwise over the contiguous [rows, F] input, which is the
    # output's layout too: one flat stream of BLOCK elements per program, consecutive programs
    # on consecutive memory, as a copy kernel runs. The column (bias) and row (probs) of an
    # element are recovered by division only when those inputs exist.
    start = tl.program_id(0).to(tl.int64) * BLOCK if WIDE else tl.program_id(0) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    ok = offs < n
    h = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(bias_ptr + offs % F, mask=ok, other=0.0).to(tl.float32)
    y, _ = _unary_terms(h, params_ptr, KIND, SOFT_CLAMP, FAST_DIV)
    if HAS_PROBS:
        y = y * tl.load(probs_ptr + offs // F, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _unary_bwd_flat_kernel(
    grad_ptr,
    x_ptr,
    params_ptr,
    dx_ptr,
    n,
    KIND: tl.constexpr,
    SOFT_CLAMP: tl.constexpr,
    WIDE: tl.constexpr,
    FAST_DIV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # The non-gated backward without bias or probabilities has no reduction: dx = grad * act'(x)
    # element by element, streamed like the flat forward.
    start = tl.program_id(0).to(tl.int64) * BLOCK if WIDE else tl.program_id(0) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    ok = offs < n
    h = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    _, d = _unary_terms(h, params_ptr, KIND, SOFT_CLAMP, FAST_DIV)
    tl.store(dx_ptr + offs, (g * d).to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_loads(
    grad_ptr,
    x_ptr,
    probs_ptr,
    row,
    row_ok,
    columns,
    F,
    GATED: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    """The backward's streamed inputs for rows ``row``, in their own dtypes: the output gradient,
    the gate (or only) half, the linear half (the gate half again when not gated) and the
    probabilities (``row_ok`` when there are none, a placeholder). ``columns``: the program's
    output columns, their mask and the gate and linear input columns they read."""
    cols, col_ok, gcol, lcol = columns
    mask = row_ok[:, None] & col_ok[None, :]
    row64 = row.to(tl.int64)[:, None]
    g = tl.load(grad_ptr + row64 * F + cols[None, :], mask=mask, other=0.0)
    x_row = x_ptr + row64 * (2 * F if GATED else F)
    gate = tl.load(x_row + gcol[None, :], mask=mask, other=0.0)
    if GATED:
        lin = tl.load(x_row + lcol[None, :], mask=mask, other=0.0)
    else:
        lin = gate
    if HAS_PROBS:
        p = tl.load(probs_ptr + row, mask=row_ok, other=0.0)
    else:
        p = row_ok
    return g, gate, lin, p


# rows_per_program is not specialised: by default Triton compiles an integer argument that is a
# multiple of 16 with a divisibility hint (and one equal to 1 as a constant), so the row split's
# arithmetic alone would pick the machine code, and which code is faster depends on the kind.
# The plan's ROWS_ALIGNED says when the split is a multiple of 16 and the kernel may know it.
@triton.jit(do_not_specialize=["rows_per_program"])
def _activation_bwd_kernel(
    grad_ptr,
    x_ptr,
    bias_ptr,
    probs_ptr,
    params_ptr,
    dx_ptr,
    dbias_part_ptr,
    dprobs_part_ptr,
    rows,
    F,
    rows_per_program,
    KIND: tl.constexpr,
    GATED: tl.constexpr,
    CLAMP: tl.constexpr,
    GATE_TANH: tl.constexpr,
    LINEAR_TANH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    FAST_DIV: tl.constexpr,
    COLUMNS_FASTEST: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(F, BLOCK_N, COLUMNS_FASTEST)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < F
    W = 2 * F if GATED else F
    if GATED:
        gcol, lcol = _glu_columns(cols, F, INTERLEAVE)
    else:
        gcol = cols
        lcol = cols
    if HAS_BIAS:
        # The bias gradient accumulates element-wise over the program's row blocks and is summed
        # over the tile's rows once, after the loop: a sum over rows inside the loop crosses
        # warps (shared memory and a barrier) on every trip of a tile of several rows, which ran
        # the unweighted GLU backward with bias at 4.4x the copy floor at 65536 x 1536 (H200,
        # session 8). For one-row tiles both forms add the same numbers in the same order and
        # compile to the same SASS (tools/inspect_kernel_sass.py). With probabilities the sum
        # over the tile's rows is taken on every trip and the accumulators are one row wide:
        # the plans there give a tile one row, or rows that each thread holds whole (the warps
        # split only the columns, _probs_bias_backward_plan), so that sum stays in the thread
        # and two rows need half the accumulator registers.
        bias_g = tl.load(bias_ptr + gcol, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_PROBS:
            acc_g = tl.zeros((BLOCK_N,), tl.float32)
        else:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if GATED:
            bias_l = tl.load(bias_ptr + lcol, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if HAS_PROBS:
                acc_l = tl.zeros((BLOCK_N,), tl.float32)
            else:
                acc_l = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # Without a bias a program takes one row block (one trip); with one, each program walks a fixed
    # row range in order, so the bias partial sums do not depend on scheduling. That loop loads
    # each trip's inputs one trip ahead (LOOP_STAGES == 0; the loads are masked to the program's
    # rows, so nothing past them is read), or has Triton pipeline them LOOP_STAGES - 1 trips
    # ahead through shared memory (_BWD_BIAS_STAGES says where each is used; the prefetches
    # stop at the loop's bound, and the span is a whole number of BLOCK_M-row trips, so the
    # rows < rows mask is the only one needed). Loading,
    # computing and storing in turn left memory idle while a program computed, and the
    # arithmetic is the same either way, so are the bits. H200, raw backward with bias / copy
    # floor, in turn -> one trip ahead (docs/bench/history.md, run 34): bf16 SwiGLU(clamp=7) 1.27
    # -> 1.24 at 65536 x 1536, weighted 1.56 -> 1.38 at 65536 x 1536 and 1.63 -> 1.35 at 16384
    # x 8192, fp32 weighted 1.49 -> 1.09.
    if HAS_BIAS:
        span = rows_per_program
        if ROWS_ALIGNED:
            # The plan rounds it to a multiple (_row_split), so this changes no value; written
            # as a product it tells the compiler (tl.multiple_of cannot mark an argument).
            span = (span // _ROWS_ALIGNMENT) * _ROWS_ALIGNMENT
    else:
        span = BLOCK_M
    row_base = pid_m * span
    columns = (cols, col_ok, gcol, lcol)
    if HAS_BIAS and LOOP_STAGES == 0:
        row_end = tl.minimum(rows, row_base + span)
        row = row_base + tl.arange(0, BLOCK_M)
        ahead = _bwd_loads(
            grad_ptr, x_ptr, probs_ptr, row, row < row_end, columns, F, GATED, HAS_PROBS
        )
    for m in tl.range(0, span, BLOCK_M, num_stages=LOOP_STAGES):
        row = row_base + m + tl.arange(0, BLOCK_M)
        row_ok = row < rows
        mask = row_ok[:, None] & col_ok[None, :]
        row64 = row.to(tl.int64)[:, None]
        if HAS_BIAS and LOOP_STAGES == 0:
            g_raw, gate_raw, lin_raw, p_raw = ahead  # loaded on the previous trip
            load_row = row + BLOCK_M
            load_ok = load_row < row_end
        else:
            load_row = row
            load_ok = row_ok
        loaded = _bwd_loads(
            grad_ptr, x_ptr, probs_ptr, load_row, load_ok, columns, F, GATED, HAS_PROBS
        )
        if HAS_BIAS and LOOP_STAGES == 0:
            ahead = loaded
        else:
            g_raw, gate_raw, lin_raw, p_raw = loaded
        g = g_raw.to(tl.float32)
        if HAS_PROBS:
            p = p_raw.to(tl.float32)[:, None]
        if GATED:
            gate = gate_raw.to(tl.float32)
            lin = lin_raw.to(tl.float32)
            if HAS_BIAS:
                gate += bias_g
                lin += bias_l
            act, lin, d_act, d_lin = _glu_terms(
                gate, lin, params_ptr, KIND, CLAMP, GATE_TANH, LINEAR_TANH, FAST_DIV
            )
            if HAS_PROBS:
                # g * act feeds both the linear half's gradient and the probability gradient's
                # terms g * act * lin; sharing it keeps fewer values live per element (sm_90,
                # bf16 clamped SwiGLU: 56 registers instead of 64, and ptxas then issues the
                # three streamed loads together; tools/inspect_kernel_sass.py).
                g_act = g * act
                d_gate = g * p * lin * d_act
                d_linear = g_act * p * d_lin
                dprobs_terms = g_act * lin
            else:
                d_gate = g * lin * d_act
                d_linear = g * act * d_lin
            dx_row = dx_ptr + row64 * W
            tl.store(dx_row + gcol[None, :], d_gate.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dx_row + lcol[None, :], d_linear.to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_BIAS:
                if HAS_PROBS:
                    acc_g += tl.sum(tl.where(mask, d_gate, 0.0), axis=0)
                    acc_l += tl.sum(tl.where(mask, d_linear, 0.0), axis=0)
                else:
                    acc_g += tl.where(mask, d_gate, 0.0)
                    acc_l += tl.where(mask, d_linear, 0.0)
        else:
            h = gate_raw.to(tl.float32)
            if HAS_BIAS:
                h += bias_g
            y, d = _unary_terms(h, params_ptr, KIND, GATE_TANH, FAST_DIV)
            d_h = g * p * d if HAS_PROBS else g * d
            tl.store(dx_ptr + row64 * W + cols[None, :], d_h.to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_BIAS:
                if HAS_PROBS:
                    acc_g += tl.sum(tl.where(mask, d_h, 0.0), axis=0)
                else:
                    acc_g += tl.where(mask, d_h, 0.0)
            if HAS_PROBS:
                dprobs_terms = g * y
        if HAS_PROBS:
            # No mask: an element of a padded column loads g = 0, x = 0 and bias 0, whose
            # activation and linear factor (the offset) are finite, so its term is +-0; a padded
            # row's sum (which may see the real bias, inf included) is never stored. The select
            # the mask would cost made ptxas defer one of the three streamed loads until the
            # first was consumed (bf16 clamped SwiGLU on sm_90).
            part = tl.sum(dprobs_terms, axis=1)
            tl.store(dprobs_part_ptr + pid_n * rows + row, part, mask=row_ok)
    if HAS_BIAS:
        if not HAS_PROBS:
            acc_g = tl.sum(acc_g, axis=0)
        tl.store(dbias_part_ptr + pid_m * W + gcol, acc_g, mask=col_ok)
        if GATED:
            if not HAS_PROBS:
                acc_l = tl.sum(acc_l, axis=0)
            tl.store(dbias_part_ptr + pid_m * W + lcol, acc_l, mask=col_ok)


# ----------------------------------------------------------------------------- launch
# Launch shape. Tiles are counted in output elements: the forward streams 2 loads and 1 store
# per element, the backward 3 loads and 2 stores and keeps more values live. The values are
# plain constants, chosen from the H200 sweep of ``tools/benchmark_kernel_variants.py
# --experiment tiles`` (docs/bench/history.md), not autotuned: a tuned choice could differ between
# runs, and the reductions' summation order (and so the gradients' bits) follows the tile shape.
_FWD_TILE, _FWD_WARPS = 4096, 8
# The weighted 16-bit GLU forward with a bias spreads the tile over fewer warps where the column
# block is narrower than _FWD_MAX_BLOCK_N (_probs_bias_forward_plan). H200, bf16, raw forward /
# copy floor, 8 -> 4 warps (docs/bench/history.md, session 16, run 70): clamped SwiGLU 1.266 ->
# 0.990 at 65536 x 1536 (its bias-only forward: 0.982), 1.167 -> 0.977 at 65536 x 2880, 1.207
# -> 1.043 at 65536 x 768; quick-GEGLU 1.135 -> 0.996, 1.113 -> 0.995, 1.327 -> 1.055; GEGLU
# 1.089 -> 0.985 at 65536 x 1536; SiTU-GLU(4) 1.217 -> 1.128. At 2048-column blocks (16384 x
# 8192) 4 warps lost 0.1-0.2, and the forwards without a bias or without probabilities, at
# 0.97-1.02 with 8 warps, keep them.
_FWD_WARPS_PROBS_BIAS_NARROW = 4
# Two kinds keep 8 warps at 1024-column blocks (F = 2880, three blocks, the last one masked):
# ReGLU, the lightest in arithmetic, and SiTU-GLU with a linear scale, the heaviest. H200, bf16,
# 65536 x 2880, raw forward / copy floor, 4 -> 8 warps (docs/bench/history.md, session 18, runs
# 76-77): ReGLU 1.066 -> 0.995 (bias only: 0.973), SiTU-GLU(4,25) 1.547 -> 1.484 (1.489); every
# other kind lost: SwiGLU 0.985 -> 1.033, clamped SwiGLU 0.985 -> 1.163, quick-GEGLU 1.000 ->
# 1.112, GEGLU 0.976 -> 1.073, SiTU-GLU(4) 1.315 -> 1.337.
_FWD_WARPS_PROBS_BIAS_KEEP_BLOCK_N = 1024
_BWD_TILE, _BWD_WARPS = 4096, 8  # non-gated, unweighted
_BWD_TILE_ROW, _BWD_WARPS_ROW = 1024, 4  # gated, unweighted: one row of 1024 columns
# Weighted: rows per program, columns per warp (8 per thread at 256) and the widest column block.
_BWD_PROBS_ROWS = 1
_BWD_PROBS_COLUMNS_PER_WARP = 256
_BWD_PROBS_MAX_BLOCK_N = 1024
# Weighted with a bias, 16-bit GLUs (_probs_bias_backward_plan): rows per trip of the row loop where
# the column block is 1024 wide (for the light unclamped kinds, SiTU-GLU with a linear scale and
# every kind at widths that do not pipeline; the others take one row,
# _BWD_PROBS_BIAS_WIDE_STAGES), the register cap there for the kinds heavy in transcendentals, and
# the cap for narrower column blocks (one row per trip), which 16-bit GLUs with a bias and without
# probabilities share (_has_narrow_glu_bias_plan).
_BWD_PROBS_BIAS_ROWS = 2
_BWD_PROBS_BIAS_WIDE_BLOCK_N = 1024  # the narrowest column block of the wide weighted plan
# The narrow weighted plan's column block for the clamped kinds and the heavy gates where a row
# spans several 512-column blocks (_probs_bias_backward_plan): 256 columns, one warp, twice the
# programs. H200, bf16, raw backward / copy floor, 512 -> 256 (docs/bench/history.md, session 20,
# runs 87-88), 65536 x 1536: clamped SwiGLU 1.217 -> 1.208, GEGLU 1.184 -> 1.176, quick-GEGLU
# 1.227 -> 1.215, SiTU-GLU(4) 1.229 -> 1.202, SiTU-GLU(4,25) 1.326 -> 1.293, and 1-2.5 % at
# 32768 x 2560; SwiGLU and ReGLU lost 1-1.5 % at both, and every kind lost 1.5-4.4 % at F = 512,
# one block wide, where the split adds the column blocks' bias sum.
_BWD_PROBS_BIAS_NARROW_MAX_BLOCK_N = 256
_BWD_PROBS_BIAS_MAX_REGISTERS = 128
_BWD_BIAS_NARROW_MAX_REGISTERS = 96  # _BIAS_PROGRAMS_NARROW follows from it
# Register cap per thread of the weighted backward (Triton's maxnreg), None for none. Kept for
# the reduce experiment: at 48 the bf16 clamped SwiGLU gained 0.01 of the copy floor on an H200,
# while fp32, GEGLU and SiTU-GLU lost 0.02-0.05 and the bias variants 0.5-0.9 (session 8).
_BWD_PROBS_MAX_REGISTERS = None
# Widest column blocks, one constant per direction. GLU forwards stream 2048-column blocks:
# every GLU kind's raw forward measured 1.04-1.06x the copy floor at 1024 and 1.01-1.04x at 2048
# (H200, bf16 [16384, 16384], candidates timed in turns; docs/bench/history.md, runs 9 and 13),
# fp32 SwiGLU(clamp=7) 1.03x and 1.01x. The backward gained at most 0.02 from wider rows and
# SiTU-GLU's lost 0.09-0.17, so it stays at 1024.
_FWD_MAX_BLOCK_N = 2048
_BWD_MAX_BLOCK_N = 1024
# Non-gated forwards, and non-gated backwards without bias or probabilities (no reduction),
# stream flat blocks (_unary_fwd_flat_kernel, _unary_bwd_flat_kernel) when _FLAT_UNARY is set;
# the 2-D tile stays for the comparison (tools/benchmark_kernel_variants.py --experiment flat; H200,
# bf16: squared ReLU 1.08x the copy floor as 2-D tiles, 1.02x flat at 2048 elements / 4 warps,
# torch.compile 1.03x; GELU backward 1.17x as tiles, 0.98x flat). The tanh soft clamp is bound
# by arithmetic, not memory, and gains from more elements per thread (forward 1.18x at 2048 / 4,
# 1.09x at 4096 / 4; backward 1.03x and 1.01x).
_FLAT_BLOCK, _FLAT_WARPS = 2048, 4
_FLAT_BLOCK_SOFT_CLAMP, _FLAT_WARPS_SOFT_CLAMP = 4096, 4
_FLAT_UNARY = True
# With a bias the backward reduces over rows; this many programs in total (across column blocks)
# share the rows. A fixed number, not one derived from the device, keeps the summation order -
# and so the bias gradient's bits - the same on every GPU. The unweighted GLU backward runs more
# of them (float32 at every width, 16-bit inputs at column blocks of 1024; narrower blocks take
# the one-row plan of _BIAS_PROGRAMS_NARROW): H200, bf16, raw backward / copy floor, 4096
# against 1024 programs: 1.27 against 1.35 at 65536 x 1536, 1.37 against 1.60 at 16384 x 2880
# (gpt-oss), 1.24 against 1.28 at 16384 x 8192; weighted and non-gated calls lost up to 0.11
# with more (docs/bench/history.md, session 8).
_BIAS_PROGRAMS = 1024
_BIAS_PROGRAMS_GLU = 4096
# The weighted 16-bit GLU backward with a bias at column blocks narrower than 1024
# (_probs_bias_backward_plan's one-row plan) runs one full wave. Every program does the same
# work, and how many an SM holds at once follows from the register cap: each of an SM's 4
# sub-partitions has 16384 registers and holds floor(16384 / (32 x cap)) warps, so under 112
# registers a thread an SM holds 16 warps, under 96 it holds 20. The count is of 2-warp
# programs (512-column blocks, F = 1536): 1320 = 10 x 132 on an H200. Blocks of 256 columns or
# fewer (F = 768) take one warp, and twice as many programs fill the same wave (_bias_programs).
# H200, bf16, raw backward / copy floor (docs/bench/history.md): 1024 -> 1056 programs under 112
# registers at 65536 x 1536 (session 13, runs 54-55), every GLU kind 0.015-0.025 faster, 1188
# (a second, partial wave) 1.67; 112 / 1056 -> 96 / 1320 (sessions 15-16, runs 65-67), clamped
# SwiGLU 1.291 -> 1.217 (its bias-only backward: 1.234), GEGLU 1.235 -> 1.182, SwiGLU 1.195 ->
# 1.157, and 0.03-0.08 at 65536 x 512 and 32768 x 2560; 80 / 1584 ran at 1.27-1.52. At 65536 x
# 768 the 1-warp programs ran at 1.47-1.79 as 1320 and 1.30-1.54 as 2640. Every GLU kind
# compiles to at most 96 registers without spilling (tools/inspect_kernel_sass.py).
# The unweighted 16-bit GLU backward with a bias takes the same plan and count at those widths
# (_has_narrow_glu_bias_plan), where its own plan (1024-element tiles over 4 warps, 4096
# programs: 5-8 waves of 5-6 programs an SM) ran at 1.54-1.67 (session 17, run 72): 65536 x
# 768, SwiGLU 1.536 -> 1.252, clamped SwiGLU 1.587 -> 1.304, GEGLU 1.588 -> 1.249, SiTU-GLU(4,
# 25) 1.674 -> 1.450; 65536 x 512 1.57-1.67 -> 1.28-1.35; 65536 x 1536 1.195 -> 1.120, 1.233
# -> 1.167, 1.218 -> 1.125, SiTU-GLU(4,25) level. Whole waves of the old plan (1320-3960
# programs) gained at most half of that.
_BIAS_PROGRAMS_NARROW = 1320
# The two-row plan at 1024-column blocks runs at most one wave as well: an SM holds 3 of its
# uncapped programs (up to 168 registers a thread, 4 warps) or 4 under the register cap of 128
# (_BWD_PROBS_BIAS_MAX_REGISTERS; another cap needs another count), so 396 = 3 x 132 and 528 =
# 4 x 132 programs, fewer where aligned rows round the split up. Kinds that bound the linear
# half (a clamp, a tanh) keep their rows per program a multiple of 16 and compile knowing it
# (ROWS_ALIGNED, _probs_bias_backward_plan); the others do not. H200, bf16, raw backward /
# the bias-only backward, 1024 programs with Triton's default specialisation -> this
# (docs/bench/history.md, session 14, runs 57-61): at 16384 x 2880 (gpt-oss) clamped SwiGLU
# 1.21 -> 0.99, quick-GEGLU 1.12 -> 1.02, SwiGLU 1.09 -> 1.03, ReGLU 1.07 -> 1.02; at
# 16384 x 8192 SiTU-GLU(4) 1.05 -> 0.98. Two to four waves ran slower nearly everywhere, and
# each group lost up to 0.1 with the other group's alignment. The same counts serve the one-row
# pipelined form of that plan (session 19), which was timed with them and not retuned.
_BIAS_PROGRAMS_PROBS_WIDE = 396
_BIAS_PROGRAMS_PROBS_WIDE_CAPPED = 528
# The unweighted GLU backward with a bias keeps its rows per program aligned at column blocks at
# least this wide. H200, raw backward / copy floor, aligned against not (docs/bench/history.md,
# session 14, runs 61-62): at 1024-column blocks 0.00-0.15 faster for every kind and dtype
# (bf16 GEGLU 1.513 -> 1.362 at 8192 x 5120, 1.277 -> 1.212 at 65536 x 2880; at 16384 x 8192,
# whose 32 rows per program were already a multiple of 16, only GEGLU moved, 1.215 -> 1.186), at
# 512-column blocks (F = 1536) 0.01-0.06 slower.
_GLU_BIAS_ALIGNED_BLOCK_N = 1024
# Whether the backward plans with a bias that have no rule of their own (non-gated kinds, the
# general weighted plan: float32, non-gated) keep their rows aligned. Off: aligned, squared
# ReLU moved by -0.10 to +0.02 and the float32 weighted kernels by -0.02 to +0.13 (runs 60-61;
# the latter with the rows rounded but the kernel not told, an earlier form of the alignment).
_BIAS_ROWS_ALIGNED = False
# How the backward's row loop with a bias keeps memory busy (the kernel's LOOP_STAGES): 0 loads
# each trip's inputs one trip ahead into registers; N >= 2 has Triton pipeline the loop's loads
# through shared memory (cp.async; tl.range's num_stages), N - 1 trips ahead, which costs 2-4 SASS
# instructions an element (the copies, the shared-memory reads, the waits) but no registers. The
# summation order, and so every bit, is the same either way. H200, raw backward with a bias /
# copy floor, register prefetch -> this (docs/bench/history.md, session 19, runs 81-82):
# - _BWD_BIAS_STAGES: the unweighted 16-bit GLU plan at 1024-column blocks (F = 1024, 2880, 8192,
#   ...; narrower blocks take the one-row plan) and the unweighted 16-bit non-gated plan; float32
#   keeps 0 (within 0.01, or up to 0.035 slower). At 16384 x 8192 every GLU kind 1.15-1.31 ->
#   1.13-1.15 (clamped SwiGLU 1.207 -> 1.134, SiTU-GLU(4,25) 1.307 -> 1.147), at 65536 x 2880
#   1.12-1.37 -> 1.11-1.15; squared ReLU 1.27 -> 1.19 at 65536 x 1536, 1.50 -> 1.30 at 65536 x 768.
#   The general weighted plan (float32 GLUs, non-gated kinds) takes it where a trip's row segment is
#   at most _BWD_PROBS_BIAS_STAGED_BYTES: its 1024 programs of one or two warps leave 8-16 warps an
#   SM, each then with more in flight (float32 clamped SwiGLU at 65536 x 768 1.306 -> 1.188, squared
#   ReLU at 65536 x 1536 1.392 -> 1.161), while 4-warp rows lost (squared ReLU 1.094 -> 1.220 at
#   16384 x 8192, float32 at 65536 x 1536 1.092 -> 1.132).
# - _BWD_BIAS_NARROW_STAGES: the one-row plan of 16-bit GLUs (F < 2048, 20 warps an SM under its
#   register cap), where 2 stages ran level and 3-4 lost up to 0.15 (SwiGLU at 65536 x 768 1.273 ->
#   1.387 with 3), except for SiTU-GLU with a linear scale, the heaviest in arithmetic
#   (_BWD_BIAS_NARROW_TANH_STAGES): 1.256 -> 1.183 at 65536 x 1536, 1.412 -> 1.349 at 65536 x 768;
#   weighted 1.383 -> 1.324 and 1.548 -> 1.497.
# - _BWD_PROBS_BIAS_WIDE_STAGES: the weighted plan at 1024-column blocks, where one row a trip so
#   pipelined replaces two rows a trip (_BWD_PROBS_BIAS_ROWS) with register prefetch for the
#   clamped kinds and the heavy gates: clamped SwiGLU 1.180 -> 1.100 at 16384 x 8192 and 1.258 ->
#   1.141 at 65536 x 2880, quick-GEGLU 1.184 -> 1.120 and 1.259 -> 1.180, GEGLU 1.153 -> 1.119
#   and 1.206 -> 1.161, SiTU-GLU(4) 1.162 -> 1.131 and 1.214 -> 1.157. SwiGLU and ReGLU keep two
#   rows (1.087 -> 1.109 and 1.076 -> 1.110 at 16384 x 8192, level at 65536 x 2880), as does
#   SiTU-GLU with a linear scale (1.243 -> 1.417 and 1.333 -> 1.521).
_BWD_BIAS_STAGES = 4
_BWD_PROBS_BIAS_STAGED_BYTES = 1024
_BWD_BIAS_NARROW_STAGES = 0
_BWD_BIAS_NARROW_TANH_STAGES = 3
_BWD_PROBS_BIAS_WIDE_STAGES = 4
# The divisibility Triton's hints speak of: an aligned split (ROWS_ALIGNED) is a multiple of it,
# small calls included, whose one to three rows per program round up to 16 (fewer, longer
# programs). H200, bf16 unweighted GLU backward with a bias, raw, rounded / not (session 14,
# runs 63-64): 0.86-1.07 at 1024-4096 rows, 0.99-1.22 at 256 rows, calls at 3-9x the floor
# that move by 5-10 % between runs (docs/bench/history.md).
_ROWS_ALIGNMENT = tl.constexpr(16)
# Program order of the tiled kernels (_tile_ids): column blocks fastest, or row blocks fastest
# (kept for tools/benchmark_kernel_variants.py --experiment launch). H200, bf16 and fp32 GLUs at
# 16384 x 8192 and 65536 x 1536, raw / copy floor: forward 0.96-0.99 columns fastest against
# 0.99-1.01 rows fastest, backward 0.97-0.98 against 1.01-1.02 (docs/bench/history.md, run 27).
_COLUMNS_FASTEST = True


def _cdiv(a: int, b: int) -> int:
    # Host-side ceil division. Not triton.cdiv: since Triton 3.7 that is a constexpr function
    # whose host call costs microseconds, four times per backward.
    return -(-a // b)


@functools.cache
def _block_n(F: int, max_block_n: int) -> int:
    """Column block: the widest power of two in 128..max_block_n whose masked tail wastes at
    most 1/8 of the row, else the one that wastes least; narrow rows get one block.

    Wide blocks keep each row's loads long and contiguous: at F = 2880 (gpt-oss) 128-column
    blocks (the least waste) ran at 1.16x the copy floor on an H200, where TE and torch.compile
    ran at 1.04-1.06x (docs/bench/history.md). Cached: the unweighted GLU backward asks on every
    call, and the search costs 1-2 us of host time (5 us through triton.next_power_of_2).
    """
    if F <= 128:
        return 1 << (F - 1).bit_length()
    sizes = [b for b in (4096, 2048, 1024, 512, 256, 128) if b <= max_block_n]
    waste = {b: _cdiv(F, b) * b - F for b in sizes}
    for b in sizes:
        if 8 * waste[b] <= F:
            return b
    return min(sizes, key=lambda b: (waste[b], -b))


def _fast_div(itemsize: int) -> bool:
    # The hardware reciprocal for 16-bit inputs only (_div says why), where PTX exists.
    return _HAS_PTX and itemsize <= 2


@functools.cache
def _plan(
    v,
    F: int,
    tile: int,
    warps: int,
    max_block_n: int,
    fast_div: bool,
    columns_fastest: bool,
    max_registers: Optional[int] = None,
    rows_aligned: Optional[bool] = None,
    loop_stages: int = 0,
) -> tuple[int, int, dict, tuple]:
    """``(BLOCK_M, BLOCK_N, compile-time kwargs, their values in signature order)`` of variant
    ``v`` at width ``F``; cached because the host cost of a launch matters for the small calls
    MoE experts make (the arguments after ``v`` and ``F`` are the module constants, the division
    choice and the program order, so a changed constant gets a fresh plan). ``max_registers``
    caps the registers per thread (Triton's ``maxnreg``; NVIDIA only, other backends ignore it).
    ``rows_aligned`` is None for the forward kernel's plan; for the backward kernel's it says
    whether the rows per program of a call with a bias are kept a multiple of
    ``_ROWS_ALIGNMENT`` and the kernel compiled knowing it (``ROWS_ALIGNED``)."""
    block_n = _block_n(F, max_block_n)
    block_m = max(1, tile // block_n)
    kwargs = dict(
        KIND=v.kind,
        GATED=v.gated,
        CLAMP=v.clamp,
        GATE_TANH=v.gate_tanh,
        LINEAR_TANH=v.linear_tanh,
        HAS_BIAS=v.has_bias,
        HAS_PROBS=v.has_probs,
        INTERLEAVE=v.interleave or 0,
        FAST_DIV=fast_div,
        COLUMNS_FASTEST=columns_fastest,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    kernel = _activation_fwd_kernel
    if rows_aligned is not None:
        kernel = _activation_bwd_kernel
        kwargs["ROWS_ALIGNED"] = rows_aligned and v.has_bias  # only a bias splits the rows
        if loop_stages == 1:
            raise ValueError(
                "a backward loop-stage constant (_BWD_BIAS_STAGES, _BWD_BIAS_NARROW_STAGES, "
                "_BWD_BIAS_NARROW_TANH_STAGES, _BWD_PROBS_BIAS_WIDE_STAGES) is 1, which would load "
                "each trip's inputs only when it runs; use 0 (one trip ahead in registers) or 2+"
            )
        kwargs["LOOP_STAGES"] = loop_stages if _pipelines(v, F) else 0
    if max_registers is not None:
        kwargs["maxnreg"] = max_registers
    params = [name for name in kernel.arg_names if name in kwargs]
    assert len(params) == len(kwargs) - 1 - (max_registers is not None)  # all but the options
    return block_m, block_n, kwargs, tuple(kwargs[name] for name in params)


def _forward_plan(v, F, itemsize: int):
    fast_div = _fast_div(itemsize)
    if _has_probs_bias_plan(v, itemsize):
        return _probs_bias_forward_plan(
            v,
            F,
            _FWD_TILE,
            _FWD_WARPS,
            _FWD_WARPS_PROBS_BIAS_NARROW,
            _FWD_WARPS_PROBS_BIAS_KEEP_BLOCK_N,
            _FWD_MAX_BLOCK_N,
            fast_div,
            _COLUMNS_FASTEST,
        )
    return _plan(v, F, _FWD_TILE, _FWD_WARPS, _FWD_MAX_BLOCK_N, fast_div, _COLUMNS_FASTEST)


@functools.cache
def _probs_bias_forward_plan(
    v,
    F: int,
    tile: int,
    warps: int,
    narrow_warps: int,
    keep_block_n: int,
    max_block_n: int,
    fast_div: bool,
    columns_fastest: bool,
):
    """The weighted forward's plan with a bias, for 16-bit GLUs: the general tile, over
    ``narrow_warps`` (``_FWD_WARPS_PROBS_BIAS_NARROW``) where the column block is narrower than
    ``max_block_n``, except for ReGLU and SiTU-GLU with a linear scale at column blocks of
    ``keep_block_n`` or more (``_FWD_WARPS_PROBS_BIAS_KEEP_BLOCK_N``); cached, as ``_plan`` is
    (the arguments after ``F`` are module constants)."""
    block_n = _block_n(F, max_block_n)
    keeps = block_n >= keep_block_n and (v.kind == "relu" or v.linear_tanh)
    if block_n < max_block_n and not keeps:
        warps = narrow_warps
    return _plan(v, F, tile, warps, max_block_n, fast_div, columns_fastest)


def _has_probs_bias_plan(v, itemsize: int) -> bool:
    # The weighted 16-bit GLU with a bias has plans of its own (_probs_bias_forward_plan,
    # _probs_bias_backward_plan) and program counts for its backward (_bias_programs).
    return v.gated and v.has_probs and v.has_bias and itemsize <= 2


def _has_narrow_glu_bias_plan(v, F: int, itemsize: int) -> bool:
    # The unweighted 16-bit GLU backward with a bias takes the weighted one-row plan where the
    # column block is narrower than _BWD_PROBS_BIAS_WIDE_BLOCK_N (_BIAS_PROGRAMS_NARROW says why).
    return (
        v.gated
        and v.has_bias
        and not v.has_probs
        and itemsize <= 2
        and _block_n(F, _BWD_PROBS_MAX_BLOCK_N) < _BWD_PROBS_BIAS_WIDE_BLOCK_N
    )


def _backward_plan(v, F, itemsize: int):
    fast_div = _fast_div(itemsize)
    if _has_probs_bias_plan(v, itemsize):
        return _probs_bias_backward_plan(
            v,
            F,
            _BWD_PROBS_BIAS_ROWS,
            _BWD_PROBS_BIAS_WIDE_BLOCK_N,
            _BWD_PROBS_BIAS_MAX_REGISTERS,
            _BWD_BIAS_NARROW_MAX_REGISTERS,
            _BWD_PROBS_MAX_BLOCK_N,
            _BWD_PROBS_BIAS_NARROW_MAX_BLOCK_N,
            _BWD_PROBS_COLUMNS_PER_WARP,
            fast_div,
            _COLUMNS_FASTEST,
            _BWD_PROBS_BIAS_WIDE_STAGES,
            _narrow_stages(v),
        )
    if _has_narrow_glu_bias_plan(v, F, itemsize):
        # The weighted plan's one row per trip, without probabilities (_BIAS_PROGRAMS_NARROW).
        return _probs_backward_plan(
            v,
            F,
            1,
            _BWD_PROBS_MAX_BLOCK_N,
            _BWD_PROBS_COLUMNS_PER_WARP,
            _BWD_BIAS_NARROW_MAX_REGISTERS,
            fast_div,
            _COLUMNS_FASTEST,
            False,
            _narrow_stages(v),
        )
    if v.has_probs:
        _require_power_of_two("_BWD_PROBS_ROWS", _BWD_PROBS_ROWS)
        return _probs_backward_plan(
            v,
            F,
            _BWD_PROBS_ROWS,
            _BWD_PROBS_MAX_BLOCK_N,
            _BWD_PROBS_COLUMNS_PER_WARP,
            _BWD_PROBS_MAX_REGISTERS,
            fast_div,
            _COLUMNS_FASTEST,
            _BIAS_ROWS_ALIGNED,
            _general_probs_stages(F, itemsize),
        )
    # The unweighted plans: 16-bit inputs pipelined, float32 loaded ahead (_BWD_BIAS_STAGES).
    stages = _BWD_BIAS_STAGES if itemsize <= 2 else 0
    if v.gated:
        # A 1024-element tile: one row where the column block is 1024 wide, two at F = 1536
        # (512-column blocks); GLUs gain nothing from taller tiles (docs/bench/history.md).
        return _plan(
            v,
            F,
            _BWD_TILE_ROW,
            _BWD_WARPS_ROW,
            _BWD_MAX_BLOCK_N,
            fast_div,
            _COLUMNS_FASTEST,
            rows_aligned=_block_n(F, _BWD_MAX_BLOCK_N) >= _GLU_BIAS_ALIGNED_BLOCK_N,
            loop_stages=stages,
        )
    return _plan(
        v,
        F,
        _BWD_TILE,
        _BWD_WARPS,
        _BWD_MAX_BLOCK_N,
        fast_div,
        _COLUMNS_FASTEST,
        rows_aligned=_BIAS_ROWS_ALIGNED,
        loop_stages=stages,
    )


@functools.cache
def _probs_bias_backward_plan(
    v,
    F: int,
    two_row_rows: int,
    wide_block_n: int,
    max_registers: Optional[int],
    narrow_max_registers: Optional[int],
    max_block_n: int,
    narrow_max_block_n: int,
    columns_per_warp: int,
    fast_div: bool,
    columns_fastest: bool,
    wide_stages: int,
    narrow_stages: int,
):
    """The weighted backward's plan with a bias, for 16-bit GLUs; cached, as ``_plan`` is (the
    arguments after ``v`` and ``F`` are the module constants).

    With a bias each program walks a range of rows, and every trip ends in the probability
    gradient's cross-warp sum (a barrier). Where the column block is 1024 wide
    (``_BWD_PROBS_BIAS_WIDE_BLOCK_N``), a trip of the clamped kinds and the heavy gates takes one
    row, its loads pipelined ``_BWD_PROBS_BIAS_WIDE_STAGES`` deep (where F is a multiple of 16:
    ``_pipelines``); the light unclamped kinds (SwiGLU, ReGLU, quick-GELU without a clamp),
    SiTU-GLU with a linear scale and the other widths take ``_BWD_PROBS_BIAS_ROWS`` rows a trip
    loaded one trip ahead in registers: the
    warps still split the columns, so each thread holds the trip's rows of its columns and the bias
    gradient's sum over them stays in registers (the kernel's 1-D accumulators), while one barrier
    serves several rows. SiTU-GLU and the GELUs take a register cap there
    (``_BWD_PROBS_BIAS_MAX_REGISTERS``); narrower blocks keep one row per trip under
    ``_BWD_BIAS_NARROW_MAX_REGISTERS``, over ``_BIAS_PROGRAMS_NARROW`` 2-warp programs or twice as
    many 1-warp ones (``_bias_programs``), pipelined for SiTU-GLU with a linear scale
    (``_BWD_BIAS_NARROW_TANH_STAGES``); where a row spans several such blocks, the clamped kinds
    and the heavy gates narrow them to ``_BWD_PROBS_BIAS_NARROW_MAX_BLOCK_N`` columns. H200, bf16,
    raw backward / copy floor, one row uncapped -> two rows a trip (docs/bench/history.md,
    session 12, run 52; runs 50-51 timed the parts; the one pipelined row of session 19 at
    ``_BWD_PROBS_BIAS_WIDE_STAGES``), 16384 x 8192: clamped SwiGLU
    1.33 -> 1.22, quick-GEGLU 1.26 -> 1.23, GEGLU 1.26 -> 1.19, SiTU-GLU(4) 1.30 -> 1.24,
    SiTU-GLU(4,25) 1.38 -> 1.29; 65536 x 1536 (512-column blocks, 1024 programs): 1.34 -> 1.31, 1.30
    -> 1.27, 1.26 -> 1.25, 1.32 -> 1.29, 1.42 -> 1.41.
    Two rows without the cap made the heavy kinds 0.2 slower; the cap made the light ones 0.1
    slower. float32 lost with two rows (1.06 -> 1.11) and keeps the general plan.
    """
    _require_power_of_two("_BWD_PROBS_BIAS_ROWS", two_row_rows)
    heavy = v.gate_tanh or v.kind in ("gelu", "gelu_tanh")
    block_n = _block_n(F, max_block_n)
    if block_n >= wide_block_n:
        # One row a trip with the loop pipelined (wide_stages) for the clamped kinds and the
        # heavy gates where the width pipelines, two rows a trip loaded one ahead in registers
        # for the light unclamped ones, SiTU-GLU with a linear scale and the widths that do not
        # (_BWD_PROBS_BIAS_WIDE_STAGES).
        pipelined = (v.clamp or heavy) and not v.linear_tanh and _pipelines(v, F)
        rows, stages = (1, wide_stages) if pipelined else (two_row_rows, 0)
        cap = max_registers if heavy else None
        # Kinds that bound the linear half (a clamp, a tanh) ran faster with aligned rows.
        aligned = v.clamp or v.linear_tanh
    else:
        rows = 1
        cap = narrow_max_registers
        aligned = False
        stages = narrow_stages
        if (v.clamp or heavy) and block_n < F:
            max_block_n = narrow_max_block_n
    # Columns per warp scale with the rows, so the warps split only the columns.
    return _probs_backward_plan(
        v,
        F,
        rows,
        max_block_n,
        columns_per_warp * rows,
        cap,
        fast_div,
        columns_fastest,
        aligned,
        stages,
    )


def _pipelines(v, F: int) -> bool:
    # Whether the backward's row loop may be pipelined (LOOP_STAGES >= 2): it has one only with a
    # bias, and only where F is specialised as a multiple of 16 can Triton prove the rows' 16-byte
    # alignment and copy each thread's 8 or 16 bytes at once; at other widths it pipelines some
    # loads in 4-byte copies and leaves the output gradient's unpipelined (sm_90 PTX), a form
    # never timed, so they keep the register prefetch.
    return v.has_bias and F % 16 == 0


def _narrow_stages(v) -> int:
    # The one-row plan's loop stages (_BWD_BIAS_NARROW_STAGES).
    return _BWD_BIAS_NARROW_TANH_STAGES if v.linear_tanh else _BWD_BIAS_NARROW_STAGES


def _general_probs_stages(F: int, itemsize: int) -> int:
    # The general weighted plan's loop stages with a bias (_BWD_PROBS_BIAS_STAGED_BYTES).
    segment = _block_n(F, _BWD_PROBS_MAX_BLOCK_N) * itemsize
    return _BWD_BIAS_STAGES if segment <= _BWD_PROBS_BIAS_STAGED_BYTES else 0


def _require_power_of_two(name: str, rows: int) -> None:
    # Rows per program become BLOCK_M, a tl.arange length, which Triton requires to be a power
    # of two: refuse any other value with the constant's name before anything compiles.
    if rows < 1 or rows & (rows - 1):
        raise ValueError(
            f"{name}={rows} is not a power of two; the weighted backward's rows per program "
            "must be 1, 2, 4, ..."
        )


@functools.cache
def _probs_backward_plan(
    v,
    F: int,
    rows: int,
    max_block_n: int,
    columns_per_warp: int,
    max_registers: Optional[int],
    fast_div: bool,
    columns_fastest: bool,
    rows_aligned: bool = False,
    loop_stages: int = 0,
):
    """``rows`` rows of one column block per program, ``columns_per_warp`` columns of it per
    warp, for the backward with probabilities (and, one row under the narrow register cap, for
    the unweighted 16-bit GLU backward with a bias: ``_has_narrow_glu_bias_plan``).

    The probability gradient is a sum over each row, so every program ends in a cross-warp
    reduction behind a barrier. Measured on an H200 (bf16 SwiGLU(clamp=7), raw backward / copy
    floor, candidates in turns; docs/bench/history.md, run 15): at F = 1536 (512-column blocks) two
    rows of 512 over 4 warps ran at 1.25, one row over 4 warps at 1.19, over 2 warps at 1.09 and
    over 1 warp at 1.19; at F = 8192 (1024-column blocks) one row over 4 warps ran at 1.07, over 2
    warps at 1.10. Both optima hold eight columns per thread; column blocks narrower than 256
    (e.g. 128 at F = 384) get one warp and fewer columns per thread. With column blocks fastest
    (run 30, the kernel before session 8's register changes) the alternatives - two, four or
    eight rows per program, one warp per row (no cross-warp sum), 4, 16 or 32 columns per
    thread, 2048-column blocks - read the same or up to 0.34 slower, except 16 columns per
    thread for the clamped SwiGLU at F = 8192 (1.08 against 1.10), which read 1.19 against 1.11
    at 1536.
    """
    block_n = _block_n(F, max_block_n)
    warps = max(1, rows * block_n // columns_per_warp)
    tile = rows * block_n
    return _plan(
        v,
        F,
        tile,
        warps,
        max_block_n,
        fast_div,
        columns_fastest,
        max_registers,
        rows_aligned,
        loop_stages,
    )


def _tile_grid(row_blocks: int, col_blocks: int, plan) -> tuple[int, int, int]:
    # The launch grid of the tiled kernels (_tile_ids says how programs map to tiles).
    if plan[2]["COLUMNS_FASTEST"]:
        return row_blocks * col_blocks, 1, 1
    return row_blocks, col_blocks, 1


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

    def __call__(self, grid, tensors: tuple, ints: tuple, plan: tuple) -> None:
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


def uses_flat_kernel(v, backward: bool) -> bool:
    """Whether variant ``v`` runs a flat kernel (``_unary_*_flat_kernel``) rather than the tiled
    one: non-gated forwards, and non-gated backwards with no bias or probabilities to reduce."""
    if v.gated or not _FLAT_UNARY:
        return False
    return not (backward and (v.has_bias or v.has_probs))


def triton_forward(v, x, bias, probs, params) -> torch.Tensor:
    """Forward of variant ``v`` on a contiguous 2-D ``x``; ``probs`` is ``[rows, 1]`` or None."""
    x, bias, probs = _contiguous(x, bias, probs)
    rows, width = x.shape
    F = width // 2 if v.gated else width
    out = torch.empty((rows, F), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if uses_flat_kernel(v, backward=False):
        _flat_forward(v, x, bias, probs, params, out, rows * F, F)
        return out
    plan = _forward_plan(v, F, x.element_size())
    grid = _tile_grid(_cdiv(rows, plan[0]), _cdiv(F, plan[1]), plan)
    with _device_guard(x):
        _forward_launcher(grid, (x, bias, probs, params, out), (rows, F), plan)
    return out


@functools.cache
def _flat_plan(v, kernel, block: int, warps: int, wide: bool, fast_div: bool) -> tuple:
    """``(BLOCK, None, compile-time kwargs, their values in signature order)`` of a flat kernel."""
    values = dict(
        KIND=v.kind,
        SOFT_CLAMP=v.gate_tanh,
        HAS_BIAS=v.has_bias,
        HAS_PROBS=v.has_probs,
        WIDE=wide,
        FAST_DIV=fast_div,
        BLOCK=block,
    )
    params = [name for name in kernel.arg_names if name in values]
    kwargs = {name: values[name] for name in params} | {"num_warps": warps}
    return block, None, kwargs, tuple(values[name] for name in params)


def _flat_shape(v, kernel, n: int, itemsize: int) -> tuple:
    if v.gate_tanh:
        block, warps = _FLAT_BLOCK_SOFT_CLAMP, _FLAT_WARPS_SOFT_CLAMP
    else:
        block, warps = _FLAT_BLOCK, _FLAT_WARPS
    # int32 offsets unless the last block's offsets pass 2**31 (program_id * BLOCK is int32).
    return _flat_plan(v, kernel, block, warps, n + block >= 2**31, _fast_div(itemsize))


def _flat_forward(v, x, bias, probs, params, out, n: int, F: int) -> None:
    plan = _flat_shape(v, _unary_fwd_flat_kernel, n, x.element_size())
    with _device_guard(x):
        _flat_launcher((_cdiv(n, plan[0]), 1, 1), (x, bias, probs, params, out), (n, F), plan)


def _bias_programs(v, F: int, plan, itemsize: int) -> int:
    """Programs in total of the backward with a bias (``v.has_bias``) under ``plan``, over all
    column blocks."""
    if not v.gated:
        return _BIAS_PROGRAMS
    # The one-row plan's count is of 2-warp programs; 1-warp ones fill the same wave with twice
    # as many.
    one_row = _BIAS_PROGRAMS_NARROW * 2 // plan[2]["num_warps"]
    if not v.has_probs:
        return one_row if _has_narrow_glu_bias_plan(v, F, itemsize) else _BIAS_PROGRAMS_GLU
    if not _has_probs_bias_plan(v, itemsize):
        return _BIAS_PROGRAMS
    if plan[1] < _BWD_PROBS_BIAS_WIDE_BLOCK_N:
        return one_row
    if "maxnreg" in plan[2]:
        return _BIAS_PROGRAMS_PROBS_WIDE_CAPPED
    return _BIAS_PROGRAMS_PROBS_WIDE


def _row_split(v, rows: int, F: int, plan, itemsize: int) -> tuple[int, int, int]:
    """``(column blocks, rows per program, programs per column block)`` of the tiled backward
    under ``plan``: one row block per program without a bias; with one, a fixed number of
    programs sharing the rows in ranges."""
    block_m, block_n = plan[0], plan[1]
    col_blocks = _cdiv(F, block_n)
    row_blocks = _cdiv(rows, block_m)
    if not v.has_bias:
        return col_blocks, block_m, row_blocks
    programs = _bias_programs(v, F, plan, itemsize)
    row_programs = min(row_blocks, max(1, programs // col_blocks))
    rows_per_program = block_m * _cdiv(row_blocks, row_programs)
    alignment = _ROWS_ALIGNMENT.value
    if plan[2]["ROWS_ALIGNED"]:
        # Rounded up: never more programs than the count above, and still a whole number of
        # BLOCK_M-row trips (BLOCK_M is a power of two, so a multiple of it that is at least 16
        # is a multiple of 16, and rounding that up to 16 keeps it).
        rows_per_program = alignment * _cdiv(rows_per_program, alignment)
    return col_blocks, rows_per_program, _cdiv(rows, rows_per_program)


def triton_backward(
    v, grad, x, bias, probs, params, in_place: bool = False
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Backward of variant ``v``: ``(dx, dbias or None, dprobs or None)``, dx laid out as ``x``.

    With ``in_place`` the kernels write ``dx`` over ``x`` (which must be contiguous) and return
    ``x``. Both kernels allow it: every input element is read only by the program that writes
    its gradient (a GLU's output column maps to one gate and one linear input column, and row
    ranges are split between programs), that program loads a tile before it stores the tile's
    gradients, and what it loads ahead (the next trip's rows, or Triton's pipelined stages) are
    rows it has not written yet. The bias and probability gradients are reduced from values in
    registers, never read back from ``dx``. So the same code computes the same bits either way.
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
    if uses_flat_kernel(v, backward=True):
        n = rows * F
        plan = _flat_shape(v, _unary_bwd_flat_kernel, n, x.element_size())
        with _device_guard(x):
            _flat_backward_launcher((_cdiv(n, plan[0]), 1, 1), (grad, x, params, dx), (n,), plan)
        return dx, None, None
    plan = _backward_plan(v, F, x.element_size())
    # An aligned plan's split is a multiple of 16 (_row_split), which its kernel relies on.
    col_blocks, rows_per_program, row_programs = _row_split(v, rows, F, plan, x.element_size())
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
    with _device_guard(x):
        _backward_launcher(
            _tile_grid(row_programs, col_blocks, plan), tensors, (rows, F, rows_per_program), plan
        )
    dbias = dbias_part.sum(dim=0).to(bias.dtype) if v.has_bias else None
    dprobs = None
    if v.has_probs:
        dprobs = dprobs_part if col_blocks == 1 else dprobs_part.sum(dim=0)
        if dprobs.dtype != probs.dtype:
            dprobs = dprobs.to(probs.dtype)
    return dx, dbias, dprobs
