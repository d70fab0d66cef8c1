"""The activation audit on layers with biases: correct layers match, broken ones do not.

Megatron's MLP classes return fc2's bias for the caller to add; the audit must add it as the
caller does, and judge a layer that drops or doubles a bias as wrong.
"""

import json

import pytest
import torch

from megatron.core.transformer import activation_audit as audit
from tests.unit_tests.extensions.fake_te import install_fake_te_with_cpu_linears

CPU = torch.device("cpu")
# gpt-oss: quick-GEGLU, clamp 7, offset 1, biases on both linears.
GPT_OSS = dict(
    activation_func=audit.FUNCTIONS["quick_gelu"],
    gated_linear_unit=True,
    activation_func_clamp_value=7.0,
    glu_linear_offset=1.0,
    add_bias_linear=True,
)
BIASED = {
    "gpt-oss": GPT_OSS,
    "biased clamped SwiGLU": dict(
        audit.BUILT_IN["DeepSeek-V4 SwiGLU(clamp=7)"], add_bias_linear=True
    ),
}


def _path(name):
    return next(p for p in audit.all_paths() if p.name == name)


def _cell(path, kwargs=GPT_OSS):
    audit._init_single_process_world(CPU)
    return audit.audit_cell(path, "biased", kwargs, CPU, torch.float32)


@pytest.mark.parametrize(
    "path", [p for p in audit.all_paths() if not p.needs_te], ids=lambda p: p.name
)
def test_biased_configs_match_on_every_cpu_path(path):
    for name, kwargs in BIASED.items():
        cell = _cell(path, kwargs)
        if path.name == "SharedExpertMLP":
            # Upstream's SharedExpertMLP takes no bias: a config rule, not a wrong result.
            assert cell.status == "upstream config rule" and "bias" in cell.detail, cell
        else:
            assert cell.status == "match", (name, cell)
            assert cell.max_rel_error <= audit.TOLERANCE[torch.float32]


# The fake TE has no grouped linears; TEGroupedMLP runs in the GPU tier with real TE.
@pytest.mark.parametrize(
    "name", ["TEFusedMLP", "TEFusedMLPWithGroupedLinear", "FusedSharedExpertMLP"]
)
def test_biased_config_never_mismatches_on_the_te_paths_with_fake_te(name, monkeypatch):
    install_fake_te_with_cpu_linears(monkeypatch)
    cell = _cell(_path(name))
    assert cell.status in ("match", "refused", "upstream config rule"), cell
    if cell.status != "match":
        assert cell.detail


def test_a_path_that_drops_the_returned_bias_is_a_mismatch():
    """Teeth: the layer's own output without fc2's bias is wrong, and the audit says so."""
    path = _path("MLP (unfused)")
    dropped = audit.Path(path.name, path.build, lambda m, x, p, t: m(x)[0], path.reference)
    cell = _cell(dropped)
    assert cell.status == "MISMATCH", cell
    assert "dlinear_fc2.bias: the layer gives no gradient" in cell.detail
    assert cell.max_rel_error is None  # no number describes a missing gradient


def test_a_path_that_adds_the_bias_twice_is_a_mismatch():
    path = _path("SequentialMLP")

    def doubled(module, x, probs, tpe):
        out = path.run(module, x, probs, tpe)
        return out + module.local_experts[0].linear_fc2.bias

    cell = _cell(audit.Path(path.name, path.build, doubled, path.reference))
    assert cell.status == "MISMATCH" and cell.max_rel_error > 0.01, cell


def test_a_path_with_a_wrong_fc1_bias_gradient_is_a_mismatch():
    """Teeth on a gradient alone: the output is right, fc1's bias gradient is not."""
    path = _path("MLP (fused kernels)")

    def run(module, x, probs, tpe):
        out = path.run(module, x, probs, tpe)
        bias = module.linear_fc1.bias
        bias.register_hook(lambda g: 2 * g)
        return out

    cell = _cell(audit.Path(path.name, path.build, run, path.reference))
    assert cell.status == "MISMATCH" and "dlinear_fc1.bias" in cell.detail, cell


def test_non_finite_output_is_a_mismatch_without_a_number():
    path = _path("MLP (unfused)")
    nan = audit.Path(
        path.name, path.build, lambda m, x, p, t: path.run(m, x, p, t) * torch.nan, path.reference
    )
    cell = _cell(nan)
    assert cell.status == "MISMATCH" and cell.max_rel_error is None
    assert "output: non-finite values" in cell.detail


def test_cli_json_is_strict_for_a_biased_config(tmp_path, capsys):
    config = tmp_path / "gpt-oss.json"
    config.write_text(
        json.dumps(
            {
                "name": "gpt-oss",
                "activation_func": "quick_gelu",
                "gated_linear_unit": True,
                "activation_func_clamp_value": 7,
                "glu_linear_offset": 1,
                "add_bias_linear": True,
            }
        )
    )
    out = tmp_path / "audit.json"
    assert audit.main(["--config", str(config), "--device", "cpu", "--json", str(out)]) == 0
    text = out.read_text()
    assert "Infinity" not in text and "NaN" not in text
    cells = json.loads(text)
    assert {c["status"] for c in cells} <= {"match", "upstream config rule", "unavailable"}
    assert "**MISMATCH**" not in capsys.readouterr().out
