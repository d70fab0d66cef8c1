"""scripts/main.sh resolves the user's file arguments against the caller's directory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
MAIN = REPO / "scripts" / "main.sh"


def _main(args, cwd):
    env = dict(os.environ)
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("scripts/main.sh needs the project's .venv")
    return subprocess.run(
        [str(MAIN), *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize("form", ["separate", "equals"])
def test_a_relative_config_is_read_from_the_callers_directory(tmp_path, form):
    (tmp_path / "model.json").write_text('{"activation_func": "swish"}')  # refused before running
    args = ["--config", "model.json"] if form == "separate" else ["--config=model.json"]
    done = _main(args, tmp_path)
    assert done.returncode == 2
    # Found (and read) in the caller's directory: the error is about its content.
    assert f"--config {tmp_path}/model.json: entry 0 needs activation_func" in done.stderr


def test_a_relative_json_is_written_in_the_callers_directory(tmp_path):
    # "docs/" exists in the clone, not here: a path resolved in the clone could be opened.
    done = _main(["--json", "docs/audit.json"], tmp_path)
    assert done.returncode == 2
    assert f"--json {tmp_path}/docs/audit.json: cannot write there" in done.stderr
    assert not (REPO / "docs" / "audit.json").exists()
