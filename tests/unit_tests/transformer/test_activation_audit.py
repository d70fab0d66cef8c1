"""The activation audit (the README's main job) on the CPU paths."""

import pytest
import torch
import torch.nn.functional as F

from mcore_activations import audit_runner
from megatron.core.transformer import activation_audit as audit
from megatron.core.transformer.activation_spec import ActivationKind, ActivationSpec
from tests.unit_tests.extensions.fake_te import install_fake_te_with_cpu_linears

CPU_PATHS = [p for p in audit.all_paths() if not p.needs_te]


@pytest.fixture(scope="module")
def cells():
    return audit.run_audit(audit.BUILT_IN, torch.device("cpu"), torch.float32, paths=CPU_PATHS)


def test_builtin_set_matches_on_every_cpu_path(cells):
    assert len(cells) == len(CPU_PATHS) * len(audit.BUILT_IN)
    assert not [c for c in cells if c.status == "MISMATCH"]
    matched = {(c.path, c.activation) for c in cells if c.status == "match"}
    for path in ("MLP (unfused)", "SharedExpertMLP", "SequentialMLP"):
        assert all((path, act) in matched for act in audit.BUILT_IN)
    # Upstream's TransformerConfig allows bias_activation_fusion only for some activations: its
    # own rule, labelled so (not this project's refusal).
    not_built = [c for c in cells if c.status not in ("match",)]
    assert not_built and all(
        c.path == "MLP (fused kernels)" and c.status == "upstream config rule" and c.detail
        for c in not_built
    ), not_built


def test_table_lists_every_cell(cells):
    table = audit.format_table(cells, list(audit.BUILT_IN))
    assert table.count("\n") == len(CPU_PATHS) + 1
    assert "match (" in table and "MISMATCH" not in table


def test_audit_detects_a_wrong_activation(monkeypatch):
    """Teeth: a layer computing plain SwiGLU for a clamped config is reported as MISMATCH."""
    path = CPU_PATHS[0]
    plain = ActivationSpec(ActivationKind.SILU, gated=True)

    def wrong_reference(params, x, module, probs, tpe):
        return audit._mlp_reference(params, x, plain, module.config)

    wrong = audit.Path(path.name, path.build, path.run, wrong_reference)
    cell = audit.audit_cell(
        wrong,
        "clamped",
        audit.BUILT_IN["DeepSeek-V4 SwiGLU(clamp=7)"],
        torch.device("cpu"),
        torch.float32,
    )
    assert cell.status == "MISMATCH" and cell.max_rel_error > 0.1


CLAMPED = ("DeepSeek-V4 SwiGLU(clamp=7)", "gpt-oss quick-GEGLU(clamp=7, offset=1)")


def test_bf16_audit_compares_at_the_layers_precision():
    """In bf16 the reference applies the activation to the pre-activations rounded as the layer
    rounds them: a correct bf16 layer matches (it reported 9-42 % errors on the clamped
    gradients against the unrounded reference)."""
    paths = [p for p in CPU_PATHS if p.name in ("MLP (unfused)", "SequentialMLP")]
    to_run = {name: audit.BUILT_IN[name] for name in CLAMPED}
    cells = audit.run_audit(to_run, torch.device("cpu"), torch.bfloat16, paths=paths)
    assert [c.status for c in cells] == ["match"] * len(cells), cells


def test_bf16_audit_still_detects_a_wrong_activation():
    path = CPU_PATHS[0]
    plain = ActivationSpec(ActivationKind.SILU, gated=True)

    def wrong_reference(params, x, module, probs, tpe):
        return audit._mlp_reference(params, x, plain, module.config, dtype=torch.bfloat16)

    wrong = audit.Path(path.name, path.build, path.run, wrong_reference)
    kwargs = audit.BUILT_IN["DeepSeek-V4 SwiGLU(clamp=7)"]
    cell = audit.audit_cell(wrong, "clamped", kwargs, torch.device("cpu"), torch.bfloat16)
    assert cell.status == "MISMATCH" and cell.max_rel_error > 0.1


