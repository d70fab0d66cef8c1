"""The TE activation lowering: which op each spec becomes, with which arguments, or why not.

CPU tests with a fake ``te`` (tests/unit_tests/extensions/fake_te.py). Three kinds of checks:

- structure: the op name and constructor arguments for every spec, plain and Scaled;
- refusals: every unsupported spec raises ``UnsupportedActivationError`` naming the path, the
  activation and the reason, and version gates raise ``TEVersionError`` (a RuntimeError too);
- numerics of the arguments: the fake ops compute te-ops.md's formulas, so running the lowered op
  on float64 inputs that hit the clamps must reproduce ``spec.reference``. A wrong alpha, offset,
  limit or beta fails here even though the op name is right.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import megatron.core.extensions.transformer_engine as te_ext
from megatron.core import activations
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer.activation_spec import (
    ActivationKind,
    ActivationSpec,
    UnsupportedActivationError,
    deinterleave_glu,
)
from tests.unit_tests.extensions.fake_te import install_fake_te, remove_te, run_op

K = ActivationKind
PATH = "TestPath"
INF = math.inf


def spec(kind, gated=False, **kwargs) -> ActivationSpec:
    return ActivationSpec(kind=kind, gated=gated, **kwargs)


@pytest.fixture
def fake_te(monkeypatch):
    return install_fake_te(monkeypatch)


def lower(s, scaled=False, **kwargs):
    return te_ext.plan_te_activation(s, path=PATH, scaled=scaled, **kwargs)


# ------------------------------------------------------------------------------- structure

# (spec, unscaled (op, kwargs) or None if refused, scaled (op, kwargs) or None if refused).
# Unscaled ops that take cache_quantized_input get it (False) on TE 2.20.2.
NOCACHE = {"cache_quantized_input": False}
CASES = {
    "swiglu": (
        spec(K.SILU, True),
        ("SwiGLU", NOCACHE),
        ("ScaledSwiGLU", {"glu_interleave_size": None}),
    ),
    "swiglu_clamp": (
        spec(K.SILU, True, clamp_value=10.0),
        ("ClampedSwiGLU", dict(limit=10.0, alpha=1.0, glu_linear_offset=0.0, **NOCACHE)),
        (
            "ScaledClampedQGeGLU",
            dict(limit=10.0, alpha=1.0, glu_linear_offset=0.0, glu_interleave_size=None),
        ),
    ),
    "swiglu_offset": (
        spec(K.SILU, True, linear_offset=0.5),
        ("ClampedSwiGLU", dict(limit=INF, alpha=1.0, glu_linear_offset=0.5, **NOCACHE)),
        (
            "ScaledClampedQGeGLU",
            dict(limit=INF, alpha=1.0, glu_linear_offset=0.5, glu_interleave_size=None),
        ),
    ),
    "situ_glu": (
        spec(K.SILU, True, gate_tanh_scale=4.0, linear_tanh_scale=25.0),
        ("SiTUGLU", dict(beta1=4.0, beta2=25.0, **NOCACHE)),
        ("ScaledSiTUGLU", dict(beta1=4.0, beta2=25.0, glu_interleave_size=None)),
    ),
    "situ_glu_gate_only": (spec(K.SILU, True, gate_tanh_scale=4.0), None, None),
    "situ_glu_offset": (
        spec(K.SILU, True, gate_tanh_scale=4.0, linear_tanh_scale=25.0, linear_offset=1.0),
        None,
        None,
    ),
    "quick_geglu": (
        spec(K.QUICK_GELU, True),
        ("QGEGLU", NOCACHE),
        (
            "ScaledClampedQGeGLU",
            dict(limit=INF, alpha=1.702, glu_linear_offset=0.0, glu_interleave_size=None),
        ),
    ),
    "quick_geglu_gpt_oss": (
        spec(K.QUICK_GELU, True, clamp_value=7.0, linear_offset=1.0),
        ("ClampedSwiGLU", dict(limit=7.0, alpha=1.702, glu_linear_offset=1.0, **NOCACHE)),
        (
            "ScaledClampedQGeGLU",
            dict(limit=7.0, alpha=1.702, glu_linear_offset=1.0, glu_interleave_size=None),
        ),
    ),
    "quick_geglu_offset": (
        spec(K.QUICK_GELU, True, linear_offset=1.0),
        ("ClampedSwiGLU", dict(limit=INF, alpha=1.702, glu_linear_offset=1.0, **NOCACHE)),
        (
            "ScaledClampedQGeGLU",
            dict(limit=INF, alpha=1.702, glu_linear_offset=1.0, glu_interleave_size=None),
        ),
    ),
    "quick_geglu_clamp": (
        spec(K.QUICK_GELU, True, clamp_value=2.5),
        ("ClampedSwiGLU", dict(limit=2.5, alpha=1.702, glu_linear_offset=0.0, **NOCACHE)),
        (
            "ScaledClampedQGeGLU",
            dict(limit=2.5, alpha=1.702, glu_linear_offset=0.0, glu_interleave_size=None),
        ),
    ),
    "geglu": (spec(K.GELU_TANH, True), ("GEGLU", NOCACHE), None),
    "geglu_erf": (spec(K.GELU, True), None, None),
    "geglu_clamp": (spec(K.GELU_TANH, True, clamp_value=2.0), None, None),
    "geglu_offset": (spec(K.GELU_TANH, True, linear_offset=1.0), None, None),
    "reglu": (spec(K.RELU, True), ("ReGLU", NOCACHE), None),
    "reglu_clamp": (spec(K.RELU, True, clamp_value=2.0), None, None),
    "sreglu": (spec(K.SQUARED_RELU, True), ("SReGLU", NOCACHE), None),
    "gelu_erf": (spec(K.GELU), None, None),
    "fast_gelu": (spec(K.GELU_TANH), ("GELU", NOCACHE), None),
    "fast_gelu_tanh": (spec(K.GELU_TANH, gate_tanh_scale=1.5), None, None),
    "silu": (spec(K.SILU), ("SiLU", NOCACHE), None),
    "silu_tanh": (spec(K.SILU, gate_tanh_scale=1.5), None, None),
    "relu": (spec(K.RELU), ("ReLU", NOCACHE), None),
    "relu_tanh": (spec(K.RELU, gate_tanh_scale=1.5), None, None),
    "quick_gelu": (spec(K.QUICK_GELU), ("QGELU", NOCACHE), None),
    "quick_gelu_tanh": (spec(K.QUICK_GELU, gate_tanh_scale=1.5), None, None),
    "squared_relu": (spec(K.SQUARED_RELU), ("SReLU", NOCACHE), ("ScaledSReLU", {})),
    "squared_relu_tanh": (
        spec(K.SQUARED_RELU, gate_tanh_scale=2.0),
        None,
        ("ScaledTanhSReLU", dict(tanh_clamp_scale=2.0)),
    ),
    "custom_gated": (spec(K.CUSTOM, True, custom_func=torch.tanh), None, None),
    "custom": (spec(K.CUSTOM, custom_func=torch.tanh), None, None),
}
SUPPORTED = [(n, s) for n in CASES for s in (False, True) if CASES[n][2 if s else 1]]
REFUSED = [(n, s) for n in CASES for s in (False, True) if not CASES[n][2 if s else 1]]


@pytest.mark.parametrize("name,scaled", SUPPORTED)
def test_lowering_picks_op_and_arguments(fake_te, name, scaled):
    s, unscaled_expected, scaled_expected = CASES[name]
    op_name, kwargs = scaled_expected if scaled else unscaled_expected
    lowering = lower(s, scaled=scaled)
    assert (lowering.op_name, lowering.op_kwargs) == (op_name, kwargs)
    assert lowering.scaled is scaled

    op = te_ext.lower_activation_to_te_op(s, path=PATH, scaled=scaled)
    assert type(op) is getattr(fake_te.pytorch.ops, op_name)
    assert op.kwargs == kwargs and op.args == ()


def test_no_clamp_never_gets_te_default_limit(fake_te):
    """TE's ClampedSwiGLU defaults (limit 7, alpha 1.702, offset 1) must never leak in."""
    for name, (s, unscaled, scaled) in CASES.items():
        for expected in (unscaled, scaled):
            if expected and expected[0] in ("ClampedSwiGLU", "ScaledClampedQGeGLU"):
                kwargs = expected[1]
                assert set(kwargs) >= {"limit", "alpha", "glu_linear_offset"}, name
                assert kwargs["limit"] == (s.clamp_value if s.clamp_value else INF), name


