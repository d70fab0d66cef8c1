"""The launch plans the kernels run with (``triton_plans``): column blocks, warps,
rows per program, register caps, loop stages, program counts and the row split, and the
``LaunchOptions`` that are refused. CPU only: nothing here launches a kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_activations.fusions import triton_plans as tp
from mcore_activations.fusions.activation_kernels import KernelVariant
from mcore_activations.fusions.triton_plans import DEFAULT_OPTIONS, LaunchOptions
from tests.unit_tests.activation_catalog import SPECS

pytest.importorskip("triton")


@pytest.mark.parametrize(
    "ffn,max_block_n,expected",
    [
        # Narrow rows: one block, the next power of two (the kernels' tl.arange needs one).
        (1, 1024, 1),
        (13, 1024, 16),
        (128, 1024, 128),
        # The widest block whose masked tail is at most 1/8 of the row.
        (1536, 1024, 512),
        (2880, 2048, 1024),
        (8192, 1024, 1024),
        (8192, 2048, 2048),
        # No block wastes 1/8 or less: the least waste (F = 300: 128-column blocks waste 84),
        # the wider block on a tie (F = 129: 256 and 128 both waste 127).
        (300, 1024, 128),
        (129, 1024, 256),
    ],
)
def test_column_block(ffn, max_block_n, expected):
    """``block_n``'s rule, and that its (cached) answer does not change between calls."""

    assert tp.block_n(ffn, max_block_n) == expected
    assert tp.block_n(ffn, max_block_n) == expected


@pytest.mark.parametrize(
    "name,dtype,ffn,expected",
    [
        # 16-bit GLUs, 1024-column blocks: one row per trip over 4 warps, its loads pipelined,
        # for the clamped kinds and the heavy gates (a register cap for the latter); the light
        # unclamped kinds and SiTU-GLU with a linear scale take two rows per trip (the columns
        # split between the warps, the rows held by each thread), loaded one trip ahead.
        ("swiglu_clamp", torch.bfloat16, 8192, (1, 1024, 4, None, 4)),
        ("quick_geglu_gpt_oss", torch.bfloat16, 2880, (1, 1024, 4, None, 4)),
        ("situ_glu_gate_only", torch.bfloat16, 8192, (1, 1024, 4, 128, 4)),
        ("geglu", torch.float16, 8192, (1, 1024, 4, 128, 4)),
        ("swiglu", torch.bfloat16, 8192, (2, 1024, 4, None, 0)),
        ("reglu", torch.float16, 8192, (2, 1024, 4, None, 0)),
        ("situ_glu", torch.bfloat16, 8192, (2, 1024, 4, 128, 0)),
        # Narrower blocks: one row a trip under the narrow cap, pipelined only for SiTU-GLU
        # with a linear scale; the clamped kinds and the heavy gates split a row of several
        # 512-column blocks into 256-column 1-warp ones, the others keep 512 over 2 warps.
        ("swiglu_clamp", torch.bfloat16, 1536, (1, 256, 1, 96, 0)),
        ("situ_glu", torch.float16, 1536, (1, 256, 1, 96, 3)),
        ("swiglu", torch.bfloat16, 1536, (1, 512, 2, 96, 0)),
        ("swiglu_clamp", torch.bfloat16, 512, (1, 512, 2, 96, 0)),
        # float32 and non-gated kinds keep the general weighted plan, pipelined where a trip's
        # row segment is at most 1 KiB.
        # Widths that are not a multiple of 16 do not pipeline, and every kind takes two rows.
        ("swiglu_clamp", torch.bfloat16, 8200, (2, 1024, 4, None, 0)),
        ("geglu", torch.bfloat16, 1000, (2, 1024, 4, 128, 0)),
        ("swiglu_clamp", torch.float32, 8192, (1, 1024, 4, None, 0)),
        ("swiglu_clamp", torch.float32, 768, (1, 256, 1, None, 4)),
        ("squared_relu", torch.bfloat16, 8192, (1, 1024, 4, None, 0)),
        ("squared_relu", torch.bfloat16, 1536, (1, 512, 2, None, 4)),
    ],
)
def test_weighted_backward_plan_with_a_bias(name, dtype, ffn, expected):
    """The plan ``triton_plans._probs_bias_backward_plan`` picks, and that the general weighted
    plan (no bias) is untouched by it: one row per program, no cap, no loop to pipeline."""

    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=True)
    plan = tp.backward_plan(variant, ffn, itemsize)
    options = plan[2]
    got = (plan[0], plan[1], options["num_warps"], options.get("maxnreg"), options["LOOP_STAGES"])
    assert got == expected
    unbiased = KernelVariant.of(SPECS[name], has_bias=False, has_probs=True)
    plan = tp.backward_plan(unbiased, ffn, itemsize)
    assert (plan[0], plan[2].get("maxnreg"), plan[2]["LOOP_STAGES"]) == (1, None, 0)


