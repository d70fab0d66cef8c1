"""The Triton kernel family against the float64 reference: every spec, dtype, bias,
probabilities and interleave, the whole float range, SiTU-GLU's edges and underflowing
exponentials.

On CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set by conftest when
no GPU is present), on small odd shapes; the GPU tier (``-m gpu``) runs the same checks compiled,
at larger shapes.
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_activations.activation_spec import GELU_TANH_COEF, ActivationKind, ActivationSpec
from mcore_activations.fusions import activation_ops
from mcore_activations.fusions.activation_kernels import KernelVariant, backward_math, forward_math
from mcore_activations.fusions.activation_ops import use_kernel_backend
from megatron.core.fusions.fused_activation import fused_activation
from tests.unit_tests.activation_catalog import SPECS, layout_cases, spec_of
from tests.unit_tests.mcore_activations.fusions.test_fused_activation import check_against_reference
from tests.unit_tests.mcore_activations.fusions.triton_cases import (
    BOTH,
    DEVICE,
    DTYPES,
    needs_triton_here,
)
from tests.unit_tests.tolerances import assert_close_to_reference

pytest.importorskip("triton")


@needs_triton_here
@pytest.mark.parametrize("has_probs", [False, True], ids=["", "probs"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("name,interleave", layout_cases())
def test_triton_kernels_match_reference(name, interleave, has_bias, has_probs):
    # Odd row count and an odd F (24 with interleave 4: whole blocks); inputs at std 3 hit every
    # clamp. The dtype rotates over the cases (every dtype is covered by the next test).
    spec = spec_of(name, glu_interleave_size=interleave)
    dtype = DTYPES[sum(map(ord, f"{name}{interleave}{has_bias}{has_probs}")) % len(DTYPES)]
    ffn = 24 if interleave else 13
    with use_kernel_backend("triton"):
        check_against_reference(spec, dtype, has_bias, has_probs, device=DEVICE, rows=7, ffn=ffn)


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_kernels_every_dtype(dtype, device):
    with use_kernel_backend("triton"):
        check_against_reference(SPECS["situ_glu"], dtype, True, True, device=device, rows=5, ffn=8)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("device", BOTH)
def test_triton_matches_torch_backends_elementwise(device):
    """The Triton kernels and the torch reference math agree to float32 rounding on raw calls,
    including on NaN and inf inputs (documented: NaN propagates, clamps keep NaN)."""
    torch.manual_seed(0)
    for name in ("swiglu_clamp", "situ_glu", "quick_geglu_gpt_oss", "reglu", "squared_relu_tanh"):
        spec = SPECS[name]
        variant = KernelVariant.of(spec, has_bias=False, has_probs=True)
        from mcore_activations.fusions.activation_kernels import params_tensor, spec_params

        width = 32 if spec.gated else 16
        x = torch.randn(6, width, device=device) * 8
        x[0, 0], x[1, 1], x[2, 2], x[3, width - 1] = math.nan, math.inf, -math.inf, math.nan
        probs = torch.rand(6, 1, device=device)
        grad = torch.randn(6, width // 2 if spec.gated else width, device=device)
        params = params_tensor(spec_params(spec), x.device)
        with use_kernel_backend("triton"):
            out = activation_ops.run_forward(variant, x, None, probs, params)
            dx, _, dprobs = activation_ops.run_backward(variant, grad, x, None, probs, params)
        ref_out = forward_math(variant, x, None, probs, params)
        ref_dx, _, ref_dprobs = backward_math(variant, grad, x, None, probs, params)
        for got, ref in ((out, ref_out), (dx, ref_dx), (dprobs, ref_dprobs)):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def _whole_range(n_each=60):
    """float32 values from -100 to 100: both signs, 1e-6 .. 100, 0, and the tanh Taylor
    branch's switch at |x| = 1/16 for the catalogue's tanh scales (1.5, 2 and 3). Past
    |x| = 44 * scale the tanh's exp(2x) overflows to inf or flushes to 0."""
    mags = torch.logspace(-6, 2, n_each, dtype=torch.float64)
    edges = torch.tensor([1.5 / 16, 2 / 16, 3 / 16], dtype=torch.float64)
    mags = torch.cat([mags, edges, edges * (1 - 1e-6), edges * (1 + 1e-6)])
    return torch.cat([-mags, torch.zeros(1, dtype=torch.float64), mags]).float()


