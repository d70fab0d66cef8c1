"""``MCORE_ACTIVATIONS_PATCH=1``: patch upstream megatron-core as soon as it is imported.

The package's .pth file imports this module at interpreter start-up when the variable is set, so
training scripts nobody edits get the patch too. The value is parsed strictly
(:func:`mcore_activations.patch_env.patch_mode`): ``1/true/yes/on`` patch, ``quiet`` patches
without the one-line report, ``0/false/no/off`` or empty do nothing, and anything else makes the
import of ``megatron.core`` fail with an error naming the variable (a typo must not decide
silently whether a run is patched). It imports neither torch nor megatron-core: it registers an
import hook, and the patch runs right after ``megatron.core`` finishes importing, before the
script can build a model. An upstream the patch does not know makes that import fail with the
patch's error: the variable asked for exact activations, and running without them would be the
silent failure this package exists to end.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

from mcore_activations.patch_env import ENV_VAR, patch_mode

_TARGET = "megatron.core"


def _after_import() -> None:
    global _DONE
    _DONE = True
    mode = patch_mode()  # raises for a value it does not understand
    if mode == "off":
        return
    from mcore_activations import megatron_patch

    if megatron_patch.is_standalone_fork():
        return  # this project's own megatron.core computes the activations already
    report = megatron_patch.patch_megatron_core()
    if mode != "quiet" and os.environ.get("RANK", "0") == "0":
        print(f"{ENV_VAR}: {report.summary()}", file=sys.stderr)


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


_DONE = False  # set once the hook has run


def installed() -> bool:
    """Whether the hook is waiting for ``megatron.core``'s import, or has run."""
    return _FINDER in sys.meta_path or _DONE


def install() -> None:
    """Patches now if megatron.core is already imported, else right after its import.

    A value of the variable that :func:`patch_mode` refuses is reported on stderr now and makes
    the import of ``megatron.core`` fail, so the run stops before it trains unpatched.
    """
    try:
        mode = patch_mode()
    except ValueError as err:
        print(f"mcore_activations: {err}", file=sys.stderr)
        mode = "invalid"
    if mode == "off":
        return
    if _TARGET in sys.modules:
        _after_import()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


install()
