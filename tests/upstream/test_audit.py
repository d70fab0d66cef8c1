"""The audit on upstream's own classes: silent mismatches before the patch, none after."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import target_env

CLAMP = "DeepSeek-V4 SwiGLU(clamp=0.5)"
QGEGLU = "gpt-oss quick-GEGLU(clamp=1.5, offset=1)"
GEGLU = "GEGLU (erf)"


def _audit(target: str, tmp_path) -> tuple[int, dict, str]:
    out = tmp_path / "audit.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mcore_activations.upstream_audit",
            "--before-after",
            "--device",
            "cpu",
            "--json",
            str(out),
        ],
        env=target_env(target),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert out.is_file(), done.stderr[-4000:]
    return done.returncode, json.loads(out.read_text())["tables"], done.stdout


def _cells(table):
    return [cell for row in table.values() for cell in row.values()]


def test_audit_before_and_after_the_patch(target, tmp_path):
    rc, tables, stdout = _audit(target, tmp_path)
    before, after = tables["before"], tables["after"]

    # After: every path computes every configured activation, or upstream's own config rules
    # reject the config (squared ReLU with bias_activation_fusion). Nothing else.
    assert rc == 0, stdout
    for cell in _cells(after):
        assert cell.startswith(("match", "exact", "unavailable", "upstream config rule")), cell
    assert all(
        c.startswith("match")
        for c in after["MLP (bias_activation_fusion)"].values()
        if not c.startswith("upstream config rule")
    )

    # Before: upstream's known silent failures, as the audit must find them.
    fused = before["MLP (bias_activation_fusion)"]
    assert fused[GEGLU].startswith("MISMATCH")  # tanh GELU where F.gelu (erf) is configured
    assert fused[QGEGLU].startswith("error")  # quick-GEGLU without per-token scale
    assert before["SequentialMLP (bias_activation_fusion)"][GEGLU].startswith("error")
    if target == "release":
        # 0.19.2's fused SwiGLU ignores the DeepSeek-V4 clamp: a silent mismatch, also in the
        # shared expert and the routed experts.
        assert fused[CLAMP].startswith("MISMATCH")
        assert before["SharedExpertMLP (bias_activation_fusion)"][CLAMP].startswith("MISMATCH")
        assert before["SequentialMLP (bias_activation_fusion)"][CLAMP].startswith("MISMATCH")
    else:
        assert fused[CLAMP].startswith("match")  # fixed upstream by #5940
        assert before["compiled entry points"]["compiled clamped_swiglu (#6918 sequence)"] == (
            "STALE (off by 0.2620)"
        )
    assert all(c.startswith("match") for c in before["MLP (unfused)"].values())
