"""The kernel manifest is complete and consistent, and the coverage tool enforces it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit_tests.determinism.kernels.manifest import KERNELS
from tools import check_kernel_determinism_coverage as coverage

REPO = Path(__file__).resolve().parents[4]


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_names_are_unique_and_kinds_known():
    names = [entry["name"] for entry in KERNELS]
    assert len(names) == len(set(names))
    kinds = {"triton", "compiled-torch", "torch-library", "transformer-engine"}
    assert {entry["kind"] for entry in KERNELS} <= kinds


def test_sources_and_tests_exist_and_each_entry_is_tested_xor_exempt():
    for entry in KERNELS:
        for source in entry["sources"]:
            assert (REPO / source).is_file(), f"{entry['name']}: {source} does not exist"
        assert bool(entry["tests"]) != bool(entry["exempt"]), entry["name"]
        for test in entry["tests"]:
            file, _, function = test.partition("::")
            assert function in _test_functions(REPO / file), f"{entry['name']}: {test} missing"


def test_every_kernel_bearing_file_is_registered():
    assert coverage.check(REPO, KERNELS) == []


def _planted_tree(tmp_path: Path) -> Path:
    package = tmp_path / "mcore_activations"
    package.mkdir()
    (package / "plain.py").write_text(
        '"""uses triton.jit in prose only"""\nx = 1  # torch.compile(\n'
    )
    (package / "kernel.py").write_text("import triton\n\n@triton.jit\ndef k(x):\n    pass\n")
    (tmp_path / "test_kernel.py").write_text("def test_k():\n    pass\n")
    return tmp_path


def test_tool_catches_a_planted_unregistered_kernel(tmp_path):
    root = _planted_tree(tmp_path)
    problems = coverage.check(root, [])
    assert problems == [
        "mcore_activations/kernel.py: kernel-bearing but not registered in "
        "tests/unit_tests/determinism/kernels/manifest.py (add an entry with its replay tests)"
    ]  # plain.py mentions kernels only in a docstring and a comment


def test_tool_requires_a_test_change_with_a_source_change(tmp_path):
    root = _planted_tree(tmp_path)
    entry = {
        "name": "k",
        "sources": ["mcore_activations/kernel.py"],
        "tests": ["test_kernel.py::test_k"],
        "kind": "triton",
        "exempt": None,
    }
    changed_alone = coverage.check(root, [entry], changed=["mcore_activations/kernel.py"])
    assert len(changed_alone) == 1 and "none of k's replay tests did" in changed_alone[0]
    with_test = ["mcore_activations/kernel.py", "test_kernel.py"]
    assert coverage.check(root, [entry], changed=with_test) == []
    waived = coverage.check(root, [entry], ["mcore_activations/kernel.py"], True)
    assert waived == []
    untested = dict(entry, tests=[])
    assert coverage.check(root, [untested]) == ["k: neither replay tests nor an exemption reason"]


def test_tool_command_line(tmp_path):
    root = _planted_tree(tmp_path)
    manifest = tmp_path / "manifest.py"
    manifest.write_text("KERNELS = []\n")
    tool = [sys.executable, str(REPO / "tools/check_kernel_determinism_coverage.py")]
    failing = subprocess.run(
        [*tool, "--all", "--root", str(root), "--manifest", str(manifest)],
        capture_output=True,
        text=True,
    )
    assert failing.returncode == 1 and "1 violation(s)" in failing.stdout
    project = subprocess.run([*tool, "--all"], capture_output=True, text=True, cwd=REPO)
    assert project.returncode == 0, project.stdout
    usage = subprocess.run([*tool], capture_output=True, text=True)
    assert usage.returncode == 2


@pytest.mark.parametrize(
    "source, bearing",
    [
        ("@triton.jit\ndef k(): pass\n", True),
        ("f = torch.compile(g)\n", True),
        ("ops = te.pytorch.ops\n", True),
        ("lib = torch.library.Library('x', 'DEF')\n", True),
        ('"""torch.compile( in a docstring"""\n', False),
        ("# @triton.jit in a comment\n", False),
    ],
)
def test_kernel_patterns_ignore_comments_and_strings(tmp_path, source, bearing):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert coverage.is_kernel_bearing(path) is bearing
