"""Setuptools shim: metadata lives in pyproject.toml; this adds the autopatch .pth file.

The .pth file lands at the top of site-packages (where Python reads it at start-up), for regular
installs (build_py) and for editable ones (``pip install -e``: editable_wheel). It imports
``mcore_activations`` only when ``MCORE_ACTIVATIONS_PATCH`` is set to something, so an
interpreter started without the variable does nothing more than read the environment; the
package then parses the value strictly (``mcore_activations.patch_env``).
"""

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# The file's name and line are defined once, in the package (standard library only).
_PATCH_ENV = runpy.run_path(str(Path(__file__).parent / "mcore_activations" / "patch_env.py"))
PTH_NAME, PTH_LINE = _PATCH_ENV["PTH_NAME"], _PATCH_ENV["PTH_LINE"]


class BuildPyWithPth(build_py):
    """Also writes the autopatch .pth file next to the packages."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / PTH_NAME
        target.write_text(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH_NAME)]


cmdclass = {"build_py": BuildPyWithPth}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64 installs editables another way; the package warns instead
    editable_wheel = None


class _StrategyWithPth:
    """Wraps setuptools' editable strategy: the wheel also gets the autopatch .pth file."""

    def __init__(self, strategy):
        self._strategy = strategy

    def __call__(self, wheel, files, mapping):
        result = self._strategy(wheel, files, mapping)
        # Sorted after setuptools' "__editable__.*.pth", which makes the package importable.
        wheel.writestr(PTH_NAME, PTH_LINE.encode())
        return result

    def __enter__(self):
        self._strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self._strategy.__exit__(*exc)


if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):
    # _select_strategy is setuptools' internal seam (64 to at least 84); where it is missing,
    # `import mcore_activations` warns that the .pth file did not run (mcore_activations/_startup).

    class EditableWheelWithPth(editable_wheel):
        """Adds the autopatch .pth file to the editable wheel too."""

        def _select_strategy(self, *args, **kwargs):
            return _StrategyWithPth(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = EditableWheelWithPth


def _license() -> dict:
    # PEP 639's SPDX expression (setuptools >= 77); older setuptools know only the free-text field.
    import setuptools

    major = int(setuptools.__version__.split(".")[0])
    if major >= 77:
        return {"license_expression": LICENSE, "license_files": ["LICENSE"]}
    return {"license": LICENSE}


LICENSE = "Apache-2.0"
setup(cmdclass=cmdclass, **_license())
