"""The kernel diagnostics: the SASS report (compiled for sm_90 on the CPU machine) and the A/B
benchmark's argument parsing and baseline loading."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.benchmark_kernel_ab import (
    check_variant_labels,
    load_baseline,
    parse_candidate,
    parse_shape,
    parse_variant,
)
from tools.inspect_kernel_sass import elements_per_thread, launch_signature, parse_report

ROOT = Path(__file__).resolve().parents[3]

USAGE = """
 Function _activation_bwd_kernel:
  REG:56 STACK:0 SHARED:16 LOCAL:8 CONSTANT[0]:608 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
SASS = """
        /*0650*/                   LDG.E R20, desc[UR18][R20.64] ;
        /*0670*/               @P1 LDG.E.128 R4, desc[UR18][R22.64] ;
        /*06c0*/               @P1 LDG.E.128 R8, desc[UR18][R2.64] ;
        /*0a60*/              @!P1 LDG.E.128 R4, desc[UR18][R2.64] ;
        /*1b00*/                   MUFU.EX2 R12, R6 ;
        /*1b40*/               @P1 STG.E.128 desc[UR18][R2.64], R4 ;
        /*1b50*/               @P0 BRA 0x6c0 ;
        /*1b60*/                   EXIT ;
        /*1b70*/                   BRA 0x1b70;
"""


def test_parse_report_reads_registers_and_the_load_span():
    report = parse_report(USAGE, SASS)
    # 128-bit loads at byte offsets 0x670 and 0xa60: 63 instructions of 16 bytes apart. The
    # branch at 0x1b50 back to 0x6c0 closes a loop of 330 instructions of 16 bytes; the one to
    # itself after EXIT is padding.
    assert report == {
        "registers": 56,
        "local_bytes": 8,
        "shared_bytes": 16,
        "load_span": 63,
        "instructions": 9,
        "mufu": 1,
        "loop": 330,
    }
    assert parse_report(USAGE, "")["load_span"] is None
    assert parse_report(USAGE, "")["loop"] is None


def test_elements_per_thread_of_tiled_and_flat_plans():
    # A 1 x 1024 tile over 4 warps, and a flat block of 2048 over 4 warps.
    assert elements_per_thread((1, 1024, {"num_warps": 4}, ())) == 8
    assert elements_per_thread((2048, None, {"num_warps": 4}, ())) == 16


def test_launch_signature_specialises_integers_as_a_launch_does():
    """Integers as Triton specialises them at a launch: 1 becomes the constant 1, a multiple of
    16 carries the divisibility hint, except where the kernel opts out (the backward's
    ``rows_per_program``: ``do_not_specialize``)."""
    import torch

    from mcore_activations.fusions import activation_kernels as ak
    from mcore_activations.fusions import triton_kernels as tk

    spec = ak.ActivationSpec(ak.ActivationKind.SILU, gated=True, clamp_value=7.0)
    v = ak.KernelVariant.of(spec, has_bias=True, has_probs=True)
    names = tk._activation_bwd_kernel.arg_names
    plan = tk.plans.backward_plan(v, 8192, 2)
    for rows_per_program in (1, 128):
        ints = {"rows": 1, "F": 8192, "rows_per_program": rows_per_program}
        signature, constants, attrs, options = launch_signature(
            tk._activation_bwd_kernel, plan, torch.bfloat16, True, True, ints
        )
        assert signature["rows"] == "constexpr" and constants["rows"] == 1
        assert signature["F"] == "i32" and attrs[(names.index("F"),)] == [["tt.divisibility", 16]]
        assert signature["rows_per_program"] == "i32"
        assert (names.index("rows_per_program"),) not in attrs
        assert signature["ROWS_ALIGNED"] == "constexpr" and constants["ROWS_ALIGNED"] is True
        assert options == {"num_warps": plan[2]["num_warps"]}
    # The forward kernel has no opt-outs: 48 is hinted, 7 is not, 2**31 rows take 64 bits (the
    # values need not fit the plan's width: only their specialisation is looked at).
    forward = tk.plans.forward_plan(v, 8192, 2)
    ints = {"rows": 48, "F": 7}
    signature, constants, attrs, _ = launch_signature(
        tk._activation_fwd_kernel, forward, torch.bfloat16, False, False, ints
    )
    rows = (tk._activation_fwd_kernel.arg_names.index("rows"),)
    F = (tk._activation_fwd_kernel.arg_names.index("F"),)
    assert signature["rows"] == "i32" and attrs[rows] == [["tt.divisibility", 16]]
    assert signature["F"] == "i32" and F not in attrs and signature["bias_ptr"] == "constexpr"
    ints = {"rows": 2**31, "F": 7}
    signature, _, attrs, _ = launch_signature(
        tk._activation_fwd_kernel, forward, torch.bfloat16, False, False, ints
    )
    assert signature["rows"] == "i64" and attrs[rows] == [["tt.divisibility", 16]]