def _kernel_and_float64(spec, x, device, reference=None):
    """``(output, dx, reference output, reference dx)``: the Triton path on ``x`` (a gradient of
    ones), then ``reference`` (default: the spec's) in float64 on the same values; all float64
    on CPU."""
    grad = torch.ones(x.shape[0], 1, dtype=x.dtype)
    xs = x.clone().to(device).requires_grad_()
    with use_kernel_backend("triton"):
        out = fused_activation(xs, spec)
        out.backward(grad.to(device))
    xr = x.double().requires_grad_()
    ref = (reference or spec.reference)(xr)
    ref.backward(grad.double())
    return out.detach().cpu().double(), xs.grad.cpu().double(), ref.detach(), xr.grad


# Relative bound per element of the whole-range test, by the region a row's inputs lie in
# (_whole_range_rtol). bfloat16: one unit of its precision (2**-7, two of its rounding) everywhere.
# The CPU interpreter has no hardware reciprocal, so there bfloat16 takes the float32 division
# path; the GPU tier runs the 16-bit forms. float32: at least twice the worst error measured on
# the interpreter and on an H200 (float32 inputs run the same forms on both: _tanh and
# _tanh_fraction, never _tanh_via_sigmoid, which the 16-bit forward and the backward use):
# - "taylor": every tanh the output evaluates takes _tanh_small (|argument| < 1/16): a few
#   roundings of the polynomials, of a sigmoid near 1/2 and of the shared division; worst
#   measured 2.7e-7 (interpreter, SiTU-GLU(2, 3) with both halves in the Taylor branch) and
#   2.4e-7 (H200, gate only). Dropping the polynomial's x**5 term alone errs by
#   (2/15) x**4 = 2.0e-6 just below the switch.
# - "below_one": every input below 1 in magnitude, no exponential argument above 2 in
#   magnitude: the cancellation of _tanh's 1 - exp(-2|x|) just above the switch (7.1e-7 on
#   the H200, soft-clamped SiLU at x = 1.5 / 16), GELU-tanh's derivative near its zero at
#   x = -0.75 (1.0e-6 on the H200); SiTU-GLU's two halves add.
# - elsewhere: an exponent argument near 90 carries ~1e-5 relative error by itself.
_WHOLE_RANGE_RTOL = {
    torch.float32: dict(taylor=6e-7, below_one=3e-6, rest=3e-5),
    torch.bfloat16: dict(taylor=8e-3, below_one=8e-3, rest=8e-3),
}


def _tanh_arguments(spec, x):
    """Per row of ``x`` (``[gate | linear]`` or one column) the largest |argument| of the
    tanhs ``spec`` evaluates (the gate's or soft clamp's ``h / s``, SiTU-GLU's ``u / s_l``), as
    the kernels form it: float32 ``h * (1 / s)``, so a value beside the Taylor switch is classed
    with the branch it takes. None for a spec without a tanh."""
    scales = [spec.gate_tanh_scale, spec.linear_tanh_scale if spec.gated else None]
    args = [
        (x[:, i : i + 1].float() * (torch.tensor(1.0) / s)).abs()
        for i, s in enumerate(scales)
        if s is not None
    ]
    return torch.cat(args, dim=-1).amax(-1, keepdim=True).double() if args else None


