"""``MCORE_ACTIVATIONS_PATCH`` seen by ``import mcore_activations``: the hook, or a loud no.

The autopatch .pth file imports the package at interpreter start-up when the variable is set.
Where Python never reads that file (``pip install --target DIR``, a source tree on
``PYTHONPATH``, an editable install by a setuptools this package cannot extend), the first point
the package can speak is its own import: it installs the hook there and says that it comes late.
Standard library only.
"""

from __future__ import annotations

import sys
import warnings

from mcore_activations.patch_env import ENV_VAR, PTH_NAME, patch_mode


def _imported_by_pth() -> bool:
    # site.addpackage() executes the .pth line that imported this package ("<frozen site>"
    # where the interpreter freezes the site module).
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "addpackage" and code.co_filename.endswith(("site.py", "site>")):
            return True
        frame = frame.f_back
    return False


def run() -> None:
    """Installs the autopatch hook when the variable asks for it.

    Raises:
        ValueError: The variable has a value :func:`patch_mode` does not understand (imported by
            a script; from the .pth file the hook reports it and fails megatron-core's import).
    """
    loading = [
        name
        for name, module in list(sys.modules.items())
        if (name == "megatron.core" or name.startswith("megatron.core."))
        and getattr(getattr(module, "__spec__", None), "_initializing", False)
    ]
    if loading:
        return  # the standalone fork imports this package while it loads: it needs no patch
    by_pth = _imported_by_pth()
    if not by_pth:
        if patch_mode() == "off":  # raises for a value it does not understand
            return
        if "megatron.core" in sys.modules:
            when = (
                "megatron.core was imported first, so it is patched now: layers built before "
                "this import keep the activation they chose, build them again"
            )
        else:
            when = "megatron.core is patched when it is imported"
        warnings.warn(
            f"{ENV_VAR} is set, but this interpreter did not run {PTH_NAME} at start-up (the "
            "package is not in a site-packages directory: pip install --target, a source tree "
            "on PYTHONPATH, or an editable install whose setuptools could not add the file). "
            f"Patching from 'import mcore_activations' instead; {when}. Scripts that never "
            "import mcore_activations run unpatched: install with 'pip install <checkout>' or "
            "call mcore_activations.patch_megatron_core() in the script.",
            RuntimeWarning,
            stacklevel=2,
        )
    from mcore_activations import autopatch  # noqa: F401 - installs the hook
