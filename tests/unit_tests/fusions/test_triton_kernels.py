"""The Triton kernel family against the float64 reference, and the custom ops around it.

On CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set by conftest when
no GPU is present), on small odd shapes; the GPU tier (``-m gpu``) runs the same checks compiled,
plus the properties only real hardware shows (every element written, bitwise replay, CUDA-graph
capture).
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from mcore_activations.activation_spec import GELU_TANH_COEF, ActivationKind, ActivationSpec
from mcore_activations.fusions import activation_ops
from mcore_activations.fusions.activation_kernels import KernelVariant, backward_math, forward_math
from mcore_activations.fusions.activation_ops import kernel_backend, use_kernel_backend
from megatron.core.fusions.fused_activation import fused_activation
from tests.unit_tests.activation_catalog import SPECS, spec_of
from tests.unit_tests.fusions.test_fused_activation import check_against_reference
from tests.unit_tests.tolerances import assert_close_to_reference

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton_here = pytest.mark.skipif(
    not (CUDA or INTERPRETED), reason="Triton needs a GPU or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if CUDA else "cpu"
# The checks that are not already part of the large GPU matrix below run on both: CPU under the
# interpreter (CI) and, in the GPU tier (``-m gpu``), compiled on the GPU.
BOTH = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET unset")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GATED = sorted(name for name, spec in SPECS.items() if spec.gated)


def _cases():
    for name in sorted(SPECS):
        for interleave in (None, 4) if SPECS[name].gated else (None,):
            yield name, interleave


@needs_triton_here
@pytest.mark.parametrize("has_probs", [False, True], ids=["", "probs"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("name,interleave", list(_cases()))
def test_triton_kernels_match_reference(name, interleave, has_bias, has_probs):
    # Odd row count and an odd F (24 with interleave 4: whole blocks); inputs at std 3 hit every
    # clamp. The dtype rotates over the cases (every dtype is covered by the next test).
    spec = spec_of(name, glu_interleave_size=interleave)
    dtype = DTYPES[sum(map(ord, f"{name}{interleave}{has_bias}{has_probs}")) % len(DTYPES)]
    ffn = 24 if interleave else 13
    with use_kernel_backend("triton"):
        check_against_reference(spec, dtype, has_bias, has_probs, device=DEVICE, rows=7, ffn=ffn)


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_kernels_every_dtype(dtype, device):
    with use_kernel_backend("triton"):
        check_against_reference(SPECS["situ_glu"], dtype, True, True, device=device, rows=5, ffn=8)


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("has_probs", [False, True], ids=["unweighted", "probs"])
@pytest.mark.parametrize("name", ["swiglu_clamp", "squared_relu_tanh"])
def test_triton_reductions_across_programs(name, has_probs, device, monkeypatch):
    """Several column blocks (probs partials) and several row programs each looping over several
    row blocks (bias partials): the paths a small test shape would otherwise never take. With
    probabilities a block is one row (``_probs_backward_plan``); without, two."""
    from mcore_activations.fusions import triton_kernels

    # 4 programs over the column blocks: 2 row programs per column block for the non-gated
    # kernel (2 blocks), 1 for the gated one (3 blocks), each looping over several row blocks.
    for constant in ("_BIAS_PROGRAMS", "_BIAS_PROGRAMS_GLU", "_BIAS_PROGRAMS_NARROW"):
        monkeypatch.setattr(triton_kernels, constant, 4)
    for constant in ("_BWD_TILE", "_BWD_TILE_ROW"):  # unweighted: 2 rows per block at 128 columns
        monkeypatch.setattr(triton_kernels, constant, 256)
    with use_kernel_backend("triton"):
        check_against_reference(
            SPECS[name], torch.float32, True, has_probs, device=device, rows=19, ffn=300
        )


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("name", ["swiglu_clamp", "squared_relu_tanh"])
def test_triton_weighted_backward_with_several_rows_per_program(name, device, monkeypatch):
    """The weighted backward's plan with several rows of a column block per program (one warp
    per row of 128 columns: ``_probs_backward_plan``), a partial last row block (19 rows over
    blocks of 4), three column blocks of probability partials and, with 3 bias programs, one
    program per column block looping over all five row blocks."""
    from mcore_activations.fusions import triton_kernels

    monkeypatch.setattr(triton_kernels, "_BIAS_PROGRAMS", 3)
    monkeypatch.setattr(triton_kernels, "_BWD_PROBS_ROWS", 4)
    monkeypatch.setattr(triton_kernels, "_BWD_PROBS_MAX_BLOCK_N", 128)
    monkeypatch.setattr(triton_kernels, "_BWD_PROBS_COLUMNS_PER_WARP", 128)
    plan = triton_kernels._backward_plan(
        KernelVariant.of(SPECS[name], has_bias=True, has_probs=True), 300, 4
    )
    assert (plan[0], plan[1], plan[2]["num_warps"]) == (4, 128, 4)
    with use_kernel_backend("triton"):
        check_against_reference(
            SPECS[name], torch.float32, True, True, device=device, rows=19, ffn=300
        )


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
    """``_block_n``'s rule, and that its (cached) answer does not change between calls."""
    from mcore_activations.fusions import triton_kernels

    assert triton_kernels._block_n(ffn, max_block_n) == expected
    assert triton_kernels._block_n(ffn, max_block_n) == expected


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
    """The plan ``_probs_bias_backward_plan`` picks, and that the general weighted plan (no
    bias) is untouched by it: one row per program, no cap, no loop to pipeline."""
    from mcore_activations.fusions import triton_kernels

    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=True)
    plan = triton_kernels._backward_plan(variant, ffn, itemsize)
    options = plan[2]
    got = (plan[0], plan[1], options["num_warps"], options.get("maxnreg"), options["LOOP_STAGES"])
    assert got == expected
    unbiased = KernelVariant.of(SPECS[name], has_bias=False, has_probs=True)
    plan = triton_kernels._backward_plan(unbiased, ffn, itemsize)
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
    from mcore_activations.fusions import triton_kernels

    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=False)
    assert triton_kernels._backward_plan(variant, ffn, itemsize)[2]["LOOP_STAGES"] == stages
    unbiased = KernelVariant.of(SPECS[name], has_bias=False, has_probs=False)
    if not triton_kernels.uses_flat_kernel(unbiased, backward=True):
        assert triton_kernels._backward_plan(unbiased, ffn, itemsize)[2]["LOOP_STAGES"] == 0


@pytest.mark.parametrize("constant", ["_BWD_BIAS_STAGES", "_BWD_PROBS_BIAS_WIDE_STAGES"])
def test_one_loop_stage_is_refused(constant, monkeypatch):
    """A loop-stage constant of 1 would load each trip's inputs only as it runs (neither ahead in
    registers nor pipelined): refused with the constants' names before anything compiles."""
    from mcore_activations.fusions import triton_kernels

    monkeypatch.setattr(triton_kernels, constant, 1)
    has_probs = constant == "_BWD_PROBS_BIAS_WIDE_STAGES"
    variant = KernelVariant.of(SPECS["swiglu_clamp"], has_bias=True, has_probs=has_probs)
    with pytest.raises(ValueError, match=f"{constant}.*is 1"):
        triton_kernels._backward_plan(variant, 8192, 2)