def _whole_range_rtol(spec, x, dtype):
    """``[rows, 1]`` relative bounds of :data:`_WHOLE_RANGE_RTOL` for the rows of ``x``."""
    tol = _WHOLE_RANGE_RTOL[dtype]
    small = x.double().abs().amax(-1, keepdim=True) < 1.0
    rtol = torch.where(small, tol["below_one"], tol["rest"])
    args = _tanh_arguments(spec, x)
    if args is not None:
        rtol = torch.where(args < 0.0625, tol["taylor"], rtol)
    return rtol


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "name", ["geglu", "fast_gelu", "situ_glu", "situ_glu_gate_only", "silu_tanh"]
)
def test_kernels_are_accurate_over_the_whole_range(name, dtype, device):
    """Element by element against float64 over [-100, 100]: a relative bound per element (not
    relative to the largest value, which would hide errors in the tails), tighter where the
    inputs are small (:data:`_WHOLE_RANGE_RTOL`). GELU-tanh (evaluated as x * sigmoid(2z)):
    output and gradient. With a tanh (SiTU-GLU, the soft-clamped SiLU): the output (the tanh's
    Taylor branch, its exponential branch and its saturation); the gradient's 1 - tanh**2
    cancels in the tails by construction and is held to the tolerance table by the other tests.
    A GLU sees every gate value against another linear value and against itself. The pairs
    with itself put both of SiTU-GLU's tanhs in their Taylor branch at once, with outputs large
    enough for the relative bound to count: against the other value a gate beside the switch
    meets a linear value near 1e-6, an output near 1e-7, where the 1e-12 floor allows 1e-5."""
    spec = SPECS[name]
    values = _whole_range()
    if spec.gated:  # rows of [gate | linear], F = 1
        x = torch.cat([torch.stack([values, values.flip(0)], -1), torch.stack([values] * 2, -1)])
    else:
        x = values.view(-1, 1)
    x = x.to(dtype)
    out, dx, ref, ref_dx = _kernel_and_float64(spec, x, device)
    rtol = _whole_range_rtol(spec, x, dtype)
    checks = [("output", out, ref)]
    if spec.gate_tanh_scale is None:
        checks.append(("dx", dx, ref_dx))
    for what, got, want in checks:
        # 1e-12: the float64 reference's own 1 + tanh(z) cancels to 0 below x ~ -6, where
        # sigmoid(2z) still resolves 1e-23.
        bound = rtol * want.abs() + 1e-12
        err = (got - want).abs()
        worst = int(torch.argmax(err - bound))
        assert (err <= bound).all(), (
            f"{spec.name} {what}: x={x[worst // got.shape[-1]].tolist()} "
            f"got {got.view(-1)[worst].item():.9g}, want {want.view(-1)[worst].item():.9g} "
            f"(rtol {rtol[worst // got.shape[-1]].item():.1e})"
        )


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("linear_scale", [25.0, None], ids=["s_l=25", "gate_only"])
def test_situ_glu_with_an_offset(linear_scale, dtype, device):
    """SiTU-GLU with a linear offset (Kimi-K3's s_g = 4, s_l = 25, offset 1): the forward folds
    s_g and the offset into its shared division (``_situ_glu``), in a form per dtype and per
    linear scale, which the catalogue's offset-free entries cannot tell apart from a dropped or
    misweighted offset. Output and gradient against float64, over the whole range and random
    values large enough to saturate both tanh halves."""
    spec = ActivationSpec(
        ActivationKind.SILU,
        gated=True,
        gate_tanh_scale=4.0,
        linear_tanh_scale=linear_scale,
        linear_offset=1.0,
    )
    values = _whole_range()
    torch.manual_seed(0)
    x = torch.cat([torch.stack([values, values.flip(0)], dim=-1), torch.randn(200, 2) * 40])
    out, dx, ref, ref_dx = _kernel_and_float64(spec, x.to(dtype), device)
    assert_close_to_reference(out, ref, dtype, "output")
    assert_close_to_reference(dx, ref_dx, dtype, "dx")


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["", "offset"])
def test_situ_glu_gate_only_with_a_linear_half_near_the_float32_maximum(offset, device):
    """Gate-only SiTU-GLU (s_g = 4) with linear values from 1e37 to 3.4e38 (both signs) against
    gates from -80 to 60: 0, the gate tanh's Taylor switch (g = s_g / 16), both saturations. The
    value act(g) * (u + o) has |act(g)| < s_g, so the forward must finish its one division
    without forming a product of u that overflows (_situ_glu): wherever the float64 value fits
    in float32, the output is finite and within 1e-5 of it relatively; where it does not, inf
    of its sign; never NaN (0 * inf at g = 0). 1e-5: sigmoid(g)'s exponential at |g| = 80 errs
    by up to 80 * 2**-24 = 4.8e-6 from its argument's rounding (worst measured 2.5e-6 at
    g = -60, on the interpreter and an H200; 2.2e-7 for the other gates). Gates stay above -87,
    below which sigmoid(g) is subnormal in float32 (the GPU flushes it to 0, _LOG2_E)."""
    spec = ActivationSpec(
        ActivationKind.SILU, gated=True, gate_tanh_scale=4.0, linear_offset=offset
    )
    gates = torch.tensor([1e-6, 1e-3, 0.25, 1.0, 3.0, 20.0, 60.0])
    gates = torch.cat([-gates, torch.tensor([0.0, -80.0]), gates])
    linear = torch.tensor([1e37, 1e38, 3e38, 3.4e38])
    g, u = torch.meshgrid(gates, torch.cat([linear, -linear]), indexing="ij")
    x = torch.stack([g.reshape(-1), u.reshape(-1)], dim=-1)
    out, _, ref, _ = _kernel_and_float64(spec, x, device)
    fmax = torch.finfo(torch.float32).max
    # Every value stays clear of float32's maximum (within a rounding of it, a finite output
    # and inf would both be right).
    assert ((ref.abs() / fmax - 1.0).abs() > 1e-3).all()
    fits = (ref.abs() <= fmax).view(-1)
    out, ref = out.view(-1), ref.view(-1)
    bad = out.isnan() | (fits & ~((out - ref).abs() <= 1e-5 * ref.abs()))
    bad |= ~fits & (out != ref.sign() * math.inf)
    assert not bad.any(), [
        f"g={x[i, 0].item():.3g} u={x[i, 1].item():.3g}: got {out[i].item():.7g}, "
        f"want {ref[i].item():.7g}"
        for i in bad.nonzero().view(-1)[:4].tolist()
    ]