# -------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name,scaled", REFUSED)
def test_refusal_names_path_activation_and_reason(fake_te, name, scaled):
    s = CASES[name][0]
    with pytest.raises(UnsupportedActivationError) as info:
        te_ext.lower_activation_to_te_op(s, path=PATH, scaled=scaled)
    error = info.value
    assert not isinstance(error, te_ext.TEVersionError), "a math refusal, not a version gate"
    assert isinstance(error, ValueError)
    message = str(error)
    assert PATH in message and s.name in message and error.reason in message
    assert error.path == PATH and error.spec == s
    assert error.reason and error.alternative


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("gelu_erf", "activations.fast_gelu"),
        ("geglu_erf", "tanh"),
        ("situ_glu_gate_only", "activation_func_tanh_clamp_scale_linear"),
        ("situ_glu_offset", "glu_linear_offset"),
        ("geglu_clamp", "ClampedSwiGLU"),
        ("reglu_clamp", "clamp"),
        ("silu_tanh", "ScaledTanhSReLU"),
        ("custom", "Python callable"),
    ],
)
def test_refusal_reasons_are_specific(fake_te, name, fragment):
    with pytest.raises(UnsupportedActivationError, match=fragment):
        lower(CASES[name][0])


def test_tanh_squared_relu_refused_unscaled(fake_te):
    with pytest.raises(UnsupportedActivationError, match="only as the row-scaled"):
        lower(CASES["squared_relu_tanh"][0], scaled=False)


