#!/usr/bin/env python3
"""Prints the fingerprint table of ``mcore_activations.upstream_fingerprints`` for one upstream.

Usage: ``python tools/fingerprint_upstream.py PATH/TO/megatron/core LABEL``. It reads upstream's
files (importing nothing from them) and fingerprints every object ``megatron_patch`` replaces or
relies on: the fusion entry points this package also defines, and the MLP-class methods.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_activations.upstream_patch.entry_points import FUSION_MODULES, fusion_names  # noqa: E402
from mcore_activations.upstream_patch.upstream import (  # noqa: E402
    METHOD_TARGETS,
    source_fingerprint,
)


def _package_version(core: Path) -> str:
    tree = ast.parse((core / "package_info.py").read_text())
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = node.value.value
    return ".".join(str(values[k]) for k in ("MAJOR", "MINOR", "PATCH"))


def fingerprints(core: Path) -> dict[str, str]:
    """``{"module:qualname": fingerprint}`` for the upstream tree at ``core``."""
    out = {}
    for short in FUSION_MODULES:
        path = core / "fusions" / f"{short}.py"
        ours = importlib.import_module(f"mcore_activations.fusions.{short}")
        for name in fusion_names(ours):
            found = source_fingerprint(str(path), name)
            if found is not None:
                out[f"megatron.core.fusions.{short}:{name}"] = found
    for target in METHOD_TARGETS:
        module, qualname = target.split(":")
        path = core.joinpath(*module.split(".")[2:]).with_suffix(".py")
        found = source_fingerprint(str(path), qualname)
        if found is not None:
            out[target] = found
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("core", type=Path, help="upstream's megatron/core directory")
    parser.add_argument("label", help="e.g. 'release 0.19.2' or 'main d98e8a64'")
    args = parser.parse_args()
    table = {"label": args.label, "targets": fingerprints(args.core)}
    print(json.dumps({_package_version(args.core): table}, indent=4))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