@pytest.mark.parametrize("device", BOTH)
def test_situ_glu_backward_around_the_linear_tanh_taylor_switch(device):
    """SiTU-GLU(4, 25) (Kimi-K3's scales, no offset), float32 backward, element by element:
    gates -3, -0.5, 1 and 2 (clear of the gate derivative's zero at g = -1.22) against linear
    values with |u / s_l| from 1e-4 to 1, both signs, just beside the switch at 1/16 too. The
    backward's linear tanh is _tanh_via_sigmoid, t = 1 - 2 / (1 + exp(2x)): _tanh_small's
    polynomial below |x| = 1/16, above it a subtraction whose error is a few ulp of 1,
    absolutely (about 2 * 2**-24 measured: t's 30 ulp at the switch).

    dx of the gate half is act'(g) * s_l * t, whose relative error is act'(g)'s plus t's: bound
    8e-7, plus 4 * 2**-24 / |t| above the switch. Worst measured (interpreter and H200, 500
    values per decade): 2.6e-7 in the Taylor branch (1.9e-7 on the interpreter), 1.8e-6 just
    above the switch (bound 4.6e-6), 5.9e-7 near |x| = 1 (bound 1.1e-6). dx of the linear half
    is act(g) * (1 - t**2), which takes 2 t**2 / (1 - t**2) of t's relative error: bound
    1.3e-6, worst measured 6.4e-7 near |x| = 1 (H200). The gate half sees what the Taylor
    branch is there for: without its x**5 term the polynomial errs by (2/15) x**4, 2.0e-6 just
    below the switch, and with the switch at 1/32 the subtraction's error, about
    2 * 2**-24 / |x|, reaches 3e-6 below 1/16."""
    s_l = 25.0
    spec = ActivationSpec(
        ActivationKind.SILU, gated=True, gate_tanh_scale=4.0, linear_tanh_scale=s_l
    )
    switch = torch.tensor([1 - 1e-6, 1 + 1e-6], dtype=torch.float64) / 16
    mags = torch.cat([torch.logspace(-4, 0, 401, dtype=torch.float64), switch]) * s_l
    u = torch.cat([-mags, mags]).float()
    gates = torch.tensor([-3.0, -0.5, 1.0, 2.0])
    x = torch.stack([gates.repeat_interleave(len(u)), u.repeat(len(gates))], dim=-1)
    _, dx, _, ref_dx = _kernel_and_float64(spec, x, device)
    arg = (x[:, 1:] * (torch.tensor(1.0) / s_l)).abs().double()  # as the kernel forms it
    t = torch.tanh(arg)
    gate_rtol = 8e-7 + torch.where(arg < 0.0625, 0.0, 4 * 2.0**-24 / t)
    rtol = torch.cat([gate_rtol, torch.full_like(gate_rtol, 1.3e-6)], dim=-1)
    excess = (dx - ref_dx).abs() / (rtol * ref_dx.abs())
    row, half = divmod(int(torch.argmax(excess)), 2)
    assert (excess <= 1).all(), (
        f"{int((excess > 1).sum())} elements outside the bound; worst: gate, linear = "
        f"{x[row].tolist()}, dx of the {('gate', 'linear')[half]} half: got "
        f"{dx[row, half].item():.9g}, want {ref_dx[row, half].item():.9g} "
        f"(relative error {excess[row, half].item() * rtol[row, half].item():.2e}, bound "
        f"{rtol[row, half].item():.2e})"
    )


