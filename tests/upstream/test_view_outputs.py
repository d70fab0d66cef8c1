"""The patched forwards never modify in place a tensor that a custom autograd Function returned.

Transformer Engine's linears return their output as a view made inside their autograd Function,
and autograd refuses to modify such a view in place. Upstream's ``MLP.forward`` adds an expert's
token-weighted fc2 bias with ``output += ...``, so routed experts with biases (gpt-oss) cannot
train on Transformer Engine linears, patched or not. The patch adds it out of place.

The class of defect is reproduced on the CPU by giving each expert an fc2 whose output is such a
view (:data:`VIEW_FC2`); with CUDA and Transformer Engine, the real ``TERowParallelLinear`` is used
as well. Each case checks three things: upstream fails (the defect is real, and the test has
teeth), the patched layer trains, and the patched numbers equal upstream's own where upstream's
runs (local linears), bit for bit in bf16.
"""

from __future__ import annotations

import importlib.util

import pytest
from conftest import run_json

# In one fresh interpreter: builds upstream's SequentialMLP (two experts, biases, token weights)
# for each activation, runs forward and backward unpatched, then patched, and prints the results
# as JSON. DEVICE and LINEARS are substituted. "local" is upstream's own parallel linears (at
# world size 1 the row-parallel reduce returns its input as is, which autograd treats like a view
# made inside a custom Function); "te" is Transformer Engine's; "fresh" gives each expert's fc2 a
# freshly allocated output, so that upstream's in-place add runs and gives the reference numbers.
SEQUENTIAL_EXPERTS = """
import json, os
import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from mcore_activations import megatron_patch as mp
from megatron.core.activations import quick_gelu
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

DEVICE, LINEARS = "_DEVICE_", "_LINEARS_"
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
torch.distributed.init_process_group("nccl" if DEVICE == "cuda" else "gloo", world_size=1, rank=0)
parallel_state.initialize_model_parallel(1, 1)
tensor_parallel.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=DEVICE == "cpu")
ACTIVATIONS = {
    "gpt_oss": dict(
        activation_func=quick_gelu, activation_func_clamp_value=7.0, glu_linear_offset=1.0
    ),
    "swiglu": dict(activation_func=F.silu),
}


def fresh_fc2(linear):
    forward = linear.forward

    def wrapped(*args, **kwargs):
        out, bias = forward(*args, **kwargs)
        return out.clone(), bias

    linear.forward = wrapped


def run(activation, linears):
    from megatron.core.transformer.moe.experts import SequentialMLP

    config = TransformerConfig(
        num_layers=1, hidden_size=32, ffn_hidden_size=48, moe_ffn_hidden_size=48,
        num_attention_heads=4, num_moe_experts=2, add_bias_linear=True, gated_linear_unit=True,
        bias_activation_fusion=False, bf16=True, params_dtype=torch.bfloat16,
        use_cpu_initialization=DEVICE == "cpu", **ACTIVATIONS[activation],
    )
    if linears == "te":
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear, TERowParallelLinear,
        )
        submodules = MLPSubmodules(
            linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear
        )
    else:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    layer = SequentialMLP(2, config, submodules, pg_collection=get_default_pg_collection())
    layer = layer.to(DEVICE)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            scale = 0.3 if p.dim() > 1 else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    if linears == "fresh":
        for expert in layer.local_experts:
            fresh_fc2(expert.linear_fc2)
    x = (torch.randn(10, 32, generator=gen) * 4).to(DEVICE, torch.bfloat16).requires_grad_()
    probs = (torch.rand(10, generator=gen) + 0.5).to(DEVICE)
    try:
        out, bias = layer(x, torch.tensor([4, 6]), probs)
        out.float().square().sum().backward()
    except RuntimeError as err:
        return {"error": str(err).splitlines()[0]}
    grads = {n: p.grad.float().cpu().flatten().tolist() for n, p in layer.named_parameters()}
    return {
        "error": None,
        "bias_returned": bias is not None,
        "finite": bool(out.isfinite().all()),
        "out": out.float().cpu().flatten().tolist(),
        "dx": x.grad.float().cpu().flatten().tolist(),
        "grads": grads,
    }


results = {}
for activation in ACTIVATIONS:
    results[activation] = {"upstream": run(activation, LINEARS)}
    if LINEARS != "te":
        results[activation]["reference"] = run(activation, "fresh")
mp.patch_megatron_core()
for activation in ACTIVATIONS:
    results[activation]["patched"] = run(activation, LINEARS)
print(json.dumps(results))
"""


def _run(target: str, *, linears: str, device: str = "cpu") -> dict:
    code = SEQUENTIAL_EXPERTS.replace("_DEVICE_", device).replace("_LINEARS_", linears)
    return run_json(code, target)


def _have_cuda_te() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _assert_fixed(result: dict) -> None:
    upstream, patched = result["upstream"], result["patched"]
    assert upstream["error"] is not None and "inplace" in upstream["error"], upstream
    assert patched["error"] is None, patched["error"]
    assert patched["bias_returned"] is False  # the weighted bias is in the output, as upstream
    assert patched["finite"]


def test_experts_with_biases_train_once_patched(target):
    results = _run(target, linears="local")
    for activation, result in results.items():
        _assert_fixed(result)
        # Upstream's in-place add, where it can run, gives the same bits.
        reference, patched = result["reference"], result["patched"]
        assert reference["error"] is None, (activation, reference["error"])
        assert patched["out"] == reference["out"], activation
        assert patched["dx"] == reference["dx"], activation
        assert patched["grads"] == reference["grads"], activation


@pytest.mark.skipif(not _have_cuda_te(), reason="needs CUDA and Transformer Engine")
def test_experts_with_biases_train_on_transformer_engine_linears_once_patched(target):
    for result in _run(target, linears="te", device="cuda").values():
        _assert_fixed(result)