def test_cli_single_activation_and_json(tmp_path, capsys):
    out = tmp_path / "audit.json"
    status = audit.main(
        [
            "--activation-func",
            "silu",
            "--gated-linear-unit",
            "--activation-func-clamp-value",
            "3",
            "--device",
            "cpu",
            "--json",
            str(out),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert "SwiGLU(clamp=3)" in printed
    # The TE paths do not run on a CPU device; the audit says which and why, once.
    (why,) = [line for line in printed.splitlines() if ": unavailable: " in line]
    te_paths = [p.name for p in audit.all_paths() if p.needs_te]
    assert why.startswith(f"- {', '.join(te_paths)}: unavailable: Transformer Engine ")
    assert '"status": "match"' in out.read_text()


def test_cli_rejects_invalid_configuration():
    with pytest.raises(SystemExit):
        audit.main(["--activation-func", "silu", "--activation-func-clamp-value", "-1"])
    assert audit.FUNCTIONS["silu"] is F.silu


def _no_audit(monkeypatch):
    """Makes running the audit an error: usage errors must be caught before it starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("the audit ran despite a usage error")

    monkeypatch.setattr(audit, "run_audit", refuse)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gated-linear-unit"], "--gated-linear-unit describe one activation"),
        (["--glu-linear-offset", "1"], "need --activation-func"),
        (["--device", "bogus"], "--device 'bogus' is not a device"),
        (["--device", "meta"], "the audit runs on cpu or cuda"),
        (["--json", "/nonexistent-dir/audit.json"], "--json /nonexistent-dir/audit.json: cannot"),
    ],
)
def test_cli_usage_errors_exit_2_before_running(argv, message, monkeypatch, capsys):
    _no_audit(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        audit.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_cuda_device_without_a_gpu_is_a_usage_error(monkeypatch, capsys):
    _no_audit(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        audit.main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "has no usable CUDA GPU" in capsys.readouterr().err


def test_cli_json_to_stdout_keeps_stdout_parseable(monkeypatch, capsys):
    import json

    def fake_run(to_run, device, dtype, paths=None, progress=None):
        cells = [audit.Cell("MLP (unfused)", name, "match", max_rel_error=0.0) for name in to_run]
        for cell in cells:
            progress(cell)
        return cells

    monkeypatch.setattr(audit, "run_audit", fake_run)
    assert audit.main(["--device", "cpu", "--json", "-"]) == 0
    captured = capsys.readouterr()
    cells = json.loads(captured.out)  # nothing but the JSON
    assert {c["activation"] for c in cells} == set(audit.BUILT_IN)
    total = len(audit.all_paths()) * len(cells)
    assert "| path |" in captured.err and f"[{len(cells)}/{total}]" in captured.err
    assert "Each cell: forward and backward" in captured.err  # the legend


def test_cli_audits_the_configurations_of_a_file(tmp_path, monkeypatch, capsys):
    import json

    seen = {}

    def fake_run(to_run, device, dtype, paths=None, progress=None):
        seen.update(to_run)
        return [audit.Cell("MLP (unfused)", name, "match", max_rel_error=0.0) for name in to_run]

    monkeypatch.setattr(audit, "run_audit", fake_run)
    path = tmp_path / "model.json"
    entries = [
        {
            "name": "my-moe",
            "activation_func": "silu",
            "gated_linear_unit": True,
            "activation_func_clamp_value": 7,
            "add_bias_linear": True,
        },
        {"activation_func": "squared_relu", "activation_func_tanh_clamp_scale": 10.0},
    ]
    path.write_text(json.dumps(entries))
    assert audit.main(["--config", str(path), "--device", "cpu"]) == 0
    assert list(seen) == ["my-moe", "squared-ReLU(tanh_scale=10)"]
    assert seen["my-moe"]["activation_func"] is F.silu and seen["my-moe"]["add_bias_linear"]
    assert "| path | my-moe | squared-ReLU(tanh_scale=10) |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content, message",
    [
        ("{", "cannot read"),
        ('{"activation_func": "swish"}', "needs activation_func, one of"),
        ('{"activation_func": "silu", "hidden_size": 8}', "entry 0 sets hidden_size"),
        ('{"activation_func": "silu", "activation_func_clamp_value": -1}', "not a valid config"),
    ],
)
def test_cli_config_file_errors_exit_2(tmp_path, monkeypatch, capsys, content, message):
    _no_audit(monkeypatch)
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        audit.main(["--config", str(path), "--device", "cpu"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# The TE paths, on CPU: fake TE ops computing te-ops.md's formulas and TE-free linears.
# Checks the audit's parent comparison end to end.
TE_DENSE = ("TEFusedMLP", "TEFusedMLPWithGroupedLinear")


@pytest.fixture
def fake_te(monkeypatch):
    return install_fake_te_with_cpu_linears(monkeypatch)


def _te_cells(names=TE_DENSE):
    audit._init_single_process_world(torch.device("cpu"))
    paths = [p for p in audit.all_paths() if p.name in names]
    return [
        audit.audit_cell(path, act, kwargs, torch.device("cpu"), torch.float32)
        for path in paths
        for act, kwargs in audit.BUILT_IN.items()
    ]


def test_te_fused_classes_match_their_parents_with_fake_te(fake_te):
    cells = _te_cells()
    assert not [c for c in cells if c.status == "MISMATCH"], cells
    matched = [c for c in cells if c.status == "match"]
    assert {c.path for c in matched} == set(TE_DENSE)
    assert all(c.against == "vs MLP on the same weights" for c in matched)
    # TEFusedMLP has no op for a non-row-scaled tanh-clamped squared ReLU: refused, with reason.
    refused = {(c.path, c.activation) for c in cells if c.status == "refused"}
    assert ("TEFusedMLP", "squared-ReLU(tanh_scale=10)") in refused


def test_te_audit_detects_a_fused_class_that_ignores_the_clamp(fake_te):
    """Teeth: the upstream bug (ClampedSwiGLU lowered but plain SwiGLU computed) is a MISMATCH."""
    fake_te.pytorch.ops.ClampedSwiGLU = fake_te.pytorch.ops.SwiGLU
    path = next(p for p in audit.all_paths() if p.name == "TEFusedMLP")
    audit._init_single_process_world(torch.device("cpu"))
    cell = audit.audit_cell(
        path,
        "clamped",
        audit.BUILT_IN["DeepSeek-V4 SwiGLU(clamp=7)"],
        torch.device("cpu"),
        torch.float32,
    )
    assert cell.status == "MISMATCH" and cell.max_rel_error > 0.1


def test_checkpoint_layout_gradients_refuse_tensor_subclass_parameters():
    """A quantized weight's ``.data`` setter may quantize or copy in place: never swap it."""

    class QuantizedLike(torch.nn.Parameter):
        pass

    layer = torch.nn.Linear(4, 4)
    layer.weight = QuantizedLike(torch.randn(4, 4))
    layer(torch.randn(2, 4)).sum().backward()
    before = layer.weight.detach().clone()
    with pytest.raises(ValueError, match="'weight' of Linear is a QuantizedLike"):
        audit_runner.grads_in_checkpoint_layout(layer)
    assert torch.equal(layer.weight, before)


def test_checkpoint_layout_gradients_are_the_identity_without_hooks():
    layer = torch.nn.Linear(4, 3)
    layer(torch.randn(2, 4)).sum().backward()
    weight = layer.weight.detach().clone()
    grads = audit_runner.grads_in_checkpoint_layout(layer)
    assert torch.equal(grads["weight"], layer.weight.grad)
    assert torch.equal(grads["bias"], layer.bias.grad)
    assert torch.equal(layer.weight, weight)
