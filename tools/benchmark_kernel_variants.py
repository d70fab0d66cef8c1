"""Benchmark how the activation kernels are compiled, one design choice at a time.

The command line of the experiments in ``tools/kernel_variants/`` (one module per family:
``compile_layout``, ``launch_shapes``, ``path_and_host``). Launch-plan candidates are
``triton_plans.LaunchOptions`` passed to the kernels' entry points, never module globals.

Usage (GPU): ``python tools/benchmark_kernel_variants.py [--rows 16384 --ffn 8192]``

Times the raw kernels (no autograd) on a bf16 ``[rows, 2 * ffn]`` GLU input and reports each
time divided by a device copy of the same bytes, all in one run (docs/bench/history.md):

- ``compile``: the forward and the compiled part of the backward (``backward_terms``) compiled
  with ``dynamic=True``, with static shapes, and with dynamic rows and static widths (what
  ``activation_kernels`` does).
- ``layout``: the GLU backward with ``[dgate | dlinear]`` assembled inside the compiled graph,
  with two slice assignments inside the graph, with the halves returned and laid out outside
  (what ``activation_kernels`` does), and the halves alone (a lower bound: no layout at all).

Every layout formulation is checked against ``backward_math`` (to bf16 rounding: compiled code
may contract multiply-adds differently from eager) before it is timed.

- ``tiles``: the Triton kernels' launch shape (tile elements, warps, widest column block) for
  forward and backward, unweighted and weighted, gated and not: the sweep behind those fields of
  ``triton_plans.LaunchOptions``.
- ``path``: where the time of a whole forward+backward through ``fused_activation`` goes: the
  raw kernels next to the full autograd path, and a profiler table of every CUDA kernel the
  path launches (finds work around the kernels, e.g. copies or reductions); ``--bias`` gives
  every call a bias.
- ``flat``: the non-gated kernels as one flat stream of elements per program
  (``_unary_fwd_flat_kernel``, and ``_unary_bwd_flat_kernel`` where no reduction is needed)
  against the 2-D tile kernels GLUs use, for several flat block sizes, with and without bias and
  probabilities, next to plain ``torch.compile`` of the same forward math: the measurement
  behind ``LaunchOptions.flat_unary``.
- ``glu``: every GLU kind's raw forward and backward at the current launch shape and at the
  widest column block of 2048, next to plain ``torch.compile`` and TE's forward, all timed in
  turns within one repeat (``time_interleaved``), so the kinds and the columns compare like with
  like, and the division each runs (the hardware reciprocal or div.full; the measurement behind
  ``LaunchOptions.fwd_max_block_n`` and ``LaunchOptions.fast_div``).
- ``reduce``: the GLU backward's plans with and without probabilities (tile and warps; rows per
  program, widest column block, columns per warp, register cap), all in the same turns, and the
  forward with and without: the probability gradient is a per-row sum, with a barrier wherever
  a row spans several warps, so its best shape can differ from the unweighted one.
- ``launch``: GLU forward and backward launch shapes (bf16 kinds and float32) next to
  torch.compile and TE, in turns.
- ``turns``: the raw forward and backward against the path's forward and forward+backward,
  torch.compile and TE, and two copies (the floor of two kernels), with more repeats.
- ``host-at-shape``: the host time of one forward+backward at the given shape, with the GPU
  idle and busy (does a call wait for the GPU?), next to its GPU time, and a cProfile.
- ``weighted``: forward+backward through ``fused_activation`` with and without probabilities,
  in turns and alone (the weighted-within-5 % target), with the host time per call.
- ``host``: per-call host cost of each layer on a tiny input (the kernel launch, the op, the
  functional API, with and without autograd) and a cProfile of the functional API.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.kernel_variants.common import SPECS  # noqa: E402
from tools.kernel_variants.compile_layout import (  # noqa: E402
    COMPILE_SPECS,
    bench_compile,
    bench_layout,
)
from tools.kernel_variants.launch_shapes import (  # noqa: E402
    FLAT_CASES,
    GLU_CASES,
    REDUCE_SPECS,
    SAMPLE_GLU_CASES,
    TILE_CASES,
    bench_flat,
    bench_glu,
    bench_launch,
    bench_reduce,
    bench_tiles,
)
from tools.kernel_variants.path_and_host import (  # noqa: E402
    PATH_CASES,
    bench_host,
    bench_host_at_shape,
    bench_path,
    bench_turns,
    bench_weighted,
)


def _print_table(title, rows, unit="time / copy of the same bytes", digits=2):
    print(f"\n{title} ({unit})")
    columns = list(dict.fromkeys(c for row in rows.values() for c in row))  # a row may lack some
    print("| activation | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in rows.items():
        cells = (f"{row[c]:.{digits}f}" if c in row else "-" for c in columns)
        print(f"| {name} | " + " | ".join(cells) + " |")


def _experiments(rows: int, ffn: int, bias: bool = False) -> dict:
    """``name -> (title, run, table options)``; ``run()`` returns ``{case: result row}``
    (``bias``: the ``path`` experiment's calls take a bias)."""
    bf16 = torch.bfloat16
    weighted_unit = {"unit": "ms, host us per call, ratio", "digits": 3}
    return {
        "compile": (
            "compile modes",
            lambda: {n: bench_compile(s, rows, ffn, bf16) for n, s in COMPILE_SPECS.items()},
            {},
        ),
        "layout": (
            "GLU backward layout",
            lambda: {n: bench_layout(s, rows, ffn, bf16) for n, s in SPECS.items()},
            {},
        ),
        "tiles": (
            "Triton launch shapes: tile/warps/max column block",
            lambda: {n: bench_tiles(s, w, rows, ffn, bf16) for n, (s, w) in TILE_CASES.items()},
            {},
        ),
        "flat": (
            "non-gated forward: 2-D tiles vs flat blocks",
            lambda: {
                n: bench_flat(s, b, w, rows, ffn, bf16) for n, (s, b, w) in FLAT_CASES.items()
            },
            {},
        ),
        "glu": (
            "GLU kinds: widest column block, compile and TE, in turns",
            lambda: {n: bench_glu(s, rows, ffn, d) for n, (s, d) in GLU_CASES.items()},
            {},
        ),
        "reduce": (
            "GLU backward row plans, with and without probs, in turns",
            lambda: {n: bench_reduce(SPECS[n], rows, ffn, bf16) for n in REDUCE_SPECS},
            {},
        ),
        "launch": (
            "GLU launch shapes, compile and TE, in turns",
            lambda: {n: bench_launch(s, rows, ffn, d) for n, (s, d) in SAMPLE_GLU_CASES.items()},
            {},
        ),
        "weighted": (
            "forward+backward with and without probs, in turns",
            lambda: {n: bench_weighted(SPECS[n], rows, ffn, bf16) for n in REDUCE_SPECS},
            weighted_unit,
        ),
        "turns": (
            "raw kernels against the path, in turns",
            lambda: {n: bench_turns(s, rows, ffn, d) for n, (s, d) in SAMPLE_GLU_CASES.items()},
            {},
        ),
        "host-at-shape": (
            "forward+backward at this shape: GPU time and host time per call",
            lambda: {n: bench_host_at_shape(SPECS[n], rows, ffn, bf16) for n in REDUCE_SPECS},
            {"unit": "ratio, us"},
        ),
        "path": (
            "raw kernels vs the autograd path",
            lambda: {
                n: bench_path(s, w, rows, ffn, bf16, bias) for n, (s, w) in PATH_CASES.items()
            },
            {},
        ),
    }


def main(argv=None):
    """Runs the selected experiments and prints markdown tables (and JSON on request)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--ffn", type=int, default=8192)
    names = [*_experiments(1, 1), "host", "all"]
    parser.add_argument("--experiment", choices=names, default="all")
    parser.add_argument(
        "--bias", action="store_true", help="path: every call with a bias of the input's width"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_kernel_variants needs a CUDA GPU")
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(json.dumps(env))
    results = {"env": env}
    for name, (title, run, table) in _experiments(args.rows, args.ffn, args.bias).items():
        if args.experiment in (name, "all"):
            results[name] = run()
            _print_table(title, results[name], **table)
    if args.experiment in ("host", "all"):
        results["host"] = bench_host()  # prints its own lines and a cProfile
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
