"""patch_megatron_core() on the standalone fork says why the fork was imported, and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CODE = """
import mcore_activations
try:
    mcore_activations.patch_megatron_core()
except Exception as err:
    print(f"{type(err).__name__}: {err}")
"""


def _run(cwd, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_ACTIVATIONS_PATCH")}
    env["PYTHONPATH"] = pythonpath or ""
    done = subprocess.run(
        [sys.executable, "-c", CODE], cwd=cwd, capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_run_from_the_clone_root_names_the_current_directory():
    out = _run(REPO)
    assert out.startswith("UnsupportedUpstreamError: megatron.core is this project's standalone")
    assert f"imported from the current directory ({REPO})" in out
    assert "Run the script from another directory" in out


def test_fork_on_the_path_elsewhere_names_where_it_came_from(tmp_path):
    out = _run(tmp_path, pythonpath=str(REPO))
    assert f"It was imported from {REPO}." in out
    assert "current directory" not in out
