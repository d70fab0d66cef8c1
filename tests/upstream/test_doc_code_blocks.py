"""The README / docs blocks marked ``<!-- doc-test: upstream -->`` run as written next to
upstream megatron-core 0.19.2 (tools/doc_code_blocks.py finds them)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import target_env

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "doc_code_blocks.py"
_spec = importlib.util.spec_from_file_location("doc_code_blocks", _TOOL)
doc_code_blocks = importlib.util.module_from_spec(_spec)
sys.modules["doc_code_blocks"] = doc_code_blocks  # dataclasses look their module up
_spec.loader.exec_module(doc_code_blocks)

UPSTREAM = [b for b in doc_code_blocks.all_code_blocks() if b.where == "upstream"]


def test_the_docs_have_upstream_blocks():
    assert len(UPSTREAM) >= 3


@pytest.mark.parametrize("block", UPSTREAM, ids=lambda b: b.id)
def test_upstream_code_block_runs(block, tmp_path):
    env = target_env("release")
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}"
    if block.language == "python":
        command = [sys.executable, "-c", block.code]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.code]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"{block.id}:\n{block.code}\n{done.stderr[-3000:]}"
    if "patch_megatron_core().print()" in block.code:
        # The one-line report, on rank 0.
        assert done.stderr.strip().splitlines()[-1].startswith("mcore_activations patched ")
