"""Stale-scalar scenarios, run one per fresh process by test_compile_safety.py.

Usage: ``python -m tests.unit_tests.mcore_activations.fusions.compile_scenarios SCENARIO TARGET
[--device D] [--values ...]``; prints one JSON object on the last line of stdout.

Whether torch.compile serves stale code depends on what the process compiled before and on the
Inductor on-disk cache, so the caller starts every scenario in a new process with its own
``TORCHINDUCTOR_CACHE_DIR`` (or, for the cross-process scenario, a shared one).

Targets are compiled entry points of this project, or deliberately naive float-argument
compilations that show the harness detects the upstream bug (pytorch#194976) on this torch.
"""

from __future__ import annotations

import argparse
import functools
import json
import random

import torch

# ----------------------------------------------------------------------------- naive targets
# The pattern upstream shipped: Python-float clamp straight into compiled code.


def _naive_fwd_impl(y, clamp_value):
    y1, y2 = torch.chunk(y.float(), 2, -1)
    y1 = torch.clamp(y1, max=clamp_value)
    y2 = torch.clamp(y2, -clamp_value, clamp_value)
    return (torch.nn.functional.silu(y1) * y2).to(y.dtype)


def _naive_bwd_impl(g, y, clamp_value):
    y1, y2 = torch.chunk(y.float(), 2, -1)
    m1 = (y1 <= clamp_value).to(g.dtype)
    m2 = ((y2 >= -clamp_value) & (y2 <= clamp_value)).to(g.dtype)
    y1c = torch.clamp(y1, max=clamp_value)
    y2c = torch.clamp(y2, -clamp_value, clamp_value)
    s = torch.sigmoid(y1c)
    d1 = g * s * (1 + y1c * (1 - s)) * y2c * m1
    d2 = g * y1c * s * m2
    return torch.cat([d1, d2], -1).to(y.dtype)


_naive_fwd = torch.compile(_naive_fwd_impl)
_naive_bwd = torch.compile(_naive_bwd_impl)


@functools.cache
def _per_value(kind, direction, c):
    impl = _naive_fwd_impl if direction == "fwd" else _naive_bwd_impl
    if kind == "partial":
        return torch.compile(functools.partial(impl, clamp_value=c))
    if kind == "closure":
        if direction == "fwd":

            def closure_fwd(y):
                return impl(y, c)

            return torch.compile(closure_fwd)

        def closure_bwd(g, y):
            return impl(g, y, c)

        return torch.compile(closure_bwd)

    class Clamped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.clamp_value = c

        def forward(self, *args):
            return impl(*args, self.clamp_value)

    return torch.compile(Clamped())


