"""Benchmark the fused activation kernels against the memory-copy ceiling, eager torch and TE.

Usage (GPU): ``python tools/benchmark_activations.py [--rows 16384 --ffn 8192] [--json out.json]``

For each activation it times forward and forward+backward of:
- ``fused``: this project's compiled kernels (``fused_activation``);
- ``eager``: the same math as plain eager torch ops with autograd (``unfused_activation``);
- ``te``: the Transformer Engine op the spec lowers to, when TE is importable and the spec lowers.
and reports each time with the ratio to the device-copy time of the same bytes (a gated forward
reads 2F and writes F elements per row; its backward reads 3F and writes 2F). All timings in one
run, on one device, with ``torch.cuda.Event`` medians.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_activations.activation_spec import (  # noqa: E402
    ActivationKind,
    ActivationSpec,
    unfused_activation,
)
from mcore_activations.fusions.fused_activation import fused_activation  # noqa: E402

SPECS = {
    "SwiGLU": ActivationSpec(ActivationKind.SILU, gated=True),
    "SwiGLU(clamp=7)": ActivationSpec(ActivationKind.SILU, gated=True, clamp_value=7.0),
    "SiTU-GLU(4,25)": ActivationSpec(
        ActivationKind.SILU, gated=True, gate_tanh_scale=4.0, linear_tanh_scale=25.0
    ),
    "quick-GEGLU(gpt-oss)": ActivationSpec(
        ActivationKind.QUICK_GELU, gated=True, clamp_value=7.0, linear_offset=1.0
    ),
    "squared-ReLU(tanh=10)": ActivationSpec(ActivationKind.SQUARED_RELU, gate_tanh_scale=10.0),
}


def time_ms(fn, iters=20, warmup=5):
    """Median milliseconds of ``fn()`` over ``iters`` CUDA-event-timed runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_ms(numel, dtype):
    """Time of a device copy of ``numel`` elements (reads and writes ``numel`` each)."""
    src = torch.empty(numel, dtype=dtype, device="cuda")
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src))


def te_op(spec):
    try:
        from megatron.core.extensions import transformer_engine as te_ext

        if not te_ext.HAVE_TE:
            return None
        return te_ext.lower_activation_to_te_op(spec, path="benchmark", scaled=False)
    except Exception:  # noqa: BLE001 - refused or unavailable: no TE column
        return None


def bench(name, spec, rows, ffn, dtype):
    width = 2 * ffn if spec.gated else ffn
    x = torch.randn(rows, width, device="cuda", dtype=dtype) * 4
    g = torch.randn(rows, ffn, device="cuda", dtype=dtype)
    xg = x.clone().requires_grad_()
    # Bytes moved, in elements: fwd reads width, writes ffn; bwd reads width + ffn, writes width.
    fwd_elems, bwd_elems = rows * (width + ffn), rows * (2 * width + ffn)
    copy_fwd = copy_ms(fwd_elems // 2, dtype)
    copy_fb = copy_ms((fwd_elems + bwd_elems) // 2, dtype)
    candidates = {
        "fused": lambda t: fused_activation(t, spec),
        "eager": lambda t: unfused_activation(t, spec),
    }
    op = te_op(spec)
    if op is not None:
        candidates["te"] = op
    row = {"activation": name, "copy_fwd_ms": copy_fwd, "copy_fwd_bwd_ms": copy_fb}
    for label, fn in candidates.items():
        with torch.no_grad():
            fwd = time_ms(lambda fn=fn: fn(x))

        def fwd_bwd(fn=fn):
            xg.grad = None
            fn(xg).backward(g)

        fb = time_ms(fwd_bwd)
        row[f"{label}_fwd_ms"], row[f"{label}_fwd_bwd_ms"] = fwd, fb
        row[f"{label}_fwd_vs_copy"], row[f"{label}_fwd_bwd_vs_copy"] = fwd / copy_fwd, fb / copy_fb
    return row


def main(argv=None):
    """Runs the benchmark and prints a markdown table (and JSON on request)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_activations needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    rows = [bench(n, s, args.rows, args.ffn, dtype) for n, s in SPECS.items()]
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shape": [args.rows, args.ffn],
        "dtype": args.dtype,
    }
    try:
        from megatron.core.utils import get_te_version

        env["te"] = str(get_te_version())
    except Exception:  # noqa: BLE001
        env["te"] = "absent"
    print(json.dumps(env))
    header = (
        "| activation | copy fwd ms | fused fwd (x copy) | eager fwd (x copy) | te fwd (x copy) "
    )
    header += "| copy f+b ms | fused f+b (x copy) | eager f+b (x copy) | te f+b (x copy) |"
    print(header)
    print("|" + "---|" * 9)
    for r in rows:

        def cell(label, kind, r=r):
            key = f"{label}_{kind}_ms"
            if key not in r:
                return "-"
            return f"{r[key]:.3f} ({r[f'{label}_{kind}_vs_copy']:.2f})"

        print(
            f"| {r['activation']} | {r['copy_fwd_ms']:.3f} | {cell('fused', 'fwd')} | "
            f"{cell('eager', 'fwd')} | {cell('te', 'fwd')} | {r['copy_fwd_bwd_ms']:.3f} | "
            f"{cell('fused', 'fwd_bwd')} | {cell('eager', 'fwd_bwd')} | {cell('te', 'fwd_bwd')} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
