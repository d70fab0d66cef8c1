"""Setuptools shim: metadata lives in pyproject.toml; this adds the autopatch .pth file.

The .pth file lands at the top of site-packages (where Python reads it at start-up). It imports
``mcore_activations.autopatch`` only when ``MCORE_ACTIVATIONS_PATCH`` is set, so an interpreter
started without the variable does nothing more than read the environment.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "mcore_activations_autopatch.pth"
PTH_LINE = (
    "import os; os.environ.get('MCORE_ACTIVATIONS_PATCH', '0') not in ('', '0') "
    "and __import__('mcore_activations.autopatch')\n"
)


class BuildPyWithPth(build_py):
    """Also writes the autopatch .pth file next to the packages."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / PTH_NAME
        target.write_text(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH_NAME)]


setup(cmdclass={"build_py": BuildPyWithPth})