@pytest.mark.parametrize(
    "name,dtype,ffn,stages",
    [
        # 16-bit GLUs at 1024-column blocks and 16-bit non-gated kinds: pipelined.
        ("swiglu_clamp", torch.bfloat16, 8192, 4),
        ("situ_glu", torch.float16, 2880, 4),
        ("squared_relu", torch.bfloat16, 1536, 4),
        # The one-row plan of narrower 16-bit GLUs: only SiTU-GLU with a linear scale.
        ("swiglu_clamp", torch.bfloat16, 1536, 0),
        ("situ_glu", torch.bfloat16, 768, 3),
        # float32 loads one trip ahead in registers, and so does every width that is not a
        # multiple of 16 (Triton cannot prove the rows' 16-byte alignment there).
        ("swiglu_clamp", torch.float32, 8192, 0),
        ("squared_relu", torch.float32, 1536, 0),
        ("swiglu_clamp", torch.bfloat16, 8200, 0),
        ("situ_glu", torch.bfloat16, 1000, 0),
    ],
)
def test_unweighted_backward_loop_stages(name, dtype, ffn, stages):
    """How the unweighted backward with a bias keeps its row loop's loads in flight (the kernel's
    ``LOOP_STAGES``: 0 one trip ahead in registers, N pipelined N - 1 trips ahead); without a
    bias a program takes one trip and nothing is pipelined."""

    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=False)
    assert tp.backward_plan(variant, ffn, itemsize)[2]["LOOP_STAGES"] == stages
    unbiased = KernelVariant.of(SPECS[name], has_bias=False, has_probs=False)
    if not tp.uses_flat_kernel(unbiased, backward=True):
        assert tp.backward_plan(unbiased, ffn, itemsize)[2]["LOOP_STAGES"] == 0


@pytest.mark.parametrize("constant", ["bwd_bias_stages", "bwd_probs_bias_wide_stages"])
def test_one_loop_stage_is_refused(constant):
    """A loop-stage option of 1 would load each trip's inputs only as it runs (neither ahead in
    registers nor pipelined): refused with the option's name when the options are built, before
    anything compiles."""
    with pytest.raises(ValueError, match=f"{constant} is 1"):
        LaunchOptions(**{constant: 1})


