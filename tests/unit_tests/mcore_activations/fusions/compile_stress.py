"""Stress every compiled entry point that takes a runtime scalar, in one fresh process.

Usage: ``python -m tests.unit_tests.mcore_activations.fusions.compile_stress [--device D]
[--calls N]``; prints a JSON summary on the last line. Run by test_compile_safety.py with a fresh
Inductor cache.

Phases (the order matters, see shared research notes: no-grad calls early can hide the bug):
1. training calls (grad on) on one shape, the scalar values changing every call;
2. mixed calls: shapes, float32/bfloat16, grad on/off, all values;
3. replay of phase-2 call structures with values never seen before: must compile nothing new.

Each call compares the compiled result with the same call under
``torch.compiler.set_stance("force_eager")`` (forward, autograd gradients of every input, and the
explicit backward function where the API has one).
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from megatron.core import activations as act
from megatron.core.fusions import fused_bias_geglu as gg
from megatron.core.fusions import fused_bias_swiglu as sw
from megatron.core.fusions import fused_weighted_squared_relu as sq

POSITIVE = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)
OFFSETS = (-1.0, -0.5, 0.0, 0.5, 1.0, 2.0)
UNSEEN_POSITIVE = (0.3, 0.6, 1.25, 2.5, 4.0, 7.0)
UNSEEN_OFFSETS = (-0.75, 0.25, 1.5)


def _w(x):
    return torch.rand(x.reshape(-1, x.shape[-1]).shape[0], 1, device=x.device).to(x.dtype)


# name -> (gated, needs_bias, forward(x, b, w, v), explicit backward(g, x, b, w, v) or None,
#          value names). v is a dict of scalars.
ENTRIES = {
    "clamped_swiglu": (
        True,
        False,
        lambda x, b, w, v: sw.clamped_swiglu(x, v["c"]),
        lambda g, x, b, w, v: sw.clamped_swiglu_back(g, x, v["c"]),
        ("c",),
    ),
    "bias_clamped_swiglu": (
        True,
        True,
        lambda x, b, w, v: sw.bias_clamped_swiglu(x, b, v["c"]),
        lambda g, x, b, w, v: sw.bias_clamped_swiglu_back(g, x, b, v["c"]),
        ("c",),
    ),
    "clamped_weighted_swiglu": (
        True,
        False,
        lambda x, b, w, v: sw.clamped_weighted_swiglu(x, w, v["c"]),
        lambda g, x, b, w, v: sw.clamped_weighted_swiglu_back(g, x, w, v["c"])[0],
        ("c",),
    ),
    "bias_swiglu_impl_clamp": (
        True,
        True,
        lambda x, b, w, v: sw.bias_swiglu_impl(x, b, clamp_value=v["c"]),
        None,
        ("c",),
    ),
    "bias_swiglu_impl_situ": (
        True,
        True,
        lambda x, b, w, v: sw.bias_swiglu_impl(
            x, b, gate_clamp_scale=v["sg"], linear_clamp_scale=v["sl"]
        ),
        None,
        ("sg", "sl"),
    ),
    "weighted_bias_swiglu_impl_clamp": (
        True,
        False,
        lambda x, b, w, v: sw.weighted_bias_swiglu_impl(x, None, w, clamp_value=v["c"]),
        None,
        ("c",),
    ),
    "weighted_bias_swiglu_impl_situ": (
        True,
        False,
        lambda x, b, w, v: sw.weighted_bias_swiglu_impl(x, None, w, gate_clamp_scale=v["sg"]),
        None,
        ("sg",),
    ),
    "quick_geglu": (
        True,
        False,
        lambda x, b, w, v: gg.quick_geglu(x, v["off"]),
        lambda g, x, b, w, v: gg.quick_geglu_back(g, x, v["off"]),
        ("off",),
    ),
    "weighted_quick_geglu": (
        True,
        False,
        lambda x, b, w, v: gg.weighted_quick_geglu(x, w, v["off"]),
        lambda g, x, b, w, v: gg.weighted_quick_geglu_back(g, x, w, v["off"])[0],
        ("off",),
    ),
    "weighted_bias_quick_geglu_impl": (
        True,
        True,
        lambda x, b, w, v: gg.weighted_bias_quick_geglu_impl(
            x, b, w, linear_offset=v["off"], clamp_value=v["c"]
        ),
        None,
        ("off", "c"),
    ),
    "weighted_squared_relu_impl": (
        False,
        False,
        lambda x, b, w, v: sq.weighted_squared_relu_impl(x, w, clamp_scale=v["sg"]),
        None,
        ("sg",),
    ),
    "tanh_soft_clamp": (
        False,
        False,
        lambda x, b, w, v: act.tanh_soft_clamp(x, v["sg"]),
        None,
        ("sg",),
    ),
    "situ": (False, False, lambda x, b, w, v: act.situ(x, v["sg"]), None, ("sg",)),
    "situ_glu": (
        True,
        False,
        lambda x, b, w, v: act.situ_glu(x, v["sg"], v["sl"], v["off"]),
        None,
        ("sg", "sl", "off"),
    ),
}


def _values(names, rng, unseen):
    pos, off = (UNSEEN_POSITIVE, UNSEEN_OFFSETS) if unseen else (POSITIVE, OFFSETS)
    return {n: rng.choice(off if n == "off" else pos) for n in names}


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def one_call(name, shape, dtype, grad_on, values, device, seed):
    """Compiled vs force-eager for one call; returns the worst relative difference."""
    gated, needs_bias, fwd, bwd, _ = ENTRIES[name]
    gen = torch.Generator().manual_seed(seed)
    width = shape[-1] * (2 if gated else 1)
    x0 = (torch.randn(*shape[:-1], width, generator=gen) * 2.5).to(device=device, dtype=dtype)
    b0 = (torch.randn(width, generator=gen) * 0.5).to(device=device, dtype=dtype)
    w0 = _w(x0)
    g0 = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def run(stance):
        x = x0.clone().requires_grad_(grad_on)
        b = b0.clone().requires_grad_(grad_on) if needs_bias else None
        w = w0.clone().requires_grad_(grad_on)
        with torch.compiler.set_stance(stance):
            out = fwd(x, b, w, values)
            results = [out]
            if grad_on:
                inputs = [t for t in (x, b, w) if t is not None and t.requires_grad]
                grads = torch.autograd.grad(out, inputs, g0, allow_unused=True)
                results += [gr for gr in grads if gr is not None]
            if bwd is not None:
                results.append(bwd(g0, x0, b0 if needs_bias else None, w0, values))
        return results

    compiled, eager = run("default"), run("force_eager")
    return max(_rel(c, e) for c, e in zip(compiled, eager))


def unique_graphs() -> int:
    """Dynamo graphs compiled so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def main(argv=None):
    """Runs the three phases and prints a JSON summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=100, help="calls in phases 1 and 2 each")
    args = parser.parse_args(argv)
    # Test-only: a high limit so an eager fallback cannot hide a stale result.
    torch._dynamo.config.recompile_limit = 64
    rng = random.Random(0)
    names = sorted(ENTRIES)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
    shapes = [(2, 8), (4, 16), (16, 40), (3, 8, 32)]
    records, structures = [], []

    def record(phase, name, shape, dtype, grad_on, values, seed):
        err = one_call(name, shape, dtype, grad_on, values, args.device, seed)
        bad = not err <= tol[dtype]
        records.append(
            dict(
                phase=phase,
                name=name,
                shape=list(shape),
                dtype=str(dtype),
                grad=grad_on,
                values=values,
                rel_err=err,
                bad=bad,
            )
        )

    for i in range(args.calls):  # phase 1: training calls, one shape, values changing
        name = names[i % len(names)]
        record(1, name, (8, 64), torch.float32, True, _values(ENTRIES[name][4], rng, False), i)
    for i in range(args.calls):  # phase 2: mixed
        name = rng.choice(names)
        shape = rng.choice(shapes if name.endswith("impl") or "impl_" in name else shapes[:3])
        dtype = rng.choice([torch.float32, torch.bfloat16])
        grad_on = rng.random() < 0.6
        structures.append((name, shape, dtype, grad_on))
        record(2, name, shape, dtype, grad_on, _values(ENTRIES[name][4], rng, False), 1000 + i)
    graphs_before_replay = unique_graphs()
    for i, (name, shape, dtype, grad_on) in enumerate(structures[: args.calls // 2]):  # phase 3
        record(3, name, shape, dtype, grad_on, _values(ENTRIES[name][4], rng, True), 2000 + i)
    summary = dict(
        torch=torch.__version__,
        device=args.device,
        calls=len(records),
        bad_calls=[r for r in records if r["bad"]],
        worst={
            dt: max((r["rel_err"] for r in records if r["dtype"] == dt), default=0.0)
            for dt in ("torch.float32", "torch.bfloat16")
        },
        graphs_before_replay=graphs_before_replay,
        graphs_after_replay=unique_graphs(),
        entry_points=names,
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
