"""Experiments on the whole path and the host: ``turns``, ``host-at-shape``, ``weighted``,
``path`` and ``host``."""

from __future__ import annotations

import torch

from mcore_activations.activation_spec import ActivationKind, ActivationSpec
from mcore_activations.fusions import activation_kernels as ak
from tools.benchmark_activations import (
    copy_fn,
    sleep_cycles,
    te_candidate,
    time_interleaved,
    time_ms,
)
from tools.kernel_variants.common import SPECS, _add_compile_and_te, _glu_inputs, _raw_inputs
from tools.kernel_variants.launch_shapes import TILE_CASES


def bench_turns(spec, rows, ffn, dtype, repeats=15):
    """The raw kernels against the whole path, in turns, with more repeats than elsewhere.

    Three groups, each timed in turns with its own copy floor: the raw forward next to the
    path's forward (``fused_activation`` without gradients), torch.compile and TE; the raw
    backward; forward+backward through ``fused_activation`` next to TE's and to two copies (a
    forward- and a backward-sized one: the floor of two kernels). Where the path reads slower
    than its raw kernels, the difference is in the path or in how it is timed, not in the kernels.
    Every group is timed twice: primed, as ``time_interleaved`` does by default, and unprimed.
    """
    from mcore_activations.fusions import triton_kernels as tk
    from mcore_activations.fusions.fused_activation import fused_activation

    variant, x, grad, params, fwd_bwd = _glu_inputs(spec, rows, ffn, dtype)

    size = dtype.itemsize
    copy_fwd, copy_bwd = copy_fn(rows * 3 * ffn * size), copy_fn(rows * 5 * ffn * size)
    fwd = {
        "floor": copy_fwd,
        "raw fwd": lambda: tk.triton_forward(variant, x, None, None, params),
        "path fwd": lambda: fused_activation(x, spec),
    }
    _add_compile_and_te(fwd, spec, x)
    bwd = {
        "floor": copy_bwd,
        "raw bwd": lambda: tk.triton_backward(variant, grad, x, None, None, params),
    }
    both = {
        "floor": copy_fn(rows * 8 * ffn * size),
        "two copies": lambda: (copy_fwd(), copy_bwd()),
        "path f+b": fwd_bwd(lambda t: fused_activation(t, spec)),
    }
    te = te_candidate(spec, False)
    if te is not None:
        both["TE f+b"] = fwd_bwd(lambda t: te(t, None))
    row = {}
    groups = ((fwd, torch.no_grad), (bwd, torch.no_grad), (both, torch.enable_grad))
    for prime, suffix in ((True, ""), (False, ", unprimed")):
        for group, grad_mode in groups:
            with grad_mode():
                times = time_interleaved(group, repeats=repeats, prime=prime)
            floor = times.pop("floor")
            row |= {f"{label}{suffix}": t / floor for label, t in times.items()}
    return row


def bench_host_at_shape(spec, rows, ffn, dtype):
    """Host time of one forward+backward at a large shape, and whether the host waits for the GPU.

    For the path (``fused_activation``), the raw kernels and TE's op: the GPU time per call in
    turns, primed and unprimed (``time_interleaved``); the host's wall time per call over 50 calls
    without synchronising, once right after a synchronisation (``host us``) and once behind 200
    ms of queued GPU sleep (``host us, GPU busy``). If the second is much larger than the first,
    a call waits for the GPU somewhere (a hidden synchronisation); if both exceed the GPU time,
    the path is host-bound at this shape. Prints a cProfile of the path's calls behind the sleep.
    """
    import cProfile
    import pstats
    import time

    from mcore_activations.fusions import triton_kernels as tk
    from mcore_activations.fusions.fused_activation import fused_activation

    variant, x, grad, params, fwd_bwd = _glu_inputs(spec, rows, ffn, dtype)

    def raw():
        tk.triton_forward(variant, x, None, None, params)
        tk.triton_backward(variant, grad, x, None, None, params)

    group = {
        "floor": copy_fn(rows * 8 * ffn * dtype.itemsize),
        "path": fwd_bwd(lambda t: fused_activation(t, spec)),
        "raw": raw,
    }
    te = te_candidate(spec, False)
    if te is not None:
        group["TE"] = fwd_bwd(lambda t: te(t, None))
    row = {}
    for prime, suffix in ((True, ", primed"), (False, ", unprimed")):
        times = time_interleaved(group, repeats=11, prime=prime)
        floor = times.pop("floor")
        row |= {f"{label} / floor{suffix}": t / floor for label, t in times.items()}
    busy = sleep_cycles(200.0)
    for label, fn in group.items():
        if label == "floor":
            continue
        for ahead, suffix in ((False, ""), (True, ", GPU busy")):
            torch.cuda.synchronize()
            if ahead:
                torch.cuda._sleep(busy)
            start = time.perf_counter()
            for _ in range(50):
                fn()
            row[f"{label} host us{suffix}"] = (time.perf_counter() - start) / 50 * 1e6
            torch.cuda.synchronize()
    torch.cuda._sleep(busy)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(50):
        group["path"]()
    profile.disable()
    torch.cuda.synchronize()
    print(f"\n50 forward+backward calls of {spec.name}, {rows} x {ffn}, GPU busy")
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)
    return row


