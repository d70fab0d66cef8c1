"""Experiments on the Triton kernels' launch plans: ``tiles``, ``flat``, ``glu``, ``reduce``
and ``launch``. Each candidate is a set of ``LaunchOptions`` fields passed to the kernels'
entry points (``with_options``), checked against production's result before it is timed."""

from __future__ import annotations

import torch

from mcore_activations.activation_spec import ActivationKind, ActivationSpec
from mcore_activations.fusions import activation_kernels as ak
from mcore_activations.fusions import triton_kernels as tk
from tools.benchmark_activations import copy_fn, time_interleaved, time_ms
from tools.kernel_variants.common import (
    GLU_CASES,
    SPECS,
    _add_compile_and_te,
    _glu_inputs,
    _over_floor,
    _raw_inputs,
    check_formulation,
    result_with,
    with_options,
)

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


def bench_tiles(spec, weighted, rows, ffn, dtype):
    """Raw Triton forward / backward time over the copy floor for each (tile, warps, max block)."""
    variant = ak.KernelVariant.of(spec, has_bias=False, has_probs=weighted)
    x, grad, probs, params, copy_fwd, copy_bwd = _raw_inputs(spec, weighted, rows, ffn, dtype)

    def forward(options):
        return tk.triton_forward(variant, x, None, probs, params, options=options)

    def backward(options):
        return tk.triton_backward(variant, grad, x, None, probs, params, options=options)

    row = {}
    tiled = {"flat_unary": False}  # the 2-D tile for every kind (the flat experiment: the rest)
    for tile, warps, max_n in FWD_CONFIGS:
        fields = tiled | {"fwd_tile": tile, "fwd_warps": warps, "fwd_max_block_n": max_n}
        row[f"fwd {tile}/{warps}/{max_n}"] = time_ms(with_options(fields, forward)) / copy_fwd
    for tile, warps, max_n in BWD_CONFIGS:
        fields = tiled | {"bwd_tile": tile, "bwd_warps": warps, "bwd_max_block_n": max_n}
        fields |= {"bwd_tile_row": tile, "bwd_warps_row": warps}
        row[f"bwd {tile}/{warps}/{max_n}"] = time_ms(with_options(fields, backward)) / copy_bwd
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
    from tools.benchmark_activations import compile_candidate

    variant = ak.KernelVariant.of(spec, has_bias=has_bias, has_probs=weighted)
    x, grad, probs, params, copy_fwd, copy_bwd = _raw_inputs(spec, weighted, rows, ffn, dtype)
    bias = torch.randn(ffn, device="cuda", dtype=dtype) if has_bias else None
    with_backward = not has_bias and not weighted

    def forward(options):
        return tk.triton_forward(variant, x, bias, probs, params, options=options)

    def backward(options):
        return tk.triton_backward(variant, grad, x, None, None, params, options=options)[0]

    fwd, bwd = {}, {}
    tiled = {"flat_unary": False}
    reference = result_with(tiled, forward)
    reference_dx = result_with(tiled, backward) if with_backward else None
    fwd["2-D tile"] = time_ms(with_options(tiled, forward))
    if with_backward:
        bwd["bwd 2-D tile"] = time_ms(with_options(tiled, backward))
    for block, warps in FLAT_CONFIGS:
        fields = {"flat_block": block, "flat_warps": warps}
        fields |= {"flat_block_soft_clamp": block, "flat_warps_soft_clamp": warps}
        check_formulation(f"flat {block}/{warps}", result_with(fields, forward), reference)
        fwd[f"flat {block}/{warps}"] = time_ms(with_options(fields, forward))
        if with_backward:
            dx = result_with(fields, backward)
            check_formulation(f"flat backward {block}/{warps}", dx, reference_dx)
            bwd[f"bwd flat {block}/{warps}"] = time_ms(with_options(fields, backward))
    if not has_bias:
        compiled = compile_candidate(spec, weighted)
        fwd["torch.compile"] = time_ms(lambda: compiled(x, probs))
    return {label: t / copy_fwd for label, t in fwd.items()} | {
        label: t / copy_bwd for label, t in bwd.items()
    }


def bench_glu(spec, rows, ffn, dtype):
    """Raw GLU kernels at two widest column blocks, torch.compile and TE, timed in turns."""
    variant, x, grad, params, _ = _glu_inputs(spec, rows, ffn, dtype)

    def forward(options):
        return tk.triton_forward(variant, x, None, None, params, options=options)

    def backward(options):
        return tk.triton_backward(variant, grad, x, None, None, params, options=options)[0]

    reference_out, reference_dx = result_with({}, forward), result_with({}, backward)
    fwd = {"floor": copy_fn(rows * 3 * ffn * dtype.itemsize)}
    bwd = {"floor": copy_fn(rows * 5 * ffn * dtype.itemsize)}
    rcp = {"fast_div": True}  # the hardware reciprocal for every dtype
    div_full = {"fast_div": False}
    forward_cases = {
        "fwd max 1024": {"fwd_max_block_n": 1024},
        "fwd max 2048": {"fwd_max_block_n": 2048},
        "fwd 2048 rcp": {"fwd_max_block_n": 2048} | rcp,
        "fwd 2048 div.full": {"fwd_max_block_n": 2048} | div_full,
    }
    for label, constants in forward_cases.items():
        check_formulation(label, result_with(constants, forward), reference_out)
        fwd[label] = with_options(constants, forward)
    row_1024 = {"bwd_tile_row": 1024, "bwd_warps_row": 4, "bwd_max_block_n": 1024}
    backward_cases = {
        "bwd 1024/4/1024": row_1024,
        "bwd 1024 rcp": row_1024 | rcp,
        "bwd 1024 div.full": row_1024 | div_full,
        "bwd 2048/8/2048": {"bwd_tile_row": 2048, "bwd_warps_row": 8, "bwd_max_block_n": 2048},
    }
    for label, constants in backward_cases.items():
        check_formulation(label, result_with(constants, backward), reference_dx)
        bwd[label] = with_options(constants, backward)
    _add_compile_and_te(fwd, spec, x)
    return _over_floor(fwd) | _over_floor(bwd)


