"""The two distributions built from this source own disjoint files (docs/packaging.md)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _build_wheel(project: Path, out: Path) -> zipfile.ZipFile:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(project),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def _metadata(wheel: zipfile.ZipFile) -> str:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return wheel.read(name).decode()


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    root, standalone = tmp_path_factory.mktemp("root"), tmp_path_factory.mktemp("standalone")
    return _build_wheel(REPO, root), _build_wheel(REPO / "standalone", standalone)


def test_the_patch_distribution_installs_no_megatron_file(wheels):
    patch, _ = wheels
    names = patch.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"mcore_activations", "mcore_activations_autopatch.pth"}
    assert "MCORE_ACTIVATIONS_PATCH" in patch.read("mcore_activations_autopatch.pth").decode()
    metadata = _metadata(patch)
    assert "Name: megatron-core-activations" in metadata
    assert "License-File: LICENSE" in metadata or "LICENSE" in " ".join(names)
    entry_points = [n for n in names if n.endswith("entry_points.txt")]
    assert (
        "mcore-activations-audit = mcore_activations.upstream_audit:main"
        in patch.read(entry_points[0]).decode()
    )


def test_the_standalone_fork_ships_megatron_core_from_the_same_source(wheels):
    _, standalone = wheels
    names = standalone.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"megatron"}
    # Upstream's megatron is a namespace package: no megatron/__init__.py to overwrite.
    assert "megatron/__init__.py" not in names
    assert "megatron/core/transformer/mlp.py" in names
    alias = standalone.read("megatron/core/fusions/fused_bias_swiglu.py").decode()
    assert "import mcore_activations.fusions.fused_bias_swiglu as _canonical" in alias
    metadata = _metadata(standalone)
    assert "Name: megatron-core" in metadata
    assert "Requires-Dist: megatron-core-activations" in metadata
