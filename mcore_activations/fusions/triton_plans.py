"""Launch plans of the Triton activation kernels: tile shapes, warps, row splits and their tuning.

A plan is what a launch of ``triton_jit``'s kernels is compiled and run with: the tile
(``BLOCK_M x BLOCK_N`` output elements, or a flat block), the warps, an optional register cap,
and the compile-time switches that are not part of the activation (the division, the program
order, the row loop's alignment and pipelining). The backward with a bias also splits the rows
between a fixed number of programs (:func:`row_split`).

Every number a plan is built from is a field of :class:`LaunchOptions`, whose defaults are the
production choices; production calls pass none and get :data:`DEFAULT_OPTIONS`. The benchmarks
(tools/kernel_variants/) pass other options to compare candidates in one process. The values are
plain constants chosen from timed sweeps, not autotuned: a tuned choice could differ between runs,
and the reductions' summation order (and so the gradients' bits) follows the tile shape and the
row split. The measurements behind each default are in docs/bench/history.md, "Why the launch
plans are what they are"; the comments here give the reasons.

A plan is a :class:`LaunchPlan` ``(block_m, block_n, kwargs, values)``: ``kwargs`` are the
compile-time arguments and launch options a ``kernel[grid](...)`` call takes, ``values`` the
compile-time arguments alone in the kernel's signature order (the launcher's cache key and its
direct launch read them). Plans are cached: the host cost of a launch matters for the small calls
MoE experts make.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import NamedTuple, Optional

import torch

from mcore_activations.fusions import triton_jit

# rcp.approx is PTX: the interpreter and ROCm always take the portable division.
_HAS_PTX = os.environ.get("TRITON_INTERPRET") != "1" and not torch.version.hip


class LaunchPlan(NamedTuple):
    """How one kernel is launched: tile, compile-time arguments and launch options."""

    block_m: int  # rows of a tile; for a flat kernel, its block of elements
    block_n: Optional[int]  # columns of a tile; None for a flat kernel
    kwargs: dict  # compile-time arguments and launch options (num_warps, maxnreg)
    values: tuple  # the compile-time arguments in the kernel's signature order


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """The numbers and switches the launch plans are built from; the defaults are production's.

    Tiles are counted in output elements: the forward streams 2 loads and 1 store per element of a
    GLU, the backward 3 loads and 2 stores and keeps more values live. "Weighted" means with
    per-row probabilities (MoE), "16-bit" bf16 or fp16 inputs. Invalid values (rows per program
    that are not a power of two, a loop-stage count of 1) are refused at construction, before
    anything compiles.
    """

    # ---- forward
    fwd_tile: int = 4096
    fwd_warps: int = 8
    # GLU forwards stream 2048-column blocks: wider rows measured faster for every GLU kind.
    fwd_max_block_n: int = 2048
    # The weighted 16-bit GLU forward with a bias spreads the tile over fewer warps where the
    # column block is narrower than fwd_max_block_n: faster at 768-2880 columns; at 2048-column
    # blocks 4 warps lost, and the forwards without a bias or probabilities keep 8.
    fwd_warps_probs_bias_narrow: int = 4
    # ... except ReGLU (the lightest arithmetic) and SiTU-GLU with a linear scale (the heaviest)
    # at column blocks at least this wide, which ran faster on 8 warps while every other kind lost.
    fwd_warps_probs_bias_keep_block_n: int = 1024

    # ---- non-gated kinds: flat kernels
    # Non-gated forwards, and non-gated backwards without bias or probabilities (no reduction),
    # stream flat blocks of elements (_unary_*_flat_kernel) like a copy kernel; False keeps the
    # 2-D tile for every kind (the comparison of tools/kernel_variants, experiment "flat").
    flat_unary: bool = True
    flat_block: int = 2048
    flat_warps: int = 4
    # The tanh soft clamp is bound by arithmetic, not memory, and gains from more elements per
    # thread.
    flat_block_soft_clamp: int = 4096
    flat_warps_soft_clamp: int = 4

    # ---- backward without probabilities
    bwd_tile: int = 4096  # non-gated
    bwd_warps: int = 8
    # Gated: a 1024-element tile, one row where the column block is 1024 wide, two at F = 1536
    # (512-column blocks); GLUs gained nothing from taller tiles.
    bwd_tile_row: int = 1024
    bwd_warps_row: int = 4
    # Wider backward rows gained at most 0.02 of the copy floor and SiTU-GLU's lost 0.09-0.17.
    bwd_max_block_n: int = 1024

    # ---- weighted backward (see _probs_backward_plan)
    bwd_probs_rows: int = 1  # rows per program: a power of two (it becomes BLOCK_M)
    bwd_probs_columns_per_warp: int = 256  # 8 columns a thread
    bwd_probs_max_block_n: int = 1024
    # Register cap per thread (Triton's maxnreg) of the weighted backward, None for none. Kept
    # for the reduce experiment: 48 helped only the bf16 clamped SwiGLU, and by 0.01.
    bwd_probs_max_registers: Optional[int] = None

    # ---- weighted 16-bit GLU backward with a bias (see _probs_bias_backward_plan)
    bwd_probs_bias_rows: int = 2  # rows a trip at 1024-column blocks, for the kinds that take two
    bwd_probs_bias_wide_block_n: int = 1024  # the narrowest column block of that wide plan
    # Register cap of the wide plan for the kinds heavy in transcendentals; another cap needs
    # another bias_programs_probs_wide_capped.
    bwd_probs_bias_max_registers: int = 128
    # The narrow plans' column block for the clamped kinds and heavy gates where a row spans
    # several blocks: one warp and twice the programs. Not at one block a row, where the split
    # adds the column blocks' bias sum.
    bwd_probs_bias_narrow_max_block_n: int = 256
    # Register cap of the one-row plan (16-bit GLUs with a bias at column blocks under 1024, with
    # or without probabilities); bias_programs_narrow follows from it. Every GLU kind compiles to
    # at most 96 registers without spilling (tools/inspect_kernel_sass.py).
    bwd_bias_narrow_max_registers: int = 96

    # ---- the backward with a bias: programs sharing the rows
    # A fixed number of programs in total (across column blocks), not one derived from the
    # device: the summation order, and so the bias gradient's bits, are the same on every GPU.
    bias_programs: int = 1024
    # The unweighted GLU backward (float32 at every width, 16-bit at 1024-column blocks) runs
    # more; weighted and non-gated calls lost with more.
    bias_programs_glu: int = 4096
    # The one-row plan runs one full wave of 2-warp programs (1-warp ones: twice as many). How
    # many programs an SM holds follows from the register cap: each of its 4 sub-partitions has
    # 16384 registers and holds floor(16384 / (32 x cap)) warps, so under 96 registers a thread
    # an SM holds 20 warps: 1320 = 10 x 132 two-warp programs on an H200's 132 SMs.
    bias_programs_narrow: int = 1320
    # The two-row plan at 1024-column blocks runs at most one wave as well: an SM holds 3 of its
    # uncapped programs (up to 168 registers a thread, 4 warps) or 4 under the cap of 128
    # (bwd_probs_bias_max_registers), so 396 = 3 x 132 and 528 = 4 x 132; two to four waves ran
    # slower nearly everywhere. The one-row pipelined form of that plan uses the same counts.
    bias_programs_probs_wide: int = 396
    bias_programs_probs_wide_capped: int = 528

    # ---- the backward with a bias: alignment of the row split (ROWS_ALIGNED)
    # The unweighted GLU backward keeps its rows per program a multiple of 16 at column blocks at
    # least this wide (faster there for every kind and dtype, slower at 512-column blocks).
    glu_bias_aligned_block_n: int = 1024
    # Whether the plans with a bias that have no rule of their own (non-gated kinds, the general
    # weighted plan: float32, non-gated) keep their rows aligned: measured mixed, so off.
    bias_rows_aligned: bool = False

    # ---- the backward with a bias: how the row loop keeps memory busy (LOOP_STAGES)
    # 0 loads each trip's inputs one trip ahead into registers; N >= 2 has Triton pipeline the
    # loop's loads through shared memory (cp.async), N - 1 trips ahead, which costs 2-4 SASS
    # instructions an element but no registers. 1 (load each trip's inputs when it runs) is
    # refused. Every bit is the same either way: the summation order does not change.
    # The unweighted 16-bit plans (GLU at 1024-column blocks, non-gated); float32 keeps 0.
    bwd_bias_stages: int = 4
    # The general weighted plan (float32 GLUs, non-gated kinds) pipelines where a trip's row
    # segment is at most this many bytes (1-2 warp programs, many an SM); 4-warp rows lost.
    bwd_probs_bias_staged_bytes: int = 1024
    # The one-row plan of 16-bit GLUs: 2 stages ran level and 3-4 lost, ...
    bwd_bias_narrow_stages: int = 0
    # ... except for SiTU-GLU with a linear scale, the heaviest in arithmetic.
    bwd_bias_narrow_tanh_stages: int = 3
    # The weighted plan at 1024-column blocks: one row a trip so pipelined replaces two rows a
    # trip with register prefetch for the clamped kinds and the heavy gates.
    bwd_probs_bias_wide_stages: int = 4

    # ---- every tiled kernel
    # Program order (the kernels' COLUMNS_FASTEST, _tile_ids): a row's column blocks fastest, so
    # programs that run together stream consecutive memory; False numbers row blocks fastest.
    columns_fastest: bool = True
    # The division (the kernels' FAST_DIV, _div): None takes the hardware reciprocal for 16-bit
    # inputs and div.full for float32 (each measured faster there); True the reciprocal for every
    # dtype, False div.full for every dtype. Only where PTX exists: elsewhere always div.full.
    fast_div: Optional[bool] = None

    def __post_init__(self):
        for name in ("bwd_probs_rows", "bwd_probs_bias_rows"):
            rows = getattr(self, name)
            # Rows per program become BLOCK_M, a tl.arange length, which Triton requires to be a
            # power of two.
            if rows < 1 or rows & (rows - 1):
                raise ValueError(
                    f"{name}={rows} is not a power of two; the weighted backward's rows per "
                    "program must be 1, 2, 4, ..."
                )
        for name in _STAGE_FIELDS:
            if getattr(self, name) == 1:
                raise ValueError(
                    f"the backward loop-stage option {name} is 1, which would load each trip's "
                    "inputs only when it runs; use 0 (one trip ahead in registers) or 2+"
                )
        # Plans are cached by options on every launch: hash the fields once.
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash


_STAGE_FIELDS = (
    "bwd_bias_stages",
    "bwd_bias_narrow_stages",
    "bwd_bias_narrow_tanh_stages",
    "bwd_probs_bias_wide_stages",
)

DEFAULT_OPTIONS = LaunchOptions()


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division. Not ``triton.cdiv``: since Triton 3.7 that is a constexpr
    function whose host call costs microseconds, four times per backward."""
    return -(-a // b)


@functools.cache
def block_n(F: int, max_block_n: int) -> int:
    """Column block: the widest power of two in 128..max_block_n whose masked tail wastes at
    most 1/8 of the row, else the one that wastes least; narrow rows get one block.

    Wide blocks keep each row's loads long and contiguous: at F = 2880 (gpt-oss) the least
    wasteful 128-column blocks streamed well below the copy rate. Cached: the unweighted GLU
    backward asks on every call, and the search costs 1-2 us of host time.
    """
    if F <= 128:
        return 1 << (F - 1).bit_length()
    sizes = [b for b in (4096, 2048, 1024, 512, 256, 128) if b <= max_block_n]
    waste = {b: cdiv(F, b) * b - F for b in sizes}
    for b in sizes:
        if 8 * waste[b] <= F:
            return b
    return min(sizes, key=lambda b: (waste[b], -b))


def _fast_div(itemsize: int, options: LaunchOptions) -> bool:
    # The kernels' FAST_DIV (LaunchOptions.fast_div); only where PTX exists.
    if options.fast_div is None:
        return _HAS_PTX and itemsize <= 2
    return _HAS_PTX and options.fast_div


def uses_flat_kernel(v, backward: bool, options: LaunchOptions = DEFAULT_OPTIONS) -> bool:
    """Whether variant ``v`` runs a flat kernel (``_unary_*_flat_kernel``) rather than the tiled
    one: non-gated forwards, and non-gated backwards with no bias or probabilities to reduce."""
    if v.gated or not options.flat_unary:
        return False
    return not (backward and (v.has_bias or v.has_probs))


def tile_grid(row_blocks: int, col_blocks: int, plan: LaunchPlan) -> tuple[int, int, int]:
    """The launch grid of the tiled kernels (``_tile_ids`` says how programs map to tiles)."""
    if plan[2]["COLUMNS_FASTEST"]:
        return row_blocks * col_blocks, 1, 1
    return row_blocks, col_blocks, 1


# ----------------------------------------------------------------------------- tiled plans
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
) -> LaunchPlan:
    """The plan of variant ``v`` at width ``F`` for a ``tile``-element tile over ``warps``.

    ``max_registers`` caps the registers per thread (Triton's ``maxnreg``; NVIDIA only, other
    backends ignore it). ``rows_aligned`` is None for the forward kernel's plan; for the backward
    kernel's it says whether the rows per program of a call with a bias are kept a multiple of
    ``ROWS_ALIGNMENT`` and the kernel compiled knowing it (``ROWS_ALIGNED``).
    """
    bn = block_n(F, max_block_n)
    block_m = max(1, tile // bn)
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
        BLOCK_N=bn,
        num_warps=warps,
    )
    kernel = triton_jit._activation_fwd_kernel
    if rows_aligned is not None:
        kernel = triton_jit._activation_bwd_kernel
        kwargs["ROWS_ALIGNED"] = rows_aligned and v.has_bias  # only a bias splits the rows
        kwargs["LOOP_STAGES"] = loop_stages if _pipelines(v, F) else 0
    if max_registers is not None:
        kwargs["maxnreg"] = max_registers
    params = [name for name in kernel.arg_names if name in kwargs]
    assert len(params) == len(kwargs) - 1 - (max_registers is not None)  # all but the options
    return LaunchPlan(block_m, bn, kwargs, tuple(kwargs[name] for name in params))


