"""``MCORE_ACTIVATIONS_PATCH=1``: patch upstream megatron-core as soon as it is imported.

The package's .pth file imports this module at interpreter start-up when the variable is set
(to anything but ``0``), so training scripts nobody edits get the patch too. It imports neither
torch nor megatron-core: it registers an import hook, and the patch runs right after
``megatron.core`` finishes importing, before the script can build a model. An upstream the patch
does not know makes that import fail with the patch's error: the variable asked for exact
activations, and running without them would be the silent failure this package exists to end.
Set ``MCORE_ACTIVATIONS_PATCH=quiet`` to skip the one-line report on stderr.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

_TARGET = "megatron.core"


def _after_import() -> None:
    from mcore_activations import megatron_patch

    if megatron_patch.is_standalone_fork():
        return  # this project's own megatron.core computes the activations already
    report = megatron_patch.patch_megatron_core()
    quiet = os.environ.get(megatron_patch.ENV_VAR, "").lower() == "quiet"
    if not quiet and os.environ.get("RANK", "0") == "0":
        print(f"{megatron_patch.ENV_VAR}: {report.summary()}", file=sys.stderr)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` through the other finders and runs the patch after it loads."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _LoaderThenPatch(spec.loader)
                return spec
        return None


class _LoaderThenPatch(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _uninstall()
        _after_import()


_FINDER = _PatchAfterImport()


def _uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def install() -> None:
    """Patches now if megatron.core is already imported, else right after its import."""
    if _TARGET in sys.modules:
        _after_import()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


install()
