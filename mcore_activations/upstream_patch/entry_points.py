"""Target patcher: upstream's fused activation entry points become this package's compile-safe ones.

A clamp or offset then reaches compiled code as a tensor, never as a Python float. Each entry
point is replaced in its own module and in every upstream module that imported it by name.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

from mcore_activations.upstream_patch.patcher import Patcher
from mcore_activations.upstream_patch.upstream import CORE

FUSION_MODULES = (
    "fused_bias_swiglu",
    "fused_bias_geglu",
    "fused_bias_gelu",
    "fused_weighted_squared_relu",
)
# Upstream's dispatch compares config.activation_func with these objects by identity, and a
# config built before the patch holds upstream's: they are never rebound.
IDENTITY_SENTINELS = frozenset({"quick_gelu"})


def fusion_names(ours) -> list[str]:
    """Public names of one of this package's fusion modules that replace upstream's.

    Args:
        ours: One of this package's ``mcore_activations.fusions`` modules.
    """
    names = []
    for name, value in vars(ours).items():
        if name.startswith("_") or name in IDENTITY_SENTINELS or inspect.ismodule(value):
            continue
        # bias_gelu_impl is GeLUFunction.apply, a bound method whose __module__ is torch's.
        if getattr(value, "__module__", None) == ours.__name__ or name == "bias_gelu_impl":
            names.append(name)
    return names


def _fusion_replacements() -> list[tuple[Any, str, Any]]:
    """(upstream module, name, ours) for every public fusion name both define."""
    out = []
    for short in FUSION_MODULES:
        upstream = importlib.import_module(f"{CORE}.fusions.{short}")
        ours = importlib.import_module(f"mcore_activations.fusions.{short}")
        out += [(upstream, n, getattr(ours, n)) for n in fusion_names(ours) if hasattr(upstream, n)]
    return out


def patch_entry_points(patcher: Patcher) -> None:
    """Replaces every upstream fused entry point that this package also defines, by name."""
    originals = {}
    for module, name, ours in _fusion_replacements():
        originals[id(getattr(module, name))] = ours
        patcher.set(module, name, ours)
        patcher.record(f"{module.__name__}:{name}", "replaced", "compile-safe fused activation")
    # Upstream modules that imported an entry point by name hold the old object.
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("megatron.") or module is None:
            continue
        for name, value in list(vars(module).items()):
            if id(value) in originals and name not in IDENTITY_SENTINELS:
                if ".fusions." not in mod_name:
                    patcher.set(module, name, originals[id(value)])
                    patcher.record(f"{mod_name}:{name}", "replaced", "rebound to the fix")
