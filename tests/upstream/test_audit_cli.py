"""mcore-activations-audit's command line: --config, --dtype, legend, progress, one copy of each
warning, help on every flag, one-line usage errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import target_env

AUDIT = Path(sys.executable).parent / "mcore-activations-audit"
GPT_OSS = {
    "name": "gpt-oss",
    "activation_func": "quick_gelu",
    "gated_linear_unit": True,
    "activation_func_clamp_value": 7,
    "glu_linear_offset": 1,
    "add_bias_linear": True,
}


def _audit(args, tmp_path, target="release"):
    return subprocess.run(
        [str(AUDIT), *args],
        env=target_env(target),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )


def test_help_names_the_console_script_and_every_flag_has_help(tmp_path):
    done = _audit(["--help"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: mcore-activations-audit ")
    assert "examples:\n  upstream as installed, then patched" in done.stdout
    from mcore_activations.upstream_audit import build_parser

    assert all(action.help for action in build_parser()._actions)


@pytest.mark.skipif(
    subprocess.run(
        [sys.executable, "-c", "import torch; assert torch.cuda.is_available()"]
    ).returncode
    == 0,
    reason="needs a machine without CUDA",
)
def test_cuda_without_a_gpu_is_one_line(tmp_path):
    done = _audit(["--device", "cuda"], tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "usage:" not in done.stderr
    assert "mcore-activations-audit: error: --device cuda but this machine has no usable CUDA" in (
        done.stderr
    )


def test_a_bad_config_file_is_a_usage_error(tmp_path):
    (tmp_path / "bad.json").write_text('{"activation_func": "swish"}')
    done = _audit(["--config", "bad.json"], tmp_path)
    assert done.returncode == 2
    assert "--config bad.json: entry 0 needs activation_func" in done.stderr


def test_config_file_in_bfloat16_with_progress_legend_and_one_copy_of_each_warning(
    target, tmp_path
):
    (tmp_path / "gpt-oss.json").write_text(json.dumps(GPT_OSS))
    args = ["--before-after", "--config", "gpt-oss.json", "--dtype", "bfloat16"]
    done = _audit([*args, "--json", "out.json"], tmp_path, target)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["dtype"] == "bfloat16"
    after = result["tables"]["after"]
    assert after["MLP (unfused)"]["gpt-oss"].startswith("match")
    assert after["SequentialMLP (bias_activation_fusion)"]["gpt-oss"].startswith("match")
    shared = after["SharedExpertMLP (bias_activation_fusion)"]["gpt-oss"]
    assert shared.startswith("upstream config rule (bias is not supported")
    assert "| path | gpt-oss |" in done.stdout
    assert "`upstream config rule`: upstream megatron-core's own" in done.stdout  # the legend
    assert "[10/10] SequentialMLP (bias_activation_fusion) / gpt-oss: match" in done.stderr
    # Upstream warns from every TransformerConfig: each distinct warning once.
    for line in set(done.stderr.splitlines()):
        if "Warning: " in line:
            assert done.stderr.count(line) == 1, line


def test_builtin_labels_end_with_the_spec_name(target):
    """One vocabulary with the fork's audit: a column is ActivationSpec.name after its family."""
    code = """
import json
from mcore_activations import upstream_audit as ua
from mcore_activations.activation_spec import ActivationSpec
print(json.dumps({name: ActivationSpec.from_config(ua._config(f, fused=False, device="cpu")).name
                  for name, f in ua.builtin_activations().items()}))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], env=target_env(target), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    names = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(label.endswith(name) for label, name in names.items()), names
    assert "GEGLU (erf)" in names  # F.gelu; the fork's "GEGLU" column is the tanh fast_gelu


def test_bfloat16_keeps_its_teeth(tmp_path):
    """In bf16 a correct layer matches, and 0.19.2's fused SwiGLU ignoring the clamp does not."""
    clamped = {
        "name": "dsv4",
        "activation_func": "silu",
        "gated_linear_unit": True,
        "activation_func_clamp_value": 7,
        "add_bias_linear": True,
    }
    (tmp_path / "dsv4.json").write_text(json.dumps(clamped))
    args = ["--before-after", "--config", "dsv4.json", "--dtype", "bfloat16", "--json", "o.json"]
    done = _audit(args, tmp_path, "release")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tables = json.loads((tmp_path / "o.json").read_text())["tables"]
    assert tables["before"]["MLP (bias_activation_fusion)"]["dsv4"].startswith("MISMATCH")
    assert tables["after"]["MLP (bias_activation_fusion)"]["dsv4"].startswith("match")
    assert tables["before"]["MLP (unfused)"]["dsv4"].startswith("match")


BROKEN_IN_THE_RUNNER = """
import dataclasses, sys
from mcore_activations import audit_runner, upstream_audit
forward_backward = audit_runner._forward_backward
def broken(path, *args, **kwargs):
    if path.name == "MLP (unfused)":
        wrong = path.run
        path = dataclasses.replace(path, run=lambda *a: wrong(*a) * 1.01)
    return forward_backward(path, *args, **kwargs)
audit_runner._forward_backward = broken
sys.exit(upstream_audit.main(sys.argv[1:]))
"""


def test_a_path_broken_in_the_shared_runner_is_reported(tmp_path):
    """Teeth through the runner both audits share (the fork's side: test_activation_audit_runner
    in the CPU tier): upstream's correct unfused MLP, made wrong inside the runner, is reported."""
    (tmp_path / "gpt-oss.json").write_text(json.dumps(GPT_OSS))
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            BROKEN_IN_THE_RUNNER,
            "--config",
            "gpt-oss.json",
            "--json",
            "o.json",
        ],
        env=target_env("release"),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    table = json.loads((tmp_path / "o.json").read_text())["tables"]["as installed"]
    assert table["MLP (unfused)"]["gpt-oss"].startswith("MISMATCH (1.0e-02, worst: "), table
    assert table["SequentialMLP (unfused)"]["gpt-oss"].startswith(("match", "error (")), table
    assert "| MLP (unfused) | MISMATCH (1.0e-02" in done.stdout
