"""Every python / bash block of README.md and docs/ runs as written, or says why it cannot.

Blocks marked ``<!-- doc-test: upstream -->`` run in the upstream tier
(tests/upstream/test_doc_code_blocks.py); this file runs the rest, in a scratch directory with
the standalone fork importable (tools/doc_code_blocks.py describes the markers).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tools.doc_code_blocks import REPO, all_code_blocks

BLOCKS = all_code_blocks()
PROJECT = [b for b in BLOCKS if b.where == "project"]


def test_the_docs_have_code_blocks_and_every_skip_says_why():
    assert PROJECT and any(b.where == "upstream" for b in BLOCKS)
    assert all(b.reason for b in BLOCKS if b.where == "skip")


def test_the_readme_library_example_is_run_here():
    assert any(b.doc == "README.md" and "ActivationSpec.from_config" in b.code for b in PROJECT)


@pytest.mark.parametrize("block", PROJECT, ids=lambda b: b.id)
def test_code_block_runs(block, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_ACTIVATIONS_PATCH")}
    env["PYTHONPATH"] = str(REPO)
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}"
    command = [sys.executable, "-c", block.code] if block.language == "python" else None
    if command is None:
        command = ["bash", "-euo", "pipefail", "-c", block.code]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{block.id}:\n{block.code}\n{done.stderr[-3000:]}"
