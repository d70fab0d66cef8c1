"""Bit-exact replay of every kernel family: the same inputs give the same bits, twice in one
process and again in a fresh process. The CPU tier replays the torch backends, upstream's
compiled callables and the Triton kernels (in Triton's interpreter); the GPU tier (``-m gpu``)
replays the Triton kernels compiled for the GPU and the Transformer Engine MLPs."""

from __future__ import annotations

import os

import pytest
import torch

from tests.unit_tests.determinism.kernels.cases import CASES, CLAMPED, QUICK, SITU, fused
from tests.unit_tests.determinism.kernels.harness import (
    assert_bitwise_equal,
    replay_twice,
    run_in_fresh_process,
)
from tests.unit_tests.test_utilities import needs_sm100

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not INTERPRETED,
    reason="CPU tier: the Triton kernels under TRITON_INTERPRET=1",
)


@pytest.mark.parametrize("case", ["eager-clamped", "eager-situ", "inductor-clamped"])
def test_torch_backends_replay_bitwise(case):
    replay_twice(CASES[case], case)


def test_jit_fuser_callables_replay_bitwise():
    from mcore_activations.fusions.activation_ops import use_compiled_kernels

    with use_compiled_kernels(True):
        replay_twice(CASES["jit-callables"], "jit callables")


@needs_interpreter
@pytest.mark.parametrize(
    "case", ["triton-clamped", "triton-situ", "triton-quick", "triton-clamped-unweighted"]
)
def test_triton_kernels_replay_bitwise(case):
    replay_twice(CASES[case], case)


@needs_interpreter
def test_ops_replay_in_a_fresh_process(tmp_path):
    """Fresh interpreter, same bits: nothing depends on process state (caches, seeds, order)."""
    names = ["eager-clamped", "triton-situ"]
    fresh = run_in_fresh_process(names, tmp_path, env={"TRITON_INTERPRET": "1"})
    for name in names:
        here = {key: value.cpu() for key, value in CASES[name]().items()}
        assert_bitwise_equal(fresh[name], here, f"{name} (fresh process)")


def test_harness_reports_the_first_difference():
    a = {"t": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
    b = {"t": torch.tensor([[1.0, 2.0], [3.0, -4.0]])}
    with pytest.raises(AssertionError, match=r"first difference at \(1, 1\): 4.0 vs -4.0"):
        assert_bitwise_equal(a, b, "planted")
    zero = {"t": torch.tensor([0.0])}
    with pytest.raises(AssertionError, match="first difference"):
        assert_bitwise_equal(zero, {"t": torch.tensor([-0.0])}, "signed zero")


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [True, False], ids=["probs", "unweighted"])
@pytest.mark.parametrize("spec", [CLAMPED, SITU, QUICK], ids=["clamped", "situ", "quick"])
@pytest.mark.parametrize("shape", [(4099, 1536), (256, 2880)], ids=str)
def test_cuda_triton_replay_bitwise(spec, shape, weighted):
    # With a bias: at F = 1536 both take the one-row plan, at 2880 the two-row and the tile plans.
    rows, ffn = shape
    replay_twice(
        lambda: fused(spec, "triton", rows=rows, ffn=ffn, weighted=weighted),
        f"{spec.name} {shape} {'probs' if weighted else 'unweighted'}",
    )


@pytest.mark.gpu
def test_cuda_ops_replay_in_a_fresh_process(tmp_path):
    names = ["triton-clamped", "triton-quick", "jit-callables"]
    fresh = run_in_fresh_process(names, tmp_path)
    # The fresh process compiles the @jit_fuser callables with no history; this worker may have
    # compiled them before (a second shape makes a graph dynamic, a spent recompile limit falls
    # back to eager). Start from none here too, so both halves compile the same graphs.
    torch._dynamo.reset()
    for name in names:
        here = {key: value.cpu() for key, value in CASES[name]().items()}
        assert_bitwise_equal(fresh[name], here, f"{name} (fresh process)")


def _te_mlp_case(path_name):
    import warnings

    from megatron.core.transformer import activation_audit as audit

    def run():
        audit._init_single_process_world(torch.device("cuda"))
        path = next(p for p in audit.all_paths() if p.name == path_name)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = path.build(
                audit.BUILT_IN["DeepSeek-V4 SwiGLU(clamp=7)"], torch.device("cuda"), torch.float32
            )
        module = module.to(torch.bfloat16)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(audit.TOKENS, audit.HIDDEN, generator=gen).cuda().bfloat16()
        x.requires_grad_()
        probs = torch.rand(audit.TOKENS, 1, generator=gen).cuda()
        half, quarter = audit.TOKENS // 2, audit.TOKENS // 4
        out = path.run(module, x, probs, [half, 0, quarter, audit.TOKENS - half - quarter])
        out.backward(torch.ones_like(out))
        grads = {f"grad.{n}": p.grad for n, p in module.named_parameters() if p.grad is not None}
        return {"out": out.detach(), "dx": x.grad, **grads}

    return run


@pytest.mark.gpu
@pytest.mark.te
@pytest.mark.parametrize("path_name", ["TEFusedMLP", "TEFusedMLPWithGroupedLinear"])
def test_cuda_te_fused_mlp_replay_bitwise(path_name):
    replay_twice(_te_mlp_case(path_name), path_name)


@pytest.mark.gpu
@pytest.mark.te
@pytest.mark.parametrize(
    "path_name",
    ["TEGroupedMLP (unfused)", pytest.param("TEGroupedMLP (TE ops)", marks=needs_sm100)],
)
def test_cuda_te_grouped_mlp_replay_bitwise(path_name):
    replay_twice(_te_mlp_case(path_name), path_name)


def _te_fused_residual_rmsnorm_case():
    from megatron.core.extensions.transformer_engine import TEFusedResidualRMSNorm

    def run():
        hidden = 1536
        norm = TEFusedResidualRMSNorm(hidden, params_dtype=torch.bfloat16, device="cuda")
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=gen))
        x = torch.randn(4099, hidden, generator=gen).cuda().bfloat16().requires_grad_()
        grad_out = torch.randn(4099, hidden, generator=gen).cuda().bfloat16()
        grad_res = torch.randn(4099, hidden, generator=gen).cuda().bfloat16()
        out, residual = norm(x)
        torch.autograd.backward((out, residual), (grad_out, grad_res))
        return {
            "out": out.detach(),
            "residual": residual.detach(),
            "dx": x.grad,
            "grad.weight": norm.weight.grad,
        }

    return run


@pytest.mark.gpu
@pytest.mark.te
def test_cuda_te_fused_residual_rmsnorm_replay_bitwise():
    replay_twice(_te_fused_residual_rmsnorm_case(), "TEFusedResidualRMSNorm")
