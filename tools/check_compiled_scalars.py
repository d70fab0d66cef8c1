#!/usr/bin/env python3
"""Static check: no Python float may enter a compiled function unguarded.

``python tools/check_compiled_scalars.py [paths...] [--quiet]`` scans the given files and
directories (default: the repository's ``mcore_activations/`` and ``megatron/``), prints one line
per finding, ``path:line: function 'name' parameter 'p' ... (reason)``, and a one-line summary.
Exit status: 0 when clean, 1 when there are findings, 2 when a path does not exist or a file
cannot be read or parsed (the message names the file, line and column; the other files are still
checked). ``--quiet`` drops the summary line.

What counts as a compiled function, when a parameter can carry a float, the accepted guards and
the limits: docs/compiled-scalar-checker.md. Stdlib only; nothing of the checked code is imported.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import tokenize
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make the ``tools`` package importable
    sys.path.insert(0, str(REPO_ROOT))

from tools.compiled_scalars.module_checker import _ModuleChecker  # noqa: E402
from tools.compiled_scalars.syntax import CheckError, Finding, _Report  # noqa: E402

__all__ = ["CheckError", "Finding", "check_paths", "check_source", "main"]

DEFAULT_PATHS = (REPO_ROOT / "mcore_activations", REPO_ROOT / "megatron")


def _parse(source: str, path: str) -> ast.Module:
    try:
        return ast.parse(source, filename=path)
    except SyntaxError as err:
        raise CheckError(
            f"{path}:{err.lineno or 0}:{err.offset or 0}: cannot parse: {err.msg}"
        ) from None
    except ValueError as err:  # e.g. null bytes
        raise CheckError(f"{path}: cannot parse: {err}") from None


def _check(
    source: str, path: str, factories: dict[str, int] | None = None
) -> tuple[list[Finding], int]:
    checker = _ModuleChecker(_parse(source, path), source, path, factories)
    checker.run()
    unique = {(f.line, f.function, f.parameter, f.kind): f for f in reversed(checker.findings)}
    return sorted(unique.values()), len(checker.targets)


def check_source(source: str, filename: str = "<string>") -> list[Finding]:
    """Checks the Python source of one module.

    Args:
        source: Module source text.
        filename: Name used in findings and errors.

    Returns:
        The findings, sorted by line.

    Raises:
        CheckError: If ``source`` is not valid Python.
    """
    return _check(source, filename)[0]


def _iter_files(paths: Iterable[str | os.PathLike[str]]) -> Iterator[tuple[Path, str, str]]:
    """Python files under ``paths``: (file, file as shown, dotted module name); a missing path
    raises CheckError."""
    for raw in paths:
        root = Path(raw)
        if root.is_file():
            files, top = [root], root.parent
        elif root.is_dir():
            files = sorted(
                p
                for p in root.rglob("*.py")
                if not any(
                    part.startswith(".") or part == "__pycache__"
                    for part in p.relative_to(root).parts
                )
            )
            top = root.parent
        else:
            raise CheckError(f"{raw}: no such file or directory")
        for file in files:
            parts = list(file.relative_to(top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield file, str(file), ".".join(parts)


def _read(file: Path, shown: str, report: _Report) -> str | None:
    try:
        with tokenize.open(file) as handle:
            return handle.read()
    except (OSError, SyntaxError, UnicodeDecodeError) as err:
        report.errors.append(f"{shown}: cannot read: {err}")
        return None


def _scan(paths: Iterable[str | os.PathLike[str]]) -> _Report:
    report = _Report()
    try:
        files = list(_iter_files(paths))
    except CheckError as err:
        report.errors.append(str(err))
        return report
    sources = {}
    factories: dict[str, int] = {}
    for file, shown, module in files:
        report.files += 1
        source = _read(file, shown, report)
        if source is None:
            continue
        sources[shown] = source
        # First pass: the compiling factories of every module, so that a module calling one
        # it imported compiles its argument too.
        try:
            found = _ModuleChecker(_parse(source, shown), source, shown).factories
        except CheckError:
            continue  # reported by the second pass
        factories.update({f"{module}.{name}": index for name, index in found.items()})
    for shown, source in sources.items():
        try:
            findings, compiled = _check(source, shown, factories)
        except CheckError as err:
            report.errors.append(str(err))
            continue
        report.findings += findings
        report.compiled += compiled
    return report


def check_paths(paths: Iterable[str | os.PathLike[str]]) -> list[Finding]:
    """Checks every ``.py`` file in ``paths`` (files or directories, searched recursively).

    Hidden directories and ``__pycache__`` are skipped.

    Args:
        paths: Files and directories to check.

    Returns:
        All findings, sorted by path and line.

    Raises:
        CheckError: If a path does not exist or a file cannot be read or parsed; every other file
            is still checked first, and the message lists all such files.
    """
    report = _scan(paths)
    if report.errors:
        raise CheckError("\n".join(report.errors))
    return sorted(report.findings)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        0 when clean, 1 when there are findings, 2 when a path could not be checked.
    """
    parser = argparse.ArgumentParser(
        description="Report compiled functions that can receive an unguarded Python float."
    )
    parser.add_argument(
        "paths",
        nargs="*",
        help="files or directories to check (default: mcore_activations/ and megatron/)",
    )
    parser.add_argument("--quiet", action="store_true", help="print findings only, no summary")
    args = parser.parse_args(argv)
    paths = args.paths or [_shown(path) for path in DEFAULT_PATHS]
    report = _scan(paths)
    for finding in sorted(report.findings):
        print(finding)
    for error in report.errors:
        print(f"error: {error}", file=sys.stderr)
    if not args.quiet:
        print(
            f"check_compiled_scalars: {report.compiled} compiled function(s) in {report.files} "
            f"file(s) checked, {len(report.findings)} finding(s), {len(report.errors)} error(s)"
        )
    if report.errors:
        return 2
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