def _pipelines(v, F: int) -> bool:
    # Whether the backward's row loop may be pipelined (LOOP_STAGES >= 2): it has one only with a
    # bias, and only where F is specialised as a multiple of 16 can Triton prove the rows' 16-byte
    # alignment and copy each thread's 8 or 16 bytes at once; at other widths it pipelines some
    # loads in 4-byte copies and leaves the output gradient's unpipelined (sm_90 PTX), a form
    # never timed, so they keep the register prefetch.
    return v.has_bias and F % 16 == 0


def _has_probs_bias_plan(v, itemsize: int) -> bool:
    # The weighted 16-bit GLU with a bias has plans of its own (_probs_bias_forward_plan,
    # _probs_bias_backward_plan) and program counts for its backward (bias_programs).
    return v.gated and v.has_probs and v.has_bias and itemsize <= 2


def _has_narrow_glu_bias_plan(v, F: int, itemsize: int, options: LaunchOptions) -> bool:
    # The unweighted 16-bit GLU backward with a bias takes the weighted one-row plan where the
    # column block is narrower than bwd_probs_bias_wide_block_n: its own plan (1024-element tiles
    # over 4 warps, 4096 programs, several waves) ran far slower there.
    return (
        v.gated
        and v.has_bias
        and not v.has_probs
        and itemsize <= 2
        and block_n(F, options.bwd_probs_max_block_n) < options.bwd_probs_bias_wide_block_n
    )


