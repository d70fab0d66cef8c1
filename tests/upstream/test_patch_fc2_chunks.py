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


GROUPED_SCRIPT = (
    LOCAL_MLP_PRELUDE
    + """
from megatron.core.transformer.moe import experts
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from mcore_activations.fusions import fc2_chunks

fc2_chunks.MIN_ROWS_PER_CHUNK = 1  # the test's 12 rows make 3 blocks
TOKENS = [5, 0, 4, 3]  # sorted by expert; one expert without a token


class Grouped(torch.nn.Module):
    # Upstream's grouped linears need Transformer Engine; this one computes the same on the CPU:
    # expert i's weight (and bias, unless skip_bias_add) on its m_splits[i] rows.
    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias,
                 skip_bias_add, is_expert, tp_comm_buffer_name=None, pg_collection=None, name=None):
        super().__init__()
        self.skip_bias_add = skip_bias_add
        self.weight = torch.nn.Parameter(torch.randn(num_gemms, output_size, input_size) * 0.3)
        self.bias = torch.nn.Parameter(torch.randn(num_gemms, output_size) * 0.5)

    def forward(self, x, m_splits):
        parts = [
            F.linear(rows, w, None if self.skip_bias_add else b)
            for rows, w, b in zip(torch.split(x, list(m_splits)), self.weight, self.bias)
        ]
        return torch.cat(parts), (list(self.bias) if self.skip_bias_add else None)


def build(**overrides):
    config = TransformerConfig(**({
        "num_layers": 1, "hidden_size": 16, "ffn_hidden_size": 24, "num_attention_heads": 4,
        "num_moe_experts": 4, "moe_ffn_hidden_size": 24, "add_bias_linear": True,
        "gated_linear_unit": True, "activation_func": F.silu, "bias_activation_fusion": True,
        "activation_func_clamp_value": 1.5, "use_cpu_initialization": True,
    } | overrides))
    torch.manual_seed(0)
    submodules = experts.GroupedMLPSubmodules(linear_fc1=Grouped, linear_fc2=Grouped)
    return experts.TEGroupedMLP(4, config, submodules, pg_collection=get_default_pg_collection())


def step(layer, keywords=False):
    seen = {"splits": []}
    def keep(module, args, output):
        seen["fc1 output"] = output[0].untyped_storage().data_ptr()
        output[0].register_hook(lambda g: seen.update(grad=g.untyped_storage().data_ptr()))
    layer.linear_fc1.register_forward_hook(keep)
    layer.linear_fc2.register_forward_hook(lambda m, a, o: seen["splits"].append(list(a[1])))
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(12, 16, generator=gen) * 3).requires_grad_()
    probs = torch.rand(12, generator=gen).requires_grad_()
    if keywords:
        out, _ = layer(x, permuted_probs=probs, tokens_per_expert=torch.tensor(TOKENS))
    else:
        out, _ = layer(x, torch.tensor(TOKENS), probs)
    out.square().sum().backward()
    grads = [out.detach(), x.grad, probs.grad] + [p.grad for p in layer.parameters()]
    return grads, seen["splits"], seen["grad"] == seen["fc1 output"]


def error(got, reference):
    return max(
        ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
        for g, r in zip(got, reference)
    )


calls = []
original = fc2_chunks.activation_and_fc2
fc2_chunks.activation_and_fc2 = lambda *a, **k: calls.append(1) or original(*a, **k)
result = {}
# Upstream's forward, patched (0.19.2's fused branch would drop the clamp unpatched): the
# memory options are off.
mp.patch_megatron_core()
reference, result["reference splits"], _ = step(build())
result["reference own forward"], calls[:] = len(calls), []
mp.patch_megatron_core(in_place_backward=True, recompute_output=True, fc2_chunks=3)
got, result["patched splits"], result["aliased"] = step(build())
result["max error"] = error(got, reference)
mp.patch_megatron_core(fc2_chunks=1)
calls[:] = []
got, result["recompute splits"], _ = step(build(), keywords=True)
result["recompute own forward"] = len(calls)
result["recompute error"] = error(got, reference)
mp.patch_megatron_core(fc2_chunks=3)
try:
    build(bias_activation_fusion=False)
    result["refused"] = None
except ValueError as err:
    result["refused"] = str(err)
# Built while the option was off: upstream's unfused forward would run in one piece, silently.
mp.patch_megatron_core(fc2_chunks=1)
late = build(bias_activation_fusion=False)
mp.patch_megatron_core(fc2_chunks=3)
with torch.no_grad():  # no backward: nothing to split, nothing refused
    late(torch.randn(12, 16), torch.tensor(TOKENS), torch.rand(12))
try:
    step(late)
    result["refused late"] = None
except ValueError as err:
    result["refused late"] = str(err)
mp.unpatch_megatron_core()
print(json.dumps(result))
"""
)


def test_patch_keyword_runs_upstreams_grouped_experts_on_row_blocks(target):
    """Upstream's TEGroupedMLP, patched with both memory options and fc2_chunks=3: fc2 runs once
    per block with the block's share of every expert's rows (an expert cut by a boundary in two
    blocks, an empty expert with 0), the output and every gradient match the unpatched layer's,
    and fc1 gets its output's own buffer back. The recompute alone runs fc2 once. The reference
    is upstream's forward under the patch with the memory options off. A layer on
    upstream's unfused activation is refused when built, naming it, and at its first call with a
    gradient when built before the option was on. The recompute-only call passes its arguments
    by keyword."""
    result = run_json(GROUPED_SCRIPT, target)
    assert result["reference splits"] == [[5, 0, 4, 3]]
    assert result["patched splits"] == [[4, 0, 0, 0], [1, 0, 3, 0], [0, 0, 1, 3]]
    assert result["recompute splits"] == [[5, 0, 4, 3]]
    # Without a memory option upstream's forward runs; with one, the package's (fc2 on a recipe).
    assert (result["reference own forward"], result["recompute own forward"]) == (0, 1)
    assert result["aliased"], "fc1's output gradient was copied, not written over its output"
    assert result["max error"] < 1e-5, result["max error"]
    assert result["recompute error"] < 1e-5, result["recompute error"]
    assert "TEGroupedMLP: fc2_chunks=3" in result["refused"]
    assert "unfused activation" in result["refused"]
    assert "set after this layer was built" in result["refused late"]
    assert "unfused activation" in result["refused late"]
