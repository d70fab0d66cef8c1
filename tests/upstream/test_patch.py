"""patch_megatron_core() on upstream 0.19.2 and main: what it replaces, refuses and restores."""

from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import main_tree, run_json, run_python

PATCH_AND_UNPATCH = """
import json
import megatron.core.transformer.moe.experts as experts
import megatron.core.transformer.mlp as mlp
import megatron.core.fusions.fused_bias_swiglu as swiglu
from mcore_activations import megatron_patch as mp

watched = {
    "swiglu.bias_swiglu_impl": (swiglu, "bias_swiglu_impl"),
    "mlp.bias_swiglu_impl": (mlp, "bias_swiglu_impl"),
    "experts.weighted_bias_swiglu_impl": (experts, "weighted_bias_swiglu_impl"),
    "MLP.forward": (mlp.MLP, "forward"),
    "MLP.__init__": (mlp.MLP, "__init__"),
    "quick_gelu": (mlp, "quick_gelu"),
}
before = {k: getattr(o, n) for k, (o, n) in watched.items()}
report = mp.patch_megatron_core()
during = {k: getattr(o, n) is not before[k] for k, (o, n) in watched.items()}
again = mp.patch_megatron_core() is report
targets = [p.target for p in report.patched]
mp.unpatch_megatron_core()
restored = {k: getattr(o, n) is before[k] for k, (o, n) in watched.items()}
print(json.dumps(dict(upstream=report.upstream, targets=targets, during=during, again=again,
                      restored=restored, after_unpatch=mp.patch_report() is None)))
"""


def test_patch_replaces_the_entry_points_and_unpatch_restores_them(target):
    result = run_json(PATCH_AND_UNPATCH, target)
    expected_version = {"release": "0.19.2", "main": "0.20.0"}[target]
    assert expected_version in result["upstream"]
    changed = result["during"]
    assert changed.pop("quick_gelu") is False  # an identity sentinel of upstream's dispatch
    assert all(changed.values()), changed
    assert result["again"] is True  # idempotent: the second call returns the same report
    assert all(result["restored"].values()), result["restored"]
    assert result["after_unpatch"] is True
    for name in (
        "megatron.core.transformer.mlp:MLP.forward",
        "megatron.core.transformer.moe.experts:TEGroupedMLP.__init__",
        "megatron.core.fusions.fused_bias_geglu:weighted_bias_quick_geglu_impl",
    ):
        assert name in result["targets"]
    if target == "main":
        assert "megatron.core.fusions.fused_bias_swiglu:clamped_swiglu" in result["targets"]


def test_an_unknown_version_is_refused_and_nothing_is_patched(target):
    done = run_python(
        """
        import megatron.core.package_info as info
        import megatron.core.transformer.mlp as mlp
        from mcore_activations import megatron_patch as mp
        info.MINOR = 99
        forward = mlp.MLP.forward
        try:
            mp.patch_megatron_core()
        except mp.UnsupportedUpstreamError as err:
            print("REFUSED", err)
        assert mlp.MLP.forward is forward and mp.patch_report() is None
        """,
        target,
    )
    assert done.returncode == 0, done.stderr
    assert "REFUSED mcore_activations does not know megatron-core 0.99." in done.stdout
    assert "0.19.2" in done.stdout and "0.20.0" in done.stdout  # it names what it supports


def _copy_of_core(target: str, destination: Path) -> Path:
    if target == "main":
        source = main_tree() / "megatron"
    else:
        source = Path(sysconfig.get_paths()["purelib"]) / "megatron"
    shutil.copytree(source / "core", destination / "megatron" / "core")
    return destination


def test_a_modified_upstream_source_is_refused(target, tmp_path):
    tree = _copy_of_core(target, tmp_path)
    mlp_file = tree / "megatron" / "core" / "transformer" / "mlp.py"
    text = mlp_file.read_text()
    marker = '"""Perform the forward pass through the MLP block."""'
    assert marker in text
    mlp_file.write_text(text.replace(marker, marker + "\n        pass  # a local change", 1))
    done = run_python(
        """
        import megatron.core.transformer.mlp as mlp
        from mcore_activations import megatron_patch as mp
        assert mlp.__file__.startswith(TREE), mlp.__file__
        try:
            mp.patch_megatron_core()
        except mp.UnsupportedUpstreamError as err:
            print("REFUSED", err)
        assert mp.patch_report() is None
        """.replace("TREE", repr(str(tree))),
        target,
        env={"PYTHONPATH": str(tree)},
    )
    assert done.returncode == 0, done.stderr
    assert "REFUSED" in done.stdout
    assert "megatron.core.transformer.mlp:MLP.forward" in done.stdout
    assert "MLP.__init__" not in done.stdout  # only the changed object is named


