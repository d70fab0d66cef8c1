"""The Triton kernels for every activation an ActivationSpec describes (the kernel layer on CUDA).

This file holds the ``@triton.jit`` code only; ``triton_plans`` chooses how a kernel is launched
(tiles, warps, row splits) and ``triton_kernels`` launches it (the entry points
``triton_forward`` / ``triton_backward``). The kernels' names keep their leading underscore: it is
part of the compiled symbol names that profiles and SASS listings show.

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

``_activation_bwd_kernel`` is one body of about 170 lines on purpose: every branch is a
compile-time switch of one straight-line kernel, and its parts share the tile's loads and masks;
splitting it into jit helpers is possible (they inline) but must be shown to compile to the same
SASS (tools/inspect_kernel_sass.py --compare).
"""

from __future__ import annotations

import math

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
# Every exponential is ``tl.exp2`` of an argument already scaled by log2(e), never ``tl.exp``.
# On NVIDIA GPUs (Triton 3.6 and 3.7) ``tl.exp2`` is one ``ex2.approx.ftz`` instruction, while
# ``tl.exp`` adds a multiply by log2(e) and a guard that rescales arguments below -126 so that
# subnormal results survive (a compare and two predicated multiplies): 3-4 instructions per
# exponential, in kernels that SiTU-GLU's three per element make bound by instruction issue.
# The call sites fold log2(e) into a constant they multiply
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
    launch plan picks ``FAST_DIV`` for 16-bit inputs, where it measured faster; fp32 inputs keep
    div.full, which measured faster there (``LaunchOptions.fast_div``). With b > 2**126 the
    reciprocal flushes to 0, where a / b would be below 1e-38.
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
    # 16-bit forward, where it measured faster. SiTU-GLU(4), whose only tanh is the gate's, lost
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
    per element), and in float32 each div.full is several instructions; one shared division
    made both faster. The extra rounding is a few float32 ulp.

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
            # element against 49.5, tools/inspect_kernel_sass.py).
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


# The divisibility Triton's hints speak of: an aligned row split (ROWS_ALIGNED) is a multiple of
# it (triton_plans.row_split rounds it up).
ROWS_ALIGNMENT = tl.constexpr(16)


# Longer than the ~80 lines a function gets here, for a reason: the row loop carries up to four
# accumulators (the bias gradient's two halves, the probability gradient), shaped by HAS_PROBS,
# and a jitted helper cannot own part of a loop whose carried values it does not return. What
# does not touch those accumulators lives in inlined helpers (_tile_ids, _glu_columns, the terms).
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
        # the unweighted GLU backward with bias at several times the copy floor. For one-row
        # tiles both forms add the same numbers in the same order and
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
    # ahead through shared memory (LaunchOptions.bwd_bias_stages says where each is used; the
    # prefetches stop at the loop's bound, and the span is a whole number of BLOCK_M-row trips,
    # so the rows < rows mask is the only one needed). Loading, computing and storing in turn
    # left memory idle while a program computed; the arithmetic is the same either way, and so
    # are the bits.
    if HAS_BIAS:
        span = rows_per_program
        if ROWS_ALIGNED:
            # The plan rounds it to a multiple (row_split), so this changes no value; written
            # as a product it tells the compiler (tl.multiple_of cannot mark an argument).
            span = (span // ROWS_ALIGNMENT) * ROWS_ALIGNMENT
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
