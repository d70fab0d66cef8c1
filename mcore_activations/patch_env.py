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


class Switch:
    """An opt-in on/off option of the process: an environment variable, read once, sets the
    default; code may change the default; a call may override it (``None``: the default).

    Both memory options (``fusions.in_place``, ``fusions.output_recompute``) are one of these,
    so their variable is parsed, and a wrong value refused, the same way.

    Args:
        env_var: The environment variable.
        option: The keyword that overrides the default for one call or layer.
        setter: The public name of the function that sets the default (for messages).
        on_means: What the option does, for the variable's error message.
        off_means: What happens without it.

    Raises:
        ValueError: The variable holds anything but 1 / true / yes / on, 0 / false / no / off
            or empty (case and surrounding blanks ignored): a typo must not decide silently.
    """

    def __init__(self, env_var: str, option: str, setter: str, on_means: str, off_means: str):
        self.env_var, self.option, self.setter = env_var, option, setter
        self._on_means, self._off_means = on_means, off_means
        self._default = self.from_env()

    def from_env(self, environ: Optional[Mapping[str, str]] = None) -> bool:
        """What the variable asks for in ``environ`` (default ``os.environ``); unset is off."""
        raw = (os.environ if environ is None else environ).get(self.env_var)
        value = "" if raw is None else raw.strip().lower()
        if value in ON:
            return True
        if value in OFF:
            return False
        raise ValueError(
            f"{self.env_var}={raw!r} is not understood: set it to one of {', '.join(ON)} "
            f"({self._on_means}), or one of {', '.join(v for v in OFF if v)} or empty "
            f"({self._off_means})."
        )

    def check(self, value, name: Optional[str] = None) -> Optional[bool]:
        """``value`` if it is True, False or None.

        Raises:
            TypeError: anything else (a string such as ``"0"`` would otherwise be truthy).
        """
        if value is None or isinstance(value, bool):
            return value
        raise TypeError(
            f"{name or self.option} must be True, False or None (None: the process default, "
            f"{self.env_var} unless {self.setter} changed it); got {value!r} "
            f"({type(value).__name__})."
        )

    def enabled(self) -> bool:
        """The process default."""
        return self._default

    def set(self, enabled: bool) -> bool:
        """Sets the process default; returns the previous one.

        Raises:
            TypeError: ``enabled`` is not a bool.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"{self.setter} takes True or False, got {enabled!r}.")
        previous, self._default = self._default, enabled
        return previous

    def resolve(self, value: Optional[bool]) -> bool:
        """The option for one call: ``value``, or the process default when it is None."""
        return self._default if self.check(value) is None else value
