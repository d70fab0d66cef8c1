"""The one tolerance table for comparing against the float64 reference.

Every numerical test compares a path's result with ``ActivationSpec.reference`` (or a hand-written
float64 model) and checks ``|got - ref| <= atol + rtol * |ref|`` elementwise, with ``atol`` scaled
by the reference's magnitude so large activations (clamps hit at std ~8) are judged relative to
their size. NaN or inf in ``got`` where the reference is finite always fails.
"""

from __future__ import annotations

import torch

# rtol: relative to each element; atol: relative to max|ref| of the whole tensor.
TOLERANCES = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def tolerance(dtype: torch.dtype) -> dict:
    """``dict(rtol=..., atol=...)`` for results computed in ``dtype``."""
    return TOLERANCES[dtype]


def max_rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max(max|ref|, tiny)`` in float64; inf if ``got`` is not finite."""
    got64, ref64 = got.detach().double(), ref.detach().double()
    if not torch.isfinite(got64[torch.isfinite(ref64)]).all():
        return float("inf")
    scale = ref64.abs().max().clamp_min(1e-30)
    return ((got64 - ref64).abs().max() / scale).item()


def assert_close_to_reference(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what=""):
    """Asserts ``got`` (computed in ``dtype``) matches float64 ``ref`` per :data:`TOLERANCES`."""
    tol = tolerance(dtype)
    got64, ref64 = got.detach().double(), ref.detach().double()
    assert got64.shape == ref64.shape, f"{what}: shape {tuple(got64.shape)} != {tuple(ref64.shape)}"
    finite = torch.isfinite(ref64)
    assert torch.isfinite(got64[finite]).all(), f"{what}: non-finite values where ref is finite"
    assert torch.equal(got64[~finite].nan_to_num(), ref64[~finite].nan_to_num()), (
        f"{what}: non-finite reference values not reproduced"
    )
    scale = ref64.abs().max().item() if ref64.numel() else 0.0
    bound = tol["atol"] * max(scale, 1.0) + tol["rtol"] * ref64.abs()
    err = (got64 - ref64).abs()
    bad = err > bound
    if bad.any():
        idx = int(torch.argmax((err - bound).flatten()))
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements outside {dtype} tolerance; worst at "
            f"flat index {idx}: got {got64.flatten()[idx].item():.8g}, "
            f"ref {ref64.flatten()[idx].item():.8g}, max rel err {max_rel_error(got, ref):.3g}"
        )