def forward_plan(v, F: int, itemsize: int, options: LaunchOptions = DEFAULT_OPTIONS) -> LaunchPlan:
    """The tiled forward kernel's plan for variant ``v`` at width ``F``, inputs of ``itemsize``
    bytes."""
    return _forward_plan(v, F, itemsize, _fast_div(itemsize, options), options)


@functools.cache
def _forward_plan(v, F: int, itemsize: int, fast_div: bool, options: LaunchOptions) -> LaunchPlan:
    o = options
    warps = o.fwd_warps
    if _has_probs_bias_plan(v, itemsize):
        # The weighted 16-bit GLU with a bias: fewer warps where the column block is narrower
        # than the widest, except for the two kinds that keep them (fwd_warps_probs_bias_*).
        bn = block_n(F, o.fwd_max_block_n)
        keeps = bn >= o.fwd_warps_probs_bias_keep_block_n and (v.kind == "relu" or v.linear_tanh)
        if bn < o.fwd_max_block_n and not keeps:
            warps = o.fwd_warps_probs_bias_narrow
    return _plan(v, F, o.fwd_tile, warps, o.fwd_max_block_n, fast_div, o.columns_fastest)


def backward_plan(v, F: int, itemsize: int, options: LaunchOptions = DEFAULT_OPTIONS) -> LaunchPlan:
    """The tiled backward kernel's plan for variant ``v`` at width ``F``, inputs of ``itemsize``
    bytes."""
    return _backward_plan(v, F, itemsize, _fast_div(itemsize, options), options)