_STAGE_CONSTANTS = (
    "_BWD_BIAS_STAGES",
    "_BWD_BIAS_NARROW_STAGES",
    "_BWD_BIAS_NARROW_TANH_STAGES",
    "_BWD_PROBS_BIAS_WIDE_STAGES",
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
    name, dtype, ffn, has_probs, device, monkeypatch
):
    """Every plan whose row loop is pipelined (``LOOP_STAGES`` >= 2) gives the same bits as the
    same plan loading one trip ahead in registers: the arithmetic and the summation order are
    the same, only where the loads wait differs. A few programs, each walking several trips,
    the last one past the rows."""
    from mcore_activations.fusions import triton_kernels

    spec = SPECS[name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(spec, has_bias=True, has_probs=has_probs)
    assert triton_kernels._backward_plan(variant, ffn, itemsize)[2]["LOOP_STAGES"] >= 2
    for constant in ("_BIAS_PROGRAMS", "_BIAS_PROGRAMS_GLU", "_BIAS_PROGRAMS_NARROW"):
        monkeypatch.setattr(triton_kernels, constant, 6)
    for constant in ("_BIAS_PROGRAMS_PROBS_WIDE", "_BIAS_PROGRAMS_PROBS_WIDE_CAPPED"):
        monkeypatch.setattr(triton_kernels, constant, 3)
    torch.manual_seed(0)
    rows, width = 37, 2 * ffn if spec.gated else ffn
    x = (torch.randn(rows, width) * 3).to(device, dtype)
    bias = torch.randn(width).to(device, dtype)
    probs = torch.rand(rows, 1).to(device) if has_probs else None
    grad = torch.randn(rows, ffn).to(device, dtype)
    from mcore_activations.fusions.activation_kernels import params_tensor, spec_params

    params = params_tensor(spec_params(spec), x.device)
    pipelined = triton_kernels.triton_backward(variant, grad, x, bias, probs, params)
    for constant in _STAGE_CONSTANTS:
        monkeypatch.setattr(triton_kernels, constant, 0)
    assert triton_kernels._backward_plan(variant, ffn, itemsize)[2]["LOOP_STAGES"] == 0
    prefetched = triton_kernels.triton_backward(variant, grad, x, bias, probs, params)
    for a, b in zip(pipelined, prefetched):
        assert (a is None and b is None) or torch.equal(a, b)


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
    from mcore_activations.fusions import triton_kernels

    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS[name], has_bias=has_bias, has_probs=has_probs)
    plan = triton_kernels._forward_plan(variant, ffn, itemsize)
    assert plan[2]["num_warps"] == warps
    general = triton_kernels._plan(
        variant,
        ffn,
        triton_kernels._FWD_TILE,
        triton_kernels._FWD_WARPS,
        triton_kernels._FWD_MAX_BLOCK_N,
        triton_kernels._fast_div(itemsize),
        triton_kernels._COLUMNS_FASTEST,
    )
    assert plan[:2] == general[:2]


