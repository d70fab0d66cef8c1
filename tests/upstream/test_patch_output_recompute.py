"""``patch_megatron_core(recompute_output=...)`` on upstream 0.19.2 and main.

The keyword makes upstream's own ``MLP`` free fc2's input (the activation's output) once fc2 has
run and recompute it before fc2's backward: the storage is empty between the passes, every
gradient is bitwise the default one (alone and with the in-place backward), anything but a bool
or None is a TypeError, and the unpatch restores the default.
"""

from __future__ import annotations

from conftest import LOCAL_MLP_PRELUDE, run_json

SCRIPT = (
    LOCAL_MLP_PRELUDE
    + """
from mcore_activations.fusions import output_recompute


def build():
    config = TransformerConfig(
        num_layers=1, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
        add_bias_linear=True, gated_linear_unit=True, activation_func=F.silu,
        activation_func_clamp_value=_CLAMP_, bias_activation_fusion=True,
        use_cpu_initialization=True,
    )
    torch.manual_seed(0)
    return MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))


def step(mlp):
    seen = {}
    def keep(module, args, output):
        seen["fc2_input"] = args[0]
    handle = mlp.linear_fc2.register_forward_hook(keep)
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out, bias = mlp(x)
    between = seen["fc2_input"].untyped_storage().nbytes()
    (out + bias).square().sum().backward()
    handle.remove()
    grads = [x.grad] + [p.grad for p in mlp.parameters()]
    return out.detach(), grads, between


result = {}
mp.patch_megatron_core()
result["default"] = output_recompute.recompute_output_enabled()
out_a, grads_a, kept = step(build())
mp.patch_megatron_core(recompute_output=True)
result["set"] = output_recompute.recompute_output_enabled()
out_b, grads_b, freed = step(build())
mp.patch_megatron_core(in_place_backward=True)
out_c, grads_c, freed_c = step(build())
result["between"] = [kept, freed, freed_c]
result["bitwise"] = [
    torch.equal(out_a, o) and all(torch.equal(a, b) for a, b in zip(grads_a, g))
    for o, g in ((out_b, grads_b), (out_c, grads_c))
]
try:
    mp.patch_megatron_core(recompute_output="yes")
    result["type"] = None
except TypeError as err:
    result["type"] = str(err)
mp.unpatch_megatron_core()
result["after_unpatch"] = output_recompute.recompute_output_enabled()
print(json.dumps(result))
"""
)


def test_patch_keyword_frees_fc2_input_of_upstreams_mlp(target):
    # Upstream main allows a SwiGLU clamp on MoE layers only (its own config rule).
    for clamp in (0.5, None) if target == "release" else (None,):
        result = run_json(SCRIPT.replace("_CLAMP_", repr(clamp)), target)
        assert result["default"] is False and result["set"] is True, clamp
        kept, freed, freed_in_place = result["between"]
        assert kept == 6 * 2 * 48 * 4 and freed == 0 and freed_in_place == 0, result["between"]
        assert result["bitwise"] == [True, True], f"clamp={clamp}: the numbers changed"
        assert "recompute_output must be True, False or None" in result["type"]
        assert result["after_unpatch"] is False, clamp