@functools.cache
def _backward_plan(v, F: int, itemsize: int, fast_div: bool, options: LaunchOptions) -> LaunchPlan:
    o = options
    if _has_probs_bias_plan(v, itemsize):
        return _probs_bias_backward_plan(v, F, fast_div, o)
    if _has_narrow_glu_bias_plan(v, F, itemsize, o):
        # The weighted plan's one row per trip, without probabilities (bias_programs_narrow).
        return _probs_backward_plan(
            v,
            F,
            1,
            o.bwd_probs_max_block_n,
            o.bwd_probs_columns_per_warp,
            o.bwd_bias_narrow_max_registers,
            fast_div,
            o,
            False,
            _narrow_stages(v, o),
        )
    if v.has_probs:
        # The general weighted plan (float32 GLUs, non-gated kinds); pipelined with a bias where
        # a trip's row segment is short (bwd_probs_bias_staged_bytes).
        segment = block_n(F, o.bwd_probs_max_block_n) * itemsize
        stages = o.bwd_bias_stages if segment <= o.bwd_probs_bias_staged_bytes else 0
        return _probs_backward_plan(
            v,
            F,
            o.bwd_probs_rows,
            o.bwd_probs_max_block_n,
            o.bwd_probs_columns_per_warp,
            o.bwd_probs_max_registers,
            fast_div,
            o,
            o.bias_rows_aligned,
            stages,
        )
    # The unweighted plans: 16-bit inputs pipelined, float32 loaded ahead (bwd_bias_stages).
    stages = o.bwd_bias_stages if itemsize <= 2 else 0
    if v.gated:
        aligned = block_n(F, o.bwd_max_block_n) >= o.glu_bias_aligned_block_n
        tile, warps = o.bwd_tile_row, o.bwd_warps_row
    else:
        aligned = o.bias_rows_aligned
        tile, warps = o.bwd_tile, o.bwd_warps
    return _plan(
        v,
        F,
        tile,
        warps,
        o.bwd_max_block_n,
        fast_div,
        o.columns_fastest,
        rows_aligned=aligned,
        loop_stages=stages,
    )


