"""Real Transformer Engine numerics of the TE activation lowering and the fused MLP classes.

GPU tier (``-m gpu``; needs TE, e.g. 2.20.2 on an H200). Checks:

- every op the lowering builds, plain and Scaled, two-halves and interleaved, against
  ``ActivationSpec.reference`` (float64) on inputs that hit the clamps;
- ``TEFusedMLP`` and ``TEFusedMLPWithGroupedLinear`` (recipe ``"none"``) against ``MLP`` on the
  same weights, for every catalogue activation: output, input gradient and every weight
  gradient, fp32 within 1e-5 and bf16 within the table below; weights loaded both ways;
- every configuration the lowering refuses raises at construction with real TE;
- the contract of the fused-MLP clamp PR's reproducer (hidden 64, ffn 112, fc1 ~ N(0, 1)).

Run with ``-s`` to see the error table (path x activation -> max relative error), printed by
the last test; set ``TE_PATHS_TABLE=<file>`` to also write it there.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import megatron.core.extensions.transformer_engine as te_ext
from megatron.core.extensions.transformer_engine import (
    TEFusedMLP,
    TEFusedMLPWithGroupedLinear,
    TELayerNormColumnParallelLinear,
    TERowParallelLinear,
)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.activation_spec import (
    ActivationSpec,
    UnsupportedActivationError,
    deinterleave_glu,
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.activation_catalog import CONFIGS, NEEDS_MOE
from tests.unit_tests.mcore_activations.test_te_lowering import CASES
from tests.unit_tests.tolerances import max_rel_error, tolerance

pytestmark = [pytest.mark.gpu, pytest.mark.te]

HIDDEN = 64
SUBMODULES = MLPSubmodules(
    linear_fc1=TELayerNormColumnParallelLinear, linear_fc2=TERowParallelLinear
)
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}

# Relative error ||got - ref|| / ||ref|| of a fused class against MLP on the same weights (the
# fused-MLP clamp PR's metric). fp32: both run the same fp32 math and differ by GEMM and kernel
# rounding only, but TE's grouped GEMMs round differently from the dense ones: on an H200 the
# grouped class's fp32 gradients differed from MLP's by up to 2.9e-5 in norm (SwiGLU, interleave
# 32; FusedSharedExpertMLP's dx 1.04e-5), so the bound is 1e-4. A wrong activation shows as 1e-2
# and more. bf16: the paths round fc1's
# output separately (fused LayerNorm+GEMM vs separate ops), which also moves a few
# pre-activations across a clamp, where the gradient jumps; bounded by the bf16 tolerance of
# tests/unit_tests/tolerances.py.
MLP_MATCH = {torch.float32: 1e-4, torch.bfloat16: tolerance(torch.bfloat16)["rtol"]}
# A lowered op against the float64 reference (te-ops.md measured fp32 <= 2.1e-7, bf16 <= 1.9e-3).
OP_MATCH = {torch.float32: 1e-6, torch.bfloat16: 8e-3}

RESULTS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    from tests.unit_tests.test_utilities import Utils

    Utils.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(123)
    yield
    Utils.destroy_model_parallel()


@pytest.fixture(autouse=True)
def seeded():
    # Each test draws its weights and inputs from the same seed, whatever ran before it on this
    # worker: a result depends on the test alone.
    torch.manual_seed(1234)


@pytest.fixture
def unquantized(monkeypatch):
    # An H200 has neither MXFP8 nor NVFP4: the grouped class must be told to run unquantized.
    monkeypatch.setenv("FP4_RECIPE", "none")


def make_config(activation: str, dtype: torch.dtype, **overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=112,
        num_attention_heads=4,
        add_bias_linear=False,
        bias_activation_fusion=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        **CONFIGS[activation],
    )
    if activation in NEEDS_MOE:
        kwargs["num_moe_experts"] = 4  # the SwiGLU clamp is MoE-only (config rule)
    kwargs.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**kwargs)


def lowers(config, scaled: bool, glu_interleave_size=None) -> bool:
    try:
        te_ext.plan_te_activation(
            ActivationSpec.from_config(config),
            path="probe",
            scaled=scaled,
            glu_interleave_size=glu_interleave_size,
        )
    except UnsupportedActivationError:
        return False
    return True


def build(cls, config, **kwargs):
    return cls(config, SUBMODULES, ffn_hidden_size=config.ffn_hidden_size, **kwargs).cuda()


def norm_rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``||got - ref|| / ||ref||`` in float64; inf if ``got`` is not finite."""
    got64, ref64 = got.detach().double(), ref.detach().double()
    if not torch.isfinite(got64).all():
        return float("inf")
    return ((got64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def _fc1_in_mlp_layout(name, grad, interleave):
    if name != "linear_fc1.weight" or interleave is None:
        return grad
    gate, lin = deinterleave_glu(grad.transpose(0, 1), interleave)
    return torch.cat([gate, lin], dim=-1).transpose(0, 1)


def compare_with_mlp(fused, mlp, dtype, *, fc1_interleave=None) -> dict:
    """Runs both on the same weights and input; returns relative errors per tensor."""
    with torch.no_grad():
        # fc1 outputs with std ~8: every catalogue clamp and tanh scale is active.
        mlp.linear_fc1.weight.normal_(0.0, 1.0)
    fused.load_state_dict(mlp.state_dict())
    x = torch.randn(32, 2, HIDDEN, device="cuda", dtype=dtype)
    x_f, x_m = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_f, bias_f = fused(x_f)
    out_m, bias_m = mlp(x_m)
    if bias_m is not None:
        out_f, out_m = out_f + bias_f, out_m + bias_m
    grad = torch.randn_like(out_m)
    out_f.backward(grad)
    out_m.backward(grad)
    errors = {"out": norm_rel_error(out_f, out_m), "dx": norm_rel_error(x_f.grad, x_m.grad)}
    grads_m = dict(mlp.named_parameters())
    for name, param in fused.named_parameters():
        if param.numel() == 0:
            continue
        assert param.grad is not None, f"{name}: no gradient through the fused ops"
        got = _fc1_in_mlp_layout(name, param.grad, fc1_interleave)
        errors[f"d{name}"] = norm_rel_error(got, grads_m[name].grad)

    # And back: fused weights into MLP give the same output.
    with torch.no_grad():
        for param in fused.parameters():
            param.add_(0.01 * torch.randn_like(param))
        mlp.load_state_dict(fused.state_dict())
        x = torch.randn(8, 2, HIDDEN, device="cuda", dtype=dtype)
        errors["out(fused->MLP)"] = norm_rel_error(fused(x)[0], mlp(x)[0])
    return errors


def _check(errors: dict, bound: float, label: str):
    bad = {k: v for k, v in errors.items() if not v <= bound}
    assert not bad, f"{label}: relative errors above {bound:g}: {bad}"


# ------------------------------------------------------------------------ the lowered ops


def _ops_cases():
    for name, (spec, unscaled, scaled) in CASES.items():
        for is_scaled, expected in ((False, unscaled), (True, scaled)):
            if expected is None:
                continue
            for k in (None, 32) if spec.gated else (None,):
                yield pytest.param(
                    name, is_scaled, k, id=f"{name}-{'scaled' if is_scaled else 'plain'}-{k}"
                )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name,scaled,interleave", list(_ops_cases()))
def test_real_te_op_reproduces_reference(name, scaled, interleave, dtype):
    spec = CASES[name][0].with_interleave(interleave)
    try:
        op = te_ext.lower_activation_to_te_op(spec, path="GPU test", scaled=scaled)
    except UnsupportedActivationError:
        assert interleave is not None  # GEGLU / ReGLU / SReGLU read halves only
        return
    rows, width = 256, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    x64 = 8 * torch.randn(rows, 2 * width if spec.gated else width, device="cuda", generator=gen)
    x64 = x64.double()
    scales64 = (torch.rand(rows, device="cuda", generator=gen) + 0.5).double()
    x = x64.to(dtype).requires_grad_()
    scales = scales64.to(dtype)
    y = op(x, scales) if scaled else op(x)
    ref_x = x.detach().double().requires_grad_()
    ref = spec.reference(ref_x, probs=scales.double() if scaled else None)
    grad = torch.randn_like(ref)
    y.backward(grad.to(dtype))
    ref.backward(grad)
    errors = {"out": max_rel_error(y, ref), "dx": max_rel_error(x.grad, ref_x.grad)}
    RESULTS[("te.pytorch.ops", f"{name}{'/scaled' if scaled else ''}/k={interleave}", dtype)] = max(
        errors.values()
    )
    # bf16 dx: the reference takes its clamp decisions from the same bf16 input, so only
    # rounding of the result differs.
    _check(errors, OP_MATCH[dtype], f"{op.__class__.__name__}({op})")


# ---------------------------------------------------------------------- the fused classes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("activation", list(CONFIGS))
def test_te_fused_mlp_matches_mlp(activation, dtype):
    config = make_config(activation, dtype)
    if not lowers(config, scaled=False):
        with pytest.raises(UnsupportedActivationError, match="TEFusedMLP"):
            build(TEFusedMLP, config)
        return
    mlp, fused = build(MLP, config), build(TEFusedMLP, config)
    errors = compare_with_mlp(fused, mlp, dtype)
    RESULTS[("TEFusedMLP", activation, dtype)] = max(errors.values())
    _check(errors, MLP_MATCH[dtype], f"TEFusedMLP {activation} {DTYPE_IDS[dtype]}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_te_fused_mlp_with_biases_matches_mlp(dtype):
    config = make_config("swiglu_clamp", dtype, add_bias_linear=True)
    mlp, fused = build(MLP, config), build(TEFusedMLP, config)
    errors = compare_with_mlp(fused, mlp, dtype)
    RESULTS[("TEFusedMLP+bias", "swiglu_clamp", dtype)] = max(errors.values())
    _check(errors, MLP_MATCH[dtype], "TEFusedMLP with biases")


GROUPED_CASES = [
    (activation, k)
    for activation, kwargs in CONFIGS.items()
    for k in ((None, 32) if kwargs.get("gated_linear_unit") else (None,))
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("activation,interleave", GROUPED_CASES)
def test_grouped_matches_mlp(unquantized, activation, interleave, dtype):
    # The interleaved layout needs the per-rank FFN width to be a multiple of the block.
    config = make_config(activation, dtype, ffn_hidden_size=128 if interleave else 112)
    if not lowers(config, scaled=True, glu_interleave_size=interleave):
        with pytest.raises(UnsupportedActivationError, match="TEFusedMLPWithGroupedLinear"):
            build(TEFusedMLPWithGroupedLinear, config, glu_interleave_size=interleave)
        return
    mlp = build(MLP, config)
    fused = build(TEFusedMLPWithGroupedLinear, config, glu_interleave_size=interleave)
    assert fused.fused_recipe_name == "none"
    errors = compare_with_mlp(fused, mlp, dtype, fc1_interleave=interleave)
    label = "TEFusedMLPWithGroupedLinear" + (f"(k={interleave})" if interleave else "")
    RESULTS[(label, activation, dtype)] = max(errors.values())
    _check(errors, MLP_MATCH[dtype], f"{label} {activation} {DTYPE_IDS[dtype]}")


def test_grouped_default_recipe_refused_without_mxfp8(monkeypatch):
    monkeypatch.delenv("FP4_RECIPE", raising=False)
    if te_ext.te.pytorch.is_mxfp8_available():
        pytest.skip("this GPU has MXFP8")
    # A hardware limit, not a config error: the layer builds (it may be moved to other hardware)
    # and the first forward refuses, asking for te_fused_recipe='none'.
    fused = build(TEFusedMLPWithGroupedLinear, make_config("swiglu", torch.bfloat16))
    x = torch.randn(8, 2, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(te_ext.TEFusedRecipeError, match="'none'"):
        fused(x)


@pytest.mark.parametrize(
    "cls,activation",
    [
        (TEFusedMLP, "geglu_erf"),
        (TEFusedMLP, "situ_glu_gate_only"),
        (TEFusedMLP, "geglu_clamp"),
        (TEFusedMLP, "squared_relu_tanh"),
        (TEFusedMLPWithGroupedLinear, "geglu"),
        (TEFusedMLPWithGroupedLinear, "fast_gelu"),
        (TEFusedMLPWithGroupedLinear, "situ_glu_gate_only"),
    ],
)
def test_refusals_at_construction_with_real_te(unquantized, cls, activation):
    config = make_config(activation, torch.float32)
    with pytest.raises(UnsupportedActivationError) as info:
        build(cls, config)
    assert cls.__name__ in str(info.value)
    assert ActivationSpec.from_config(config).name in str(info.value)


SHARED_CASES = ["swiglu", "swiglu_clamp", "situ_glu", "quick_geglu_gpt_oss"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("activation", SHARED_CASES)
def test_fused_shared_expert_matches_shared_expert(activation, dtype):
    """FusedSharedExpertMLP (recipe "none") vs SharedExpertMLP on the same checkpoint."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TERowParallelLinear,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.shared_experts import (
        FusedSharedExpertMLP,
        SharedExpertMLP,
    )

    config = make_config(
        activation,
        dtype,
        num_moe_experts=4,
        moe_shared_expert_intermediate_size=128,
        moe_shared_expert_glu_interleave_size=32,
        use_grouped_gemm_for_shared_expert=True,
        te_fused_recipe="none",
    )
    linears = MLPSubmodules(linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    plain = SharedExpertMLP(config, linears, gate=True, pg_collection=pgs).cuda()
    fused = FusedSharedExpertMLP(config, linears, gate=True, pg_collection=pgs).cuda()
    with torch.no_grad():
        plain.linear_fc1.weight.normal_(0.0, 1.0)  # fc1 outputs with std ~8
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(32, 2, HIDDEN, device="cuda", dtype=dtype)
    x_f, x_p = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_f, out_p = fused(x_f), plain(x_p)
    grad = torch.randn_like(out_p)
    out_f.backward(grad)
    out_p.backward(grad)
    errors = {"out": norm_rel_error(out_f, out_p), "dx": norm_rel_error(x_f.grad, x_p.grad)}
    grads_p = dict(plain.named_parameters())
    for name, param in fused.named_parameters():
        got = _fc1_in_mlp_layout(name, param.grad, 32)
        errors[f"d{name}"] = norm_rel_error(got, grads_p[name].grad)
    RESULTS[("FusedSharedExpertMLP", activation, dtype)] = max(errors.values())
    _check(errors, MLP_MATCH[dtype], f"FusedSharedExpertMLP {activation} {DTYPE_IDS[dtype]}")


# ---------------------------------------------------------------- the PR reproducer contract


def test_pr_reproducer_contract():
    """TEFusedMLP computes the clamp (max |diff| printed) and SiTU-GLU 4/25, not plain SwiGLU."""
    cases = {
        "clamp 10": ({"activation_func_clamp_value": 10.0}, "ClampedSwiGLU"),
        "SiTU-GLU 4/25": (
            {
                "activation_func_tanh_clamp_scale": 4.0,
                "activation_func_tanh_clamp_scale_linear": 25.0,
            },
            "SiTUGLU",
        ),
    }
    for label, (act, op_name) in cases.items():
        config = TransformerConfig(
            num_layers=1,
            hidden_size=64,
            ffn_hidden_size=112,
            num_attention_heads=4,
            num_moe_experts=4,
            activation_func=F.silu,
            gated_linear_unit=True,
            add_bias_linear=False,
            bias_activation_fusion=False,
            **act,
        )
        mlp = MLP(config, SUBMODULES, ffn_hidden_size=112).cuda()
        with torch.no_grad():
            mlp.linear_fc1.weight.normal_(0.0, 1.0)  # fc1 outputs with std ~8
        fused = TEFusedMLP(config, SUBMODULES, ffn_hidden_size=112).cuda()
        assert fused._te_activation.op_name == op_name
        fused.load_state_dict(mlp.state_dict())
        x = torch.randn(32, 2, 64, device="cuda")
        out_fused, out_mlp = fused(x)[0], mlp(x)[0]
        diff = (out_fused - out_mlp).abs().max().item()
        print(f"{label}: op {fused._te_activation.describe()}, max |TEFusedMLP - MLP| = {diff:.3g}")
        assert norm_rel_error(out_fused, out_mlp) <= MLP_MATCH[torch.float32]

        # Plain SwiGLU (what upstream silently ran) is far from both.
        plain = TransformerConfig(
            num_layers=1,
            hidden_size=64,
            ffn_hidden_size=112,
            num_attention_heads=4,
            activation_func=F.silu,
            gated_linear_unit=True,
            add_bias_linear=False,
        )
        swiglu = MLP(plain, SUBMODULES, ffn_hidden_size=112).cuda()
        swiglu.load_state_dict(mlp.state_dict())
        assert norm_rel_error(swiglu(x)[0], out_mlp) > 0.1


# ------------------------------------------------------------------------------ the table


def _table(results: dict, metric: str) -> str:
    rows = sorted({(path, act) for path, act, _ in results})
    lines = [f"| path | activation | fp32 {metric} | bf16 {metric} |", "|---|---|---|---|"]
    for path, act in rows:
        cells = []
        for dtype in (torch.float32, torch.bfloat16):
            value = results.get((path, act, dtype))
            cells.append("-" if value is None else f"{value:.2g}")
        lines.append(f"| {path} | {act} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def test_zz_print_error_table():
    """Prints path x activation -> worst relative error (run with -s); paste into docs."""
    if not RESULTS:
        pytest.skip("no results collected (run the whole file)")
    ops = {k: v for k, v in RESULTS.items() if k[0] == "te.pytorch.ops"}
    classes = {k: v for k, v in RESULTS.items() if k[0] != "te.pytorch.ops"}
    table = (
        "Fused class vs MLP, same weights: worst of output, dx, every dW (||a-b||/||b||)\n\n"
        + _table(classes, "rel err")
        + "\n\nLowered op vs float64 reference: worst of output, dx (max|a-b|/max|b|)\n\n"
        + _table(ops, "max rel err")
    )
    print("\n" + table)
    target = os.environ.get("TE_PATHS_TABLE")
    if target:
        with open(target, "w") as handle:
            handle.write(table + "\n")