@pytest.mark.parametrize("name", ["geglu", "reglu", "fast_gelu", "silu", "relu", "quick_gelu"])
def test_missing_scaled_form_refused(fake_te, name):
    with pytest.raises(UnsupportedActivationError, match="no row-scaled form"):
        lower(CASES[name][0], scaled=True)


# --------------------------------------------------------------------------- GLU interleave


def test_interleave_reaches_ops_that_read_it(fake_te):
    swiglu = CASES["swiglu"][0]
    assert lower(swiglu, glu_interleave_size=32).op_kwargs == dict(
        glu_interleave_size=32, **NOCACHE
    )
    assert lower(swiglu, scaled=True, glu_interleave_size=64).op_kwargs == {
        "glu_interleave_size": 64
    }
    # The spec's own layout is used when the caller gives none.
    assert lower(swiglu.with_interleave(32), scaled=True).op_kwargs == {"glu_interleave_size": 32}
    # Plain quick-GEGLU has no interleaving op (QGEGLU); the clamped op reads the layout.
    lowering = lower(CASES["quick_geglu"][0], glu_interleave_size=32)
    assert lowering.op_name == "ClampedSwiGLU"
    assert lowering.op_kwargs == dict(
        limit=INF, alpha=1.702, glu_linear_offset=0.0, glu_interleave_size=32, **NOCACHE
    )
    situ = lower(CASES["situ_glu"][0], scaled=True, glu_interleave_size=32)
    assert situ.op_kwargs == dict(beta1=4.0, beta2=25.0, glu_interleave_size=32)


@pytest.mark.parametrize("name", ["geglu", "reglu", "sreglu"])
def test_interleave_refused_on_ops_without_the_option(fake_te, name):
    with pytest.raises(UnsupportedActivationError, match="no glu_interleave_size option"):
        lower(CASES[name][0], glu_interleave_size=32)


def test_scaled_interleave_must_be_multiple_of_32(fake_te):
    with pytest.raises(UnsupportedActivationError, match="multiple of 32"):
        lower(CASES["swiglu"][0], scaled=True, glu_interleave_size=16)
    # The unscaled ops interleave in Python and take any block size.
    assert lower(CASES["swiglu"][0], glu_interleave_size=16).op_kwargs["glu_interleave_size"] == 16


def test_interleave_on_non_gated_refused(fake_te):
    with pytest.raises(UnsupportedActivationError, match="not gated"):
        lower(CASES["squared_relu"][0], scaled=True, glu_interleave_size=32)


def test_contradicting_interleave_is_a_caller_bug(fake_te):
    with pytest.raises(ValueError, match="contradicts") as info:
        lower(CASES["swiglu"][0].with_interleave(32), glu_interleave_size=64)
    assert not isinstance(info.value, UnsupportedActivationError)


# ----------------------------------------------------------------------------- version gates