def _narrow_stages(v, options: LaunchOptions) -> int:
    # The one-row plan's loop stages (bwd_bias_narrow_stages, bwd_bias_narrow_tanh_stages).
    if v.linear_tanh:
        return options.bwd_bias_narrow_tanh_stages
    return options.bwd_bias_narrow_stages


def _probs_bias_backward_plan(v, F: int, fast_div: bool, o: LaunchOptions) -> LaunchPlan:
    """The weighted backward's plan with a bias, for 16-bit GLUs.

    With a bias each program walks a range of rows, and every trip ends in the probability
    gradient's cross-warp sum (a barrier). Where the column block is
    ``bwd_probs_bias_wide_block_n`` wide, a trip of the clamped kinds and the heavy gates takes
    one row, its loads pipelined ``bwd_probs_bias_wide_stages`` deep (where F is a multiple of 16:
    ``_pipelines``); the light unclamped kinds (SwiGLU, ReGLU, quick-GELU without a clamp),
    SiTU-GLU with a linear scale and the other widths take ``bwd_probs_bias_rows`` rows a trip
    loaded one trip ahead in registers: the warps still split the columns, so each thread holds
    the trip's rows of its columns and the bias gradient's sum over them stays in registers (the
    kernel's 1-D accumulators), while one barrier serves several rows. SiTU-GLU and the GELUs
    take a register cap there (``bwd_probs_bias_max_registers``): two rows without it made the
    heavy kinds slower, while the cap made the light ones slower. Narrower blocks keep one row
    per trip under ``bwd_bias_narrow_max_registers``, over ``bias_programs_narrow`` 2-warp
    programs or twice as many 1-warp ones (``bias_programs``), pipelined for SiTU-GLU with a
    linear scale (``bwd_bias_narrow_tanh_stages``); where a row spans several such blocks, the
    clamped kinds and the heavy gates narrow them to ``bwd_probs_bias_narrow_max_block_n``
    columns. float32 lost with two rows and keeps the general weighted plan.
    """
    heavy = v.gate_tanh or v.kind in ("gelu", "gelu_tanh")
    max_block_n = o.bwd_probs_max_block_n
    if block_n(F, max_block_n) >= o.bwd_probs_bias_wide_block_n:
        pipelined = (v.clamp or heavy) and not v.linear_tanh and _pipelines(v, F)
        if pipelined:
            rows, stages = 1, o.bwd_probs_bias_wide_stages
        else:
            rows, stages = o.bwd_probs_bias_rows, 0
        cap = o.bwd_probs_bias_max_registers if heavy else None
        # Kinds that bound the linear half (a clamp, a tanh) ran faster with aligned rows.
        aligned = v.clamp or v.linear_tanh
    else:
        rows, cap, aligned, stages = 1, o.bwd_bias_narrow_max_registers, False, _narrow_stages(v, o)
        if (v.clamp or heavy) and block_n(F, max_block_n) < F:
            max_block_n = o.bwd_probs_bias_narrow_max_block_n
    # Columns per warp scale with the rows, so the warps split only the columns.
    columns_per_warp = o.bwd_probs_columns_per_warp * rows
    return _probs_backward_plan(
        v, F, rows, max_block_n, columns_per_warp, cap, fast_div, o, aligned, stages
    )


