"""``MCORE_ACTIVATIONS_PATCH``: what its value asks for, parsed strictly.

Standard library only: the autopatch .pth file and ``import mcore_activations`` read it at
interpreter start-up, before torch or megatron-core is imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional

ENV_VAR = "MCORE_ACTIVATIONS_PATCH"

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off", "")
QUIET = "quiet"  # patch, without the one-line report

# The .pth file an install puts in site-packages, and its one line: Python runs it at start-up.
# Without the variable it only reads the environment; with it, it imports the package, which
# parses the value and installs the hook (mcore_activations._startup).
PTH_NAME = "mcore_activations_autopatch.pth"
PTH_LINE = (
    f"import os; os.environ.get({ENV_VAR!r}, '').strip() and __import__('mcore_activations')\n"
)


def patch_mode(environ: Optional[Mapping[str, str]] = None) -> str:
    """``"off"``, ``"on"`` or ``"quiet"``: what ``MCORE_ACTIVATIONS_PATCH`` asks for.

    Case and surrounding blanks are ignored; unset means ``"off"``.

    Args:
        environ: The environment to read; default ``os.environ``.

    Raises:
        ValueError: Any other value. A typo must not decide silently whether a run trains with
            exact activations.
    """
    raw = (os.environ if environ is None else environ).get(ENV_VAR)
    value = "" if raw is None else raw.strip().lower()
    if value in ON:
        return "on"
    if value in OFF:
        return "off"
    if value == QUIET:
        return "quiet"
    raise ValueError(
        f"{ENV_VAR}={raw!r} is not understood: set it to one of {', '.join(ON)} (patch "
        f"megatron-core when it is imported), {QUIET} (patch without the report), or one of "
        f"{', '.join(v for v in OFF if v)} or empty (do not patch)."
    )