@pytest.mark.parametrize(
    "name,scaled,first_ok,last_refused",
    [
        ("swiglu_clamp", False, "2.17.0.dev0", "2.16.2"),
        ("swiglu_clamp", True, "2.17.0.dev0", "2.16.2"),
        ("quick_geglu_offset", False, "2.17.0.dev0", "2.16.2"),
        ("situ_glu", False, "2.20.0", "2.19.1"),
        ("situ_glu", True, "2.20.0", "2.19.1"),
        ("silu", False, "2.8.0", "2.7.0"),
        ("swiglu", True, "2.14.0", "2.13.0"),
        ("swiglu", False, "1.13.0", "1.12.0"),
    ],
)
def test_version_gates(monkeypatch, name, scaled, first_ok, last_refused):
    s = CASES[name][0]
    install_fake_te(monkeypatch, version=first_ok)
    lower(s, scaled=scaled)
    install_fake_te(monkeypatch, version=last_refused)
    with pytest.raises(te_ext.TEVersionError) as info:
        lower(s, scaled=scaled)
    # Upstream raised RuntimeError for a too-old TE; the refusal is both.
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
    assert first_ok in str(info.value) and last_refused in str(info.value)
    assert PATH in str(info.value) and s.name in str(info.value)


def test_interleave_on_unscaled_ops_needs_grouped_era_te(monkeypatch):
    install_fake_te(monkeypatch, version="2.13.0")
    with pytest.raises(te_ext.TEVersionError, match="glu_interleave_size option"):
        lower(CASES["swiglu"][0], glu_interleave_size=32)


def test_cache_quantized_input_only_on_te_2_3_and_ops_that_take_it(monkeypatch):
    swiglu = CASES["swiglu"][0]
    install_fake_te(monkeypatch, version="2.3.0")
    assert lower(swiglu, cache_quantized_input=True).op_kwargs == {"cache_quantized_input": True}
    install_fake_te(monkeypatch, version="2.2.0")
    assert lower(swiglu, cache_quantized_input=True).op_kwargs == {}
    # The Scaled* ops have no such option; the flag is a memory saving and is dropped.
    install_fake_te(monkeypatch)
    scaled = lower(swiglu, scaled=True, cache_quantized_input=True)
    assert "cache_quantized_input" not in scaled.op_kwargs


def test_op_missing_from_te_build_is_a_version_refusal(monkeypatch):
    install_fake_te(monkeypatch, missing=("ScaledClampedQGeGLU",))
    with pytest.raises(te_ext.TEVersionError, match="has no te.pytorch.ops.ScaledClampedQGeGLU"):
        lower(CASES["swiglu_clamp"][0], scaled=True)


def test_without_te_lowering_refuses(monkeypatch):
    remove_te(monkeypatch)
    with pytest.raises(te_ext.TEVersionError, match="cannot be imported"):
        lower(CASES["swiglu"][0])


# -------------------------------------------------------------------- upstream entry points


@pytest.mark.parametrize(
    "func,gated,op_name",
    [
        (F.silu, True, "SwiGLU"),
        (F.silu, False, "SiLU"),
        (F.relu, True, "ReGLU"),
        (F.relu, False, "ReLU"),
        (activations.fast_gelu, True, "GEGLU"),
        (activations.fast_gelu, False, "GELU"),
        (quick_gelu, False, "QGELU"),
        (activations.squared_relu, False, "SReLU"),
    ],
)
def test_make_te_ops_activation_compat(fake_te, func, gated, op_name):
    op = te_ext._make_te_ops_activation(func, gated, cache_quantized_input=True)
    assert type(op).__name__ == op_name
    assert op.kwargs == {"cache_quantized_input": True}


@pytest.mark.parametrize("func,gated", [(F.gelu, True), (F.gelu, False), (torch.tanh, True)])
def test_make_te_ops_activation_refuses_what_te_cannot_compute(fake_te, func, gated):
    # Upstream ran F.gelu as TE's tanh GELU without a word.
    with pytest.raises(UnsupportedActivationError, match="TEFusedMLP"):
        te_ext._make_te_ops_activation(func, gated, cache_quantized_input=False)


def _config(**kwargs):
    defaults = dict(
        activation_func=F.silu,
        gated_linear_unit=False,
        activation_func_fp8_input_store=False,
        glu_linear_offset=0.0,
        activation_func_clamp_value=None,
        activation_func_tanh_clamp_scale=None,
        activation_func_tanh_clamp_scale_linear=None,
    )
    defaults.update(kwargs)
    return SimpleNamespace(**defaults)


def test_te_activation_op_non_gated_silu_is_silu(fake_te):
    # Upstream built ops.ReLU here.
    op = te_ext.TEActivationOp(_config())
    assert type(op).__name__ == "SiLU"


