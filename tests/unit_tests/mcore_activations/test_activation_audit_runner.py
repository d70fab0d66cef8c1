"""One catalogue and one runner behind both audits.

The fork's audit (``scripts/main.sh``) and ``mcore-activations-audit`` read their columns from
``mcore_activations.activation_catalogue`` and judge every cell through
``mcore_activations.audit_runner``: a path broken inside the runner shows up in both outputs.
The upstream audit runs here on this fork's classes (an API-compatible megatron-core) with its
upstream check stubbed; tests/upstream/test_audit_cli.py runs the same injection on upstream.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mcore_activations import activation_catalogue as catalogue
from mcore_activations import audit_runner, megatron_patch
from mcore_activations import upstream_audit as ua
from megatron.core.transformer import activation_audit as audit
from tests.unit_tests import activation_catalog

CLAMPED = {
    "name": "dsv4",
    "activation_func": "silu",
    "gated_linear_unit": True,
    "activation_func_clamp_value": 7,
}


def test_every_entry_has_a_use_and_every_use_a_reason():
    assert all(entry.values for entry in catalogue.CATALOGUE)
    assert all(len(why) > 40 for why in catalogue.USES.values())
    assert len(catalogue.BY_KEY) == len(catalogue.CATALOGUE)
    assert set(audit.FUNCTIONS) == set(catalogue.FUNCTION_NAMES)


def test_the_audits_and_the_tests_read_the_catalogue():
    fork = catalogue.columns(catalogue.FORK_AUDIT, audit.FUNCTIONS)
    assert audit.BUILT_IN == fork
    assert list(fork) == [
        "SwiGLU",
        "DeepSeek-V4 SwiGLU(clamp=7)",
        "Kimi-K3 SiTU-GLU(s_g=4, s_l=25)",
        "gpt-oss quick-GEGLU(clamp=7, offset=1)",
        "GEGLU",
        "squared-ReLU(tanh_scale=10)",
    ]
    upstream = catalogue.columns(catalogue.UPSTREAM_AUDIT, audit.FUNCTIONS)
    assert (
        list(upstream)
        == list(ua.builtin_activations())
        == [
            "SwiGLU",
            "DeepSeek-V4 SwiGLU(clamp=0.5)",
            "gpt-oss quick-GEGLU(clamp=1.5, offset=1)",
            "GEGLU (erf)",
            "squared-ReLU",
        ]
    )
    tests = catalogue.entries(catalogue.TESTS)
    assert list(activation_catalog.CONFIGS) == [entry.key for entry in tests]
    assert activation_catalog.NEEDS_MOE == {"swiglu_clamp"}


def test_one_entry_carries_each_uses_clamp():
    entry = catalogue.BY_KEY["swiglu_clamp"]
    clamps = {
        use: entry.config(use, audit.FUNCTIONS)["activation_func_clamp_value"]
        for use in entry.values
    }
    assert clamps == {
        catalogue.TESTS: 1.5,
        catalogue.FORK_AUDIT: 7.0,
        catalogue.UPSTREAM_AUDIT: 0.5,
    }
    assert entry.label(catalogue.FORK_AUDIT, audit.FUNCTIONS) == "DeepSeek-V4 SwiGLU(clamp=7)"


def test_catalogue_errors_name_the_entry():
    with pytest.raises(KeyError, match="situ_glu is not run by the upstream audit"):
        catalogue.BY_KEY["situ_glu"].config(catalogue.UPSTREAM_AUDIT, audit.FUNCTIONS)
    with pytest.raises(ValueError, match="swish"):
        catalogue.Activation("x", "swish", True, {catalogue.TESTS: {}})
    with pytest.raises(ValueError, match="unknown uses"):
        catalogue.Activation("x", "silu", True, {"benchmarks": {}})
    with pytest.raises(KeyError, match="unknown use"):
        catalogue.entries("benchmarks")


@pytest.fixture
def upstream_stand_in(monkeypatch):
    """The upstream audit on this fork: its version check stubbed, its dense paths only (the
    fork has no ``moe_utils.get_default_pg_collection``)."""
    monkeypatch.setattr(megatron_patch, "installed_upstream", lambda: (None, "stand-in"))
    dense = [p for p in ua.paths(with_te=False) if p.name.startswith("MLP")]
    monkeypatch.setattr(ua, "paths", lambda with_te: dense)
    audit._init_single_process_world(torch.device("cpu"))


@pytest.fixture
def runner_calls(monkeypatch):
    """Records which audit reached the runner, and with how many cells."""
    calls = []
    run = audit_runner.run_audit

    def spy(paths, activations, device, dtype, settings, **kwargs):
        calls.append(settings)
        return run(paths, activations, device, dtype, settings, **kwargs)

    monkeypatch.setattr(audit_runner, "run_audit", spy)
    return calls


def _both_audits(tmp_path):
    config = tmp_path / "dsv4.json"
    config.write_text(json.dumps(CLAMPED))
    fork_json, upstream_json = tmp_path / "fork.json", tmp_path / "upstream.json"
    fork_rc = audit.main(["--config", str(config), "--device", "cpu", "--json", str(fork_json)])
    up_rc = ua.main(["--config", str(config), "--device", "cpu", "--json", str(upstream_json)])
    fork = {c["path"]: c for c in json.loads(fork_json.read_text())}
    upstream = json.loads(upstream_json.read_text())["tables"]["as installed"]
    return fork_rc, fork, up_rc, upstream


def test_both_command_lines_run_the_one_runner(tmp_path, upstream_stand_in, runner_calls):
    fork_rc, fork, up_rc, upstream = _both_audits(tmp_path)
    assert [s.metric for s in runner_calls] == [
        audit_runner.max_relative,
        audit_runner.norm_relative,
    ]
    assert fork_rc == 0 and fork["MLP (unfused)"]["status"] == "match"
    assert up_rc == 0 and upstream["MLP (unfused)"]["dsv4"].startswith("match ")


def test_a_path_broken_in_the_runner_shows_in_both_outputs(
    tmp_path, upstream_stand_in, runner_calls, monkeypatch, capsys
):
    """Teeth through both command lines: the runner runs a wrong layer, both audits say so."""
    forward_backward = audit_runner._forward_backward

    def broken(path, *args, **kwargs):
        if path.name == "MLP (unfused)":
            wrong = path.run
            path = dataclasses.replace(path, run=lambda *a: wrong(*a) * 1.01)
        return forward_backward(path, *args, **kwargs)

    monkeypatch.setattr(audit_runner, "_forward_backward", broken)
    fork_rc, fork, up_rc, upstream = _both_audits(tmp_path)
    assert len(runner_calls) == 2
    assert fork_rc == 1 and up_rc == 1
    assert fork["MLP (unfused)"]["status"] == "MISMATCH"
    assert upstream["MLP (unfused)"]["dsv4"].startswith("MISMATCH (1.0e-02, worst: ")
    # Only the broken path: the other rows still match.
    assert fork["MLP (fused kernels)"]["status"] == "match"
    assert upstream["MLP (bias_activation_fusion)"]["dsv4"].startswith("match ")
    out = capsys.readouterr().out
    assert "| MLP (unfused) | **MISMATCH** 1.00e-02 |" in out
    assert "| MLP (unfused) | MISMATCH (1.0e-02, worst: " in out
