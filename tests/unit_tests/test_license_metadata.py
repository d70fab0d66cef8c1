"""Both distributions declare their license as an SPDX expression, and building warns nothing."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("project", [".", "standalone"])
def test_license_is_an_spdx_expression_without_deprecation_warnings(tmp_path, project):
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path), str(REPO / project)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "SetuptoolsDeprecationWarning" not in output, output[-3000:]
    assert "License classifiers are deprecated" not in output
    (wheel,) = tmp_path.glob("*.whl")
    archive = zipfile.ZipFile(wheel)
    (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = archive.read(name).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "Classifier: License ::" not in metadata