def test_te_activation_op_follows_the_spec(fake_te):
    op = te_ext.TEActivationOp(
        _config(gated_linear_unit=True, activation_func_fp8_input_store=True)
    )
    assert type(op).__name__ == "SwiGLU" and op.kwargs == {"cache_quantized_input": True}
    clamped = te_ext.TEActivationOp(
        _config(gated_linear_unit=True, activation_func_clamp_value=3.0)
    )
    assert type(clamped).__name__ == "ClampedSwiGLU" and clamped.kwargs["limit"] == 3.0
    with pytest.raises(UnsupportedActivationError, match="TEActivationOp"):
        te_ext.TEActivationOp(_config(activation_func=F.gelu))


def test_te_activation_op_needs_te(monkeypatch):
    remove_te(monkeypatch)
    with pytest.raises(ImportError, match="transformer-engine"):
        te_ext.TE_ONLY_CLASSES["TEActivationOp"](_config())


def test_te_only_classes_are_exported_as_none_without_te():
    """Upstream's skip guards (``if TEFusedMLP is None``) keep working on the fork."""
    from mcore_activations.te_import import have_te

    for name, cls in te_ext.TE_ONLY_CLASSES.items():
        assert cls is not None
        assert getattr(te_ext, name) is (cls if have_te() else None), name


# ------------------------------------------------------------------ numerics of the arguments

ROWS = 64


def _inputs(s: ActivationSpec, width: int = 128, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # std 8 (as FC1 outputs with N(0, 1) weights) puts >5 % of gates past a clamp of 10.
    x = torch.randn(ROWS, 2 * width if s.gated else width, generator=g, dtype=torch.float64) * 8
    scales = torch.rand(ROWS, generator=g, dtype=torch.float64) + 0.5
    return x, scales


NUMERIC_CASES = [
    (name, scaled, k)
    for name, scaled in SUPPORTED
    for k in ((None, 32) if CASES[name][0].gated else (None,))
]


@pytest.mark.parametrize("name,scaled,interleave", NUMERIC_CASES)
def test_lowered_arguments_reproduce_the_reference(fake_te, name, scaled, interleave):
    s = CASES[name][0].with_interleave(interleave)
    try:
        op = te_ext.lower_activation_to_te_op(s, path=PATH, scaled=scaled)
    except UnsupportedActivationError:
        # Only GEGLU / ReGLU / SReGLU lack the layout option, and they must say so.
        assert interleave is not None and CASES[name][1][0] in ("GEGLU", "ReGLU", "SReGLU")
        return
    x, scales = _inputs(s)
    if s.clamp_value is not None:
        gate, _ = deinterleave_glu(x, interleave)
        assert (gate > s.clamp_value).float().mean() > 0.05, "the clamp must be active"
    got = run_op(op, x, scales if scaled else None)
    ref = s.reference(x, probs=scales if scaled else None)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "wrong",
    [
        dict(limit=7.0),  # TE's default limit instead of the configured clamp
        dict(alpha=1.702),  # quick-GELU slope on a SwiGLU
        dict(glu_linear_offset=1.0),  # TE's default offset
    ],
)
def test_numerics_check_catches_wrong_clamped_arguments(fake_te, wrong):
    """The comparison above has the power to see a wrong argument."""
    s = CASES["swiglu_clamp"][0]
    lowering = lower(s)
    bad = type(te_ext.lower_activation_to_te_op(s, path=PATH, scaled=False))(
        **{**lowering.op_kwargs, **wrong}
    )
    x, _ = _inputs(s)
    assert not torch.allclose(run_op(bad, x), s.reference(x), rtol=1e-3, atol=1e-3)


def test_numerics_check_catches_swapped_betas(fake_te):
    s = CASES["situ_glu"][0]
    op_cls = type(te_ext.lower_activation_to_te_op(s, path=PATH, scaled=False))
    x, _ = _inputs(s)
    swapped = op_cls(beta1=25.0, beta2=4.0)
    assert not torch.allclose(run_op(swapped, x), s.reference(x), rtol=1e-3, atol=1e-3)


def test_lowering_describe_is_readable(fake_te):
    lowering = lower(CASES["swiglu_clamp"][0])
    assert lowering.describe() == (
        "ClampedSwiGLU(alpha=1.0, cache_quantized_input=False, glu_linear_offset=0.0, limit=10.0)"
    )
