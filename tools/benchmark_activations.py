"""Side-by-side benchmark of the fused activation path against TE, torch.compile, eager and the
memory floor.

Usage (GPU)::

    python tools/benchmark_activations.py [--suite headline|sweep|full|memory] [--bias]
        [--json out.json]

For each activation spec, dtype, shape ``T x H`` (input ``[T, 2H]`` for a GLU, ``[T, H]``
otherwise) and weighting (per-row probabilities or none), in one run on one device, it times
forward and forward+backward of:

- ``ours``: this project's ``fused_activation`` (the Triton kernels on CUDA);
- ``ours_inplace``: the same with ``in_place_backward=True`` (the input gradient written over the
  saved input);
- ``te``: the Transformer Engine op the spec lowers to (its ``Scaled*`` form when weighted), when
  TE imports and has one;
- ``compile``: plain ``torch.compile`` of the same float32 math with the scalars in a tensor (the
  reference body, autograd-derived backward; static shapes, compiled per shape);
- ``eager``: ``unfused_activation``, torch ops with autograd (headline suite only);
- ``liger`` / ``liger_inplace``: Liger-Kernel's Megatron SwiGLU (``LigerMegatronSwiGLU``,
  ``in_place`` off / on), for plain SwiGLU without bias or weights, where ``liger_kernel`` imports.

In forward+backward every candidate's input is a fresh intermediate of the graph over the same
memory each call (:class:`Intermediate`), as fc1's output is in a layer: the in-place modes
accept only such an input, and no candidate pays for a copy. The in-place candidates' input then
holds the previous call's gradient; the kernels take the same time whatever the values.
Each candidate's forward+backward peak memory beyond its inputs and output gradient is recorded
too (``*_fwd_bwd_peak_mib``: ``torch.cuda.max_memory_allocated`` over one call, less what was
allocated before it), which is where the in-place modes differ.

With ``--bias`` every row adds a bias of the input's width, whose gradient the backward computes
too: ``ours`` and ``compile`` take it as an input, ``te`` and ``eager`` run on ``x + bias``
(TE fuses a bias into the GEMM before the activation, not into the activation op).

``floor`` is a device-to-device copy of the bytes the activation must move, measured in the same
run: forward reads the input and writes the output; backward reads the input and the output
gradient and writes the input gradient. Each time is the median over repeats of a batch of
back-to-back calls between two CUDA events, divided by the batch size: a call whose host side is
slower than its kernels shows up as host time, as it would in training (an untimed call primes
each batch, so the first timed call's host time is not counted as GPU time; see
``time_interleaved``). The candidates of a row (floor included) take turns within every repeat,
so drift of the card's state during a row is shared by all of them rather than charged to
whichever ran first.

Every candidate's host time per call is measured too (``host_ms``: calls enqueued while the GPU
sleeps, so none waits for its kernels) and stored as ``*_host_ms``; the table marks a time that
is within 10 % of it as paced by the host, where the ratio to the floor says nothing about the
kernels.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_activations.activation_spec import (  # noqa: E402
    ActivationKind,
    ActivationSpec,
    unfused_activation,
)
from mcore_activations.fusions.activation_kernels import (  # noqa: E402
    KernelVariant,
    forward_math,
    params_tensor,
    spec_params,
)
from mcore_activations.fusions.activation_ops import kernel_backend  # noqa: E402
from mcore_activations.fusions.fused_activation import fused_activation  # noqa: E402

SPECS = {
    "SwiGLU": ActivationSpec(ActivationKind.SILU, gated=True),
    "SwiGLU(clamp=7)": ActivationSpec(ActivationKind.SILU, gated=True, clamp_value=7.0),
    "SiTU-GLU(4,25)": ActivationSpec(
        ActivationKind.SILU, gated=True, gate_tanh_scale=4.0, linear_tanh_scale=25.0
    ),
    "SiTU-GLU(4)": ActivationSpec(ActivationKind.SILU, gated=True, gate_tanh_scale=4.0),
    "GEGLU": ActivationSpec(ActivationKind.GELU_TANH, gated=True),
    "ReGLU": ActivationSpec(ActivationKind.RELU, gated=True),
    "quick-GEGLU(gpt-oss)": ActivationSpec(
        ActivationKind.QUICK_GELU, gated=True, clamp_value=7.0, linear_offset=1.0
    ),
    "GELU": ActivationSpec(ActivationKind.GELU_TANH),
    "squared-ReLU": ActivationSpec(ActivationKind.SQUARED_RELU),
    "squared-ReLU(tanh=10)": ActivationSpec(ActivationKind.SQUARED_RELU, gate_tanh_scale=10.0),
}
HEADLINE = "SwiGLU(clamp=7)"
HEADLINE_SHAPES = [(16384, 8192), (4096, 2048), (65536, 1536)]
# The memory suite: the shapes at which the in-place modes are compared ([T, 2H] inputs of
# 8192 x 65536, 16384 x 16384 and 8192 x 8192), for the kinds Liger has and those it has not.
MEMORY_SHAPES = [(8192, 32768), (16384, 8192), (8192, 4096)]
MEMORY_SPECS = ["SwiGLU", "SwiGLU(clamp=7)", "SiTU-GLU(4,25)", "quick-GEGLU(gpt-oss)"]
SWEEP_T = [256, 4096, 65536]
SWEEP_H = [1024, 2880, 8192, 16384]  # 2880 (gpt-oss) is not a multiple of 128


def time_ms(fn, calls=10, repeats=7, warmup=3):
    """Median over ``repeats`` of the mean time of ``calls`` back-to-back ``fn()`` calls."""
    return time_interleaved({"fn": fn}, calls, repeats, warmup)["fn"]


def time_interleaved(fns, calls=10, repeats=7, warmup=3, prime=True):
    """``{label: ms}`` for each of ``fns``, timed in turns: each repeat times every candidate
    once, starting one further along the list each time.

    Timing candidates one after another let the card's state drift between them (clocks,
    temperature, the allocator after the previous candidate): in earlier runs whichever
    candidate came first in a row read a few percent slower than its neighbours. Turns spread
    that drift over all of them, so ratios within a row compare like with like.

    ``prime``: each batch is preceded by one untimed call of the same candidate, queued before
    the start event, so the host enqueues the first timed call while the GPU still runs that
    one, as in a training loop, where the host runs ahead. Unprimed, the first call's host time
    (about 40 us for bare kernels, 200-350 us for a Python autograd forward+backward, this
    project's or TE's) counted as GPU time: 0.05-0.06 of the copy floor for a 10-call batch at
    16384 x 8192 (docs/bench/history.md, runs 24-25). A call whose host side is slower than its
    kernels still measures host time: the priming call covers only the first one.
    """
    labels = list(fns)
    for label in labels:
        for _ in range(warmup):
            fns[label]()
    torch.cuda.synchronize()
    times = {label: [] for label in labels}
    for r in range(repeats):
        for i in range(len(labels)):
            label = labels[(r + i) % len(labels)]
            fn = fns[label]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if prime:
                fn()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[label].append(start.elapsed_time(end) / calls)
    return {label: statistics.median(t) for label, t in times.items()}


@functools.cache
def sleep_cycles(ms: float) -> int:
    """Clock cycles ``torch.cuda._sleep`` spins for about ``ms`` on this card (measured once)."""
    probe = 1_000_000
    torch.cuda._sleep(probe)  # the first call pays for loading the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize()
    return max(1, int(probe * ms / start.elapsed_time(end)))


def host_ms(fn, calls=20, repeats=3, busy_ms=50.0):
    """The host's time per ``fn()`` call, in ms, or None where it cannot be told apart.

    Each repeat queues a GPU sleep of ``busy_ms``, then times ``calls`` back-to-back calls on
    the host's clock: the GPU is still asleep while they are enqueued, so no call can wait for
    its kernels and the wall time is the host's alone. The median over ``repeats`` is returned.
    If the sleep had ended before the last call returned (a call synchronised with the device,
    or the host took longer than the sleep), the time includes GPU time and None is returned.

    A row whose measured time per call is close to this is paced by the host, not the kernels
    (``markdown`` marks it): its ratio to the floor says nothing about the kernels.
    """
    busy = sleep_cycles(busy_ms)
    fn()  # a first call may load libraries or compile, and synchronise while it does
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(busy)
        asleep = torch.cuda.Event()
        asleep.record()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        woke_early = asleep.query()
        torch.cuda.synchronize()
        if woke_early:
            return None
        samples.append(elapsed * 1e3 / calls)
    return statistics.median(samples)


def copy_fn(nbytes):
    """A device copy moving ``nbytes`` bytes in all (half read, half written)."""
    src = torch.empty(max(1, nbytes // 4), dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def copy_ms(nbytes, calls=10):
    """Time of a device copy moving ``nbytes`` bytes in all (half read, half written)."""
    return time_ms(copy_fn(nbytes), calls)


def te_candidate(spec, weighted):
    """The TE op for ``spec`` as ``fn(x, probs)``, or None when TE is absent or has no op."""
    try:
        from mcore_activations.te_lowering import lower_activation_to_te_op

        op = lower_activation_to_te_op(spec, path="benchmark", scaled=weighted)
    except Exception:  # noqa: BLE001 - TE missing or the spec does not lower: no TE column
        return None
    if weighted:
        return lambda x, p: op(x, p.view(-1))
    return lambda x, p: op(x)


def liger_candidates(spec, weighted, bias):
    """Liger's Megatron SwiGLU (``in_place`` off and on) as ``fn(x, probs)``, for plain SwiGLU
    without bias or weights where ``liger_kernel`` imports; else ``{}``."""
    plain_swiglu = spec == SPECS["SwiGLU"]
    if not plain_swiglu or weighted or bias is not None:
        return {}
    try:
        from liger_kernel.megatron import LigerMegatronSwiGLU
    except Exception:  # noqa: BLE001 - not installed: no Liger columns
        return {}
    found = {}
    for label, flag in (("liger", False), ("liger_inplace", True)):
        module = LigerMegatronSwiGLU(in_place=flag)
        found[label] = lambda x, p, module=module: module(x)
    return found


class Intermediate(torch.autograd.Function):
    """``buffer`` as a new intermediate of the graph, without a copy; its gradient stops here.

    The forward returns ``buffer.detach()``: a tensor object of its own over ``buffer``'s
    memory, produced by this node (so not a leaf, as fc1's output is not). ``anchor`` is a
    one-element tensor that requires gradients, so that the output does.
    """

    @staticmethod
    def forward(ctx, anchor, buffer):
        """A fresh tensor over ``buffer``'s memory."""
        return buffer.detach()

    @staticmethod
    def backward(ctx, grad):
        """Nothing flows further: the benchmark times the activation alone."""
        return None, None


def compile_candidate(spec, weighted, bias=None):
    """Plain torch.compile of the reference math, scalars as a tensor, static shapes; with
    ``bias`` (a tensor), the bias is an input of the compiled function too."""
    variant = KernelVariant.of(spec, has_bias=bias is not None, has_probs=weighted)
    params = params_tensor(spec_params(spec), torch.device("cuda"))
    torch._dynamo.reset()  # each shape compiles its own static graphs

    @torch.compile(dynamic=False)
    def math(x, p, b):
        return forward_math(variant, x, b, p, params)

    return lambda x, p: math(x, p, bias)


def candidates(spec, weighted, with_eager, bias=None):
    """``label -> fn(x, probs)`` of a row; ``bias`` (or None) is added by each candidate."""
    found = {"ours": lambda x, p: fused_activation(x, spec, bias=bias, probs=p)}
    found["ours_inplace"] = lambda x, p: fused_activation(
        x, spec, bias=bias, probs=p, in_place_backward=True
    )
    te = te_candidate(spec, weighted)
    if te is not None:
        found["te"] = te if bias is None else (lambda x, p: te(x + bias, p))
    found["compile"] = compile_candidate(spec, weighted, bias)
    if with_eager:

        def eager(x, p):
            out = unfused_activation(x if bias is None else x + bias, spec)
            return out * p.to(out.dtype) if p is not None else out

        found["eager"] = eager
    return found | liger_candidates(spec, weighted, bias)


def batch_calls(T: int, width: int, floor_ms: float = 0.0, min_batch_ms: float = 0.0) -> int:
    """Calls per timed batch for a ``[T, width]`` input.

    20-200 by size (small calls are host-bound and get more). With ``min_batch_ms`` (and the
    row's floor time per call), at least enough calls for a batch at the floor to last that
    long, at most 2000: a short row then spreads the host's jitter, and its slower calls right
    after each batch's synchronisation, over more calls.
    """
    calls = max(20, min(200, int(2e9 // (T * width))))
    if min_batch_ms > 0 and floor_ms > 0:
        calls = max(calls, min(2000, math.ceil(min_batch_ms / floor_ms)))
    return calls


def bench(
    name, spec, T, H, dtype, weighted, with_eager, min_batch_ms=0.0, with_bias=False, repeats=7
):
    """Times every candidate on one configuration; returns a result row (``min_batch_ms``: see
    :func:`batch_calls`; ``with_bias``: a bias of the input's width, with its gradient;
    ``repeats``: the turns of :func:`time_interleaved`; each time is their median)."""
    width = 2 * H if spec.gated else H
    size = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(T, width, device="cuda", dtype=dtype) * 4
    grad = torch.randn(T, H, device="cuda", dtype=dtype)
    probs = torch.rand(T, 1, device="cuda") if weighted else None
    anchor = torch.zeros(1, device="cuda", requires_grad=True)
    pg = probs.clone().requires_grad_() if weighted else None
    bias = torch.randn(width, device="cuda", dtype=dtype).requires_grad_() if with_bias else None
    fwd_bytes = T * (width + H) * size
    bwd_bytes = T * (2 * width + H) * size
    row = {
        "spec": name,
        "dtype": str(dtype).replace("torch.", ""),
        "T": T,
        "H": H,
        "weighted": weighted,
        "bias": with_bias,
        "repeats": repeats,
    }
    found = candidates(spec, weighted, with_eager, bias)

    def reset():
        for leaf in (pg, bias):
            if leaf is not None:
                leaf.grad = None

    def fwd_bwd(fn):
        buffer = x.clone()  # the candidate's own: an in-place candidate overwrites it

        def call():
            reset()
            fn(Intermediate.apply(anchor, buffer), pg).backward(grad)

        return call

    forward = {"floor": copy_fn(fwd_bytes)} | {
        label: (lambda fn=fn: fn(x, probs)) for label, fn in found.items()
    }
    both = {"floor": copy_fn(fwd_bytes + bwd_bytes)} | {
        label: fwd_bwd(fn) for label, fn in found.items()
    }
    for group, suffix in ((forward, "fwd"), (both, "fwd_bwd")):
        floor_ms = time_ms(group["floor"], calls=5, repeats=3) if min_batch_ms else 0.0
        calls = batch_calls(T, width, floor_ms, min_batch_ms)
        row[f"calls_{suffix}"] = calls
        with torch.no_grad() if suffix == "fwd" else torch.enable_grad():
            for label, ms in time_interleaved(group, calls, repeats).items():
                row[f"{label}_{suffix}_ms"] = ms
                if label != "floor":
                    row[f"{label}_{suffix}_host_ms"] = host_ms(group[label])
    for label, call in both.items():
        if label != "floor":
            row[f"{label}_fwd_bwd_peak_mib"] = peak_mib(call, reset)
    return row


def peak_mib(call, reset) -> float:
    """MiB that one ``call()`` allocates at its peak beyond what was allocated before it.

    A first call settles what persists between calls (the weights' gradients, caches); the
    measured one starts from ``reset()`` (those gradients freed), so its own gradients count.
    """
    call()
    reset()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def configurations(suite):
    """``(name, spec, T, H, dtype, weighted, with_eager)`` for each row of ``suite``."""
    bf16 = torch.bfloat16
    if suite in ("headline", "full"):
        for T, H in HEADLINE_SHAPES:
            for name, spec in SPECS.items():
                yield name, spec, T, H, bf16, False, True
            yield HEADLINE, SPECS[HEADLINE], T, H, bf16, True, True
        for dtype in (torch.float16, torch.float32):
            for name in (HEADLINE, "SiTU-GLU(4,25)", "quick-GEGLU(gpt-oss)"):
                yield name, SPECS[name], 16384, 8192, dtype, False, True
    if suite == "memory":
        for T, H in MEMORY_SHAPES:
            for name in MEMORY_SPECS:
                yield name, SPECS[name], T, H, bf16, False, False
            yield HEADLINE, SPECS[HEADLINE], T, H, bf16, True, False
    if suite in ("sweep", "full"):
        for T in SWEEP_T:
            for H in SWEEP_H:
                for weighted in (False, True):
                    yield HEADLINE, SPECS[HEADLINE], T, H, bf16, weighted, False


def environment():
    """Card, driver and library versions of this run."""
    import triton

    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "backend": kernel_backend(torch.device("cuda")),
    }
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        env["driver"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    except OSError:
        env["driver"] = "unknown"
    try:
        import transformer_engine

        env["te"] = transformer_engine.__version__
    except Exception:  # noqa: BLE001
        env["te"] = "absent"
    try:
        from importlib.metadata import version

        env["liger_kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001
        env["liger_kernel"] = "absent"
    return env


# A cell whose host time per call is at least this share of its measured time is paced by the
# host: the GPU idles between calls, so the time is Python's and the driver's, not the kernels'.
HOST_PACED = 0.9
HOST_PACED_MARK = "\u2020"
HOST_PACED_LEGEND = (
    f"{HOST_PACED_MARK}: paced by the host (its time per call, `*_host_ms` in the JSON, is at "
    f"least {HOST_PACED} of the measured time), so the time measures the host, not the kernels."
)


def host_paced(row: dict, label: str, suffix: str) -> bool:
    """Whether ``label``'s ``suffix`` ("fwd" / "fwd_bwd") time in ``row`` is the host's time."""
    host = row.get(f"{label}_{suffix}_host_ms")
    return host is not None and host >= HOST_PACED * row[f"{label}_{suffix}_ms"]


def markdown(rows):
    """The result rows as a markdown table: ms, and x the floor in parentheses, then the
    forward+backward peak where measured; a time paced by the host (:func:`host_paced`) carries
    ``HOST_PACED_MARK``."""
    labels = ["ours", "ours_inplace", "te", "compile", "eager", "liger", "liger_inplace"]
    head = "| spec | dtype | T x H | probs | bias | floor fwd / f+b ms |"
    head += "".join(f" {label} fwd / f+b / peak |" for label in labels)
    lines = [head, "|" + "---|" * (6 + len(labels))]
    for r in rows:
        cells = []
        for label in labels:
            if f"{label}_fwd_ms" not in r:
                cells.append("-")
                continue
            halves = []
            for suffix in ("fwd", "fwd_bwd"):
                ms, floor = r[f"{label}_{suffix}_ms"], r[f"floor_{suffix}_ms"]
                mark = HOST_PACED_MARK if host_paced(r, label, suffix) else ""
                halves.append(f"{ms:.3f}{mark} ({ms / floor:.2f})")
            peak = r.get(f"{label}_fwd_bwd_peak_mib")
            if peak is not None:
                halves.append(f"{peak:.0f} MiB")
            cells.append(" / ".join(halves))
        lines.append(
            f"| {r['spec']} | {r['dtype']} | {r['T']} x {r['H']} | {'yes' if r['weighted'] else ''}"
            f" | {'yes' if r.get('bias') else ''}"
            f" | {r['floor_fwd_ms']:.3f} / {r['floor_fwd_bwd_ms']:.3f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def selected(args, name: str, T: int, H: int, dtype: torch.dtype) -> bool:
    """Whether a row passes the ``--spec``, ``--h``, ``--t`` and ``--dtype`` filters."""
    if args.spec and name not in args.spec:
        return False
    if (args.h and H not in args.h) or (args.t and T not in args.t):
        return False
    return not args.dtype or str(dtype).replace("torch.", "") in args.dtype


def main(argv=None):
    """Runs the benchmark; prints the environment and a markdown table (JSON on request)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="full", choices=["headline", "sweep", "full", "memory"])
    parser.add_argument("--spec", action="append", choices=sorted(SPECS), help="only these")
    parser.add_argument("--h", type=int, action="append", help="only these widths H")
    parser.add_argument("--t", type=int, action="append", help="only these row counts T")
    parser.add_argument(
        "--dtype", action="append", choices=["bfloat16", "float16", "float32"], help="only these"
    )
    parser.add_argument("--no-eager", action="store_true", help="leave out the eager column")
    parser.add_argument(
        "--bias", action="store_true", help="every row with a bias of the input's width"
    )
    parser.add_argument(
        "--min-batch-ms",
        type=float,
        default=0.0,
        help="time at least this many ms of the floor per batch (default: 20-200 calls by size; "
        "the JSON rows record the calls as calls_fwd / calls_fwd_bwd)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=7,
        help="turns per row, each time the median over them (default 7; host-bound rows, "
        "whose host time moves by 10-20 %% between batches, settle with more)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_activations needs a CUDA GPU")
    env = environment()
    print(json.dumps(env), flush=True)
    rows = []
    for name, spec, T, H, dtype, weighted, with_eager in configurations(args.suite):
        if not selected(args, name, T, H, dtype):
            continue
        eager = with_eager and not args.no_eager
        rows.append(
            bench(
                name, spec, T, H, dtype, weighted, eager, args.min_batch_ms, args.bias, args.repeats
            )
        )
        torch.cuda.empty_cache()
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print(markdown(rows))
    print(f"\n{HOST_PACED_LEGEND}")
    if args.json:
        args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