def _gelu_tanh_via_sigmoid(x):
    # GELU-tanh as x * sigmoid(2z) in float64: the catalogue's 0.5 * x * (1 + tanh(z)) cancels
    # in float64 too, to 0 below x ~ -7.5, where the value is still ~1e-20 (~1e-28 at x = -9).
    z = math.sqrt(2.0 / math.pi) * (x + GELU_TANH_COEF * x**3)
    return x * torch.sigmoid(2.0 * z)


@pytest.mark.parametrize("device", BOTH)
@pytest.mark.parametrize("name", ["fast_gelu", "geglu", "silu", "quick_gelu", "situ_glu"])
def test_underflowing_exponentials_change_nothing_above_1e_35(name, device):
    """Where an exponential underflows (argument below -87.3) the kernels' ``tl.exp2`` flushes
    it to 0 on a GPU (``triton_jit``, next to ``_LOG2_E``): outputs and gradients stay within
    3e-5 of float64 relatively, or 1e-35 absolutely (SiTU-GLU: its output), and never turn
    NaN. |x| from 9 to 200 takes GELU-tanh's sigmoid(-|2z|) (both signs), the sigmoids of SiLU,
    quick-GELU and SiTU-GLU (x above 51-88) and SiTU-GLU's gate tanh (|x| above 175) through
    the underflow; on CPU the interpreter does not flush, and the test checks the same tails.
    (Exact GELU is left out: its 1 + erf cancels to 0 in float32 below x ~ -6 on every backend,
    a limit of its formula, not of the exponential.)"""
    tail = torch.logspace(math.log10(9.0), math.log10(200.0), 64, dtype=torch.float64).float()
    values = torch.cat([-tail, tail])
    spec = SPECS[name]
    x = torch.stack([values, torch.ones_like(values)], dim=-1) if spec.gated else values.view(-1, 1)
    reference = None
    if spec.kind.value == "gelu_tanh":

        def reference(xr):
            return _gelu_tanh_via_sigmoid(xr[:, :1]) * (xr[:, 1:] if spec.gated else 1.0)

    out, dx, ref, ref_dx = _kernel_and_float64(spec, x, device, reference)
    assert not dx.isnan().any()
    checks = [(out, ref)]
    if not spec.is_situ_glu:  # SiTU-GLU's 1 - tanh**2 cancels in its tails (see the test above)
        checks.append((dx, ref_dx))
    for got, want in checks:
        assert not got.isnan().any()
        # Relative 3e-5 where the values are normal (SiLU's x * sigmoid(x) near x = -9 is -1e-3).
        bound = 3e-5 * want.abs() + 1e-35
        assert ((got - want).abs() <= bound).all(), (got - want).abs().max().item()


# ----------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("has_probs", [False, True], ids=["", "probs"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("interleave", [None, 32], ids=["", "il32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_cuda_triton_every_spec_dtype_bias_probs_interleave(
    name, dtype, interleave, has_bias, has_probs
):
    if interleave and not SPECS[name].gated:
        pytest.skip("interleave applies to GLUs only")
    spec = spec_of(name, glu_interleave_size=interleave)
    with use_kernel_backend("triton"):
        check_against_reference(spec, dtype, has_bias, has_probs, device="cuda", rows=1031, ffn=352)


@pytest.mark.gpu
@pytest.mark.parametrize("has_probs", [False, True], ids=["", "probs"])
@pytest.mark.parametrize("ffn", [2048, 768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_cuda_triton_bias_plans_against_reference(name, dtype, ffn, has_probs):
    """The backward plans with a bias at the widths where their row loops are pipelined through
    shared memory (1024-column blocks in 16-bit, 256-column float32 rows of the general weighted
    plan) or loaded ahead in registers, compiled, against the float64 reference."""
    with use_kernel_backend("triton"):
        check_against_reference(
            SPECS[name], dtype, True, has_probs, device="cuda", rows=1031, ffn=ffn
        )