def test_inspect_kernel_sass_compiles_for_sm90_without_a_gpu():
    """The tool compiles one activation's four kernels with Triton's own ptxas and cuobjdump
    (not the interpreter: it inspects real machine code)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [
            sys.executable,
            "tools/inspect_kernel_sass.py",
            "--ffn",
            "1536",
            "--cases",
            "SwiGLU(clamp=7)",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    row = next(line for line in result.stdout.splitlines() if line.startswith("| SwiGLU(clamp=7)"))
    cells = [c.strip() for c in row.strip("|").split("|")[1:]]
    assert len(cells) == 4  # forward, backward, each with and without probabilities
    for cell in cells:
        registers, local, span, per_element, loop = (part.strip() for part in cell.split("/"))
        assert 16 <= int(registers) <= 255 and int(local) >= 0 and span != "None"
        instructions, mufu = per_element.rstrip(")").split(" (")
        # SwiGLU's sigmoid: one exponential and one reciprocal per element, a few dozen in all.
        assert 10 < float(instructions) < 200 and 1.5 < float(mufu) < 4
        # Without a bias each program takes one tile: no row loop.
        assert loop == "-"


def test_parse_candidate_and_shape():
    assert parse_candidate("bias_programs=4096,bwd_probs_max_registers=None") == {
        "bias_programs": 4096,
        "bwd_probs_max_registers": None,
    }
    with pytest.raises(argparse.ArgumentTypeError, match="no field '_BIAS_PROGRAMS'"):
        parse_candidate("_BIAS_PROGRAMS=1")
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=VALUE"):
        parse_candidate("bias_programs")
    with pytest.raises(argparse.ArgumentTypeError, match="not a Python literal"):
        parse_candidate("bias_programs=many")
    assert parse_shape("65536x1536") == (65536, 1536)
    with pytest.raises(argparse.ArgumentTypeError, match="ROWSxWIDTH"):
        parse_shape("65536")


def test_load_baseline_imports_the_kernels_of_a_commit(tmp_path):
    baseline = load_baseline("HEAD", str(tmp_path))
    assert baseline.__name__ == "baseline_triton_kernels"
    assert callable(baseline.triton_backward) and callable(baseline.triton_forward)


def _split_copy(directory: Path, plans_edit=("", "")) -> Path:
    # A copy of this tree's three kernel modules, as the GPU machine's snapshot would hold one.
    directory.mkdir()
    for name in ("triton_jit", "triton_plans", "triton_kernels"):
        source = (ROOT / f"mcore_activations/fusions/{name}.py").read_text()
        if name == "triton_plans" and plans_edit[0]:
            assert plans_edit[0] in source
            source = source.replace(*plans_edit)
        (directory / f"{name}.py").write_text(source)
    return directory


def test_load_baseline_imports_a_copy_of_the_kernels_from_a_path(tmp_path):
    # The GPU machine has a snapshot of the tree without git: baselines and variants come as
    # files, a single file from before the kernels were split in three, or a directory of the
    # three. A modified copy proves the modules are the copy's, not this tree's.
    old = tmp_path / "old.py"
    old.write_text("def triton_forward():\n    pass\n\n\ndef triton_backward():\n    pass\n")
    module = load_baseline(str(old), str(tmp_path), "variant_0_triton_kernels")
    assert module.__name__ == "variant_0_triton_kernels" and callable(module.triton_backward)
    edit = ("    bias_programs: int = 1024\n", "    bias_programs: int = 7\n")
    copy = _split_copy(tmp_path / "split", edit)
    module = load_baseline(str(copy), str(tmp_path), "variant_1_triton_kernels")
    assert module.__name__ == "variant_1_triton_kernels" and callable(module.triton_backward)
    assert module.plans.DEFAULT_OPTIONS.bias_programs == 7
    assert module.plans.__name__ == "variant_1_triton_kernels.triton_plans"
    from mcore_activations.fusions import triton_plans

    assert triton_plans.DEFAULT_OPTIONS.bias_programs == 1024


def test_parse_variant():
    assert parse_variant("prefetch=variants/a.py") == ("prefetch", "variants/a.py")
    assert parse_variant(" old = HEAD~2 ") == ("old", "HEAD~2")
    for bad in ("HEAD~2", "=HEAD", "old="):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL=REV"):
            parse_variant(bad)


def test_variant_labels_never_replace_another_column():
    # A variant labelled like the floor (or any other column) would silently replace its
    # timing, and every ratio of the row with it.
    candidates = [{"bias_programs": 2048}]
    assert check_variant_labels([("prefetch", "a.py"), ("old", "HEAD~1")], candidates) is None
    for label in ("floor", "plain", "bias only", "this tree", "baseline", "bias_programs=2048"):
        assert "already a column" in check_variant_labels([(label, "a.py")], candidates)
    assert "'a'" in check_variant_labels([("a", "x.py"), ("a", "y.py")], [])
    # A candidate's own bias-only timing is a column too.
    own = check_variant_labels([("bias only, bias_programs=2048", "a.py")], candidates)
    assert "already a column" in own


def test_inspect_kernel_sass_compares_sass_with_another_copy(tmp_path):
    """``--compare`` compiles this tree's kernels and another copy's: a copy whose weighted
    backward runs on twice the warps differs there and only there."""
    old = "    bwd_probs_columns_per_warp: int = 256"
    copy = _split_copy(tmp_path / "copy", (old, old.replace("256", "128")))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Without a bias: with one, the unweighted GLU backward at F = 1536 takes the weighted
    # one-row plan, and so the same columns per warp.
    command = [sys.executable, "tools/inspect_kernel_sass.py", "--ffn", "1536"]
    command += ["--cases", "SwiGLU(clamp=7)", "--compare", str(copy)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    row = [line for line in result.stdout.splitlines() if line.startswith("| SwiGLU(clamp=7)")]
    assert row == ["| SwiGLU(clamp=7) | same | same | same | differs |"], result.stdout


def test_inspect_kernel_sass_candidate_sets_constants_before_compiling(tmp_path):
    """``--candidate`` changes this tree's constants only: against an unchanged copy, twice the
    warps for the weighted backward differ there and only there (as the edited copy does in the
    test above)."""
    copy = _split_copy(tmp_path / "copy")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "tools/inspect_kernel_sass.py", "--ffn", "1536"]
    command += ["--cases", "SwiGLU(clamp=7)", "--compare", str(copy)]
    command += ["--candidate", "bwd_probs_columns_per_warp=128"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "bwd_probs_columns_per_warp=128" in result.stdout.splitlines()[0]
    row = [line for line in result.stdout.splitlines() if line.startswith("| SwiGLU(clamp=7)")]
    assert row == ["| SwiGLU(clamp=7) | same | same | same | differs |"], result.stdout


_PIPELINE_PROBE = """
import sys
import torch
from mcore_activations.fusions.activation_kernels import KernelVariant
from tools.inspect_kernel_sass import CASES, compile_kernel, kernel_and_plan

