"""What the compiler made of the activation kernels, without a GPU.

Usage: ``python tools/inspect_kernel_sass.py [--ffn 8192] [--rows 16384] [--dtype bfloat16]
[--arch 90] [--bias] [--cases NAME ...] [--compare REV] [--candidate NAME=VALUE[,...]]``

Compiles the Triton kernels of each activation for an NVIDIA architecture on any machine (Triton
ships ptxas and cuobjdump in its wheel), at the launch plan ``triton_kernels`` would use at width
``--ffn``, and prints per kernel: registers per thread, spilled bytes, the *load span* (the
number of SASS instructions between the first and the last 128-bit load of a program) and the
*instructions per element* (the kernel's static SASS instruction count, prologue and padding
included, and in parentheses its special-function ``MUFU`` ones - exponentials, reciprocals -
over the output elements one thread computes per trip), and the *loop per element*: the
instructions of the kernel's longest loop (the backward's walk over a program's rows, where it
has one; found as the branch back to an address, ``BRA 0x...``, that spans the most
instructions) over the same elements. A program with a bias walks a hundred rows or more, so the
loop, not the whole kernel, is what runs: the whole-kernel count credits plans with more
elements a trip for their prologue, the loop count does not. A span of a few dozen means every
streamed input is in flight at once; a span of hundreds means ptxas deferred a load until an
earlier one was consumed, so each program waits for memory twice. Registers bound how many
warps an SM holds (65536 registers; 64 per thread leaves 32 warps of 4-warp programs, 56 leaves
36), and so how much memory traffic hides latency. An SM issues one instruction per clock per
scheduler, so a kernel with many instructions per element can be bound by issue, not memory.

``--candidate`` compiles this tree's kernels under ``triton_plans.LaunchOptions`` with those
fields replaced (as ``benchmark_kernel_ab`` does), so a plan can be read in SASS before it is
timed.

``--compare REV`` (a git revision, or a copy as ``benchmark_kernel_ab.load_baseline`` takes one:
the single ``triton_kernels.py`` of a revision before the split, or a directory of the split
modules) prints, per kernel,
whether this tree's SASS is identical to ``REV``'s: a refactor that compiles to the same
machine code keeps every timing and GPU test result taken on ``REV``.

This is how the weighted clamped SwiGLU backward's 13 % over the unweighted one was traced
(docs/bench/history.md): 64 registers and a load span of 63 instructions, against 48
registers and 19 for the unweighted kernel. The instruction count found the cost of
``tl.exp``'s subnormal guard: SiTU-GLU(4,25)'s bf16 forward issued 61 instructions
per element, 49 with ``tl.exp2``. It is a diagnostic, not a benchmark: the times come from the
H200 runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_activations.fusions import activation_kernels as ak  # noqa: E402
from mcore_activations.fusions import triton_kernels as tk  # noqa: E402
from tools.benchmark_kernel_ab import CASES as AB_CASES  # noqa: E402
from tools.benchmark_kernel_ab import candidate_label, load_baseline, parse_candidate  # noqa: E402

# The activations of the A/B benchmark, once each (its float32 entries repeat a bf16 one; the
# dtype here is --dtype).
CASES = {name: spec for name, (spec, dtype) in AB_CASES.items() if dtype == torch.bfloat16}
# Pointers that carry the activation's dtype; the others (probs, params, partial sums) are float32.
_DATA_POINTERS = {"x_ptr", "grad_ptr", "bias_ptr", "out_ptr", "dx_ptr"}
_TRITON_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def kernel_and_plan(v, F: int, rows: int, itemsize: int, backward: bool, kernels=tk, options=None):
    """The kernel and launch plan ``triton_forward`` / ``triton_backward`` pick for variant ``v``
    at width ``F`` (the flat kernels for non-gated calls without a reduction); ``kernels`` is the
    ``triton_kernels`` module to take them from (this tree's, or one ``load_baseline`` loaded:
    split, with its ``plans``, or a single file from before the split), ``options`` the
    ``LaunchOptions`` of a split one (None: production's)."""
    if not hasattr(kernels, "plans"):
        return _single_file_kernel_and_plan(v, F, rows, itemsize, backward, kernels)
    plans = kernels.plans
    options = options or plans.DEFAULT_OPTIONS
    if plans.uses_flat_kernel(v, backward, options):
        kernel = kernels._unary_bwd_flat_kernel if backward else kernels._unary_fwd_flat_kernel
        return kernel, plans.flat_plan(v, backward, rows * F, itemsize, options)
    if backward:
        return kernels._activation_bwd_kernel, plans.backward_plan(v, F, itemsize, options)
    return kernels._activation_fwd_kernel, plans.forward_plan(v, F, itemsize, options)


def _single_file_kernel_and_plan(v, F: int, rows: int, itemsize: int, backward: bool, kernels):
    # A revision from before the kernels were split in three: its plans are private functions.
    if kernels.uses_flat_kernel(v, backward):
        kernel = kernels._unary_bwd_flat_kernel if backward else kernels._unary_fwd_flat_kernel
        return kernel, kernels._flat_shape(v, kernel, rows * F, itemsize)
    if backward:
        return kernels._activation_bwd_kernel, kernels._backward_plan(v, F, itemsize)
    return kernels._activation_fwd_kernel, kernels._forward_plan(v, F, itemsize)


def compile_kernel(kernel, plan, dtype, has_bias: bool, has_probs: bool, ints: dict, arch: int):
    """Compiles ``kernel`` at ``plan`` for ``sm_{arch}``; returns Triton's compiled kernel
    (``launch_signature`` says with what)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants, attrs, options = launch_signature(
        kernel, plan, dtype, has_bias, has_probs, ints
    )
    source = ASTSource(kernel, signature, constants, attrs)
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(source, target=target, options=options)


def launch_signature(kernel, plan, dtype, has_bias: bool, has_probs: bool, ints: dict):
    """``(signature, constants, attributes, options)`` that Triton would compile ``kernel`` with
    at a launch under ``plan``.

    Absent inputs are ``None`` constexprs, as Triton specialises a launch with ``None``; present
    pointers, and the integers of ``ints`` (name -> value) that are multiples of 16, carry
    Triton's divisibility hint, as at a real launch of contiguous tensors from the caching
    allocator (without it a masked load of 16-bit values is not vectorised); an integer equal to
    1 becomes the constant 1, one of 2**31 or more an ``i64``. As at a launch, an argument the
    kernel lists in ``do_not_specialize`` gets neither the constant nor the hint, one listed in
    ``do_not_specialize_on_alignment`` no hint.

    Args:
        kernel: the ``@triton.jit`` kernel.
        plan: its launch plan (``triton_kernels``' ``(BLOCK_M, BLOCK_N, kwargs, values)``).
        dtype: the dtype of the activation's tensors.
        has_bias: whether a bias is passed (else its pointers are ``None``).
        has_probs: whether probabilities are passed.
        ints: the integer arguments' values at the launch, by name.

    Returns:
        ``(signature, constants, attributes, options)`` for ``triton.compiler.ASTSource`` and
        ``triton.compile``.
    """
    constants = dict(plan[2])
    # Launch options, as Triton takes them from a launch's keyword arguments.
    options = {name: constants.pop(name) for name in ("num_warps", "maxnreg") if name in constants}
    absent = set()
    if not has_bias:
        absent |= {"bias_ptr", "dbias_part_ptr"}
    if not has_probs:
        absent |= {"probs_ptr", "dprobs_part_ptr"}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in absent:
            signature[name], constants[name] = "constexpr", None
        elif name.endswith("_ptr"):
            signature[name] = _TRITON_TYPES[dtype] if name in _DATA_POINTERS else "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif ints.get(name) == 1 and not _unspecialised(kernel, i, name, "do_not_specialize"):
            # Triton compiles an integer argument equal to 1 as the constant 1.
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i64" if ints.get(name, 1) >= 2**31 else "i32"
            hinted = not any(
                _unspecialised(kernel, i, name, opt)
                for opt in ("do_not_specialize", "do_not_specialize_on_alignment")
            )
            if hinted and ints.get(name, 1) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs, options


def _unspecialised(kernel, index: int, name: str, option: str) -> bool:
    # Whether ``kernel``'s ``@triton.jit(option=[...])`` names the argument (by name or index);
    # under TRITON_INTERPRET=1 the kernel is an interpreted function that keeps them in kwargs.
    listed = getattr(kernel, option, None) or getattr(kernel, "kwargs", {}).get(option) or ()
    return name in listed or index in listed


def _cuobjdump(*args: str) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), *args], capture_output=True, text=True, check=True).stdout


def _usage_and_sass(compiled) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        return _cuobjdump("-res-usage", cubin), _cuobjdump("-sass", cubin)


def sass_report(compiled) -> dict:
    """``{"registers", "local_bytes", "shared_bytes", "load_span", "instructions", "mufu",
    "loop"}`` of a compiled kernel (local memory is where spilled registers go)."""
    return parse_report(*_usage_and_sass(compiled))


def sass_text(compiled) -> str:
    """The SASS listing of a compiled kernel (what ``--compare`` compares)."""
    return _usage_and_sass(compiled)[1]


def parse_report(usage: str, sass: str) -> dict:
    """Parses ``cuobjdump -res-usage`` and ``cuobjdump -sass`` output of one kernel."""

    def field(name):
        return int(re.search(rf"\b{name}:(\d+)", usage).group(1))

    # SASS lines look like "/*0670*/  @P1 LDG.E.128 R4, desc[UR18][R22.64] ;": the offset is in
    # bytes, 16 per instruction.
    offsets = [
        int(m.group(1), 16) // 16
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?LDG\.E\.128\b", sass)
    ]
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    # Loops end in a branch back to their first instruction; the longest is the row loop. (The
    # branch to itself after EXIT is padding, not a loop.)
    spans = [
        (int(at, 16) - int(target, 16)) // 16 + 1
        for at, target in re.findall(
            r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\S*\s+(?:`\()?0x([0-9a-f]+)", sass
        )
        if int(target, 16) < int(at, 16)
    ]
    return {
        "registers": field("REG"),
        "local_bytes": field("LOCAL"),
        "shared_bytes": field("SHARED"),
        "load_span": offsets[-1] - offsets[0] if offsets else None,
        "instructions": len(opcodes),
        "mufu": opcodes.count("MUFU"),
        "loop": max(spans) if spans else None,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument(
        "--rows",
        type=int,
        default=16384,
        help="rows of the launch (divisibility hints, bias plans)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90, 100")
    parser.add_argument("--bias", action="store_true")
    parser.add_argument("--cases", nargs="+", default=list(CASES), help="names from CASES")
    parser.add_argument(
        "--compare",
        metavar="REV",
        help="report whether each kernel's SASS is identical to that of REV (a git revision, a "
        "copy of a single-file triton_kernels.py, or a directory of the split modules) instead "
        "of registers and load spans",
    )
    parser.add_argument(
        "--candidate",
        type=parse_candidate,
        default={},
        help="NAME=VALUE[,NAME=VALUE...]: LaunchOptions fields to compile this tree's kernels with",
    )
    args = parser.parse_args(argv)
    args.options = dataclasses.replace(tk.plans.DEFAULT_OPTIONS, **args.candidate)
    names = args.cases
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        other = None
        if args.compare:
            other = load_baseline(args.compare, tmp, "compared_triton_kernels")
            split = hasattr(other, "plans")
            missing = [] if split or hasattr(other, "_row_split") else ["_row_programs"]
            missing = [
                n for n in ("uses_flat_kernel", *missing) if not split and not hasattr(other, n)
            ]
            if missing:
                parser.error(
                    f"--compare: {args.compare}'s triton_kernels has no {', '.join(missing)} "
                    "(added on 2026-12-01); compare against a later revision"
                )
        candidate = candidate_label(args.candidate)
        print(
            f"sm_{args.arch}, {args.dtype}, F = {args.ffn}, bias: {args.bias}"
            + (f", {candidate}" if candidate else "")
        )
        if other is None:
            print(
                "registers / local (spill) bytes / load span (SASS instructions) / SASS "
                "instructions (MUFU) per element of a thread / the longest loop's instructions "
                "per element ('-': no loop), per kernel"
            )
        else:
            print(f"SASS of this tree against {args.compare}, per kernel")
        print("| activation | forward | backward | forward, probs | backward, probs |")
        print("|---|---|---|---|---|")
        for name in names:
            cells = [
                _cell(CASES[name], args, dtype, has_probs, backward, other)
                for has_probs in (False, True)
                for backward in (False, True)
            ]
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def elements_per_thread(plan) -> int:
    """Output elements one thread computes per trip of a launch ``plan``: the tile (or flat
    block) over the program's threads."""
    tile = plan[0] * (plan[1] if plan[1] is not None else 1)
    return max(1, tile // (32 * plan[2]["num_warps"]))


def _compiled(kernels, v, args, dtype, has_probs: bool, backward: bool, options=None):
    kernel, plan = kernel_and_plan(
        v, args.ffn, args.rows, dtype.itemsize, backward, kernels, options
    )
    # The integers' values at a launch of [rows, F], for Triton's specialisation of them.
    ints = {"rows": args.rows, "F": args.ffn, "n": args.rows * args.ffn}
    if backward and plan[1] is not None:  # the tiled backward kernel
        if hasattr(kernels, "plans"):
            split = kernels.plans.row_split(
                v,
                args.rows,
                args.ffn,
                plan,
                dtype.itemsize,
                options or kernels.plans.DEFAULT_OPTIONS,
            )
            rows_per_program = split[1]
        elif hasattr(kernels, "_row_split"):
            rows_per_program = kernels._row_split(v, args.rows, args.ffn, plan, dtype.itemsize)[1]
        else:  # a revision from before the row split had its own function
            col_blocks = -(-args.ffn // plan[1])
            rows_per_program = kernels._row_programs(v, args.rows, plan[0], col_blocks)[0]
        ints["rows_per_program"] = rows_per_program
    return compile_kernel(kernel, plan, dtype, args.bias, has_probs, ints, args.arch), plan


def _cell(spec, args, dtype, has_probs: bool, backward: bool, other) -> str:
    """One table cell: the report of this tree's kernel, or with ``other`` (a ``triton_kernels``
    module) whether both compile to the same SASS."""
    v = ak.KernelVariant.of(spec, has_bias=args.bias, has_probs=has_probs)
    mine, plan = _compiled(tk, v, args, dtype, has_probs, backward, args.options)
    if other is None:
        r = sass_report(mine)
        n = elements_per_thread(plan)
        per_element = f"{r['instructions'] / n:.1f} ({r['mufu'] / n:.1f})"
        loop = f"{r['loop'] / n:.1f}" if r["loop"] is not None else "-"
        return f"{r['registers']} / {r['local_bytes']} / {r['load_span']} / {per_element} / {loop}"
    theirs, _ = _compiled(other, v, args, dtype, has_probs, backward)
    return "same" if sass_text(mine) == sass_text(theirs) else "differs"


if __name__ == "__main__":
    main()
