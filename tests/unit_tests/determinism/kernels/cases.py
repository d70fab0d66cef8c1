"""The replay cases: each builds fixed inputs, runs one kernel family forward and backward and
returns every output and gradient by name. ``python -m ...cases OUT CASE...`` runs cases in a
fresh interpreter and saves their results to OUT (the fresh-process half of a replay test).

Inputs are drawn from seeded CPU generators and moved to the device, so every process sees the
same bits; values reach std 4 so the clamps are active.
"""

from __future__ import annotations

import sys

import torch

from mcore_activations.activation_spec import ActivationKind, ActivationSpec

CLAMPED = ActivationSpec(ActivationKind.SILU, gated=True, clamp_value=3.0)
SITU = ActivationSpec(ActivationKind.SILU, gated=True, gate_tanh_scale=2.0, linear_tanh_scale=4.0)
QUICK = ActivationSpec(ActivationKind.QUICK_GELU, gated=True, clamp_value=3.0, linear_offset=1.0)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def fused(
    spec,
    backend,
    rows=67,
    ffn=40,
    dtype=torch.bfloat16,
    device=None,
    interleave=None,
    weighted=True,
):
    """``fused_activation`` on ``backend`` with a bias, and probabilities unless ``weighted`` is
    False (the two take different backward plans): out, dx, dbias and dprobs where weighted."""
    from mcore_activations.fusions.activation_ops import use_kernel_backend
    from mcore_activations.fusions.fused_activation import fused_activation

    if interleave is not None:
        import dataclasses

        spec = dataclasses.replace(spec, glu_interleave_size=interleave)
    device = device or _device()
    gen = torch.Generator().manual_seed(1234)
    width = 2 * ffn if spec.gated else ffn
    x = (torch.randn(rows, width, generator=gen) * 4).to(device, dtype).requires_grad_()
    bias = torch.randn(width, generator=gen).to(device, dtype).requires_grad_()
    probs = torch.rand(rows, 1, generator=gen).to(device).requires_grad_()
    grad = torch.randn(rows, ffn, generator=gen).to(device, dtype)
    with use_kernel_backend(backend):
        out = fused_activation(x, spec, bias=bias, probs=probs if weighted else None)
        out.backward(grad)
    results = {"out": out.detach(), "dx": x.grad, "dbias": bias.grad}
    return results | ({"dprobs": probs.grad} if weighted else {})


def jit_callables():
    """Upstream's ``@jit_fuser`` callables, compiled in every process that runs this case.

    The test tier disables ``jit_fuser`` (tests/unit_tests/conftest.py) while a fresh interpreter
    keeps it, so the decorated names are eager in one and compiled in the other, and on CUDA the
    two differ by an ulp. Compiling the undecorated function here makes both halves replay the
    same compiled code.
    """
    from mcore_activations import activations

    gen = torch.Generator().manual_seed(7)
    results = {}
    for name in ("squared_relu", "quick_gelu", "fast_gelu"):
        decorated = getattr(activations, name)
        fn = torch.compile(getattr(decorated, "_torchdynamo_orig_callable", decorated))
        x = (torch.randn(33, 24, generator=gen) * 3).to(_device()).requires_grad_()
        out = fn(x)
        out.backward(torch.ones_like(out))
        results[f"{name}.out"], results[f"{name}.dx"] = out.detach(), x.grad
    return results


CASES = {
    "eager-clamped": lambda: fused(CLAMPED, "eager"),
    "eager-situ": lambda: fused(SITU, "eager", interleave=4),
    "inductor-clamped": lambda: fused(CLAMPED, "inductor"),
    "triton-clamped": lambda: fused(CLAMPED, "triton"),
    "triton-situ": lambda: fused(SITU, "triton", interleave=4),
    "triton-quick": lambda: fused(QUICK, "triton"),
    "triton-clamped-unweighted": lambda: fused(CLAMPED, "triton", weighted=False),
    "jit-callables": jit_callables,
}


def main(argv=None) -> None:
    """Runs the named cases and saves ``{case: results}`` (tensors moved to the CPU)."""
    out_file, *names = argv if argv is not None else sys.argv[1:]
    results = {name: {key: value.cpu() for key, value in CASES[name]().items()} for name in names}
    torch.save(results, out_file)


if __name__ == "__main__":
    main()
