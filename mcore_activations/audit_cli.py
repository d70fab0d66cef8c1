"""Command-line plumbing both activation audits share: the parser, the command's name, the
progress lines and one copy of each warning."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Iterable
from typing import Optional

from mcore_activations.audit_config import CONFIG_FILE_FIELDS, FUNCTION_NAMES

# scripts/main.sh names itself here, so --help and errors show the command the user typed.
PROG_ENV = "MCORE_ACTIVATIONS_AUDIT_PROG"


def command_name(module: str) -> str:
    """How the user started the audit: ``scripts/main.sh``, ``python -m <module>``, or the
    console script's name (e.g. ``mcore-activations-audit``)."""
    if os.environ.get(PROG_ENV):
        return os.environ[PROG_ENV]
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name == module:
        return f"python -m {module}"
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name and not name.endswith(".py") else f"python -m {module}"


class AuditArgumentParser(argparse.ArgumentParser):
    """Keeps the examples' line breaks, and answers a usage error with one line, not the usage."""

    def __init__(self, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(**kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the options)\n")


def add_common_options(
    parser: argparse.ArgumentParser,
    *,
    cuda_available: bool,
    json_help: str,
    device_choices: Optional[Iterable[str]] = None,
) -> None:
    """Adds ``--config``, ``--device``, ``--dtype`` and ``--json``, which both audits take.

    Args:
        parser: The audit's parser.
        cuda_available: Whether ``--device`` defaults to ``cuda``.
        json_help: What ``--json`` writes (each audit has its own JSON layout).
        device_choices: The devices ``--device`` accepts; None accepts any torch device string
            (the audit then checks it).
    """
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="audit the configurations in this JSON file instead of the built-in set: one object "
        "or a list, each with an optional 'name' and any of: "
        f"{', '.join(CONFIG_FILE_FIELDS)} (activation_func by name: "
        f"{', '.join(sorted(FUNCTION_NAMES))})",
    )
    parser.add_argument(
        "--device",
        default="cuda" if cuda_available else "cpu",
        choices=None if device_choices is None else list(device_choices),
        help="cpu or cuda (default: cuda where a GPU is usable; the Transformer Engine paths "
        "need cuda)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the layers' parameter and compute dtype (default: float32)",
    )
    parser.add_argument("--json", metavar="FILE", help=json_help)


@contextlib.contextmanager
def one_copy_of_each_warning():
    """Shows each distinct warning once: the audit builds many configs, and upstream warns from
    every ``TransformerConfig`` (e.g. a deprecation), which would otherwise repeat per cell."""
    seen = set()
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if key not in seen:
            seen.add(key)
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = original


def progress_printer(total: int):
    """A progress callback of the audit runner: ``[done/total] path / activation: status`` on
    stderr, one line per cell, counted across every table the command prints."""
    done = 0

    def progress(cell) -> None:
        nonlocal done
        done += 1
        print(f"[{done}/{total}] {cell.path} / {cell.activation}: {cell.status}", file=sys.stderr)

    return progress
