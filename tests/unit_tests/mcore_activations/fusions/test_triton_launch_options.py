"""The kernels under launch options other than production's (``LaunchOptions``): the
shapes a small test would otherwise never reach (several programs looping over several row
blocks, partial trips, aligned splits) against the float64 reference, and the options that must
not change a bit (pipelined or prefetched row loops, the two program orders).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_activations.fusions import triton_kernels as tk
from mcore_activations.fusions import triton_plans as tp
from mcore_activations.fusions.activation_kernels import KernelVariant, params_tensor, spec_params
from mcore_activations.fusions.triton_plans import LaunchOptions
from tests.unit_tests.activation_catalog import SPECS
from tests.unit_tests.mcore_activations.fusions.test_fused_activation import _inputs, _leaf
from tests.unit_tests.mcore_activations.fusions.triton_cases import BOTH
from tests.unit_tests.tolerances import assert_close_to_reference

pytest.importorskip("triton")


def check_against_reference(spec, dtype, has_bias, has_probs, options, device, rows, ffn):
    """The raw kernels under ``options`` against the float64 reference: output and every
    gradient, as ``test_fused_activation.check_against_reference`` checks the whole path (which
    always runs production's options)."""
    x, bias, probs, grad = _inputs(spec, dtype, has_bias, has_probs, rows=rows, ffn=ffn)
    x, grad = x.to(device), grad.to(device)
    bias = bias.to(device) if bias is not None else None
    probs = probs.to(device) if probs is not None else None
    variant = KernelVariant.of(spec, has_bias=has_bias, has_probs=has_probs)
    params = params_tensor(spec_params(spec), x.device)
    out = tk.triton_forward(variant, x, bias, probs, params, options=options)
    dx, dbias, dprobs = tk.triton_backward(variant, grad, x, bias, probs, params, options=options)
    xr, br, pr = _leaf(x, torch.float64), _leaf(bias, torch.float64), _leaf(probs, torch.float64)
    ref = spec.reference(xr, bias=br, probs=pr)
    ref.backward(grad.double())
    assert out.dtype == dtype
    assert_close_to_reference(out, ref, dtype, f"{spec.name} output")
    assert_close_to_reference(dx, xr.grad, dtype, f"{spec.name} dx")
    if has_bias:
        assert dbias.dtype == dtype
        assert_close_to_reference(dbias, br.grad, dtype, f"{spec.name} dbias")
    if has_probs:
        assert dprobs.dtype == dtype
        assert_close_to_reference(dprobs, pr.grad, dtype, f"{spec.name} dprobs")


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("has_probs", [False, True], ids=["unweighted", "probs"])
@pytest.mark.parametrize("name", ["swiglu_clamp", "squared_relu_tanh"])
def test_triton_reductions_across_programs(name, has_probs, device):
    """Several column blocks (probs partials) and several row programs each looping over several
    row blocks (bias partials): the paths a small test shape would otherwise never take. With
    probabilities a block is one row (``_probs_backward_plan``); without, two."""

    # 4 programs over the column blocks: 2 row programs per column block for the non-gated
    # kernel (2 blocks), 1 for the gated one (3 blocks), each looping over several row blocks.
    # Unweighted: 2 rows per block at 128 columns.
    options = LaunchOptions(
        bias_programs=4, bias_programs_glu=4, bias_programs_narrow=4, bwd_tile=256, bwd_tile_row=256
    )
    check_against_reference(
        SPECS[name], torch.float32, True, has_probs, options, device=device, rows=19, ffn=300
    )


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("name", ["swiglu_clamp", "squared_relu_tanh"])
def test_triton_weighted_backward_with_several_rows_per_program(name, device):
    """The weighted backward's plan with several rows of a column block per program (one warp
    per row of 128 columns: ``_probs_backward_plan``), a partial last row block (19 rows over
    blocks of 4), three column blocks of probability partials and, with 3 bias programs, one
    program per column block looping over all five row blocks."""

    options = LaunchOptions(
        bias_programs=3, bwd_probs_rows=4, bwd_probs_max_block_n=128, bwd_probs_columns_per_warp=128
    )
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=True)
    plan = tp.backward_plan(variant, 300, 4, options)
    assert (plan[0], plan[1], plan[2]["num_warps"]) == (4, 128, 4)
    check_against_reference(
        SPECS[name], torch.float32, True, True, options, device=device, rows=19, ffn=300
    )


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize(
    "name,dtype,ffn,has_probs",
    [
        ("swiglu_clamp", torch.bfloat16, 1024, False),  # the GLU tile plan
        ("quick_geglu_gpt_oss", torch.bfloat16, 1024, True),  # the weighted one-row wide plan
        ("situ_glu", torch.float16, 304, True),  # the one-row narrow plan, linear tanh
        ("situ_glu", torch.bfloat16, 304, False),
        ("squared_relu", torch.bfloat16, 496, True),  # the general weighted plan
        ("squared_relu_tanh", torch.bfloat16, 1008, False),  # the non-gated plan
        ("swiglu_clamp", torch.float32, 208, True),  # the general weighted plan, float32
    ],
)
def test_pipelined_row_loop_matches_register_prefetch_bit_for_bit(
    name, dtype, ffn, has_probs, device
):
    """Every plan whose row loop is pipelined (``LOOP_STAGES`` >= 2) gives the same bits as the
    same plan loading one trip ahead in registers: the arithmetic and the summation order are
    the same, only where the loads wait differs. A few programs, each walking several trips,
    the last one past the rows."""

    spec = SPECS[name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(spec, has_bias=True, has_probs=has_probs)
    assert tp.backward_plan(variant, ffn, itemsize)[2]["LOOP_STAGES"] >= 2
    counts = dict(bias_programs=6, bias_programs_glu=6, bias_programs_narrow=6)
    counts |= dict(bias_programs_probs_wide=3, bias_programs_probs_wide_capped=3)
    options = LaunchOptions(**counts)
    torch.manual_seed(0)
    rows, width = 37, 2 * ffn if spec.gated else ffn
    x = (torch.randn(rows, width) * 3).to(device, dtype)
    bias = torch.randn(width).to(device, dtype)
    probs = torch.rand(rows, 1).to(device) if has_probs else None
    grad = torch.randn(rows, ffn).to(device, dtype)
    params = params_tensor(spec_params(spec), x.device)
    pipelined = tk.triton_backward(variant, grad, x, bias, probs, params, options=options)
    stages = dict(bwd_bias_stages=0, bwd_bias_narrow_stages=0, bwd_bias_narrow_tanh_stages=0)
    options = dataclasses.replace(options, bwd_probs_bias_wide_stages=0, **stages)
    assert tp.backward_plan(variant, ffn, itemsize, options)[2]["LOOP_STAGES"] == 0
    prefetched = tk.triton_backward(variant, grad, x, bias, probs, params, options=options)
    for a, b in zip(pipelined, prefetched):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("device", BOTH)
def test_aligned_rows_with_a_tile_taller_than_16_rows(device):
    """Aligned rows per program where the tile holds 32 rows (a non-gated plan at 128 columns,
    aligned by bias_rows_aligned): every split stays a whole number of tiles and a multiple of
    16, and the kernel's aligned form computes the right gradients over several programs."""

    options = LaunchOptions(bias_rows_aligned=True, bias_programs=5)
    variant = KernelVariant.of(SPECS["squared_relu"], has_bias=True, has_probs=False)
    plan = tp.backward_plan(variant, 128, 2, options)
    assert plan[0] == 32 and plan[2]["ROWS_ALIGNED"] is True
    # 10 row blocks over 5 programs: 2 blocks (64 rows) each.
    assert tp.row_split(variant, 320, 128, plan, 2, options) == (1, 64, 5)
    # 3 row blocks over 5 programs: one block each, the last program 6 rows.
    assert tp.row_split(variant, 70, 128, plan, 2, options) == (1, 32, 3)
    check_against_reference(
        SPECS["squared_relu"], torch.bfloat16, True, False, options, device=device, rows=70, ffn=128
    )


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize(
    "name,rows,split,trip_rows",
    [
        # Two rows a trip (SiTU-GLU with a linear scale), aligned rows: 25 trips over 3 programs
        # would be 18 rows each; rounded to 32, two programs, the second 18 rows (9 trips, then 7
        # empty ones). 8 rows per program round to 16: 16 rows, then 3 (the last trip half
        # empty).
        ("situ_glu", 50, (1, 32, 2), 2),
        ("situ_glu", 19, (1, 16, 2), 2),
        # One row a trip, pipelined: aligned (a clamp) 17 rows round to 32 and 7 to 16.
        ("swiglu_clamp", 50, (1, 32, 2), 1),
        ("swiglu_clamp", 19, (1, 16, 2), 1),
        # An unaligned kind: 19 trips over 3 programs, 7 each, the last 5 rows.
        ("situ_glu_gate_only", 19, (1, 7, 3), 1),
        # Two rows a trip, unaligned (SwiGLU): 10 trips over 3 programs, 8 rows (4 trips) each,
        # the last 3 rows.
        ("swiglu", 19, (1, 8, 3), 2),
    ],
)
def test_triton_weighted_backward_with_a_bias_at_1024_column_blocks(
    name, rows, split, trip_rows, device
):
    """The 16-bit weighted backward with a bias at a 1024-column block: one row per trip, or two
    with the bias gradient summed over each trip's rows inside the thread, several programs each
    looping over several trips, aligned and unaligned rows per program; bf16 and the interleaved
    layout."""

    options = LaunchOptions(bias_programs_probs_wide=3, bias_programs_probs_wide_capped=3)
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=True)
    plan = tp.backward_plan(variant, 1024, 2, options)
    assert plan[0] == trip_rows
    assert tp.row_split(variant, rows, 1024, plan, 2, options) == split
    for spec in (SPECS[name], dataclasses.replace(SPECS[name], glu_interleave_size=32)):
        check_against_reference(
            spec, torch.bfloat16, True, True, options, device=device, rows=rows, ffn=1024
        )


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("has_probs", [False, True], ids=["unweighted", "probs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_glu_backward_with_a_bias_one_row_per_trip(dtype, has_probs, device):
    """The one-row plan of 16-bit GLUs with a bias, weighted or not, at 128-column blocks (F =
    300: three blocks, the last partly padding): a count of 6 is 12 one-warp programs, 4 per
    column block, so each walks 5 of the 19 rows one per trip (the last 4), against the float64
    reference."""

    options = LaunchOptions(bias_programs_narrow=6)
    variant = KernelVariant.of(SPECS["swiglu_clamp"], has_bias=True, has_probs=has_probs)
    plan = tp.backward_plan(variant, 300, 2, options)
    assert (plan[0], plan[1], plan[2]["num_warps"]) == (1, 128, 1)
    assert tp.row_split(variant, 19, 300, plan, 2, options) == (3, 5, 4)
    for name in ("swiglu_clamp", "situ_glu", "quick_geglu_gpt_oss"):
        check_against_reference(
            SPECS[name], dtype, True, has_probs, options, device=device, rows=19, ffn=300
        )


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_triton_unweighted_glu_backward_with_aligned_rows(dtype, device):
    """The unweighted GLU backward with a bias at a 1024-column block keeps its rows per
    program a multiple of 16: 50 rows over 3 programs would be 17 each; aligned, two programs
    of 32 and 18 rows, the second ending inside its range."""

    options = LaunchOptions(bias_programs_glu=3)
    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS["swiglu_clamp"], has_bias=True, has_probs=False)
    plan = tp.backward_plan(variant, 1024, itemsize, options)
    assert plan[2]["ROWS_ALIGNED"] is True
    assert tp.row_split(variant, 50, 1024, plan, itemsize, options) == (1, 32, 2)
    check_against_reference(
        SPECS["swiglu_clamp"], dtype, True, False, options, device=device, rows=50, ffn=1024
    )


@pytest.mark.parametrize("device", BOTH)
def test_triton_weighted_backward_register_cap(device):
    """A register cap (``bwd_probs_max_registers``, off by default) reaches the launch as
    Triton's ``maxnreg`` and leaves the gradients right; without one the plan passes none."""

    variant = KernelVariant.of(SPECS["swiglu_clamp"], has_bias=True, has_probs=True)
    assert "maxnreg" not in tp.backward_plan(variant, 300, 4)[2]
    options = LaunchOptions(bwd_probs_max_registers=40)
    assert tp.backward_plan(variant, 300, 4, options)[2]["maxnreg"] == 40
    check_against_reference(
        SPECS["swiglu_clamp"], torch.float32, True, True, options, device=device, rows=19, ffn=300
    )


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("has_probs", [False, True], ids=["unweighted", "probs"])
@pytest.mark.parametrize("name", ["swiglu_clamp", "situ_glu", "squared_relu_tanh"])
def test_triton_program_orders_agree_bit_for_bit(name, has_probs, device):
    """The tiled kernels' two program orders (``columns_fastest``: a 1-D grid with column blocks
    fastest, the default, or a 2-D grid with row blocks fastest, which the benchmark keeps for
    comparison) give every tile the same rows and columns: outputs and gradients, the bias and
    probability reductions included, must agree bit for bit."""
    # 75 rows over three column blocks of 128: three forward row blocks of 32 (4096-element tiles;
    # a non-gated forward runs the flat kernel, which has no tiles); with 12 bias programs, four
    # row programs in the backward, each looping over several row blocks (8 rows for a GLU, 2 for
    # the non-gated kind at a 256-element tile, 1 with probabilities).
    counts = dict(bias_programs=12, bias_programs_glu=12, bias_programs_narrow=12)
    rows = 75
    spec = SPECS[name]
    variant = KernelVariant.of(spec, has_bias=True, has_probs=has_probs)
    gen = torch.Generator().manual_seed(7)
    width = 600 if spec.gated else 300  # three column blocks of 128
    x = (torch.randn(rows, width, generator=gen) * 4).to(device)
    grad = torch.randn(rows, 300, generator=gen).to(device)
    bias = torch.randn(width, generator=gen).to(device)
    probs = torch.rand(rows, 1, generator=gen).to(device) if has_probs else None
    params = params_tensor(spec_params(spec), x.device)
    results = []
    for columns_fastest in (True, False):
        options = LaunchOptions(bwd_tile=256, columns_fastest=columns_fastest, **counts)
        plans = [tp.backward_plan(variant, 300, x.element_size(), options)]
        if spec.gated:
            plans.append(tp.forward_plan(variant, 300, x.element_size(), options))
        assert all(plan[2]["COLUMNS_FASTEST"] is columns_fastest for plan in plans)
        out = tk.triton_forward(variant, x, bias, probs, params, options=options)
        grads = tk.triton_backward(variant, grad, x, bias, probs, params, options=options)
        results.append([out, *(g for g in grads if g is not None)])
    for first, second in zip(*results):
        torch.testing.assert_close(first, second, rtol=0, atol=0)