@pytest.mark.parametrize(
    "name,has_probs,dtype,ffn,constant",
    [
        ("squared_relu", True, torch.bfloat16, 1536, "_BIAS_PROGRAMS"),
        ("squared_relu", False, torch.bfloat16, 1536, "_BIAS_PROGRAMS"),
        ("swiglu_clamp", False, torch.bfloat16, 3072, "_BIAS_PROGRAMS_GLU"),
        ("swiglu_clamp", False, torch.float32, 1536, "_BIAS_PROGRAMS_GLU"),
        # 16-bit GLUs take the one-row plan at 512-column blocks, weighted or not; the weighted
        # ones the wide plan at 1024-column blocks (one row or two a trip), with and without the
        # register cap (SiTU-GLU and the GELUs take it). Weighted float32 keeps the general
        # count.
        ("swiglu_clamp", False, torch.bfloat16, 1536, "_BIAS_PROGRAMS_NARROW"),
        ("geglu", False, torch.float16, 1536, "_BIAS_PROGRAMS_NARROW"),
        ("swiglu", True, torch.bfloat16, 1536, "_BIAS_PROGRAMS_NARROW"),
        ("reglu", True, torch.float16, 1536, "_BIAS_PROGRAMS_NARROW"),
        ("swiglu_clamp", True, torch.bfloat16, 3072, "_BIAS_PROGRAMS_PROBS_WIDE"),
        ("reglu", True, torch.float16, 3072, "_BIAS_PROGRAMS_PROBS_WIDE"),
        ("situ_glu", True, torch.bfloat16, 3072, "_BIAS_PROGRAMS_PROBS_WIDE_CAPPED"),
        ("geglu", True, torch.bfloat16, 3072, "_BIAS_PROGRAMS_PROBS_WIDE_CAPPED"),
        ("swiglu_clamp", True, torch.float32, 1536, "_BIAS_PROGRAMS"),
    ],
)
def test_bias_backward_program_count(name, has_probs, dtype, ffn, constant, monkeypatch):
    """Which constant sets the backward's program count with a bias, and that it reaches the
    row split: 6 programs over 3 column blocks give each 2 ranges of 320 row blocks (a multiple
    of 16 rows, so an aligned plan keeps the count)."""
    from mcore_activations.fusions import triton_kernels

    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=has_probs)
    plan = triton_kernels._backward_plan(variant, ffn, itemsize)
    expected = getattr(triton_kernels, constant)
    assert triton_kernels._bias_programs(variant, ffn, plan, itemsize) == expected
    monkeypatch.setattr(triton_kernels, constant, 6)
    col_blocks, rows_per_program, row_programs = triton_kernels._row_split(
        variant, 640 * plan[0], ffn, plan, itemsize
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
    from mcore_activations.fusions import triton_kernels

    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=has_probs)
    plan = triton_kernels._backward_plan(variant, ffn, itemsize)
    assert (plan[0], plan[2]["num_warps"]) == (1, warps)
    assert plan[2]["maxnreg"] == triton_kernels._BWD_BIAS_NARROW_MAX_REGISTERS
    programs = triton_kernels._bias_programs(variant, ffn, plan, itemsize)
    assert programs * warps == 2 * triton_kernels._BIAS_PROGRAMS_NARROW


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
    """The narrow weighted plan's column block with a bias (``_BWD_PROBS_BIAS_NARROW_MAX_BLOCK_N``):
    one warp per 256 columns, the wave's warps unchanged; the unweighted plan keeps 512."""
    from mcore_activations.fusions import triton_kernels

    weighted = KernelVariant.of(SPECS[name], has_bias=True, has_probs=True)
    plan = triton_kernels._backward_plan(weighted, ffn, 2)
    warps = block_n // triton_kernels._BWD_PROBS_COLUMNS_PER_WARP
    assert (plan[0], plan[1], plan[2]["num_warps"]) == (1, block_n, warps)
    programs = triton_kernels._bias_programs(weighted, ffn, plan, 2)
    assert programs * warps == 2 * triton_kernels._BIAS_PROGRAMS_NARROW
    unweighted = KernelVariant.of(SPECS[name], has_bias=True, has_probs=False)
    assert triton_kernels._backward_plan(unweighted, ffn, 2)[1] == 512


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
        # The unweighted GLU plan aligns at 1024-column blocks (_GLU_BIAS_ALIGNED_BLOCK_N), in
        # every dtype, and not at 512 (F = 1536).
        ("swiglu_clamp", False, torch.bfloat16, 8192, True),
        ("swiglu", False, torch.float32, 2880, True),
        ("situ_glu", False, torch.float16, 1536, False),
        # The rest follows _BIAS_ROWS_ALIGNED (off): float32 weighted, non-gated kinds.
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
    from mcore_activations.fusions import triton_kernels

    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=has_probs)
    plan = triton_kernels._backward_plan(variant, ffn, itemsize)
    assert plan[2]["ROWS_ALIGNED"] is aligned
    programs = triton_kernels._bias_programs(variant, ffn, plan, itemsize)
    rows = 16384 + 6  # not a multiple of any tile's rows
    col_blocks, rows_per_program, row_programs = triton_kernels._row_split(
        variant, rows, ffn, plan, itemsize
    )
    block_m = plan[0]
    row_blocks = math.ceil(rows / block_m)
    even = block_m * math.ceil(row_blocks / (programs // col_blocks))
    assert rows_per_program == (16 * math.ceil(even / 16) if aligned else even)
    assert rows_per_program % block_m == 0
    assert row_programs == -(-rows // rows_per_program)
    assert row_programs * col_blocks <= programs


@pytest.mark.parametrize("device", BOTH)
def test_aligned_rows_with_a_tile_taller_than_16_rows(device, monkeypatch):
    """Aligned rows per program where the tile holds 32 rows (a non-gated plan at 128 columns,
    aligned by _BIAS_ROWS_ALIGNED): every split stays a whole number of tiles and a multiple of
    16, and the kernel's aligned form computes the right gradients over several programs."""
    from mcore_activations.fusions import triton_kernels

    monkeypatch.setattr(triton_kernels, "_BIAS_ROWS_ALIGNED", True)
    monkeypatch.setattr(triton_kernels, "_BIAS_PROGRAMS", 5)
    variant = KernelVariant.of(SPECS["squared_relu"], has_bias=True, has_probs=False)
    plan = triton_kernels._backward_plan(variant, 128, 2)
    assert plan[0] == 32 and plan[2]["ROWS_ALIGNED"] is True
    # 10 row blocks over 5 programs: 2 blocks (64 rows) each.
    assert triton_kernels._row_split(variant, 320, 128, plan, 2) == (1, 64, 5)
    # 3 row blocks over 5 programs: one block each, the last program 6 rows.
    assert triton_kernels._row_split(variant, 70, 128, plan, 2) == (1, 32, 3)
    with use_kernel_backend("triton"):
        check_against_reference(
            SPECS["squared_relu"], torch.bfloat16, True, False, device=device, rows=70, ffn=128
        )


@pytest.mark.parametrize("name", ["swiglu_clamp", "swiglu"])
@pytest.mark.parametrize("has_probs", [False, True], ids=["unweighted", "probs"])
def test_every_aligned_split_is_a_multiple_of_16(name, has_probs, monkeypatch):
    """The aligned kernel reads its rows per program as a multiple of 16, so every split of an
    aligned plan must be one, small calls included (one or two rows round up to 16), and every
    split must cover the rows once in whole tiles, within the program count."""
    from mcore_activations.fusions import triton_kernels

    for constant in ("_BIAS_PROGRAMS_GLU", "_BIAS_PROGRAMS_PROBS_WIDE"):
        monkeypatch.setattr(triton_kernels, constant, 12)
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=has_probs)
    for ffn in (1024, 2880):
        plan = triton_kernels._backward_plan(variant, ffn, 2)
        aligned = plan[2]["ROWS_ALIGNED"]
        assert aligned is (name == "swiglu_clamp" or not has_probs)
        for rows in [*range(1, 70), 255, 256, 1000, 4097]:
            col_blocks, per_program, programs = triton_kernels._row_split(
                variant, rows, ffn, plan, 2
            )
            assert per_program % plan[0] == 0
            assert (programs - 1) * per_program < rows <= programs * per_program
            assert programs * col_blocks <= 12
            if aligned:
                assert per_program % 16 == 0


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
    name, rows, split, trip_rows, device, monkeypatch
):
    """The 16-bit weighted backward with a bias at a 1024-column block: one row per trip, or two
    with the bias gradient summed over each trip's rows inside the thread, several programs each
    looping over several trips, aligned and unaligned rows per program; bf16 and the interleaved
    layout."""
    from mcore_activations.fusions import triton_kernels

    for constant in ("_BIAS_PROGRAMS_PROBS_WIDE", "_BIAS_PROGRAMS_PROBS_WIDE_CAPPED"):
        monkeypatch.setattr(triton_kernels, constant, 3)
    variant = KernelVariant.of(SPECS[name], has_bias=True, has_probs=True)
    plan = triton_kernels._backward_plan(variant, 1024, 2)
    assert plan[0] == trip_rows
    assert triton_kernels._row_split(variant, rows, 1024, plan, 2) == split
    with use_kernel_backend("triton"):
        for spec in (SPECS[name], dataclasses.replace(SPECS[name], glu_interleave_size=32)):
            check_against_reference(
                spec, torch.bfloat16, True, True, device=device, rows=rows, ffn=1024
            )


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("has_probs", [False, True], ids=["unweighted", "probs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_glu_backward_with_a_bias_one_row_per_trip(dtype, has_probs, device, monkeypatch):
    """The one-row plan of 16-bit GLUs with a bias, weighted or not, at 128-column blocks (F =
    300: three blocks, the last partly padding): a count of 6 is 12 one-warp programs, 4 per
    column block, so each walks 5 of the 19 rows one per trip (the last 4), against the float64
    reference."""
    from mcore_activations.fusions import triton_kernels

    monkeypatch.setattr(triton_kernels, "_BIAS_PROGRAMS_NARROW", 6)
    variant = KernelVariant.of(SPECS["swiglu_clamp"], has_bias=True, has_probs=has_probs)
    plan = triton_kernels._backward_plan(variant, 300, 2)
    assert (plan[0], plan[1], plan[2]["num_warps"]) == (1, 128, 1)
    assert triton_kernels._row_split(variant, 19, 300, plan, 2) == (3, 5, 4)
    with use_kernel_backend("triton"):
        for name in ("swiglu_clamp", "situ_glu", "quick_geglu_gpt_oss"):
            check_against_reference(
                SPECS[name], dtype, True, has_probs, device=device, rows=19, ffn=300
            )


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_triton_unweighted_glu_backward_with_aligned_rows(dtype, device, monkeypatch):
    """The unweighted GLU backward with a bias at a 1024-column block keeps its rows per
    program a multiple of 16: 50 rows over 3 programs would be 17 each; aligned, two programs
    of 32 and 18 rows, the second ending inside its range."""
    from mcore_activations.fusions import triton_kernels

    monkeypatch.setattr(triton_kernels, "_BIAS_PROGRAMS_GLU", 3)
    itemsize = torch.empty((), dtype=dtype).element_size()
    variant = KernelVariant.of(SPECS["swiglu_clamp"], has_bias=True, has_probs=False)
    plan = triton_kernels._backward_plan(variant, 1024, itemsize)
    assert plan[2]["ROWS_ALIGNED"] is True
    assert triton_kernels._row_split(variant, 50, 1024, plan, itemsize) == (1, 32, 2)
    with use_kernel_backend("triton"):
        check_against_reference(
            SPECS["swiglu_clamp"], dtype, True, False, device=device, rows=50, ffn=1024
        )


@pytest.mark.parametrize("rows", [0, 3, 6])
@pytest.mark.parametrize(
    "constant,has_bias", [("_BWD_PROBS_ROWS", False), ("_BWD_PROBS_BIAS_ROWS", True)]
)
def test_weighted_backward_rows_per_program_must_be_a_power_of_two(
    constant, has_bias, rows, monkeypatch
):
    """The weighted backward's rows per program (``_BWD_PROBS_ROWS``, and with a bias
    ``_BWD_PROBS_BIAS_ROWS``) become the tile's BLOCK_M, which Triton requires to be a power of
    two: any other value is refused with the constant's name before anything compiles."""
    from mcore_activations.fusions import triton_kernels

    monkeypatch.setattr(triton_kernels, constant, rows)
    variant = KernelVariant.of(SPECS["swiglu_clamp"], has_bias=has_bias, has_probs=True)
    with pytest.raises(ValueError, match=f"{constant}={rows} is not a power of two"):
        triton_kernels._backward_plan(variant, 1024, 2)


@pytest.mark.parametrize("device", BOTH)
def test_triton_weighted_backward_register_cap(device, monkeypatch):
    """A register cap (``_BWD_PROBS_MAX_REGISTERS``, off by default) reaches the launch as
    Triton's ``maxnreg`` and leaves the gradients right; without one the plan passes none."""
    from mcore_activations.fusions import triton_kernels

    variant = KernelVariant.of(SPECS["swiglu_clamp"], has_bias=True, has_probs=True)
    assert "maxnreg" not in triton_kernels._backward_plan(variant, 300, 4)[2]
    monkeypatch.setattr(triton_kernels, "_BWD_PROBS_MAX_REGISTERS", 40)
    assert triton_kernels._backward_plan(variant, 300, 4)[2]["maxnreg"] == 40
    with use_kernel_backend("triton"):
        check_against_reference(
            SPECS["swiglu_clamp"], torch.float32, True, True, device=device, rows=19, ffn=300
        )


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("has_probs", [False, True], ids=["unweighted", "probs"])
@pytest.mark.parametrize("name", ["swiglu_clamp", "situ_glu", "squared_relu_tanh"])
def test_triton_program_orders_agree_bit_for_bit(name, has_probs, device, monkeypatch):
    """The tiled kernels' two program orders (``_COLUMNS_FASTEST``: a 1-D grid with column blocks
    fastest, the default, or a 2-D grid with row blocks fastest, which the benchmark keeps for
    comparison) give every tile the same rows and columns: outputs and gradients, the bias and
    probability reductions included, must agree bit for bit."""
    from mcore_activations.fusions import triton_kernels as tk
    from mcore_activations.fusions.activation_kernels import params_tensor, spec_params

    # 75 rows over three column blocks of 128: three forward row blocks of 32 (4096-element tiles;
    # a non-gated forward runs the flat kernel, which has no tiles); with 12 bias programs, four
    # row programs in the backward, each looping over several row blocks (8 rows for a GLU, 2 for
    # the non-gated kind at a 256-element tile, 1 with probabilities).
    for constant in ("_BIAS_PROGRAMS", "_BIAS_PROGRAMS_GLU", "_BIAS_PROGRAMS_NARROW"):
        monkeypatch.setattr(tk, constant, 12)
    monkeypatch.setattr(tk, "_BWD_TILE", 256)
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
        monkeypatch.setattr(tk, "_COLUMNS_FASTEST", columns_fastest)
        plans = [tk._backward_plan(variant, 300, x.element_size())]
        if spec.gated:
            plans.append(tk._forward_plan(variant, 300, x.element_size()))
        assert all(plan[2]["COLUMNS_FASTEST"] is columns_fastest for plan in plans)
        out = tk.triton_forward(variant, x, bias, probs, params)
        grads = tk.triton_backward(variant, grad, x, bias, probs, params)
        results.append([out, *(g for g in grads if g is not None)])
    for first, second in zip(*results):
        torch.testing.assert_close(first, second, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("device", BOTH)
def test_triton_matches_torch_backends_elementwise(device):
    """The Triton kernels and the torch reference math agree to float32 rounding on raw calls,
    including on NaN and inf inputs (documented: NaN propagates, clamps keep NaN)."""
    torch.manual_seed(0)
    for name in ("swiglu_clamp", "situ_glu", "quick_geglu_gpt_oss", "reglu", "squared_relu_tanh"):
        spec = SPECS[name]
        variant = KernelVariant.of(spec, has_bias=False, has_probs=True)
        from mcore_activations.fusions.activation_kernels import params_tensor, spec_params

        width = 32 if spec.gated else 16
        x = torch.randn(6, width, device=device) * 8
        x[0, 0], x[1, 1], x[2, 2], x[3, width - 1] = math.nan, math.inf, -math.inf, math.nan
        probs = torch.rand(6, 1, device=device)
        grad = torch.randn(6, width // 2 if spec.gated else width, device=device)
        params = params_tensor(spec_params(spec), x.device)
        with use_kernel_backend("triton"):
            out = activation_ops.run_forward(variant, x, None, probs, params)
            dx, _, dprobs = activation_ops.run_backward(variant, grad, x, None, probs, params)
        ref_out = forward_math(variant, x, None, probs, params)
        ref_dx, _, ref_dprobs = backward_math(variant, grad, x, None, probs, params)
        for got, ref in ((out, ref_out), (dx, ref_dx), (dprobs, ref_dprobs)):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def _whole_range(n_each=60):
    """float32 values from -100 to 100: both signs, 1e-6 .. 100, 0, and the tanh Taylor
    branch's switch at |x| = 1/16 for the catalogue's tanh scales (1.5, 2 and 3). Past
    |x| = 44 * scale the tanh's exp(2x) overflows to inf or flushes to 0."""
    mags = torch.logspace(-6, 2, n_each, dtype=torch.float64)
    edges = torch.tensor([1.5 / 16, 2 / 16, 3 / 16], dtype=torch.float64)
    mags = torch.cat([mags, edges, edges * (1 - 1e-6), edges * (1 + 1e-6)])
    return torch.cat([-mags, torch.zeros(1, dtype=torch.float64), mags]).float()


def _kernel_and_float64(spec, x, device, reference=None):
    """``(output, dx, reference output, reference dx)``: the Triton path on ``x`` (a gradient of
    ones), then ``reference`` (default: the spec's) in float64 on the same values; all float64
    on CPU."""
    grad = torch.ones(x.shape[0], 1, dtype=x.dtype)
    xs = x.clone().to(device).requires_grad_()
    with use_kernel_backend("triton"):
        out = fused_activation(xs, spec)
        out.backward(grad.to(device))
    xr = x.double().requires_grad_()
    ref = (reference or spec.reference)(xr)
    ref.backward(grad.double())
    return out.detach().cpu().double(), xs.grad.cpu().double(), ref.detach(), xr.grad


# Relative bound per element of the whole-range test, by the region a row's inputs lie in
# (_whole_range_rtol). bfloat16: one unit of its precision (2**-7, two of its rounding) everywhere.
# The CPU interpreter has no hardware reciprocal, so there bfloat16 takes the float32 division
# path; the GPU tier runs the 16-bit forms. float32: at least twice the worst error measured on
# the interpreter and on an H200 (float32 inputs run the same forms on both: _tanh and
# _tanh_fraction, never _tanh_via_sigmoid, which the 16-bit forward and the backward use):
# - "taylor": every tanh the output evaluates takes _tanh_small (|argument| < 1/16): a few
#   roundings of the polynomials, of a sigmoid near 1/2 and of the shared division; worst
#   measured 2.7e-7 (interpreter, SiTU-GLU(2, 3) with both halves in the Taylor branch) and
#   2.4e-7 (H200, gate only). Dropping the polynomial's x**5 term alone errs by
#   (2/15) x**4 = 2.0e-6 just below the switch.
# - "below_one": every input below 1 in magnitude, no exponential argument above 2 in
#   magnitude: the cancellation of _tanh's 1 - exp(-2|x|) just above the switch (7.1e-7 on
#   the H200, soft-clamped SiLU at x = 1.5 / 16), GELU-tanh's derivative near its zero at
#   x = -0.75 (1.0e-6 on the H200); SiTU-GLU's two halves add.
# - elsewhere: an exponent argument near 90 carries ~1e-5 relative error by itself.
_WHOLE_RANGE_RTOL = {
    torch.float32: dict(taylor=6e-7, below_one=3e-6, rest=3e-5),
    torch.bfloat16: dict(taylor=8e-3, below_one=8e-3, rest=8e-3),
}


def _tanh_arguments(spec, x):
    """Per row of ``x`` (``[gate | linear]`` or one column) the largest |argument| of the
    tanhs ``spec`` evaluates (the gate's or soft clamp's ``h / s``, SiTU-GLU's ``u / s_l``), as
    the kernels form it: float32 ``h * (1 / s)``, so a value beside the Taylor switch is classed
    with the branch it takes. None for a spec without a tanh."""
    scales = [spec.gate_tanh_scale, spec.linear_tanh_scale if spec.gated else None]
    args = [
        (x[:, i : i + 1].float() * (torch.tensor(1.0) / s)).abs()
        for i, s in enumerate(scales)
        if s is not None
    ]
    return torch.cat(args, dim=-1).amax(-1, keepdim=True).double() if args else None


def _whole_range_rtol(spec, x, dtype):
    """``[rows, 1]`` relative bounds of :data:`_WHOLE_RANGE_RTOL` for the rows of ``x``."""
    tol = _WHOLE_RANGE_RTOL[dtype]
    small = x.double().abs().amax(-1, keepdim=True) < 1.0
    rtol = torch.where(small, tol["below_one"], tol["rest"])
    args = _tanh_arguments(spec, x)
    if args is not None:
        rtol = torch.where(args < 0.0625, tol["taylor"], rtol)
    return rtol


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "name", ["geglu", "fast_gelu", "situ_glu", "situ_glu_gate_only", "silu_tanh"]
)
def test_kernels_are_accurate_over_the_whole_range(name, dtype, device):
    """Element by element against float64 over [-100, 100]: a relative bound per element (not
    relative to the largest value, which would hide errors in the tails), tighter where the
    inputs are small (:data:`_WHOLE_RANGE_RTOL`). GELU-tanh (evaluated as x * sigmoid(2z)):
    output and gradient. With a tanh (SiTU-GLU, the soft-clamped SiLU): the output (the tanh's
    Taylor branch, its exponential branch and its saturation); the gradient's 1 - tanh**2
    cancels in the tails by construction and is held to the tolerance table by the other tests.
    A GLU sees every gate value against another linear value and against itself. The pairs
    with itself put both of SiTU-GLU's tanhs in their Taylor branch at once, with outputs large
    enough for the relative bound to count: against the other value a gate beside the switch
    meets a linear value near 1e-6, an output near 1e-7, where the 1e-12 floor allows 1e-5."""
    spec = SPECS[name]
    values = _whole_range()
    if spec.gated:  # rows of [gate | linear], F = 1
        x = torch.cat([torch.stack([values, values.flip(0)], -1), torch.stack([values] * 2, -1)])
    else:
        x = values.view(-1, 1)
    x = x.to(dtype)
    out, dx, ref, ref_dx = _kernel_and_float64(spec, x, device)
    rtol = _whole_range_rtol(spec, x, dtype)
    checks = [("output", out, ref)]
    if spec.gate_tanh_scale is None:
        checks.append(("dx", dx, ref_dx))
    for what, got, want in checks:
        # 1e-12: the float64 reference's own 1 + tanh(z) cancels to 0 below x ~ -6, where
        # sigmoid(2z) still resolves 1e-23.
        bound = rtol * want.abs() + 1e-12
        err = (got - want).abs()
        worst = int(torch.argmax(err - bound))
        assert (err <= bound).all(), (
            f"{spec.name} {what}: x={x[worst // got.shape[-1]].tolist()} "
            f"got {got.view(-1)[worst].item():.9g}, want {want.view(-1)[worst].item():.9g} "
            f"(rtol {rtol[worst // got.shape[-1]].item():.1e})"
        )


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("linear_scale", [25.0, None], ids=["s_l=25", "gate_only"])
def test_situ_glu_with_an_offset(linear_scale, dtype, device):
    """SiTU-GLU with a linear offset (Kimi-K3's s_g = 4, s_l = 25, offset 1): the forward folds
    s_g and the offset into its shared division (``_situ_glu``), in a form per dtype and per
    linear scale, which the catalogue's offset-free entries cannot tell apart from a dropped or
    misweighted offset. Output and gradient against float64, over the whole range and random
    values large enough to saturate both tanh halves."""
    spec = ActivationSpec(
        ActivationKind.SILU,
        gated=True,
        gate_tanh_scale=4.0,
        linear_tanh_scale=linear_scale,
        linear_offset=1.0,
    )
    values = _whole_range()
    torch.manual_seed(0)
    x = torch.cat([torch.stack([values, values.flip(0)], dim=-1), torch.randn(200, 2) * 40])
    out, dx, ref, ref_dx = _kernel_and_float64(spec, x.to(dtype), device)
    assert_close_to_reference(out, ref, dtype, "output")
    assert_close_to_reference(dx, ref_dx, dtype, "dx")


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["", "offset"])
def test_situ_glu_gate_only_with_a_linear_half_near_the_float32_maximum(offset, device):
    """Gate-only SiTU-GLU (s_g = 4) with linear values from 1e37 to 3.4e38 (both signs) against
    gates from -80 to 60: 0, the gate tanh's Taylor switch (g = s_g / 16), both saturations. The
    value act(g) * (u + o) has |act(g)| < s_g, so the forward must finish its one division
    without forming a product of u that overflows (_situ_glu): wherever the float64 value fits
    in float32, the output is finite and within 1e-5 of it relatively; where it does not, inf
    of its sign; never NaN (0 * inf at g = 0). 1e-5: sigmoid(g)'s exponential at |g| = 80 errs
    by up to 80 * 2**-24 = 4.8e-6 from its argument's rounding (worst measured 2.5e-6 at
    g = -60, on the interpreter and an H200; 2.2e-7 for the other gates). Gates stay above -87,
    below which sigmoid(g) is subnormal in float32 (the GPU flushes it to 0, _LOG2_E)."""
    spec = ActivationSpec(
        ActivationKind.SILU, gated=True, gate_tanh_scale=4.0, linear_offset=offset
    )
    gates = torch.tensor([1e-6, 1e-3, 0.25, 1.0, 3.0, 20.0, 60.0])
    gates = torch.cat([-gates, torch.tensor([0.0, -80.0]), gates])
    linear = torch.tensor([1e37, 1e38, 3e38, 3.4e38])
    g, u = torch.meshgrid(gates, torch.cat([linear, -linear]), indexing="ij")
    x = torch.stack([g.reshape(-1), u.reshape(-1)], dim=-1)
    out, _, ref, _ = _kernel_and_float64(spec, x, device)
    fmax = torch.finfo(torch.float32).max
    # Every value stays clear of float32's maximum (within a rounding of it, a finite output
    # and inf would both be right).
    assert ((ref.abs() / fmax - 1.0).abs() > 1e-3).all()
    fits = (ref.abs() <= fmax).view(-1)
    out, ref = out.view(-1), ref.view(-1)
    bad = out.isnan() | (fits & ~((out - ref).abs() <= 1e-5 * ref.abs()))
    bad |= ~fits & (out != ref.sign() * math.inf)
    assert not bad.any(), [
        f"g={x[i, 0].item():.3g} u={x[i, 1].item():.3g}: got {out[i].item():.7g}, "
        f"want {ref[i].item():.7g}"
        for i in bad.nonzero().view(-1)[:4].tolist()
    ]


@pytest.mark.parametrize("device", BOTH)
def test_situ_glu_backward_around_the_linear_tanh_taylor_switch(device):
    """SiTU-GLU(4, 25) (Kimi-K3's scales, no offset), float32 backward, element by element:
    gates -3, -0.5, 1 and 2 (clear of the gate derivative's zero at g = -1.22) against linear
    values with |u / s_l| from 1e-4 to 1, both signs, just beside the switch at 1/16 too. The
    backward's linear tanh is _tanh_via_sigmoid, t = 1 - 2 / (1 + exp(2x)): _tanh_small's
    polynomial below |x| = 1/16, above it a subtraction whose error is a few ulp of 1,
    absolutely (about 2 * 2**-24 measured: t's 30 ulp at the switch).

    dx of the gate half is act'(g) * s_l * t, whose relative error is act'(g)'s plus t's: bound
    8e-7, plus 4 * 2**-24 / |t| above the switch. Worst measured (interpreter and H200, 500
    values per decade): 2.6e-7 in the Taylor branch (1.9e-7 on the interpreter), 1.8e-6 just
    above the switch (bound 4.6e-6), 5.9e-7 near |x| = 1 (bound 1.1e-6). dx of the linear half
    is act(g) * (1 - t**2), which takes 2 t**2 / (1 - t**2) of t's relative error: bound
    1.3e-6, worst measured 6.4e-7 near |x| = 1 (H200). The gate half sees what the Taylor
    branch is there for: without its x**5 term the polynomial errs by (2/15) x**4, 2.0e-6 just
    below the switch, and with the switch at 1/32 the subtraction's error, about
    2 * 2**-24 / |x|, reaches 3e-6 below 1/16."""
    s_l = 25.0
    spec = ActivationSpec(
        ActivationKind.SILU, gated=True, gate_tanh_scale=4.0, linear_tanh_scale=s_l
    )
    switch = torch.tensor([1 - 1e-6, 1 + 1e-6], dtype=torch.float64) / 16
    mags = torch.cat([torch.logspace(-4, 0, 401, dtype=torch.float64), switch]) * s_l
    u = torch.cat([-mags, mags]).float()
    gates = torch.tensor([-3.0, -0.5, 1.0, 2.0])
    x = torch.stack([gates.repeat_interleave(len(u)), u.repeat(len(gates))], dim=-1)
    _, dx, _, ref_dx = _kernel_and_float64(spec, x, device)
    arg = (x[:, 1:] * (torch.tensor(1.0) / s_l)).abs().double()  # as the kernel forms it
    t = torch.tanh(arg)
    gate_rtol = 8e-7 + torch.where(arg < 0.0625, 0.0, 4 * 2.0**-24 / t)
    rtol = torch.cat([gate_rtol, torch.full_like(gate_rtol, 1.3e-6)], dim=-1)
    excess = (dx - ref_dx).abs() / (rtol * ref_dx.abs())
    row, half = divmod(int(torch.argmax(excess)), 2)
    assert (excess <= 1).all(), (
        f"{int((excess > 1).sum())} elements outside the bound; worst: gate, linear = "
        f"{x[row].tolist()}, dx of the {('gate', 'linear')[half]} half: got "
        f"{dx[row, half].item():.9g}, want {ref_dx[row, half].item():.9g} "
        f"(relative error {excess[row, half].item() * rtol[row, half].item():.2e}, bound "
        f"{rtol[row, half].item():.2e})"
    )


def _gelu_tanh_via_sigmoid(x):
    # GELU-tanh as x * sigmoid(2z) in float64: the catalogue's 0.5 * x * (1 + tanh(z)) cancels
    # in float64 too, to 0 below x ~ -7.5, where the value is still ~1e-20 (~1e-28 at x = -9).
    z = math.sqrt(2.0 / math.pi) * (x + GELU_TANH_COEF * x**3)
    return x * torch.sigmoid(2.0 * z)


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("name", ["fast_gelu", "geglu", "silu", "quick_gelu", "situ_glu"])
def test_underflowing_exponentials_change_nothing_above_1e_35(name, device):
    """Where an exponential underflows (argument below -87.3) the kernels' ``tl.exp2`` flushes
    it to 0 on a GPU (``triton_kernels``, next to ``_LOG2_E``): outputs and gradients stay within
    3e-5 of float64 relatively, or 1e-35 absolutely (SiTU-GLU: its output), and never turn
    NaN. |x| from 9 to 200 takes GELU-tanh's sigmoid(-|2z|) (both signs), the sigmoids of SiLU,
    quick-GELU and SiTU-GLU (x above 51-88) and SiTU-GLU's gate tanh (|x| above 175) through
    the underflow; on CPU the interpreter does not flush, and the test checks the same tails.
    (Exact GELU is left out: its 1 + erf cancels to 0 in float32 below x ~ -6 on every backend,
    a limit of its formula, not of the exponential.)"""
    tail = torch.logspace(math.log10(9.0), math.log10(200.0), 64, dtype=torch.float64).float()
    values = torch.cat([-tail, tail])
    spec = SPECS[name]
    x = torch.stack([values, torch.ones_like(values)], dim=-1) if spec.gated else values.view(-1, 1)
    reference = None
    if spec.kind.value == "gelu_tanh":

        def reference(xr):
            return _gelu_tanh_via_sigmoid(xr[:, :1]) * (xr[:, 1:] if spec.gated else 1.0)

    out, dx, ref, ref_dx = _kernel_and_float64(spec, x, device, reference)
    assert not dx.isnan().any()
    checks = [(out, ref)]
    if not spec.is_situ_glu:  # SiTU-GLU's 1 - tanh**2 cancels in its tails (see the test above)
        checks.append((dx, ref_dx))
    for got, want in checks:
        assert not got.isnan().any()
        # Relative 3e-5 where the values are normal (SiLU's x * sigmoid(x) near x = -9 is -1e-3).
        bound = 3e-5 * want.abs() + 1e-35
        assert ((got - want).abs() <= bound).all(), (got - want).abs().max().item()


def test_backend_choice():
    assert kernel_backend(torch.device("cuda")) == "triton"
    with use_kernel_backend("eager"):
        assert kernel_backend(torch.device("cuda")) == "eager"
        with use_kernel_backend(None):
            assert kernel_backend(torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="'cutlass' is not an activation kernel backend"):
        with use_kernel_backend("cutlass"):
            pass


def test_triton_backend_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_kernel_backend("triton"), pytest.raises(ValueError, match="runs on CUDA"):
        fused_activation(torch.randn(2, 8), SPECS["swiglu"])


def test_bad_backend_in_environment_is_refused_at_import():
    import subprocess
    import sys

    env = dict(os.environ, MCORE_ACTIVATIONS_BACKEND="fast")
    proc = subprocess.run(
        [sys.executable, "-c", "import mcore_activations.fusions.activation_ops"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "MCORE_ACTIVATIONS_BACKEND='fast' is not an activation kernel backend" in proc.stderr


@pytest.mark.parametrize(
    "backend,device",
    [
        ("eager", "cpu"),
        pytest.param("triton", "cpu", marks=BOTH[0].marks),
        pytest.param("triton", "cuda", marks=pytest.mark.gpu),
    ],
)
def test_custom_ops_pass_opcheck(backend, device):
    spec = spec_of("swiglu_clamp", glu_interleave_size=4)
    variant = KernelVariant.of(spec, has_bias=True, has_probs=True)
    from mcore_activations.fusions.activation_kernels import params_tensor, spec_params

    x = torch.randn(5, 16, device=device, requires_grad=False)
    bias = torch.randn(16, device=device)
    probs = torch.rand(5, 1, device=device)
    grad = torch.randn(5, 8, device=device)
    params = params_tensor(spec_params(spec), x.device).clone()
    structure = activation_ops.structure_args(variant)
    with use_kernel_backend(backend):
        torch.library.opcheck(
            activation_ops.activation_forward_op, (x, bias, probs, params, *structure)
        )
        torch.library.opcheck(
            activation_ops.activation_backward_op, (grad, x, bias, probs, params, *structure)
        )


def test_user_compile_sees_one_opaque_op_and_specializes_each_clamp():
    """Inside a caller's torch.compile the kernel family is one opaque node per direction (in
    the traced body of the autograd Function, with no graph break), and the spec's numbers are
    specialized: every clamp value is computed exactly, a new value gets a graph of its own and
    a repeated one reuses its graph, so no value is ever served code traced for another."""
    from torch._dynamo.utils import counters

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(x, spec):
        return fused_activation(x, spec).sum()

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    counts = []
    for clamp in (0.5, 1.5, 3.0, 0.25, 1.5):
        spec = dataclasses.replace(SPECS["swiglu_clamp"], clamp_value=clamp)
        x = (torch.randn(4, 16) * 4).requires_grad_()
        got = compiled(x, spec)
        got.backward()
        xr = x.detach().double().requires_grad_()
        ref = spec.reference(xr).sum()
        ref.backward()
        assert_close_to_reference(got, ref, torch.float32, f"clamp {clamp}")
        assert_close_to_reference(x.grad, xr.grad, torch.float32, f"clamp {clamp} dx")
        counts.append(counters["stats"]["unique_graphs"])
    assert counts[-1] == counts[-2], f"a repeated clamp value recompiled: {counts}"
    ops = {
        str(node.target)
        for gm in graphs
        for module in gm.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    }
    assert "mcore_activations.activation_forward.default" in ops


# ----------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("has_probs", [False, True], ids=["", "probs"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("interleave", [None, 32], ids=["", "il32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_cuda_triton_every_spec_dtype_bias_probs_interleave(
    name, dtype, interleave, has_bias, has_probs
):
    if interleave and not SPECS[name].gated:
        pytest.skip("interleave applies to GLUs only")
    spec = spec_of(name, glu_interleave_size=interleave)
    with use_kernel_backend("triton"):
        check_against_reference(spec, dtype, has_bias, has_probs, device="cuda", rows=1031, ffn=352)


@pytest.mark.gpu
@pytest.mark.parametrize("has_probs", [False, True], ids=["", "probs"])
@pytest.mark.parametrize("ffn", [2048, 768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_cuda_triton_bias_plans_against_reference(name, dtype, ffn, has_probs):
    """The backward plans with a bias at the widths where their row loops are pipelined through
    shared memory (1024-column blocks in 16-bit, 256-column float32 rows of the general weighted
    plan) or loaded ahead in registers, compiled, against the float64 reference."""
    with use_kernel_backend("triton"):
        check_against_reference(
            SPECS[name], dtype, True, has_probs, device="cuda", rows=1031, ffn=ffn
        )


def _poisoned_cache(nbytes: int):
    """Fills the caching allocator's free blocks with NaN so an unwritten output shows up."""
    block = torch.full((nbytes // 4 + 1024,), math.nan, device="cuda")
    del block


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["swiglu_clamp", "situ_glu", "squared_relu_tanh"])
def test_cuda_triton_writes_every_element(name):
    spec = SPECS[name]
    rows, ffn = 1027, 1000
    width = 2 * ffn if spec.gated else ffn
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(width, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(rows, 1, device="cuda")
    variant = KernelVariant.of(spec, has_bias=True, has_probs=True)
    from mcore_activations.fusions.activation_kernels import params_tensor, spec_params

    params = params_tensor(spec_params(spec), x.device)
    grad = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)
    with use_kernel_backend("triton"):
        _poisoned_cache(64 * rows * width)
        out = activation_ops.run_forward(variant, x, bias, probs, params)
        _poisoned_cache(64 * rows * width)
        dx, dbias, dprobs = activation_ops.run_backward(variant, grad, x, bias, probs, params)
    for t in (out, dx, dbias, dprobs):
        assert not t.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("has_bias", [False, True], ids=["", "bias"])
def test_cuda_triton_is_bitwise_reproducible(has_bias):
    spec = SPECS["swiglu_clamp"]
    torch.manual_seed(0)
    x = torch.randn(4099, 2 * 1536, device="cuda", dtype=torch.bfloat16) * 4
    bias = torch.randn(2 * 1536, device="cuda", dtype=torch.bfloat16) if has_bias else None
    probs = torch.rand(4099, 1, device="cuda")
    grad = torch.randn(4099, 1536, device="cuda", dtype=torch.bfloat16)
    results = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, bias, probs)]
        with use_kernel_backend("triton"):
            out = fused_activation(leaves[0], spec, bias=leaves[1], probs=leaves[2])
        out.backward(grad)
        results.append([out] + [t.grad for t in leaves if t is not None])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.gpu
@pytest.mark.parametrize("ffn", [1024, 1536], ids=["one-block", "three-blocks"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("has_probs", [False, True], ids=["unweighted", "probs"])
def test_cuda_triton_captures_in_a_cuda_graph(has_probs, has_bias, ffn):
    """Forward and backward capture in one CUDA graph (no host sync, no per-call host-to-device
    copies) and a replay on new input values gives exactly what an eager call gives: with and
    without a bias and probabilities, over one column block and over three (whose partial
    probability gradients are summed after the kernel)."""
    spec = SPECS["situ_glu"]
    leaves = {"x": (torch.randn(512, 2 * ffn, device="cuda", dtype=torch.bfloat16) * 4)}
    if has_bias:
        leaves["bias"] = torch.randn(2 * ffn, device="cuda", dtype=torch.bfloat16)
    if has_probs:
        leaves["probs"] = torch.rand(512, 1, device="cuda")
    for leaf in leaves.values():
        leaf.requires_grad_()
    grad = torch.randn(512, ffn, device="cuda", dtype=torch.bfloat16)

    def call(t):
        return fused_activation(t["x"], spec, bias=t.get("bias"), probs=t.get("probs"))

    with use_kernel_backend("triton"):
        # Warm up on a side stream (compiles the kernels, fills the params cache), then capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                call(leaves).backward(grad)
        torch.cuda.current_stream().wait_stream(stream)
        for leaf in leaves.values():
            leaf.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(leaves)
            out.backward(grad)
        with torch.no_grad():
            for leaf in leaves.values():
                leaf.mul_(0.5).add_(0.25)
        graph.replay()
        torch.cuda.synchronize()
        fresh = {name: leaf.detach().clone().requires_grad_() for name, leaf in leaves.items()}
        eager = call(fresh)
        eager.backward(grad)
    assert torch.equal(out, eager)
    for name, leaf in leaves.items():
        assert torch.equal(leaf.grad, fresh[name].grad), name


def test_export_leaves_no_fake_tensor_behind():
    """torch.export (non-strict) traces the params tensor under a fake mode; nothing created there
    may stay cached, or every later eager call with the same values fails (#12 item 4)."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    class Layer(torch.nn.Module):
        def forward(self, x):
            return bias_swiglu_impl(x, None, clamp_value=2.75)

    x = torch.randn(4, 16) * 4
    exported = torch.export.export(Layer(), (x,), strict=False)
    targets = {str(node.target) for node in exported.graph.nodes}
    assert "mcore_activations.activation_forward.default" in targets
    eager = Layer()(x)  # failed with "Cannot access data pointer of Tensor" before the fix
    torch.testing.assert_close(exported.module()(x), eager, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_tracers_see_the_op_and_plain_calls_skip_only_the_dispatcher():
    """Plain eager calls run the backend directly; under a dispatch mode (as under fake tensors,
    FX tracing, functionalization) the call goes through the op, with the same result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    spec = SPECS["swiglu_clamp"]
    x = torch.randn(3, 8) * 4
    direct = fused_activation(x, spec)
    with Log():
        traced = fused_activation(x, spec)
    assert "mcore_activations.activation_forward.default" in seen
    torch.testing.assert_close(direct, traced, rtol=0, atol=0)
    # Under vmap the op's batching fallback runs it row by row: the kernels never see a
    # batched (wrapped) tensor.
    vmapped = torch.vmap(lambda row: fused_activation(row, spec))(x)
    torch.testing.assert_close(vmapped, direct, rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_direct_launch_respecialises_on_alignment():
    """The direct launcher keys compiled kernels on what Triton specialises on: an input that is
    not 16-byte aligned after an aligned one must get its own kernel, not the aligned one."""
    spec = SPECS["swiglu_clamp"]
    aligned = torch.randn(33, 64, device="cuda", dtype=torch.bfloat16) * 4
    storage = torch.empty(33 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    shifted = storage[1:].view(33, 64)
    shifted.copy_(aligned)
    assert shifted.data_ptr() % 16 != 0
    with use_kernel_backend("triton"):
        first = fused_activation(aligned, spec)
        again = fused_activation(aligned, spec)  # direct launch of the cached kernel
        moved = fused_activation(shifted, spec)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(moved, first, rtol=0, atol=0)


@pytest.mark.parametrize("device", BOTH)
def test_upstream_raw_functions_stay_differentiable_on_the_triton_backend(device):
    """Upstream's ``@jit_fuser`` functions (``clamped_swiglu``, ``bias_gelu``, ...) are compiled
    torch code there, so autograd goes through them; on the Triton backend they must too."""
    from megatron.core.fusions import fused_bias_gelu as ge
    from megatron.core.fusions import fused_bias_swiglu as sw

    y = (torch.randn(5, 16, device=device) * 4).requires_grad_()
    b = torch.randn(16, device=device, requires_grad=True)
    with use_kernel_backend("triton"):
        cases = [
            (sw.clamped_swiglu(y, 1.5), sw.clamped_swiglu._torchdynamo_orig_callable(y, 1.5)),
            (
                ge.bias_gelu(b, y),
                (lambda t: 0.5 * t * (1 + torch.tanh(0.79788456 * t * (1 + 0.044715 * t * t))))(
                    y + b
                ),
            ),
        ]
        for got, ref in cases:
            g = torch.randn_like(got)
            got_grads = torch.autograd.grad(got, (y, b), g, allow_unused=True)
            ref_grads = torch.autograd.grad(ref, (y, b), g, allow_unused=True)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            for a, r in zip(got_grads, ref_grads):
                if r is not None:
                    torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.te
@pytest.mark.parametrize("weighted", [False, True], ids=["", "scaled"])
@pytest.mark.parametrize("name", GATED + ["squared_relu", "squared_relu_tanh"])
def test_cuda_triton_matches_te_op(name, weighted):
    """Where Transformer Engine has an op for the spec, it and the Triton kernels agree (both
    against the float64 reference, through the one tolerance table, forward and backward)."""
    from mcore_activations.activation_spec import UnsupportedActivationError
    from mcore_activations.te_lowering import lower_activation_to_te_op

    spec = SPECS[name]
    try:
        op = lower_activation_to_te_op(spec, path="test", scaled=weighted)
    except UnsupportedActivationError:
        pytest.skip(f"TE has no {'scaled ' if weighted else ''}op for {name}")
    width = 2 * 512 if spec.gated else 512
    x = torch.randn(257, width, device="cuda", dtype=torch.bfloat16) * 3
    probs = torch.rand(257, 1, device="cuda") if weighted else None
    grad = torch.randn(257, 512, device="cuda", dtype=torch.bfloat16)
    results = []
    for run in ("triton", "te"):
        xs = x.clone().requires_grad_()
        ps = probs.clone().requires_grad_() if weighted else None
        if run == "triton":
            with use_kernel_backend("triton"):
                out = fused_activation(xs, spec, probs=ps)
        else:
            out = op(xs, ps.view(-1)) if weighted else op(xs)
        out.backward(grad)
        results.append((out, xs.grad))
    xr = x.double().requires_grad_()
    ref = spec.reference(xr, probs=probs.double() if weighted else None)
    ref.backward(grad.double())
    for (out, dx), run in zip(results, ("triton", "te")):
        assert_close_to_reference(out, ref, torch.bfloat16, f"{run} {name} out")
        assert_close_to_reference(dx, xr.grad, torch.bfloat16, f"{run} {name} dx")


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: records how it was launched."""

    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.launches = []
        self.function, self.packed_metadata = "function", "metadata"

    def run(self, *args):
        if self.refuse:
            raise TypeError("launcher takes other arguments")
        self.launches.append(("run", args))

    def __getitem__(self, grid):
        def launch(*args):
            if self.refuse:
                raise TypeError("launcher takes other arguments")
            self.launches.append(("grid", grid, args))

        return launch


class _FakeKernel:
    """Stands in for a ``@triton.jit`` function with pointers ``x`` and ``bias``, integers ``n``
    and ``m`` (``m`` unspecialised) and one compile-time value; each launch returns
    ``compiled``."""

    arg_names = ["x_ptr", "bias_ptr", "n", "m", "BLOCK"]
    do_not_specialize = ["m"]

    def __init__(self, compiled):
        self.compiled = compiled
        self.calls = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls += 1
            return self.compiled

        return run


_FAKE_PLAN = (1, 1, {"BLOCK": 4, "num_warps": 1}, (4,))


def _fake_launcher(monkeypatch, compiled, hooks_off=True):
    from mcore_activations.fusions import triton_kernels as tk

    monkeypatch.setattr(tk.triton.compiler, "CompiledKernel", _FakeCompiled)
    monkeypatch.setattr(tk, "_DIRECT_LAUNCH", True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    if hooks_off:
        monkeypatch.setattr(tk, "_no_launch_hooks", lambda: True)
    kernel = _FakeKernel(compiled)
    return tk, kernel, tk._Launcher(kernel)


def test_direct_launch_falls_back_to_triton_when_the_launcher_differs(monkeypatch):
    """Users run other Triton releases: if a cached kernel's launcher refuses the arguments,
    the call goes through Triton's own entry point instead, and so do all later calls."""
    tk, kernel, launcher = _fake_launcher(monkeypatch, _FakeCompiled(refuse=True))
    x = torch.zeros(4)
    for expected_calls in (1, 2, 3):
        launcher((1, 1, 1), (x, None), (4, 5), _FAKE_PLAN)
        assert kernel.calls == expected_calls
    assert tk._DIRECT_LAUNCH is False


def test_direct_launch_passes_raw_pointers_and_the_current_stream(monkeypatch):
    """A cached kernel is launched through its launcher with the stream, no launch metadata or
    hooks, pointers as integers (None where absent), the integers, then the compile-time values.
    Calls whose integers differ only where the kernel does not specialise (``m``) share it; a
    specialised integer of another value class, a pointer of another alignment or dtype each
    go through Triton again."""
    compiled = _FakeCompiled()
    tk, kernel, launcher = _fake_launcher(monkeypatch, compiled)
    x = torch.zeros(16)
    launcher((3, 1, 1), (x, None), (32, 5), _FAKE_PLAN)
    assert kernel.calls == 1 and not compiled.launches
    for m in (7, 16, 1):  # not specialised: 16 and 1 would be other classes for ``n``
        launcher((3, 1, 1), (x, None), (48, m), _FAKE_PLAN)  # 48: a multiple of 16, as 32 is
    head = (3, 1, 1, 1234, "function", "metadata", None, None, None, x.data_ptr(), None)
    assert compiled.launches == [("run", head + (48, m, 4)) for m in (7, 16, 1)]
    assert kernel.calls == 1
    for expected_calls, args in enumerate(
        [
            ((x, None), (33, 5)),  # 33 is not a multiple of 16
            ((x[1:], None), (32, 5)),  # 4 bytes past a 16-byte boundary
            ((x.double(), None), (32, 5)),  # another dtype
        ],
        start=2,
    ):
        launcher((3, 1, 1), *args, _FAKE_PLAN)
        assert kernel.calls == expected_calls
    assert len(compiled.launches) == 3


def test_direct_launch_calls_triton_launch_hooks_when_set(monkeypatch):
    """With a launch hook installed (a profiler's, which may also instrument what it compiles),
    every launch goes through Triton's own entry point, which compiles for the hooks and calls
    them; with the hook removed, the cached kernel launches directly again."""
    tk, kernel, launcher = _fake_launcher(monkeypatch, _FakeCompiled(), hooks_off=False)
    if tk._RUNTIME_KNOBS is None:
        pytest.skip("this Triton has no launch hook knobs")
    x = torch.zeros(8)
    launcher((1, 1, 1), (x, None), (8, 1), _FAKE_PLAN)
    assert tk._no_launch_hooks() and kernel.calls == 1

    def hook(metadata):
        pass

    tk._RUNTIME_KNOBS.launch_enter_hook.add(hook)
    try:
        assert not tk._no_launch_hooks()
        launcher((1, 1, 1), (x, None), (8, 1), _FAKE_PLAN)
        assert kernel.calls == 2 and not kernel.compiled.launches
    finally:
        tk._RUNTIME_KNOBS.launch_enter_hook.remove(hook)
    launcher((1, 1, 1), (x, None), (8, 1), _FAKE_PLAN)
    assert kernel.calls == 2 and len(kernel.compiled.launches) == 1


def test_launcher_refuses_tensors_on_another_device(monkeypatch):
    """A raw pointer is not checked downstream, so a tensor on another device than the first is
    refused, by name, before anything launches."""
    tk, kernel, launcher = _fake_launcher(monkeypatch, _FakeCompiled())
    x = torch.zeros(8)
    other = torch.zeros(8, device="meta")
    monkeypatch.setattr(torch.Tensor, "get_device", lambda t: 0 if t.is_meta else -1)
    with pytest.raises(RuntimeError, match="activation kernel's bias is on meta but its x is"):
        launcher((1, 1, 1), (x, other), (8, 1), (1, 1, {"num_warps": 1}, ()))
    assert kernel.calls == 0


def test_launchers_take_the_unspecialised_integers_from_the_kernels():
    """Only the backward's row split is unspecialised, as its decorator says, whether Triton
    compiles the kernels or the interpreter runs them."""
    from mcore_activations.fusions import triton_kernels as tk

    backward = tk._activation_bwd_kernel.arg_names.index("rows_per_program")
    assert tk._backward_launcher.unspecialised == {backward}
    for launcher in (tk._forward_launcher, tk._flat_launcher, tk._flat_backward_launcher):
        assert launcher.unspecialised == frozenset()


@pytest.mark.gpu
def test_cuda_launcher_knows_the_unspecialised_integers():
    """The direct launcher's cache key treats an integer as Triton does: by value class, or by
    width alone where the kernel says ``do_not_specialize``."""
    from mcore_activations.fusions import triton_kernels as tk

    for launcher in (
        tk._forward_launcher,
        tk._flat_launcher,
        tk._flat_backward_launcher,
        tk._backward_launcher,
    ):
        params = launcher.kernel.params
        assert launcher.unspecialised == {p.num for p in params if p.do_not_specialize}


@pytest.mark.gpu
def test_cuda_cpu_bias_is_refused():
    """A CPU bias beside a CUDA input is refused by name before any launch (as a raw pointer it
    would fault on the GPU)."""
    spec = SPECS["swiglu_clamp"]
    x = torch.randn(8, 64, device="cuda")
    with use_kernel_backend("triton"), pytest.raises(RuntimeError, match="bias is on cpu"):
        fused_activation(x, spec, bias=torch.zeros(64))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["squared_relu_tanh", "swiglu_clamp"])
def test_cuda_offsets_past_int32(name):
    """Inputs of more than 2**31 elements: the element offsets must be 64-bit. The first and last
    rows of one large call must equal, bit for bit, the same rows computed in a small call (the
    kernels are elementwise per row, so nothing but the offsets differs)."""
    spec = SPECS[name]
    ffn = 4096
    width = 2 * ffn if spec.gated else ffn
    rows = 2**31 // width + 3
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.empty(rows, width, device="cuda", dtype=torch.bfloat16)
    x[:4].normal_(0.0, 4.0, generator=gen)
    x[-4:].normal_(0.0, 4.0, generator=gen)
    probs = torch.rand(rows, 1, device="cuda", generator=gen)
    bias = torch.randn(width, device="cuda", dtype=torch.bfloat16, generator=gen)
    with use_kernel_backend("triton"):
        out = fused_activation(x, spec, bias=bias, probs=probs)
        for part in (slice(0, 4), slice(rows - 4, rows)):
            small = fused_activation(x[part].clone(), spec, bias=bias, probs=probs[part].clone())
            torch.testing.assert_close(out[part], small, rtol=0, atol=0)
    del out
    with use_kernel_backend("triton"):
        x.requires_grad_()
        grad = torch.zeros(rows, ffn, device="cuda", dtype=torch.bfloat16)
        grad[-4:].normal_(generator=gen)
        fused_activation(x, spec).backward(grad)
        tail = x[-4:].detach().clone().requires_grad_()
        fused_activation(tail, spec).backward(grad[-4:])
    torch.testing.assert_close(x.grad[-4:], tail.grad, rtol=0, atol=0)