@pytest.mark.parametrize(
    "name,has_bias,has_probs,dtype,ffn,warps",
    [
        # Weighted 16-bit GLUs with a bias: 4 warps below 2048-column blocks.
        ("swiglu_clamp", True, True, torch.bfloat16, 1536, 4),
        ("quick_geglu_gpt_oss", True, True, torch.float16, 2880, 4),
        ("situ_glu", True, True, torch.bfloat16, 768, 4),
        ("swiglu_clamp", True, True, torch.bfloat16, 8192, 8),
        # ... but ReGLU and SiTU-GLU with a linear scale keep 8 at 1024-column blocks.
        ("reglu", True, True, torch.bfloat16, 2880, 8),
        ("situ_glu", True, True, torch.bfloat16, 2880, 8),
        ("situ_glu_gate_only", True, True, torch.bfloat16, 2880, 4),
        ("reglu", True, True, torch.bfloat16, 1536, 4),
        ("situ_glu", True, True, torch.float16, 1536, 4),
        # Everything else keeps the general forward plan.
        ("swiglu_clamp", True, True, torch.float32, 1536, 8),
        ("swiglu_clamp", True, False, torch.bfloat16, 1536, 8),
        ("swiglu_clamp", False, True, torch.bfloat16, 1536, 8),
        ("squared_relu", True, True, torch.bfloat16, 1536, 8),
    ],
)
def test_forward_plan_warps(name, has_bias, has_probs, dtype, ffn, warps):
    """The forward's warps per program, and that the weighted plan with a bias changes only
    them: the same tile (rows and column block) as the general plan."""

    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS[name], has_bias=has_bias, has_probs=has_probs)
    plan = tp.forward_plan(variant, ffn, itemsize)
    assert plan[2]["num_warps"] == warps
    # The general plan: the same options, with every weighted-with-bias rule out of play.
    general = tp.forward_plan(variant._replace(has_probs=False), ffn, itemsize)
    assert plan[:2] == general[:2]


@pytest.mark.parametrize(
    "name,has_probs,dtype,ffn,constant",
    [
        ("squared_relu", True, torch.bfloat16, 1536, "bias_programs"),
        ("squared_relu", False, torch.bfloat16, 1536, "bias_programs"),
        ("swiglu_clamp", False, torch.bfloat16, 3072, "bias_programs_glu"),
        ("swiglu_clamp", False, torch.float32, 1536, "bias_programs_glu"),
        # 16-bit GLUs take the one-row plan at 512-column blocks, weighted or not; the weighted
        # ones the wide plan at 1024-column blocks (one row or two a trip), with and without the
        # register cap (SiTU-GLU and the GELUs take it). Weighted float32 keeps the general
        # count.
        ("swiglu_clamp", False, torch.bfloat16, 1536, "bias_programs_narrow"),
        ("geglu", False, torch.float16, 1536, "bias_programs_narrow"),
        ("swiglu", True, torch.bfloat16, 1536, "bias_programs_narrow"),
        ("reglu", True, torch.float16, 1536, "bias_programs_narrow"),
        ("swiglu_clamp", True, torch.bfloat16, 3072, "bias_programs_probs_wide"),
        ("reglu", True, torch.float16, 3072, "bias_programs_probs_wide"),
        ("situ_glu", True, torch.bfloat16, 3072, "bias_programs_probs_wide_capped"),
        ("geglu", True, torch.bfloat16, 3072, "bias_programs_probs_wide_capped"),
        ("swiglu_clamp", True, torch.float32, 1536, "bias_programs"),
    ],
)
def test_bias_backward_program_count(name, has_probs, dtype, ffn, constant):
    """Which constant sets the backward's program count with a bias, and that it reaches the
    row split: 6 programs over 3 column blocks give each 2 ranges of 320 row blocks (a multiple
    of 16 rows, so an aligned plan keeps the count)."""

    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=has_probs)
    plan = tp.backward_plan(variant, ffn, itemsize)
    expected = getattr(DEFAULT_OPTIONS, constant)
    assert tp.bias_programs(variant, ffn, plan, itemsize) == expected
    options = LaunchOptions(**{constant: 6})
    assert tp.backward_plan(variant, ffn, itemsize, options) == plan
    col_blocks, rows_per_program, row_programs = tp.row_split(
        variant, 640 * plan[0], ffn, plan, itemsize, options
    )
    assert col_blocks == 3 and row_programs == 2
    assert rows_per_program == 320 * plan[0]


