"""The TE import seam: the one module that imports Transformer Engine, and the one place a test
replaces it."""

from __future__ import annotations

import ast

import megatron.core.extensions.transformer_engine as te_ext
import megatron.core.transformer.moe.experts as experts_module
import megatron.core.transformer.moe.shared_experts as shared_experts_module
from mcore_activations import te_import
from megatron.core import utils
from tests.unit_tests.extensions.fake_te import install_fake_te, remove_te
from tests.unit_tests.test_import_graph import module_files


def test_only_the_seam_imports_transformer_engine():
    importers = []
    for module, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "transformer_engine" or n.startswith("transformer_engine.") for n in names):
                importers.append(module)
    assert sorted(set(importers)) == ["mcore_activations.te_import"]


def test_one_patch_reaches_every_te_path(monkeypatch):
    fake = install_fake_te(monkeypatch, version="2.19.1")
    for module in (te_ext, experts_module, shared_experts_module):
        assert module.te is fake and module.HAVE_TE is True
    # Every version check reads the version of the te in force.
    for check in (te_import.is_te_min_version, utils.is_te_min_version):
        assert check("2.19.0") and check("2.19.1") and not check("2.20.0")
        assert not check("2.19.1", check_equality=False)
    assert str(utils.get_te_version()) == "2.19.1"


def test_removing_te_reaches_every_te_path(monkeypatch):
    remove_te(monkeypatch)
    assert not te_import.have_te()
    for module in (te_ext, experts_module, shared_experts_module):
        assert module.HAVE_TE is False