def bench_weighted(spec, rows, ffn, dtype):
    """Forward+backward through ``fused_activation`` with and without probabilities, in turns.

    Only this project's path, so the weighted and unweighted calls share the card and the
    allocator with nothing else in between (the side-by-side benchmark interleaves TE and
    torch.compile too). Also the host time per call, measured without synchronising: below the
    device time the path is bound by the GPU.
    """
    import time

    from mcore_activations.fusions.fused_activation import fused_activation

    x = torch.randn(rows, 2 * ffn, device="cuda", dtype=dtype) * 4
    grad = torch.randn(rows, ffn, device="cuda", dtype=dtype)
    probs = torch.rand(rows, 1, device="cuda")
    xg, pg = x.clone().requires_grad_(), probs.clone().requires_grad_()

    def call(p):
        def run():
            xg.grad = pg.grad = None
            fused_activation(xg, spec, probs=p).backward(grad)

        return run

    cases = {"unweighted": call(None), "probs": call(pg), "probs without grad": call(probs)}
    row = {f"{label} ms": ms for label, ms in time_interleaved(cases).items()}
    row["probs / unweighted"] = row["probs ms"] / row["unweighted ms"]
    for label, run in cases.items():
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            run()
        row[f"{label} host us"] = (time.perf_counter() - start) / 50 * 1e6
        torch.cuda.synchronize()
    return row


PATH_CASES = TILE_CASES | {
    "GELU": (ActivationSpec(ActivationKind.GELU_TANH), False),
    "squared-ReLU, probs": (ActivationSpec(ActivationKind.SQUARED_RELU), True),
}


def bench_path(spec, weighted, rows, ffn, dtype, has_bias=False):
    """Raw kernels against the whole autograd path: GPU time, host time, allocations, kernels.

    ``host us`` is the wall time per call of 50 calls with one synchronisation at the end: when
    it exceeds the GPU time, the path is bound by its host side at this shape (when the GPU is
    the bound, the launch queue fills and the host waits, so host time reads as GPU time).
    ``device allocs`` counts the caching allocator's cudaMalloc calls during those calls (each
    one can synchronise the device). ``has_bias``: a bias of the input's width, with its
    gradient. The profiler table lists every kernel the path launches, by GPU time.
    """
    import time

    from mcore_activations.fusions import triton_kernels as tk
    from mcore_activations.fusions.fused_activation import fused_activation

    variant = ak.KernelVariant.of(spec, has_bias=has_bias, has_probs=weighted)
    x, grad, probs, params, copy_fwd, copy_bwd = _raw_inputs(spec, weighted, rows, ffn, dtype)
    xg = x.clone().requires_grad_()
    pg = probs.clone().requires_grad_() if weighted else None
    bias = None
    if has_bias:
        bias = torch.randn(x.shape[1], device="cuda", dtype=dtype).requires_grad_()

    def fwd_bwd():
        for leaf in (xg, pg, bias):
            if leaf is not None:
                leaf.grad = None
        fused_activation(xg, spec, bias=bias, probs=pg).backward(grad)

    def raw():
        tk.triton_forward(variant, x, bias, probs, params)
        tk.triton_backward(variant, grad, x, bias, probs, params)

    row = {}
    for label, fn in (("raw", raw), ("path", fwd_bwd)):
        row[f"{label} f+b / floor"] = time_ms(fn) / (copy_fwd + copy_bwd)
        torch.cuda.synchronize()
        allocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
        start = time.perf_counter()
        for _ in range(50):
            fn()
        host = (time.perf_counter() - start) / 50
        torch.cuda.synchronize()
        row[f"{label} host us"] = host * 1e6
        allocs = torch.cuda.memory_stats().get("num_device_alloc", 0) - allocs
        row[f"{label} device allocs"] = allocs
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            fwd_bwd()
        torch.cuda.synchronize()
    print(
        f"\n10 forward+backward calls of {spec.name}, {rows} x {ffn}, weighted={weighted}, "
        f"bias={has_bias}"
    )
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    return row