def _probs_backward_plan(
    v,
    F: int,
    rows: int,
    max_block_n: int,
    columns_per_warp: int,
    max_registers: Optional[int],
    fast_div: bool,
    o: LaunchOptions,
    rows_aligned: bool = False,
    loop_stages: int = 0,
) -> LaunchPlan:
    """``rows`` rows of one column block per program, ``columns_per_warp`` columns of the tile per
    warp, for the backward with probabilities
    (and, one row under the narrow register cap, for the unweighted 16-bit GLU backward with a
    bias: ``_has_narrow_glu_bias_plan``).

    The probability gradient is a sum over each row, so every program ends in a cross-warp
    reduction behind a barrier: one row over as many warps as hold eight columns a thread
    measured fastest, against more rows per program, one warp per row (no cross-warp sum), 4, 16
    or 32 columns a thread and 2048-column blocks. Column blocks narrower than 256 (e.g. 128 at
    F = 384) get one warp and fewer columns per thread.
    """
    bn = block_n(F, max_block_n)
    warps = max(1, rows * bn // columns_per_warp)
    return _plan(
        v,
        F,
        rows * bn,
        warps,
        max_block_n,
        fast_div,
        o.columns_fastest,
        max_registers,
        rows_aligned,
        loop_stages,
    )


# ----------------------------------------------------------------------------- the row split
def bias_programs(
    v, F: int, plan: LaunchPlan, itemsize: int, options: LaunchOptions = DEFAULT_OPTIONS
) -> int:
    """Programs in total of the backward with a bias (``v.has_bias``) under ``plan``, over all
    column blocks."""
    o = options
    if not v.gated:
        return o.bias_programs
    # The one-row plan's count is of 2-warp programs; 1-warp ones fill the same wave with twice
    # as many.
    one_row = o.bias_programs_narrow * 2 // plan[2]["num_warps"]
    if not v.has_probs:
        if _has_narrow_glu_bias_plan(v, F, itemsize, o):
            return one_row
        return o.bias_programs_glu
    if not _has_probs_bias_plan(v, itemsize):
        return o.bias_programs
    if plan[1] < o.bwd_probs_bias_wide_block_n:
        return one_row
    if "maxnreg" in plan[2]:
        return o.bias_programs_probs_wide_capped
    return o.bias_programs_probs_wide


def row_split(
    v,
    rows: int,
    F: int,
    plan: LaunchPlan,
    itemsize: int,
    options: LaunchOptions = DEFAULT_OPTIONS,
) -> tuple[int, int, int]:
    """``(column blocks, rows per program, programs per column block)`` of the tiled backward
    under ``plan``: one row block per program without a bias; with one, a fixed number of
    programs sharing the rows in ranges (so the bias partial sums do not depend on scheduling).
    """
    block_m, bn = plan[0], plan[1]
    col_blocks = cdiv(F, bn)
    row_blocks = cdiv(rows, block_m)
    if not v.has_bias:
        return col_blocks, block_m, row_blocks
    programs = bias_programs(v, F, plan, itemsize, options)
    row_programs = min(row_blocks, max(1, programs // col_blocks))
    rows_per_program = block_m * cdiv(row_blocks, row_programs)
    alignment = triton_jit.ROWS_ALIGNMENT.value
    if plan[2]["ROWS_ALIGNED"]:
        # Rounded up: never more programs than the count above, and still a whole number of
        # BLOCK_M-row trips (BLOCK_M is a power of two, so a multiple of it that is at least 16
        # is a multiple of 16, and rounding that up to 16 keeps it). Small calls' one to three
        # rows per program so round up to 16 (fewer, longer programs), which measured level.
        rows_per_program = alignment * cdiv(rows_per_program, alignment)
    return col_blocks, rows_per_program, cdiv(rows, rows_per_program)


# ----------------------------------------------------------------------------- flat plans
def flat_plan(
    v, backward: bool, n: int, itemsize: int, options: LaunchOptions = DEFAULT_OPTIONS
) -> LaunchPlan:
    """The plan of the flat kernel (``_unary_bwd_flat_kernel`` if ``backward``, else
    ``_unary_fwd_flat_kernel``) over ``n`` elements; ``block_n`` is None."""
    if v.gate_tanh:
        block = options.flat_block_soft_clamp
    else:
        block = options.flat_block
    # int32 offsets unless the last block's offsets pass 2**31 (program_id * BLOCK is int32).
    wide = n + block >= 2**31
    return _flat_plan(v, backward, wide, _fast_div(itemsize, options), options)


@functools.cache
def _flat_plan(v, backward: bool, wide: bool, fast_div: bool, options: LaunchOptions):
    if v.gate_tanh:
        block, warps = options.flat_block_soft_clamp, options.flat_warps_soft_clamp
    else:
        block, warps = options.flat_block, options.flat_warps
    kernel = triton_jit._unary_bwd_flat_kernel if backward else triton_jit._unary_fwd_flat_kernel
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
    return LaunchPlan(block, None, kwargs, tuple(values[name] for name in params))
