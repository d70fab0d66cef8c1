"""``patch_megatron_core(recompute_output=...)`` on upstream 0.19.2 and main.

The keyword makes upstream's own ``MLP`` have fc2 save a recipe of its input (the activation's
output) instead of the input, recomputed in fc2's backward: every gradient is bitwise the default
one (alone and with the in-place backward), anything but a bool or None is a TypeError, and the
unpatch restores the default.
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
    # How many tensors fc2 saved as recipes of its input (the option asked in the forward).
    made = []
    original = output_recompute.recompute_when_saved
    def spy(*args):
        context = original(*args)
        made.append(context)
        return context
    output_recompute.recompute_when_saved = spy
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out, bias = mlp(x)
    output_recompute.recompute_when_saved = original
    made = [getattr(context, "recipes", 0) for context in made]
    (out + bias).square().sum().backward()
    grads = [x.grad] + [p.grad for p in mlp.parameters()]
    return out.detach(), grads, made


result = {}
mp.patch_megatron_core()
result["default"] = output_recompute.recompute_output_enabled()
out_a, grads_a, kept = step(build())
mp.patch_megatron_core(recompute_output=True)
result["set"] = output_recompute.recompute_output_enabled()
out_b, grads_b, freed = step(build())
mp.patch_megatron_core(in_place_backward=True)
out_c, grads_c, freed_c = step(build())
result["recipes"] = [kept, freed, freed_c]
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


def test_patch_keyword_has_upstreams_fc2_save_a_recipe(target):
    # Upstream main allows a SwiGLU clamp on MoE layers only (its own config rule).
    for clamp in (0.5, None) if target == "release" else (None,):
        result = run_json(SCRIPT.replace("_CLAMP_", repr(clamp)), target)
        assert result["default"] is False and result["set"] is True, clamp
        # Off: nothing asked. On (alone and with the in-place backward): fc2 saved its input
        # as one recipe.
        assert result["recipes"] == [[], [1], [1]], result["recipes"]
        assert result["bitwise"] == [True, True], f"clamp={clamp}: the numbers changed"
        assert "recompute_output must be True, False or None" in result["type"]
        assert result["after_unpatch"] is False, clamp
