"""``patch_megatron_core(fc2_chunks=...)`` on upstream 0.19.2 and main.

With both memory options on, the keyword has upstream's own ``MLP`` run its activation and fc2 on
row blocks of fc1's output: fc2 runs once per block, the output and every gradient match the
unpatched layer's to float32 rounding, fc1 gets its output's own buffer back as the gradient, a
layer with a memory option off is refused when built, a wrong value is a TypeError, and the
unpatch restores the default.
"""

from __future__ import annotations

from conftest import LOCAL_MLP_PRELUDE, run_json

SCRIPT = (
    LOCAL_MLP_PRELUDE
    + """
from mcore_activations.fusions import fc2_chunks

fc2_chunks.MIN_ROWS_PER_CHUNK = 1  # the test's 6 rows make 3 blocks


def build():
    config = TransformerConfig(
        num_layers=1, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
        add_bias_linear=True, gated_linear_unit=True, activation_func=F.silu,
        bias_activation_fusion=True, use_cpu_initialization=True,
    )
    torch.manual_seed(0)
    return MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))


def step(mlp):
    seen = {"fc2 calls": 0}
    def keep(module, args, output):
        seen["fc1 output"] = output[0].untyped_storage().data_ptr()
        output[0].register_hook(lambda g: seen.update(grad=g.untyped_storage().data_ptr()))
    mlp.linear_fc1.register_forward_hook(keep)
    def count(*args):
        seen["fc2 calls"] += 1
    mlp.linear_fc2.register_forward_hook(count)
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out, bias = mlp(x)
    (out + bias).square().sum().backward()
    grads = [out.detach(), x.grad] + [p.grad for p in mlp.parameters()]
    return grads, seen["fc2 calls"], seen["grad"] == seen["fc1 output"]


import megatron.core.transformer.mlp as mlp_module

ranges = []
mlp_module.nvtx_range_push = lambda suffix: ranges.append("push " + suffix)
mlp_module.nvtx_range_pop = lambda suffix: ranges.append("pop " + suffix)
result = {}
reference, calls, _ = step(build())  # upstream's own forward: the patch is not in force yet
result["unpatched fc2 calls"] = calls
result["unpatched ranges"], ranges[:] = list(ranges), []
mp.patch_megatron_core(in_place_backward=True, recompute_output=True, fc2_chunks=3)
result["set"] = fc2_chunks.fc2_chunks()
got, calls, aliased = step(build())
result["patched fc2 calls"], result["aliased"] = calls, aliased
result["patched ranges"] = list(ranges)
result["max error"] = max(
    ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for g, r in zip(got, reference)
)
mp.patch_megatron_core(recompute_output=False)
try:
    build()
    result["refused"] = None
except ValueError as err:
    result["refused"] = str(err)
try:
    mp.patch_megatron_core(fc2_chunks="4")
    result["type"] = None
except TypeError as err:
    result["type"] = str(err)
mp.unpatch_megatron_core()
result["after unpatch"] = fc2_chunks.fc2_chunks()
print(json.dumps(result))
"""
)


def test_patch_keyword_runs_upstreams_mlp_on_row_blocks(target):
    result = run_json(SCRIPT, target)
    assert result["set"] == 3 and result["after unpatch"] == 1
    assert (result["unpatched fc2 calls"], result["patched fc2 calls"]) == (1, 3)
    assert result["aliased"], "fc1's output gradient was copied, not written over its output"
    # Upstream's NVTX ranges, in its order; the activation's and fc2's once per block.
    fc1 = ["push linear_fc1", "pop linear_fc1"]
    block = ["push activation", "pop activation", "push linear_fc2", "pop linear_fc2"]
    assert result["unpatched ranges"] == fc1 + block
    assert result["patched ranges"] == fc1 + 3 * block
    assert result["max error"] < 1e-5, result["max error"]
    assert "fc2_chunks=3" in result["refused"] and "recompute_output off" in result["refused"]
    assert "fc2_chunks must be a positive int" in result["type"]
