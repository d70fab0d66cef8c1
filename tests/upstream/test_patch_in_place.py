"""``patch_megatron_core(in_place_backward=...)`` on upstream 0.19.2 and main.

The keyword sets the fused activations' low-memory backward for upstream's own ``MLP``: the
backward then writes the input gradient over fc1's output (its version counter moves) with the
same bits as the default backward; a config under which that is unsafe is refused when the layer
is built; anything but a bool or None is a TypeError; the unpatch restores the default.
"""

from __future__ import annotations

from conftest import LOCAL_MLP_PRELUDE, run_json

SCRIPT = (
    LOCAL_MLP_PRELUDE
    + """
from mcore_activations.fusions import in_place


def build(**extra):
    config = TransformerConfig(
        num_layers=1, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        activation_func_clamp_value=_CLAMP_, bias_activation_fusion=True,
        use_cpu_initialization=True, **extra,
    )
    torch.manual_seed(0)
    return MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))


def step(mlp):
    seen = {}
    def keep(module, args, output):
        seen["fc1"] = output[0]
        seen["version"] = output[0]._version
    handle = mlp.linear_fc1.register_forward_hook(keep)
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out, _ = mlp(x)
    out.sum().backward()
    handle.remove()
    grads = [x.grad] + [p.grad for p in mlp.parameters()]
    return out.detach(), grads, seen["fc1"]._version > seen["version"]

result = {}
mp.patch_megatron_core()
result["default"] = in_place.in_place_backward_enabled()
out_a, grads_a, wrote_a = step(build())
mp.patch_megatron_core(in_place_backward=True)
result["set"] = in_place.in_place_backward_enabled()
out_b, grads_b, wrote_b = step(build())
result["wrote"] = [wrote_a, wrote_b]
same = [torch.equal(a, b) for a, b in zip(grads_a, grads_b)]
result["bitwise"] = torch.equal(out_a, out_b) and all(same)
try:
    build(cpu_offloading=True, cpu_offloading_activations=True, cpu_offloading_num_layers=0)
    result["refused"] = None
except ValueError as err:
    result["refused"] = str(err)
try:
    mp.patch_megatron_core(in_place_backward="1")
    result["type"] = None
except TypeError as err:
    result["type"] = str(err)
mp.unpatch_megatron_core()
result["after_unpatch"] = in_place.in_place_backward_enabled()
print(json.dumps(result))
"""
)


def test_patch_keyword_turns_the_in_place_backward_on_for_upstreams_mlp(target):
    # Upstream main allows a SwiGLU clamp on MoE layers only (its own config rule).
    for clamp in (0.5, None) if target == "release" else (None,):
        result = run_json(SCRIPT.replace("_CLAMP_", repr(clamp)), target)
        assert result["default"] is False and result["set"] is True, clamp
        assert result["wrote"] == [False, True], clamp  # only the in-place run wrote over fc1
        assert result["bitwise"], f"clamp={clamp}: the in-place backward changed the numbers"
        assert "cpu_offloading=True" in result["refused"], result["refused"]
        assert "in_place_backward must be True, False or None" in result["type"]
        assert result["after_unpatch"] is False, clamp


WARMUP_SCRIPT = """
import json, types, torch
import megatron.training.initialize as init
from mcore_activations import megatron_patch as mp

result = {}
for swiglu in (True, False):
    mp.patch_megatron_core(in_place_backward=True)
    args = types.SimpleNamespace(
        bf16=False, fp16=False, ffn_hidden_size=16, tensor_model_parallel_size=1, seq_length=8,
        context_parallel_size=1, micro_batch_size=2, swiglu=swiglu, sequence_parallel=False,
        hidden_size=8,
    )
    init.get_args = lambda: args
    real_rand = torch.rand
    torch.rand = lambda *a, device=None, **k: real_rand(*a, **k)  # the warmup asks for CUDA
    try:
        init._warmup_jit_function()
        result["swiglu" if swiglu else "gelu"] = "ran"
    except Exception as err:
        result["swiglu" if swiglu else "gelu"] = f"{type(err).__name__}: {err}"
    finally:
        torch.rand = real_rand
    result["rebound"] = init.bias_swiglu.__module__
    mp.unpatch_megatron_core()
print(json.dumps(result))
"""


def test_megatrons_jit_warmup_runs_with_the_in_place_backward_on(target):
    """megatron.training's JIT warmup, run before the first step, calls the raw bias_swiglu and
    bias_gelu on leaf tensors that want a gradient. With the option on for the process (as
    MCORE_ACTIVATIONS_IN_PLACE_BACKWARD=1 sets it in pretrain_gpt.py) they run: the raw functions
    never write over their input. (On the CPU, the warmup's CUDA tensors are made on the host.)"""
    result = run_json(WARMUP_SCRIPT, target)
    assert result["rebound"] == "mcore_activations.fusions.fused_bias_swiglu"
    assert result["swiglu"] == "ran" and result["gelu"] == "ran", result
