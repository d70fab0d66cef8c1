"""The process-wide switch for megatron.core's experimental APIs (off by default)."""

ENABLE_EXPERIMENTAL = False
"""Whether functions and classes marked ``experimental_fn`` / ``experimental_cls`` may run."""


def set_experimental_flag(flag: bool) -> None:
    """Allows (True) or forbids (False) calls into experimental APIs."""
    global ENABLE_EXPERIMENTAL
    ENABLE_EXPERIMENTAL = flag


def is_experimental_enabled() -> bool:
    """Returns the experimental flag."""
    return ENABLE_EXPERIMENTAL
