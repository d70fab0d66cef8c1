"""Where a forward+backward step of the fused path spends its GPU time, kernel by kernel.

Usage (GPU)::

    python tools/profile_activation_step.py [--spec "SwiGLU(clamp=7)"] [--t 65536] [--h 1536]
        [--dtype bfloat16] [--probs] [--bias] [--steps 20] [--json out.json]

Runs ``--steps`` steps of ``fused_activation(x, spec, ...).backward(grad)`` (as
``benchmark_activations`` times them: the leaf gradients reset, the host free to run ahead)
under ``torch.profiler`` with CUDA activity, after a warm-up, and prints per step position: each
GPU kernel's median duration, the median idle time of the GPU before it (time since the previous
kernel of the step, or of the previous step, ended), and the median period of a step (one
forward kernel's start to the next). ``benchmark_activations`` says how long a step takes; this
says whether that is the kernels (and which), or the GPU waiting between them (host time,
allocations, synchronisation). Compare the kernels' durations with ``benchmark_kernel_ab``'s
raw times of the same shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_activations.fusions.activation_ops import use_kernel_backend  # noqa: E402
from mcore_activations.fusions.fused_activation import fused_activation  # noqa: E402
from tools.benchmark_activations import SPECS  # noqa: E402

# The forward kernels of the fused path; each step starts with one of them.
FORWARD_KERNELS = ("_activation_fwd_kernel", "_unary_fwd_flat_kernel")


class Kernel(NamedTuple):
    """One GPU kernel of the profile: its name and device times in microseconds."""

    name: str
    start_us: float
    end_us: float


def split_steps(kernels: list[Kernel], step_start=FORWARD_KERNELS) -> list[list[Kernel]]:
    """The kernels in start order, cut into steps at each kernel whose name contains one of
    ``step_start``; kernels before the first such kernel are dropped (the profile's start cuts
    into a step)."""
    steps: list[list[Kernel]] = []
    for kernel in sorted(kernels, key=lambda k: k.start_us):
        if any(marker in kernel.name for marker in step_start):
            steps.append([])
        if steps:
            steps[-1].append(kernel)
    return steps


def summarize(steps: list[list[Kernel]]) -> dict:
    """Medians over the steps: the period (one step's first kernel start to the next step's: n - 1
    periods of n steps) and, per position in the step, the kernel's name, its duration and the
    GPU's idle time before it (since the previous kernel ended; none for the very first).

    Raises:
        ValueError: fewer than two steps, or steps whose kernels differ (names or count), which
            a profile of one configuration should never show.
    """
    if len(steps) < 2:
        raise ValueError(
            f"need at least two steps to time a period, got {len(steps)}: the profile has "
            f"{'no' if not steps else 'one'} forward kernel of the fused path (names containing "
            f"{' or '.join(FORWARD_KERNELS)}); is the Triton backend running?"
        )
    names = [[k.name for k in step] for step in steps]
    if any(n != names[0] for n in names):
        distinct = sorted({tuple(n) for n in names})
        raise ValueError(f"the steps launch different kernels: {distinct}")
    periods = [b[0].start_us - a[0].start_us for a, b in zip(steps, steps[1:])]
    rows = []
    for i, name in enumerate(names[0]):
        durations, idles = [], []
        for s, step in enumerate(steps):
            kernel = step[i]
            durations.append(kernel.end_us - kernel.start_us)
            before = step[i - 1].end_us if i else (steps[s - 1][-1].end_us if s else None)
            if before is not None:
                idles.append(max(0.0, kernel.start_us - before))
        rows.append(
            {
                "kernel": name,
                "duration_us": statistics.median(durations),
                "idle_before_us": statistics.median(idles) if idles else None,
            }
        )
    busy = sum(row["duration_us"] for row in rows)
    return {
        "steps": len(steps),
        "period_us": statistics.median(periods),
        "busy_us": busy,
        "kernels": rows,
    }


def markdown(summary: dict) -> str:
    """The summary as a markdown table, with the period and the kernels' share of it."""
    lines = ["| kernel | duration us | GPU idle before it, us |", "|---|---|---|"]
    for row in summary["kernels"]:
        idle = "-" if row["idle_before_us"] is None else f"{row['idle_before_us']:.1f}"
        lines.append(f"| {row['kernel'][:80]} | {row['duration_us']:.1f} | {idle} |")
    period, busy = summary["period_us"], summary["busy_us"]
    lines.append(
        f"\nstep period {period:.1f} us (median of {summary['steps'] - 1}), kernels {busy:.1f} us "
        f"({busy / period:.0%} of it)"
    )
    return "\n".join(lines)


def profile(spec, T: int, H: int, dtype, with_probs: bool, with_bias: bool, steps: int):
    """The GPU kernels of ``steps`` forward+backward steps, as :class:`Kernel` tuples."""
    width = 2 * H if spec.gated else H
    x = (torch.randn(T, width, device="cuda", dtype=dtype) * 4).requires_grad_()
    grad = torch.randn(T, H, device="cuda", dtype=dtype)
    probs = torch.rand(T, 1, device="cuda").requires_grad_() if with_probs else None
    bias = torch.randn(width, device="cuda", dtype=dtype).requires_grad_() if with_bias else None

    def step():
        for leaf in (x, probs, bias):
            if leaf is not None:
                leaf.grad = None
        fused_activation(x, spec, bias=bias, probs=probs).backward(grad)

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    # The Triton kernels whatever MCORE_ACTIVATIONS_BACKEND says: they are what is profiled.
    with use_kernel_backend("triton"):
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    return [
        Kernel(e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="SwiGLU(clamp=7)", choices=sorted(SPECS))
    parser.add_argument("--t", type=int, default=65536, help="rows T")
    parser.add_argument("--h", type=int, default=1536, help="output width H")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--probs", action="store_true", help="per-row probabilities")
    parser.add_argument("--bias", action="store_true", help="a bias of the input's width")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (a period needs two steps), got {args.steps}")
    if not torch.cuda.is_available():
        raise SystemExit("profile_activation_step needs a CUDA GPU")
    kernels = profile(
        SPECS[args.spec],
        args.t,
        args.h,
        getattr(torch, args.dtype),
        args.probs,
        args.bias,
        args.steps,
    )
    summary = summarize(split_steps(kernels))
    summary |= {"spec": args.spec, "T": args.t, "H": args.h, "dtype": args.dtype}
    summary |= {"probs": args.probs, "bias": args.bias, "gpu": torch.cuda.get_device_name()}
    print(f"{args.spec} {args.dtype} {args.t} x {args.h} probs={args.probs} bias={args.bias}")
    print(markdown(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
