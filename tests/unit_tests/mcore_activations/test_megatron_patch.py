"""The patch machinery, on CPU in the fork's environment (upstream itself: tests/upstream)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from mcore_activations import megatron_patch as mp
from mcore_activations.upstream_fingerprints import CAPABILITIES, KNOWN_UPSTREAMS
from mcore_activations.upstream_patch.upstream import MLP_MODULE, SHARED_MODULE, TE_MODULE

REPO = Path(__file__).resolve().parents[3]
ARCHIVES = sorted((REPO.parent / "shared" / "upstream").glob("megatron-lm-main-*.tar.gz"))

SOURCE = textwrap.dedent(
    """
    import torch

    def plain(x):
        return x

    if HAVE_TE:
        class Fused:
            @staticmethod
            def build(x):
                return x + 1
    else:
        Fused = None

    try:
        class Guarded:
            def method(self):
                return 1
    except ImportError:
        pass

    alias = plain
    """
)


@pytest.fixture
def module_file(tmp_path) -> Path:
    path = tmp_path / "mod.py"
    path.write_text(SOURCE)
    return path


@pytest.mark.parametrize("qualname", ["plain", "Fused.build", "Guarded.method", "alias"])
def test_fingerprint_finds_definitions_inside_conditional_blocks(module_file, qualname):
    found = mp.source_fingerprint(str(module_file), qualname)
    assert found is not None and len(found) == 16


def test_fingerprint_is_none_for_a_missing_definition(module_file):
    assert mp.source_fingerprint(str(module_file), "Fused.missing") is None
    assert mp.source_fingerprint(str(module_file), "nothing") is None


def test_fingerprint_changes_with_the_body_and_the_decorators(module_file):
    before = mp.source_fingerprint(str(module_file), "Fused.build")
    other = mp.source_fingerprint(str(module_file), "plain")
    module_file.write_text(SOURCE.replace("return x + 1", "return x + 2"))
    after_body = mp.source_fingerprint(str(module_file), "Fused.build")
    module_file.write_text(SOURCE.replace("@staticmethod", "@classmethod"))
    after_decorator = mp.source_fingerprint(str(module_file), "Fused.build")
    assert len({before, after_body, after_decorator}) == 3
    assert mp.source_fingerprint(str(module_file), "plain") == other  # other objects unchanged


def test_known_upstreams_cover_every_target_they_define():
    for key, known in KNOWN_UPSTREAMS.items():
        targets = known["targets"]
        assert known["label"]
        assert f"{MLP_MODULE}:MLP.forward" in targets, key
        assert f"{SHARED_MODULE}:SharedExpertMLP.linear_fc1_forward_and_act" in targets, key
        assert all(len(v) == 16 for v in targets.values())
    # 0.19.2 builds TEFusedMLP's activation in a method; main in a module-level function.
    assert f"{TE_MODULE}:TEFusedMLP._make_activation_op" in KNOWN_UPSTREAMS["0.19.2"]["targets"]
    assert f"{TE_MODULE}:_make_te_ops_activation" in KNOWN_UPSTREAMS["0.20.0"]["targets"]


def test_every_known_upstream_has_its_capabilities():
    assert set(CAPABILITIES) == set(KNOWN_UPSTREAMS)
    # Which method builds TEFusedMLP's activation op is also what the fingerprints record.
    for key, capabilities in CAPABILITIES.items():
        targets = KNOWN_UPSTREAMS[key]["targets"]
        in_method = f"{TE_MODULE}:TEFusedMLP._make_activation_op" in targets
        assert capabilities.te_activation_op_method == in_method, key
        assert (f"{TE_MODULE}:_make_te_ops_activation" in targets) != in_method, key


def test_patch_logic_names_no_upstream_version():
    """What differs between upstream versions is data beside the fingerprints, not code."""
    package = Path(mp.__file__).parent
    for path in [Path(mp.__file__), *sorted((package / "upstream_patch").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        }
        strings = [
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ]
        for key in KNOWN_UPSTREAMS:
            assert not [s for s in strings if key in s], (path.name, key)


@pytest.mark.skipif(not ARCHIVES, reason="the upstream main archive of ../shared/upstream")
def test_recorded_fingerprints_of_main_match_the_archive(tmp_path):
    with tarfile.open(ARCHIVES[0]) as archive:
        archive.extractall(tmp_path, filter="data")
    (core,) = tmp_path.glob("*/megatron/core")
    tool = importlib.import_module("tools.fingerprint_upstream")
    assert tool.fingerprints(core) == KNOWN_UPSTREAMS["0.20.0"]["targets"]


def test_the_standalone_fork_is_not_patched():
    assert mp.is_standalone_fork()
    with pytest.raises(mp.UnsupportedUpstreamError, match="standalone fork"):
        mp.patch_megatron_core()
    assert mp.patch_report() is None


@pytest.mark.parametrize("before", [False, True])
def test_a_refused_patch_leaves_the_in_place_default_as_it_was(before):
    from mcore_activations.fusions import in_place

    with in_place.use_in_place_backward(before):
        with pytest.raises(mp.UnsupportedUpstreamError):
            mp.patch_megatron_core(in_place_backward=not before)
        assert in_place.in_place_backward_enabled() is before
        with pytest.raises(TypeError, match="in_place_backward must be True, False or None"):
            mp.patch_megatron_core(in_place_backward="on")
        assert in_place.in_place_backward_enabled() is before


def test_autopatch_leaves_the_standalone_fork_alone():
    code = """
        import megatron.core.transformer.mlp
        import mcore_activations.autopatch
        from mcore_activations import megatron_patch
        assert megatron_patch.patch_report() is None
        print("OK")
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"MCORE_ACTIVATIONS_PATCH": "1", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "OK"


def test_package_import_is_light():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, mcore_activations; print('torch' in sys.modules)"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"  # the .pth hook imports it at every interpreter start