for name, probs, ffn in [tuple(case.split(":")) for case in sys.argv[1:]]:
    has_probs = probs == "probs"
    v = KernelVariant.of(CASES[name], has_bias=True, has_probs=has_probs)
    kernel, plan = kernel_and_plan(v, int(ffn), 65536, 2, True)
    ints = {"rows": 65536, "F": int(ffn), "rows_per_program": 100}
    ptx = compile_kernel(kernel, plan, torch.bfloat16, True, has_probs, ints, 90).asm["ptx"]
    print(name, probs, ffn, plan[2]["LOOP_STAGES"], "cp.async" in ptx)
"""


def test_pipelined_plans_compile_to_asynchronous_copies():
    """The plans that ask for a pipelined row loop (LOOP_STAGES >= 2) get one from Triton: their
    sm_90 PTX has cp.async copies (a Triton that stopped pipelining such loops would leave the
    loads unprefetched, slower than the register prefetch), and the register-prefetch plans have
    none. Compiled with Triton's own ptxas, not the interpreter."""
    cases = [
        "SwiGLU(clamp=7):bias:8192",  # the unweighted GLU plan at 1024-column blocks
        "SwiGLU(clamp=7):probs:8192",  # the weighted one, one row a trip
        "SiTU-GLU(4,25):bias:1536",  # the one-row plan, SiTU-GLU with a linear scale
        "SwiGLU:bias:1536",  # the one-row plan, register prefetch
        "SwiGLU:probs:8192",  # the weighted plan's two rows a trip, register prefetch
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-c", _PIPELINE_PROBE, *cases]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line.split() for line in result.stdout.splitlines()]
    assert [(stages, copies) for *_, stages, copies in lines] == [
        ("4", "True"),
        ("4", "True"),
        ("3", "True"),
        ("0", "False"),
        ("0", "False"),
    ], result.stdout