REDUCE_SPECS = ("SwiGLU(clamp=7)", "SwiGLU")
# (tile elements, warps) of the unweighted GLU backward's one-row plan, widest block 1024.
REDUCE_CONFIGS = [(1024, 4), (512, 2), (1024, 2), (2048, 4)]
# (rows per program, widest column block, columns per warp, register cap) of the weighted
# backward's plan: the current one first, then with register caps, then other shapes (the sweep
# in docs/bench/history.md); one warp per row where a warp holds the whole block (no cross-warp
# sum).
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
    x = torch.randn(rows, 2 * ffn, device="cuda", dtype=dtype) * 4
    grad = torch.randn(rows, ffn, device="cuda", dtype=dtype)
    probs = torch.rand(rows, 1, device="cuda")
    params = ak.params_tensor(ak.spec_params(spec), x.device)
    plain = ak.KernelVariant.of(spec, has_bias=False, has_probs=False)
    weighted = ak.KernelVariant.of(spec, has_bias=False, has_probs=True)

    def backward(options, v=plain, p=None):
        return tk.triton_backward(v, grad, x, None, p, params, options=options)

    def weighted_backward(options):
        return backward(options, weighted, probs)

    # The floor is the unweighted bytes: the weighted call also reads probs and writes their
    # gradient, 8 bytes per row (0.1 % at F = 1536).
    group = {"floor": copy_fn(rows * 5 * ffn * dtype.itemsize)}
    reference = result_with({}, backward)
    for t, w in REDUCE_CONFIGS:
        constants = {"bwd_tile_row": t, "bwd_warps_row": w}
        label = f"bwd {t}/{w}"
        check_formulation(label, result_with(constants, backward)[0], reference[0])
        group[label] = with_options(constants, backward)
    reference = result_with({}, weighted_backward)
    # A float32 sum of ffn products in another order: rounding well above 2 ulp.
    scale = reference[2].abs().max().item()
    for r, n, c, cap in PROBS_CONFIGS:
        constants = {"bwd_probs_rows": r, "bwd_probs_max_block_n": n}
        constants |= {"bwd_probs_columns_per_warp": c, "bwd_probs_max_registers": cap}
        label = f"probs bwd {r} x {n}, {c}/warp, {cap or 'any'} regs"
        out = result_with(constants, weighted_backward)
        check_formulation(label, out[0], reference[0])
        torch.testing.assert_close(out[2], reference[2], rtol=1e-4, atol=1e-4 * scale)
        group[label] = with_options(constants, weighted_backward)
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

    The forward candidates vary the tile (``fwd_tile``, ``fwd_warps``, ``fwd_max_block_n``), the
    backward ones the unweighted GLU plan (``bwd_tile_row``, ``bwd_warps_row``,
    ``bwd_max_block_n``), and the current plans also run with row blocks fastest
    (``columns_fastest``); each is checked against the current plan's result first.
    """
    variant, x, grad, params, _ = _glu_inputs(spec, rows, ffn, dtype)

    def forward(options):
        return tk.triton_forward(variant, x, None, None, params, options=options)

    def backward(options):
        return tk.triton_backward(variant, grad, x, None, None, params, options=options)[0]

    fwd = {"floor": copy_fn(rows * 3 * ffn * dtype.itemsize)}
    reference = result_with({}, forward)
    for tile, warps, max_n in LAUNCH_FWD_CONFIGS:
        constants = {"fwd_tile": tile, "fwd_warps": warps, "fwd_max_block_n": max_n}
        label = f"fwd {tile}/{warps}/{max_n}"
        check_formulation(label, result_with(constants, forward), reference)
        fwd[label] = with_options(constants, forward)
    rows_fastest = {"columns_fastest": False}
    check_formulation("rows fastest", result_with(rows_fastest, forward), reference)
    fwd["fwd current, rows fastest"] = with_options(rows_fastest, forward)
    _add_compile_and_te(fwd, spec, x)
    bwd = {"floor": copy_fn(rows * 5 * ffn * dtype.itemsize)}
    reference = result_with({}, backward)
    for tile, warps, max_n in LAUNCH_BWD_CONFIGS:
        constants = {"bwd_tile_row": tile, "bwd_warps_row": warps, "bwd_max_block_n": max_n}
        label = f"bwd {tile}/{warps}/{max_n}"
        check_formulation(label, result_with(constants, backward), reference)
        bwd[label] = with_options(constants, backward)
    check_formulation("rows fastest", result_with(rows_fastest, backward), reference)
    bwd["bwd current, rows fastest"] = with_options(rows_fastest, backward)
    row = {}
    for group in (fwd, bwd):
        with torch.no_grad():
            times = time_interleaved(group, repeats=11)
        floor = times.pop("floor")
        row |= {label: t / floor for label, t in times.items()}
    return row
