"""The upstream audit on layers with biases: correct layers match, broken ones do not.

Upstream's MLP classes return fc2's bias for the caller to add; an audit that forgets it would
call a correct layer wrong (fc2's bias gets no gradient), and one that ignores biases in the
reference would call a layer that drops them right.
"""

from __future__ import annotations

from conftest import run_json

GPT_OSS = """
from megatron.core.fusions.fused_bias_geglu import quick_gelu
FIELDS = dict(activation_func=quick_gelu, gated_linear_unit=True, activation_func_clamp_value=7.0,
              glu_linear_offset=1.0, add_bias_linear=True)
"""


def test_biased_gpt_oss_layer_on_every_cpu_path_before_and_after_the_patch(target):
    result = run_json(
        GPT_OSS
        + """
import json
from mcore_activations import megatron_patch, upstream_audit as ua
ua._init_parallel("cpu")
def table():
    return {path.name: ua.audit_cell(path, FIELDS, "cpu") for path in ua.paths(with_te=False)}
before = table()
megatron_patch.patch_megatron_core()
print(json.dumps({"before": before, "after": table()}))
""",
        target,
    )
    before, after = result["before"], result["after"]
    assert before["MLP (unfused)"].startswith("match"), before
    # 0.19.2's experts add fc2's bias in place on a view: upstream raises, the audit says so.
    assert before["SequentialMLP (unfused)"].startswith(("match", "error (RuntimeError")), before
    shared = "SharedExpertMLP (bias_activation_fusion)"
    # The shared expert takes no bias: upstream's own rule, not a wrong result.
    assert before[shared].startswith("upstream config rule (bias is not supported"), before
    assert after[shared] == before[shared]
    for name, cell in after.items():
        if name != shared:
            assert cell.startswith("match"), (name, cell)


def test_a_path_that_drops_the_returned_bias_is_a_mismatch(target):
    """Teeth: the audit of a layer whose caller forgets fc2's bias reports it."""
    result = run_json(
        GPT_OSS
        + """
import dataclasses, json
from mcore_activations import upstream_audit as ua
ua._init_parallel("cpu")
path = ua.mlp_path("MLP (unfused)", fused=False)
dropped = dataclasses.replace(path, run=lambda layer, x, probs, tpe: layer(x)[0])
def run_twice_bias(layer, x, probs, tpe):
    layer.linear_fc1.bias.register_hook(lambda g: 2 * g)
    return path.run(layer, x, probs, tpe)
wrong_bias_grad = dataclasses.replace(path, run=run_twice_bias)
print(json.dumps([ua.audit_cell(dropped, FIELDS, "cpu"),
                  ua.audit_cell(wrong_bias_grad, FIELDS, "cpu")]))
""",
        target,
    )
    dropped, wrong_grad = result
    assert dropped.startswith("MISMATCH") and "dlinear_fc2.bias" in dropped, dropped
    assert wrong_grad.startswith("MISMATCH") and "dlinear_fc1.bias" in wrong_grad, wrong_grad