def bench_host(rounds: int = 5, calls: int = 1000):
    """Microseconds per call of each layer on a tiny input; prints a cProfile of the top.

    Every layer is timed once per round, the rounds one after another, and the least of the
    rounds is kept: host noise only adds time, and interleaving spreads a slow spell of the
    host over all layers instead of one. The bias rows time the backward with a bias and, apart,
    the three torch calls around its kernel (the partial-sum buffer, its sum over programs, the
    cast to the bias's dtype)."""
    import cProfile
    import pstats
    import time

    from mcore_activations.fusions import activation_ops, triton_jit, triton_plans
    from mcore_activations.fusions import triton_kernels as tk
    from mcore_activations.fusions.fused_activation import fused_activation

    spec = SPECS["SwiGLU(clamp=7)"]
    variant = ak.KernelVariant.of(spec, has_bias=False, has_probs=False)
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    grad = torch.randn(8, 32, device="cuda", dtype=torch.bfloat16)
    params = ak.params_tensor(ak.spec_params(spec), x.device)
    out = torch.empty(8, 32, device="cuda", dtype=torch.bfloat16)
    biased = ak.KernelVariant.of(spec, has_bias=True, has_probs=False)
    bias = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    biasg = bias.clone().requires_grad_()
    partials = torch.randn(8, 64, device="cuda")
    summed = partials.sum(dim=0)

    def launch():
        kwargs = triton_plans.forward_plan(variant, 32, x.element_size())[2]
        triton_jit._activation_fwd_kernel[(2, 1)](x, None, None, params, out, 8, 32, **kwargs)

    def fwd_bwd():
        xg.grad = None
        fused_activation(xg, spec).backward(grad)

    def fwd_bwd_bias():
        xg.grad = biasg.grad = None
        fused_activation(xg, spec, bias=biasg).backward(grad)

    class _PassThrough(torch.autograd.Function):
        # The least a Python autograd.Function costs: one output allocation each way, no kernel.
        @staticmethod
        def forward(ctx, x):
            return torch.empty(8, 32, device=x.device, dtype=x.dtype)

        @staticmethod
        def backward(ctx, grad):
            return torch.empty(8, 64, device=grad.device, dtype=grad.dtype)

    def autograd_floor():
        xg.grad = None
        _PassThrough.apply(xg).backward(grad)

    class _Bare(torch.autograd.Function):
        # The same two Triton calls behind a minimal autograd.Function: what this project's
        # layers add to a forward+backward is "fused_activation fwd+bwd" less this.
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return tk.triton_forward(variant, x, None, None, params)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return tk.triton_backward(variant, grad, x, None, None, params)[0]

    def bare_fwd_bwd():
        xg.grad = None
        _Bare.apply(xg).backward(grad)

    def native_fwd_bwd():
        # One native op each way (silu on the first half), no Python autograd.Function.
        xg.grad = None
        torch.nn.functional.silu(xg[:, :32]).backward(grad)

    layers = {
        "torch.empty": lambda: torch.empty(8, 32, device="cuda", dtype=torch.bfloat16),
        "triton launch": launch,
        "triton_forward": lambda: tk.triton_forward(variant, x, None, None, params),
        "forward op": lambda: activation_ops.run_forward(variant, x, None, None, params),
        "fused_activation (no grad)": lambda: fused_activation(x, spec),
        "triton_backward": lambda: tk.triton_backward(variant, grad, x, None, None, params),
        "fused_activation fwd+bwd": fwd_bwd,
        "triton_backward, bias": lambda: tk.triton_backward(biased, grad, x, bias, None, params),
        "bias partials: torch.empty": lambda: torch.empty((8, 64), device="cuda"),
        "bias partials: sum(dim=0)": lambda: partials.sum(dim=0),
        "bias partials: sum cast to bf16": lambda: summed.to(torch.bfloat16),
        "fused_activation fwd+bwd, bias": fwd_bwd_bias,
        "autograd floor: Python Function, no kernels, fwd+bwd": autograd_floor,
        "bare Function around the two Triton calls, fwd+bwd": bare_fwd_bwd,
        "autograd floor: one native op, fwd+bwd": native_fwd_bwd,
    }
    te = te_candidate(spec, False)
    if te is not None:

        def te_fwd_bwd():
            xg.grad = None
            te(xg, None).backward(grad)

        layers["TE op (no grad)"] = lambda: te(x, None)
        layers["TE op fwd+bwd"] = te_fwd_bwd
    times = {label: [] for label in layers}
    for _ in range(rounds):
        for label, fn in layers.items():
            with torch.no_grad() if "bwd" not in label else torch.enable_grad():
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            times[label].append((time.perf_counter() - start) / calls * 1e6)
    row = {}
    for label, spread in times.items():
        row[label] = min(spread)
        print(f"{label}: {row[label]:.1f} us/call (rounds: {max(spread):.1f} at most)", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(500):
        fwd_bwd()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    pstats.Stats(profile).sort_stats("cumulative").print_stats("mcore_activations", 25)
    return row
