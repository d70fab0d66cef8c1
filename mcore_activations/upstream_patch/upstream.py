"""Which upstream megatron-core is installed, and whether it is the source the patch knows.

The patch touches upstream objects by name, so it runs only on an upstream whose version is in
:data:`~mcore_activations.upstream_fingerprints.KNOWN_UPSTREAMS` and whose every touched object
has the recorded source fingerprint. What differs between the known versions is data
(:data:`~mcore_activations.upstream_fingerprints.CAPABILITIES`), handed to the target patchers in
an :class:`Upstream`.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import os
import sys
from typing import Optional

from mcore_activations.activation_path import select_activation_path
from mcore_activations.upstream_fingerprints import (
    CAPABILITIES,
    KNOWN_UPSTREAMS,
    RELEASE,
    Capabilities,
)

CORE = "megatron.core"
MLP_MODULE = "megatron.core.transformer.mlp"
EXPERTS_MODULE = "megatron.core.transformer.moe.experts"
SHARED_MODULE = "megatron.core.transformer.moe.shared_experts"
TE_MODULE = "megatron.core.extensions.transformer_engine"

# The upstream methods the patch replaces, wraps, or relies on (their callers and the code whose
# op choice it checks); each must have the fingerprint recorded for the installed version.
METHOD_TARGETS = (
    f"{MLP_MODULE}:MLP.__init__",
    f"{MLP_MODULE}:MLP.forward",
    f"{SHARED_MODULE}:SharedExpertMLP.linear_fc1_forward_and_act",
    f"{SHARED_MODULE}:FusedSharedExpertMLP._validate_fused_grouped_swiglu",
    f"{SHARED_MODULE}:FusedSharedExpertMLP._make_fused_grouped_swiglu_ops",
    f"{EXPERTS_MODULE}:TEGroupedMLP.__init__",
    f"{EXPERTS_MODULE}:TEGroupedMLP._make_fused_ops",
    f"{EXPERTS_MODULE}:TEGroupedMLP.forward",
    f"{EXPERTS_MODULE}:SequentialMLP.forward",
    f"{EXPERTS_MODULE}:InferenceGroupedMLP._resolve_flashinfer_activation_type",
    f"{EXPERTS_MODULE}:InferenceGroupedMLP._resolve_mcore_activation_type",
    f"{TE_MODULE}:TEActivationOp.__new__",
    f"{TE_MODULE}:TEFusedMLP._make_activation_op",
    f"{TE_MODULE}:TEFusedMLP._make_fused_impl",
    f"{TE_MODULE}:TEFusedMLP.forward",
    f"{TE_MODULE}:_make_te_ops_activation",
    f"{TE_MODULE}:TEFusedMLPWithGroupedLinear._make_fused_impl",
)


class UnsupportedUpstreamError(RuntimeError):
    """The installed megatron-core is not a version (or not the source) this patch knows."""


@dataclasses.dataclass(frozen=True)
class Upstream:
    """The installed upstream, checked: what the target patchers may rely on.

    Attributes:
        key: The version key of ``KNOWN_UPSTREAMS``, e.g. ``"0.19.2"``.
        description: As the report names it, e.g. ``"megatron-core 0.19.2"``.
        label: The known source, e.g. ``"release 0.19.2"`` or ``"main d98e8a64"``.
        capabilities: What this upstream's own code does where the patch must act differently.
    """

    key: str
    description: str
    label: str
    capabilities: Capabilities


def source_fingerprint(module_file: str, qualname: str) -> Optional[str]:
    """SHA-256 (16 hex digits) of the source of ``qualname`` in ``module_file``, or None if absent.

    The definition is found in the parsed file, also inside ``if`` / ``try`` blocks, so a class
    that upstream defines only when Transformer Engine imports is fingerprinted without TE.
    Module-level assignments (``bias_gelu_impl = GeLUFunction.apply``) count as definitions.

    Args:
        module_file: Path of the Python source file.
        qualname: Dotted name inside the file, e.g. ``"MLP.forward"``.

    Returns:
        The fingerprint, or None when the file defines no such name.
    """
    with open(module_file, encoding="utf-8") as f:
        text = f.read()
    node = _find_definition(ast.parse(text).body, qualname.split("."))
    if node is None:
        return None
    segment = ast.get_source_segment(text, node) or ""
    decorators = "".join(ast.get_source_segment(text, d) or "" for d in _decorators(node))
    digest = hashlib.sha256((decorators + "\n" + segment).encode("utf-8")).hexdigest()
    return digest[:16]


def _decorators(node) -> list:
    return list(getattr(node, "decorator_list", []))


def _find_definition(body: list, parts: list[str]):
    for node in body:
        if isinstance(node, ast.If | ast.Try):
            nested = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                nested += handler.body
            found = _find_definition(nested, parts)
            if found is not None:
                return found
            continue
        name = getattr(node, "name", None)
        if name is None and isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            name = parts[0] if parts[0] in targets else None
        if name == parts[0]:
            if len(parts) == 1:
                return node
            return _find_definition(getattr(node, "body", []), parts[1:])
    return None


def installed_upstream() -> tuple[str, str]:
    """Returns ``(key, description)`` of the installed megatron-core, e.g. ``("0.19.2", ...)``.

    Raises:
        UnsupportedUpstreamError: megatron-core is not importable, or this is the standalone fork.
    """
    try:
        info = importlib.import_module(f"{CORE}.package_info")
    except ImportError as err:
        raise UnsupportedUpstreamError(
            f"patch_megatron_core() needs an installed upstream megatron-core ({err}). Install "
            f"it with: pip install megatron-core=={RELEASE}"
        ) from err
    if is_standalone_fork():
        raise UnsupportedUpstreamError(
            "megatron.core is this project's standalone fork, which already computes the "
            "configured activations; patch_megatron_core() is for upstream megatron-core. "
            + _where_the_fork_came_from()
        )
    key = ".".join(str(getattr(info, part, "?")) for part in ("MAJOR", "MINOR", "PATCH"))
    return key, f"megatron-core {getattr(info, '__version__', key)}"


def _where_the_fork_came_from() -> str:
    # Most often the current directory is a clone of this project, and Python's sys.path puts it
    # before the installed upstream.
    core = sys.modules[CORE]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(core.__file__))))
    if os.path.samefile(root, os.getcwd()):
        return (
            f"It was imported from the current directory ({root}), a clone of this project: "
            "Python puts the current directory first on sys.path, so the clone's megatron/ "
            "hides the installed megatron-core. Run the script from another directory (or "
            "start Python with -P, 3.11+)."
        )
    return (
        f"It was imported from {root}. To patch upstream instead, make upstream's "
        f"megatron.core the importable one (pip install megatron-core=={RELEASE}, or put "
        "your Megatron-LM checkout first on PYTHONPATH)."
    )


def is_standalone_fork() -> bool:
    """Whether the importable ``megatron.core`` is this project's fork (nothing to patch)."""
    mlp_module = importlib.import_module(MLP_MODULE)
    return getattr(mlp_module, "select_activation_path", None) is select_activation_path