@functools.cache
def _custom_op_with_float():
    """A custom op whose schema takes the clamp as a float, called from an outer compile."""

    @torch.library.custom_op("mcore_compile_scenarios::clamped_swiglu", mutates_args=())
    def op(y: torch.Tensor, clamp_value: float) -> torch.Tensor:
        return _naive_fwd_impl(y, clamp_value)

    @op.register_fake
    def _(y, clamp_value):
        return y.new_empty(*y.shape[:-1], y.shape[-1] // 2)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.clamp_value = inputs[1]

    def backward(ctx, grad):
        return _naive_bwd_impl(grad, ctx.saved_tensors[0], ctx.clamp_value), None

    op.register_autograd(backward, setup_context=setup_context)
    return op, torch.compile(lambda y, c: op(y, c))


# ------------------------------------------------------------------------------ entry points
def _entry(target):
    """Returns ``(compiled_fwd, eager_fwd, compiled_bwd or None, eager_bwd or None)``.

    Each takes ``(y, c)`` / ``(g, y, c)``; the ``eager`` twins never touch compiled code.
    """
    from mcore_activations.fusions.activation_ops import use_compiled_kernels
    from megatron.core.fusions import fused_bias_swiglu as sw

    def eager(fn):
        @functools.wraps(fn)
        def run(*args):
            with use_compiled_kernels(False):
                return fn(*args)

        return run

    if target == "clamped_swiglu":
        return (
            sw.clamped_swiglu,
            sw.clamped_swiglu._torchdynamo_orig_callable,
            sw.clamped_swiglu_back,
            sw.clamped_swiglu_back._torchdynamo_orig_callable,
        )
    if target == "bias_swiglu_impl":
        fn = lambda y, c: sw.bias_swiglu_impl(y, None, clamp_value=c)
        return fn, eager(fn), None, None
    if target == "weighted_bias_swiglu_impl":

        def fn(y, c):
            w = torch.linspace(0.1, 1.0, y.shape[0], device=y.device).to(y.dtype)[:, None]
            return sw.weighted_bias_swiglu_impl(y, None, w, clamp_value=c)

        return fn, eager(fn), None, None
    if target == "outer_compile":
        # A user's torch.compile around our entry point, the clamp a float argument of theirs.
        fn = torch.compile(lambda y, c: sw.bias_swiglu_impl(y, None, clamp_value=c))
        return fn, eager(lambda y, c: sw.bias_swiglu_impl(y, None, clamp_value=c)), None, None
    if target == "naive_float":
        return _naive_fwd, _naive_fwd_impl, _naive_bwd, _naive_bwd_impl
    if target == "custom_op_float":
        op, outer = _custom_op_with_float()
        return outer, op, None, None
    if target in ("naive_partial", "naive_closure", "naive_module"):
        kind = target.split("_")[1]
        return (
            lambda y, c: _per_value(kind, "fwd", c)(y),
            _naive_fwd_impl,
            lambda g, y, c: _per_value(kind, "bwd", c)(g, y),
            _naive_bwd_impl,
        )
    raise SystemExit(f"unknown target {target!r}")


def _max_diff(a, b):
    return (a.detach().double() - b.detach().double()).abs().max().item()


FILL = None  # --fill: constant inputs and gradients, as in the bug report (0.75)


def run_call(entry, shape, requires_grad, c, device, dtype=torch.float32, seed=0):
    """One call: forward, autograd backward (if requires_grad) and explicit backward vs eager."""
    fwd, eager_fwd, bwd, eager_bwd = entry
    gen = torch.Generator().manual_seed(seed)
    y0 = (torch.randn(shape, generator=gen) * 2.5).to(device=device, dtype=dtype)
    g = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(device=device, dtype=dtype)
    if FILL is not None:
        y0, g = torch.full_like(y0, FILL), torch.ones_like(g)
    result = {"shape": list(shape), "grad": requires_grad, "c": c}

    y = y0.clone().requires_grad_(requires_grad)
    out = fwd(y, c)
    y_ref = y0.clone().requires_grad_(requires_grad)
    out_ref = eager_fwd(y_ref, c)
    result["forward_diff"] = _max_diff(out, out_ref)
    if requires_grad:
        (gy,) = torch.autograd.grad(out, y, g)
        (gy_ref,) = torch.autograd.grad(out_ref, y_ref, g)
        result["autograd_diff"] = _max_diff(gy, gy_ref)
    if bwd is not None:
        result["explicit_back_diff"] = _max_diff(bwd(g, y0, c), eager_bwd(g, y0, c))
    return result


def unique_graphs() -> int:
    """Dynamo graphs compiled so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# -------------------------------------------------------------------------------- scenarios
def scenario_report(target, device, values):
    """The bug report's sequence: (1,2) no grad, (1,4) grad, (1,4) grad."""
    entry = _entry(target)
    c0, c1, c2 = values or (1.0, 0.5, 1.0)
    calls = [((1, 2), False, c0), ((1, 4), True, c1), ((1, 4), True, c2)]
    return [run_call(entry, s, rg, c, device, seed=i) for i, (s, rg, c) in enumerate(calls)]


def scenario_values(target, device, values):
    """Training calls on one shape with a new clamp value each time; counts graphs per call."""
    entry = _entry(target)
    values = values or (1.0, 0.5, 2.0, 3.0, 0.25, 0.1, 0.75, 1.5)
    out = []
    for i, c in enumerate(values):
        res = run_call(entry, (8, 128), True, c, device, seed=i)
        res["graphs"] = unique_graphs()
        out.append(res)
    return out


def scenario_calls(target, device, values):
    """Given (shape, grad, c) calls, e.g. one half of the cross-process sequence."""
    entry = _entry(target)
    calls = [((1, 2), False, values[0])] + [((8, 128), True, c) for c in values[1:]]
    return [run_call(entry, s, rg, c, device, seed=i) for i, (s, rg, c) in enumerate(calls)]


SCENARIOS = {"report": scenario_report, "values": scenario_values, "calls": scenario_calls}


def main(argv=None):
    """Runs one scenario and prints its JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("target")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--values", type=float, nargs="*")
    parser.add_argument("--fill", type=float, help="constant input value instead of randn*2.5")
    args = parser.parse_args(argv)
    global FILL
    FILL = args.fill
    random.seed(0)
    result = SCENARIOS[args.scenario](args.target, args.device, args.values)
    print(json.dumps({"torch": torch.__version__, "calls": result}))


if __name__ == "__main__":
    main()
