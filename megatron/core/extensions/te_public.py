"""Names the TE classes call through ``megatron.core.extensions.transformer_engine``.

Upstream defines every TE class in that one module, so users, tools and upstream's own tests
change what the classes call by patching the module's attributes (``mock.patch(
"megatron.core.extensions.transformer_engine.get_tensor_model_parallel_world_size", ...)``,
``is_te_min_version``, ``get_cuda_rng_tracker``). Here the classes live in the ``te_*`` modules
and the public module re-exports them, so a name each ``te_*`` module imported for itself would
keep the original function and never see such a patch.

The ``te_*`` modules therefore call these names through :func:`public`, which reads the public
module's attribute at each call. The alternative, defining the classes in the public module
again, would bring back one file of several thousand lines; this keeps one file per job and one
place (the public module) where the patchable names are bound.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from mcore_activations.te_import import require_te, te_version

PUBLIC_MODULE = "megatron.core.extensions.transformer_engine"

# The names upstream's module binds at its top and its classes call; the public module binds
# the same ones. Only these are read through it.
PATCHABLE_NAMES = frozenset(
    {
        "get_cuda_rng_tracker",
        "get_tensor_model_parallel_world_size",
        "is_te_min_version",
    }
)


def public(name: str) -> Any:
    """The public module's current ``name`` (a patched value if one is patched in).

    Raises:
        KeyError: ``name`` is not one of :data:`PATCHABLE_NAMES`.
    """
    if name not in PATCHABLE_NAMES:
        raise KeyError(f"{name!r} is not read through {PUBLIC_MODULE}: {sorted(PATCHABLE_NAMES)}")
    module = sys.modules.get(PUBLIC_MODULE)
    if module is None:  # a te_* module used before the package finished importing
        module = importlib.import_module(PUBLIC_MODULE)
    return getattr(module, name)


def require_te_min_version(what: str, min_version: str, needs: str = "") -> None:
    """Raises unless Transformer Engine is importable and at least ``min_version``.

    The version is asked through the public module's ``is_te_min_version``, so a patch of it
    decides, as upstream.

    Args:
        what: The class or function that needs TE, named in the error.
        min_version: The oldest TE it runs with.
        needs: What it uses from that version, named in the error.

    Raises:
        ImportError: TE cannot be imported.
        RuntimeError: TE is older than ``min_version`` (upstream's error type).
    """
    require_te(what)
    if not public("is_te_min_version")(min_version):
        detail = f" (needs {needs})" if needs else ""
        raise RuntimeError(
            f"{what} requires Transformer Engine >= {min_version}{detail}, found {te_version()}. "
            f"Upgrade with: pip install --upgrade 'transformer-engine[pytorch]>={min_version}'"
        )