def check_upstream(key: str) -> dict[str, str]:
    """Verifies the fingerprint of every target of upstream ``key``; returns the known table.

    Args:
        key: A version key, as :func:`installed_upstream` returns it.

    Returns:
        The ``KNOWN_UPSTREAMS`` entry of ``key`` (its ``label`` and ``targets``).

    Raises:
        UnsupportedUpstreamError: Unknown version, or a target whose source differs.
    """
    known = KNOWN_UPSTREAMS.get(key)
    if known is None:
        supported = ", ".join(f"{k} ({v['label']})" for k, v in KNOWN_UPSTREAMS.items())
        raise UnsupportedUpstreamError(
            f"mcore_activations does not know megatron-core {key}; it supports {supported}. "
            "Install a supported megatron-core, or use the standalone fork's megatron.core."
        )
    differences = []
    for target, expected in known["targets"].items():
        module_name, qualname = target.split(":")
        module = importlib.import_module(module_name)
        found = source_fingerprint(module.__file__, qualname)
        if found != expected:
            differences.append(f"{target} (expected {expected}, found {found})")
    if differences:
        raise UnsupportedUpstreamError(
            f"The installed megatron-core {key} is not the {known['label']} source this patch "
            "was written against; these objects differ: "
            + "; ".join(differences)
            + ". Install the released package, or the upstream commit named in "
            "docs/using-with-megatron-lm.md."
        )
    return known


def identify_upstream() -> Upstream:
    """The installed upstream, its version known and its every target's source checked.

    Raises:
        UnsupportedUpstreamError: Not importable, the standalone fork, an unknown version, or a
            target whose source differs.
    """
    key, description = installed_upstream()
    known = check_upstream(key)
    return Upstream(key, description, known["label"], CAPABILITIES[key])
