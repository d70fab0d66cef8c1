"""The launch plans production chooses, frozen: every kernel, tile, warp count, register cap,
compile-time switch, row split and grid for a grid of variants, widths and dtypes.

``launch_plans_expected.txt`` was captured from the single-file ``triton_kernels.py`` before
its launch plans moved to ``triton_plans`` (with the hardware reciprocal available, as on an
NVIDIA GPU), together with the plans each of the four experiment switches (then module
globals, now ``LaunchOptions`` fields) gives where it changes anything. A line per case::

    <case> | fwd <plan> | bwd <plan> | split <col blocks,rows per program,programs>... | grid ...

where a plan is ``BLOCK_MxBLOCK_N`` (or ``flatBLOCK``, for the two sizes of offsets), ``w``
warps, ``maxnreg`` when capped, the switches that are on (``rcp``: FAST_DIV, ``cols``:
COLUMNS_FASTEST, ``aligned``: ROWS_ALIGNED, ``wide``: 64-bit offsets) and the loop stages. The
split and the grids are at 1, 70 and 65536 rows. A change of any of them changes generated code
or its launch, which a refactor must not; a deliberate change of a plan rewrites the file (run
this module as a script) and is measured on a GPU first (docs/bench/history.md).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from mcore_activations.activation_spec import ActivationKind as K
from mcore_activations.activation_spec import ActivationSpec as S
from mcore_activations.fusions import triton_plans
from mcore_activations.fusions.activation_kernels import KernelVariant

EXPECTED = Path(__file__).with_name("launch_plans_expected.txt")

SPECS = {
    "swiglu": S(K.SILU, gated=True),
    "swiglu_c7": S(K.SILU, gated=True, clamp_value=7.0),
    "swiglu_c7_il32": S(K.SILU, gated=True, clamp_value=7.0, glu_interleave_size=32),
    "reglu": S(K.RELU, gated=True),
    "geglu_erf": S(K.GELU, gated=True),
    "geglu": S(K.GELU_TANH, gated=True),
    "gptoss": S(K.QUICK_GELU, gated=True, clamp_value=7.0, linear_offset=1.0),
    "situ4": S(K.SILU, gated=True, gate_tanh_scale=4.0),
    "situ4_25": S(K.SILU, gated=True, gate_tanh_scale=4.0, linear_tanh_scale=25.0),
    "sqrelu_glu": S(K.SQUARED_RELU, gated=True),
    "silu": S(K.SILU),
    "gelu": S(K.GELU_TANH),
    "sqrelu": S(K.SQUARED_RELU),
    "sqrelu_t10": S(K.SQUARED_RELU, gate_tanh_scale=10.0),
    "relu": S(K.RELU),
}
WIDTHS = (100, 768, 1536, 2880, 8192)
ROWS = (1, 70, 65536)
# The experiment switches at their non-production values, on a subset of the grid.
SWITCHES = {
    "_FLAT_UNARY=False": {"flat_unary": False},
    "_COLUMNS_FASTEST=False": {"columns_fastest": False},
    "_BIAS_ROWS_ALIGNED=True": {"bias_rows_aligned": True},
    "_BWD_PROBS_MAX_REGISTERS=40": {"bwd_probs_max_registers": 40},
}
SWITCH_SPECS = ("swiglu_c7", "situ4_25", "sqrelu", "gelu", "geglu")
SWITCH_WIDTHS = (768, 8192)

_FLAGS = {"FAST_DIV": "rcp", "COLUMNS_FASTEST": "cols", "ROWS_ALIGNED": "aligned", "WIDE": "wide"}
# The compile-time arguments that restate the variant (checked apart, in _check_structure).
_STRUCTURE = {
    "KIND": "kind",
    "GATED": "gated",
    "CLAMP": "clamp",
    "GATE_TANH": "gate_tanh",
    "LINEAR_TANH": "linear_tanh",
    "HAS_BIAS": "has_bias",
    "HAS_PROBS": "has_probs",
    "SOFT_CLAMP": "gate_tanh",
}


def _words(plan) -> str:
    kwargs = plan.kwargs
    shape = f"{plan.block_m}x{plan.block_n}" if plan.block_n is not None else f"flat{plan.block_m}"
    words = [shape, f"w{kwargs['num_warps']}"]
    if "maxnreg" in kwargs:
        words.append(f"maxnreg{kwargs['maxnreg']}")
    words += [flag for name, flag in _FLAGS.items() if kwargs.get(name)]
    if "LOOP_STAGES" in kwargs:
        words.append(f"stages{kwargs['LOOP_STAGES']}")
    return " ".join(words)


def _check_structure(v, plan, kernel) -> None:
    # The variant's own compile-time arguments, and the values in the kernel's signature order.
    for name, field in _STRUCTURE.items():
        if name in plan.kwargs:
            assert plan.kwargs[name] == getattr(v, field), name
    if "INTERLEAVE" in plan.kwargs:
        assert plan.kwargs["INTERLEAVE"] == (v.interleave or 0)
    names = [n for n in kernel.arg_names if n in plan.kwargs]
    assert plan.values == tuple(plan.kwargs[n] for n in names)
    launch_options = {"num_warps", "maxnreg"}
    assert set(plan.kwargs) - launch_options == set(names)


def case_line(key: str, v, F: int, itemsize: int, options=triton_plans.DEFAULT_OPTIONS) -> str:
    """The expected file's line for one case (the format of the module docstring)."""
    from mcore_activations.fusions import triton_jit as jit

    parts, grids = [key], []
    for backward, label in ((False, "fwd"), (True, "bwd")):
        if triton_plans.uses_flat_kernel(v, backward, options):
            kernel = jit._unary_bwd_flat_kernel if backward else jit._unary_fwd_flat_kernel
            flat = [
                triton_plans.flat_plan(v, backward, n, itemsize, options)
                for n in (F, (2**31 // F + 1) * F)
            ]
            for plan in flat:
                _check_structure(v, plan, kernel)
            parts.append(f"{label} " + " / ".join(_words(p) for p in flat))
            continue
        if backward:
            plan = triton_plans.backward_plan(v, F, itemsize, options)
            _check_structure(v, plan, jit._activation_bwd_kernel)
            splits = [triton_plans.row_split(v, r, F, plan, itemsize, options) for r in ROWS]
            grids = [triton_plans.tile_grid(s[2], s[0], plan) for s in splits]
            parts.append(f"{label} {_words(plan)}")
            parts.append("split " + " ".join(",".join(map(str, s)) for s in splits))
        else:
            plan = triton_plans.forward_plan(v, F, itemsize, options)
            _check_structure(v, plan, jit._activation_fwd_kernel)
            cdiv = triton_plans.cdiv
            grids = [triton_plans.tile_grid(cdiv(r, plan[0]), cdiv(F, plan[1]), plan) for r in ROWS]
            parts.append(f"{label} {_words(plan)}")
    if grids:
        parts.append("grid " + " ".join(",".join(map(str, g)) for g in grids))
    return " | ".join(parts)


def _cases(specs=SPECS, widths=WIDTHS, itemsizes=(2, 4)):
    for name in specs:
        for bias in (False, True):
            for probs in (False, True):
                v = KernelVariant.of(SPECS[name], has_bias=bias, has_probs=probs)
                for F in widths:
                    for itemsize in itemsizes:
                        key = (
                            f"{name} bias={int(bias)} probs={int(probs)} F={F} itemsize={itemsize}"
                        )
                        yield key, v, F, itemsize


def current_lines() -> list[str]:
    """Every line of the expected file, from the current plans (the GPU's division choice)."""
    lines = {key: case_line(key, v, F, n) for key, v, F, n in _cases()}
    result = [lines[key] for key in sorted(lines)]
    switched = {}
    for label, fields in SWITCHES.items():
        options = dataclasses.replace(triton_plans.DEFAULT_OPTIONS, **fields)
        for key, v, F, n in _cases(SWITCH_SPECS, SWITCH_WIDTHS):
            line = case_line(f"{label} {key}", v, F, n, options)
            if line.split(" ", 1)[1] != lines[key]:  # only where the switch changes something
                switched[f"{label} {key}"] = line
    return result + [switched[key] for key in sorted(switched)]


@pytest.fixture
def with_ptx(monkeypatch):
    # The plans as on an NVIDIA GPU, where the hardware reciprocal exists (FAST_DIV for 16-bit
    # inputs); the cached plans are keyed by the division choice, so nothing stale is read.
    monkeypatch.setattr(triton_plans, "_HAS_PTX", True)


def test_launch_plans_are_the_frozen_ones(with_ptx):
    expected = EXPECTED.read_text().splitlines()
    current = current_lines()
    assert len(current) == len(expected)
    changed = [(e, c) for e, c in zip(expected, current) if e != c]
    assert not changed, "plans changed:\n" + "\n".join(f"- {e}\n+ {c}" for e, c in changed[:10])


def test_without_ptx_only_the_division_changes():
    # On CPU (the interpreter) and ROCm every plan is the GPU's with FAST_DIV off.
    for key, v, F, itemsize in _cases(widths=(768, 8192), itemsizes=(2,)):
        line = case_line(key, v, F, itemsize)
        assert "rcp" not in line
        expected = next(e for e in EXPECTED.read_text().splitlines() if e.startswith(key + " |"))
        assert line == expected.replace(" rcp", "")


if __name__ == "__main__":
    # Rewrites the expected file from the current plans (a deliberate change of a plan only).
    triton_plans._HAS_PTX = True
    EXPECTED.write_text("\n".join(current_lines()) + "\n")
    sys.exit(0)