def test_environment_variable_patches_at_import(target):
    done = run_python(
        """
        import torch.nn.functional as F
        import megatron.core
        from mcore_activations import megatron_patch as mp
        report = mp.patch_report()
        assert report is not None, "not patched at import"
        print("PATCHED", report.summary())
        """,
        target,
        env={"MCORE_ACTIVATIONS_PATCH": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert "PATCHED patched megatron-core" in done.stdout
    assert "MCORE_ACTIVATIONS_PATCH: patched megatron-core" in done.stderr  # the one-line report


def test_environment_variable_unset_patches_nothing(target):
    result = run_json(
        """
        import json, sys
        import megatron.core
        print(json.dumps({"imported": "mcore_activations.megatron_patch" in sys.modules}))
        """,
        target,
    )
    assert result == {"imported": False}


def test_seed_6918_stale_clamp_before_and_exact_after(target):
    code = """
        import json
        from mcore_activations import megatron_patch as mp
        from mcore_activations.upstream_audit import stale_scalar_row
        if PATCH:
            mp.patch_megatron_core()
        print(json.dumps(stale_scalar_row("cpu")))
    """
    before = run_json(code.replace("PATCH", "False"), target)
    after = run_json(code.replace("PATCH", "True"), target)
    (before_cell,) = before.values()
    (after_cell,) = after.values()
    if target == "release":
        # 0.19.2 has no compiled clamped SwiGLU (its fused SwiGLU ignores the clamp instead,
        # which test_audit covers), and the patch adds no upstream names.
        assert before_cell.startswith("unavailable") and after_cell.startswith("unavailable")
    else:
        assert before_cell == "STALE (off by 0.2620)"  # upstream issue #6918, reproduced
        assert after_cell.startswith("exact"), after_cell


@pytest.mark.skipif(sys.version_info < (3, 12), reason="the upstream tier runs on Python 3.12")
def test_console_command_is_installed():
    script = Path(sys.prefix) / "bin" / "mcore-activations-audit"
    assert script.is_file()


def test_release_grouped_experts_fused_swiglu_computes_the_running_layers_clamp():
    """0.19.2's TEGroupedMLP calls the fused weighted SwiGLU without its clamp; patched, the call
    made during a layer's forward computes that layer's whole spec, and any other call stays
    upstream's (the layer itself needs Transformer Engine: the GPU tiers build it)."""
    result = run_json(
        """
        import json, types
        import torch
        import megatron.core.transformer.moe.experts as experts
        from mcore_activations import megatron_patch as mp
        from mcore_activations.activation_spec import ActivationSpec, ActivationKind
        from mcore_activations.upstream_patch.grouped_experts import RUNNING_GROUPED_MLP

        forward = experts.TEGroupedMLP.forward
        report = mp.patch_megatron_core()
        spec = ActivationSpec(ActivationKind.SILU, gated=True, clamp_value=0.5)
        layer = types.SimpleNamespace(activation_spec=spec)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)) * 3
        probs = torch.rand(16, 1, generator=torch.Generator().manual_seed(1))
        token = RUNNING_GROUPED_MLP.set(layer)
        try:
            inside = experts.weighted_bias_swiglu_impl(x, None, probs, False)
        finally:
            RUNNING_GROUPED_MLP.reset(token)
        outside = experts.weighted_bias_swiglu_impl(x, None, probs, False)
        expected = spec.reference(x.double()) * probs.double()
        plain = ActivationSpec(ActivationKind.SILU, gated=True).reference(x.double()) * probs
        targets = [p.target for p in report.patched]
        mp.unpatch_megatron_core()
        print(json.dumps({
            "inside": (inside.double() - expected).abs().max().item(),
            "outside": (outside.double() - plain).abs().max().item(),
            "clamp_matters": (expected - plain).abs().max().item(),
            "wrapped": "megatron.core.transformer.moe.experts:TEGroupedMLP.forward" in targets,
            "restored": experts.TEGroupedMLP.forward is forward,
        }))
        """,
        "release",
    )
    assert result["clamp_matters"] > 0.1
    assert result["inside"] < 1e-5 and result["outside"] < 1e-5
    assert result["wrapped"] and result["restored"]