@pytest.mark.parametrize("has_probs", [False, True], ids=["unweighted", "probs"])
@pytest.mark.parametrize(
    "name,dtype,ffn,warps",
    [
        ("swiglu", torch.bfloat16, 1536, 2),  # 512-column blocks
        ("situ_glu", torch.float16, 512, 2),
        ("swiglu_clamp", torch.bfloat16, 768, 1),  # 256-column blocks
        ("geglu", torch.bfloat16, 100, 1),  # one block of 128
    ],
)
def test_narrow_bias_programs_fill_one_wave(name, dtype, ffn, warps, has_probs):
    """The one-row plan of 16-bit GLUs with a bias, weighted or not: its count is of 2-warp
    programs, 1-warp programs run twice as many, so every narrow plan runs the same warps in
    total (one wave under the narrow register cap)."""

    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=has_probs)
    plan = tp.backward_plan(variant, ffn, itemsize)
    assert (plan[0], plan[2]["num_warps"]) == (1, warps)
    assert plan[2]["maxnreg"] == DEFAULT_OPTIONS.bwd_bias_narrow_max_registers
    programs = tp.bias_programs(variant, ffn, plan, itemsize)
    assert programs * warps == 2 * DEFAULT_OPTIONS.bias_programs_narrow


@pytest.mark.parametrize(
    "name,ffn,block_n",
    [
        # The clamped kinds and the heavy gates, where a row spans several 512-column blocks.
        ("swiglu_clamp", 1536, 256),
        ("quick_geglu_gpt_oss", 1536, 256),
        ("geglu", 2560, 256),
        ("geglu_erf", 1536, 256),
        ("situ_glu_gate_only", 2560, 256),
        ("situ_glu", 1536, 256),
        # The light unclamped kinds keep 512 columns, and so does every kind where one block
        # spans the row.
        ("swiglu", 1536, 512),
        ("reglu", 2560, 512),
        ("quick_geglu_offset", 1536, 512),
        ("swiglu_clamp", 512, 512),
        ("situ_glu", 512, 512),
    ],
)
def test_narrow_weighted_bias_column_block(name, ffn, block_n):
    """The narrow weighted plan's column block with a bias (``bwd_probs_bias_narrow_max_block_n``):
    one warp per 256 columns, the wave's warps unchanged; the unweighted plan keeps 512."""

    weighted = KernelVariant.of(SPECS[name], has_bias=True, has_probs=True)
    plan = tp.backward_plan(weighted, ffn, 2)
    warps = block_n // DEFAULT_OPTIONS.bwd_probs_columns_per_warp
    assert (plan[0], plan[1], plan[2]["num_warps"]) == (1, block_n, warps)
    programs = tp.bias_programs(weighted, ffn, plan, 2)
    assert programs * warps == 2 * DEFAULT_OPTIONS.bias_programs_narrow
    unweighted = KernelVariant.of(SPECS[name], has_bias=True, has_probs=False)
    assert tp.backward_plan(unweighted, ffn, 2)[1] == 512


