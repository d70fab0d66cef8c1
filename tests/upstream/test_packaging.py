"""Installing megatron-core-activations next to upstream overwrites and uninstalls nothing."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

SITE = Path(sysconfig.get_paths()["purelib"])
INSTALL_LOG = Path(sys.prefix) / "install-activations.log"


def _record_problems(dist_name: str) -> list[str]:
    """Files of ``dist_name`` that are missing or differ from the hashes in its RECORD."""
    dist = metadata.distribution(dist_name)
    problems = []
    for entry in dist.files:
        if entry.hash is None:  # RECORD itself, and .pyc files written after installation
            continue
        path = Path(entry.locate())
        if not path.is_file():
            problems.append(f"missing {entry}")
            continue
        digest = hashlib.new(entry.hash.mode, path.read_bytes()).digest()
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != entry.hash.value:
            problems.append(f"changed {entry}")
    return problems


def test_upstream_release_is_installed_and_intact():
    assert metadata.version("megatron-core") == "0.19.2"
    assert _record_problems("megatron-core") == []


def test_installing_this_package_uninstalled_nothing():
    log = INSTALL_LOG.read_text()
    assert "Successfully installed megatron-core-activations" in log, log
    assert "uninstall" not in log.lower(), log


def test_this_package_owns_no_upstream_file():
    ours = {str(f) for f in metadata.distribution("megatron-core-activations").files}
    theirs = {str(f) for f in metadata.distribution("megatron-core").files}
    shared = {f for f in ours & theirs if not f.endswith(".pyc")}
    assert shared == set()
    assert all(not f.startswith("megatron/") for f in ours), sorted(ours)[:10]
    assert (SITE / "mcore_activations_autopatch.pth").is_file()
    assert _record_problems("megatron-core-activations") == []


@pytest.mark.alone  # every other test imports the package this one uninstalls
def test_uninstalling_leaves_upstream_intact_and_reinstall_works():
    source = os.environ.get("MCORE_ACTIVATIONS_SOURCE")
    if not source:
        pytest.skip("MCORE_ACTIVATIONS_SOURCE is not set (scripts/upstream_env.sh sets it)")
    pip = [sys.executable, "-m", "pip"]
    done = subprocess.run(
        [*pip, "uninstall", "-y", "megatron-core-activations"],
        text=True,
        capture_output=True,
        check=True,
    )
    try:
        assert "megatron-core-activations" in done.stdout
        assert _record_problems("megatron-core") == []
        assert not (SITE / "mcore_activations_autopatch.pth").exists()
        assert not (SITE / "mcore_activations").exists()
        # Upstream still imports, unpatched.
        subprocess.run(
            [sys.executable, "-c", "import megatron.core.transformer.mlp"],
            check=True,
            cwd=Path(__file__).parent,
        )
    finally:
        again = subprocess.run(
            [*pip, "install", "--no-deps", "--no-build-isolation", source],
            text=True,
            capture_output=True,
        )
    assert again.returncode == 0, again.stderr
    assert "uninstall" not in again.stdout.lower()
    assert _record_problems("megatron-core") == []
