"""What the kernel-variant experiments share: the activations, inputs, checks and timing groups.

Launch-plan candidates are :class:`~mcore_activations.fusions.triton_plans.LaunchOptions`
passed to ``triton_forward`` / ``triton_backward``; production's options stay untouched, so
candidates and production calls can be timed in the same turns.
"""

from __future__ import annotations

import dataclasses

import torch

from mcore_activations.activation_spec import ActivationKind, ActivationSpec
from mcore_activations.fusions import activation_kernels as ak
from mcore_activations.fusions.triton_plans import DEFAULT_OPTIONS
from tools.benchmark_activations import copy_ms, te_candidate, time_interleaved

_SILU, _QGELU = ActivationKind.SILU, ActivationKind.QUICK_GELU
SPECS = {
    "SwiGLU": ActivationSpec(_SILU, gated=True),
    "SwiGLU, interleave 32": ActivationSpec(_SILU, gated=True, glu_interleave_size=32),
    "quick-GEGLU(gpt-oss)": ActivationSpec(_QGELU, gated=True, clamp_value=7.0, linear_offset=1.0),
    "SwiGLU(clamp=7)": ActivationSpec(_SILU, gated=True, clamp_value=7.0),
    "SwiGLU(clamp=7), interleave 32": ActivationSpec(
        _SILU, gated=True, clamp_value=7.0, glu_interleave_size=32
    ),
    "SiTU-GLU(4,25)": ActivationSpec(
        _SILU, gated=True, gate_tanh_scale=4.0, linear_tanh_scale=25.0
    ),
    "SiTU-GLU(4,25), interleave 32": ActivationSpec(
        _SILU, gated=True, gate_tanh_scale=4.0, linear_tanh_scale=25.0, glu_interleave_size=32
    ),
}


def check_formulation(
    label: str, out: torch.Tensor, expected: torch.Tensor, units: int = 2
) -> None:
    """Raises unless ``out`` equals ``expected`` to within the rounding of ``expected.dtype``:
    two units of it per element, or ``units`` units of the largest value."""
    scale = expected.abs().max().float().clamp_min(1e-30).item()
    eps = torch.finfo(expected.dtype).eps
    torch.testing.assert_close(
        out.float(), expected.float(), rtol=2 * eps, atol=units * eps * scale, msg=label
    )


def _raw_inputs(spec, weighted, rows, ffn, dtype):
    """Inputs at std 4 (the clamps bite), probabilities, params and the two copy floors."""
    width = 2 * ffn if spec.gated else ffn
    x = torch.randn(rows, width, device="cuda", dtype=dtype) * 4
    grad = torch.randn(rows, ffn, device="cuda", dtype=dtype)
    probs = torch.rand(rows, 1, device="cuda") if weighted else None
    params = ak.params_tensor(ak.spec_params(spec), x.device)
    copy_fwd = copy_ms(rows * (width + ffn) * dtype.itemsize)
    copy_bwd = copy_ms(rows * (2 * width + ffn) * dtype.itemsize)
    return x, grad, probs, params, copy_fwd, copy_bwd


GLU_CASES = {
    "SwiGLU": (SPECS["SwiGLU"], torch.bfloat16),
    "SwiGLU(clamp=7)": (SPECS["SwiGLU(clamp=7)"], torch.bfloat16),
    "ReGLU": (ActivationSpec(ActivationKind.RELU, gated=True), torch.bfloat16),
    "GEGLU": (ActivationSpec(ActivationKind.GELU_TANH, gated=True), torch.bfloat16),
    "quick-GEGLU(gpt-oss)": (SPECS["quick-GEGLU(gpt-oss)"], torch.bfloat16),
    "SiTU-GLU(4)": (ActivationSpec(_SILU, gated=True, gate_tanh_scale=4.0), torch.bfloat16),
    "SiTU-GLU(4,25)": (SPECS["SiTU-GLU(4,25)"], torch.bfloat16),
    "SwiGLU(clamp=7), fp32": (SPECS["SwiGLU(clamp=7)"], torch.float32),
    "SiTU-GLU(4,25), fp32": (SPECS["SiTU-GLU(4,25)"], torch.float32),
}


def with_options(fields: dict, fn):
    """A call of no arguments that runs ``fn(options)``: production's launch options with
    ``fields`` (``LaunchOptions`` field names) replaced."""
    options = dataclasses.replace(DEFAULT_OPTIONS, **fields)
    return lambda: fn(options)


def result_with(fields: dict, fn):
    """``fn(options)``'s result under production's options with ``fields`` replaced."""
    return with_options(fields, fn)()


def _glu_inputs(spec, rows, ffn, dtype):
    """``(variant, x, grad, params, fwd_bwd)`` for an unweighted GLU ``[rows, 2 * ffn]`` input:
    ``fwd_bwd(fn)`` is a call that runs ``fn`` forward and backward on a leaf copy of ``x``."""
    variant = ak.KernelVariant.of(spec, has_bias=False, has_probs=False)
    x = torch.randn(rows, 2 * ffn, device="cuda", dtype=dtype) * 4
    grad = torch.randn(rows, ffn, device="cuda", dtype=dtype)
    xg = x.clone().requires_grad_()
    params = ak.params_tensor(ak.spec_params(spec), x.device)

    def fwd_bwd(fn):
        def call():
            xg.grad = None
            fn(xg).backward(grad)

        return call

    return variant, x, grad, params, fwd_bwd


def _over_floor(group: dict) -> dict:
    """``{label: time / floor}`` for a group of candidates that includes ``"floor"``, timed in
    turns without gradients."""
    with torch.no_grad():
        times = time_interleaved(group)
    floor = times.pop("floor")
    return {label: t / floor for label, t in times.items()}


def _add_compile_and_te(group: dict, spec, x) -> None:
    """Adds torch.compile's forward of ``spec`` on ``x`` and TE's (when TE has the op)."""
    from tools.benchmark_activations import compile_candidate

    compiled = compile_candidate(spec, False)
    group["torch.compile"] = lambda: compiled(x, None)
    te = te_candidate(spec, False)
    if te is not None:
        group["TE"] = lambda: te(x, None)