@pytest.mark.parametrize(
    "name,has_probs,dtype,ffn,aligned",
    [
        # The weighted plan at 1024-column blocks (one row or two a trip): kinds that bound the
        # linear half (a clamp, a linear tanh) align.
        ("swiglu_clamp", True, torch.bfloat16, 8192, True),
        ("quick_geglu_gpt_oss", True, torch.float16, 8192, True),
        ("situ_glu", True, torch.bfloat16, 8192, True),
        ("swiglu", True, torch.bfloat16, 8192, False),
        ("reglu", True, torch.bfloat16, 8192, False),
        ("geglu", True, torch.bfloat16, 8192, False),
        ("situ_glu_gate_only", True, torch.bfloat16, 8192, False),
        # The weighted one-row plan at 512-column blocks does not.
        ("swiglu_clamp", True, torch.bfloat16, 1536, False),
        # The unweighted GLU plan aligns at 1024-column blocks (glu_bias_aligned_block_n), in
        # every dtype, and not at 512 (F = 1536).
        ("swiglu_clamp", False, torch.bfloat16, 8192, True),
        ("swiglu", False, torch.float32, 2880, True),
        ("situ_glu", False, torch.float16, 1536, False),
        # The rest follows bias_rows_aligned (off): float32 weighted, non-gated kinds.
        ("swiglu_clamp", True, torch.float32, 8192, False),
        ("squared_relu", False, torch.bfloat16, 8192, False),
        ("squared_relu", True, torch.bfloat16, 8192, False),
    ],
)
def test_backward_rows_alignment(name, has_probs, dtype, ffn, aligned, monkeypatch):
    """Which backward plans keep the rows per program a multiple of 16 (``ROWS_ALIGNED``), and
    the row split that follows: rounded up to it (never more programs than the count), still a
    multiple of the tile's rows; unaligned plans split the row
    blocks evenly."""

    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=has_probs)
    plan = tp.backward_plan(variant, ffn, itemsize)
    assert plan[2]["ROWS_ALIGNED"] is aligned
    programs = tp.bias_programs(variant, ffn, plan, itemsize)
    rows = 16384 + 6  # not a multiple of any tile's rows
    col_blocks, rows_per_program, row_programs = tp.row_split(variant, rows, ffn, plan, itemsize)
    block_m = plan[0]
    row_blocks = math.ceil(rows / block_m)
    even = block_m * math.ceil(row_blocks / (programs // col_blocks))
    assert rows_per_program == (16 * math.ceil(even / 16) if aligned else even)
    assert rows_per_program % block_m == 0
    assert row_programs == -(-rows // rows_per_program)
    assert row_programs * col_blocks <= programs


@pytest.mark.parametrize("name", ["swiglu_clamp", "swiglu"])
@pytest.mark.parametrize("has_probs", [False, True], ids=["unweighted", "probs"])
def test_every_aligned_split_is_a_multiple_of_16(name, has_probs):
    """The aligned kernel reads its rows per program as a multiple of 16, so every split of an
    aligned plan must be one, small calls included (one or two rows round up to 16), and every
    split must cover the rows once in whole tiles, within the program count."""
    options = LaunchOptions(bias_programs_glu=12, bias_programs_probs_wide=12)
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=has_probs)
    for ffn in (1024, 2880):
        plan = tp.backward_plan(variant, ffn, 2, options)
        aligned = plan[2]["ROWS_ALIGNED"]
        assert aligned is (name == "swiglu_clamp" or not has_probs)
        for rows in [*range(1, 70), 255, 256, 1000, 4097]:
            col_blocks, per_program, programs = tp.row_split(variant, rows, ffn, plan, 2, options)
            assert per_program % plan[0] == 0
            assert (programs - 1) * per_program < rows <= programs * per_program
            assert programs * col_blocks <= 12
            if aligned:
                assert per_program % 16 == 0


@pytest.mark.parametrize("rows", [0, 3, 6])
@pytest.mark.parametrize(
    "constant,has_bias", [("bwd_probs_rows", False), ("bwd_probs_bias_rows", True)]
)
def test_weighted_backward_rows_per_program_must_be_a_power_of_two(constant, has_bias, rows):
    """The weighted backward's rows per program (``bwd_probs_rows``, and with a bias
    ``bwd_probs_bias_rows``) become the tile's BLOCK_M, which Triton requires to be a power of
    two: any other value is refused with the option's name when the options are built, before
    anything compiles; the production values are powers of two."""
    with pytest.raises(ValueError, match=f"{constant}={rows} is not a power of two"):
        LaunchOptions(**{constant: rows})
    variant = KernelVariant.of(SPECS["swiglu_clamp"], has_bias=has_bias, has_probs=True)
    tp.backward_plan(variant, 1024, 2)
