"""Fail a change to a kernel-bearing source that has no registered bit-exact replay test.

Usage::

    python tools/check_kernel_determinism_coverage.py --all             # the whole tree (CI)
    python tools/check_kernel_determinism_coverage.py --base origin/main  # files changed since
    python tools/check_kernel_determinism_coverage.py --files a.py b.py

A file is kernel-bearing when its code (comments and strings ignored) defines or builds a kernel:
``triton.jit``, ``jit_fuser``, ``torch.compile(``, a ``torch.library`` op, or Transformer Engine
fusible ops (``pytorch.ops``). Every such file under the package directories must be a source of
an entry of ``tests/unit_tests/determinism/kernels/manifest.py``; every entry needs replay tests
or a written exemption; and a change to an entry's source needs a change to one of its tests
(``--allow-untested-changes`` waives that for a reviewed change). Exit status 1 on a violation,
2 on a usage error. Standard library only.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = Path("tests/unit_tests/determinism/kernels/manifest.py")
PACKAGE_DIRS = ("mcore_activations", "megatron")
KERNEL_PATTERNS = re.compile(
    r"triton\.jit|\bjit_fuser\b|torch\.compile\(|torch\.library\.(Library|custom_op)|pytorch\.ops\b"
)


def code_without_comments_and_strings(source: str) -> str:
    """``source`` with every comment and string literal removed (kept: names and operators)."""
    kept = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type in (tokenize.COMMENT, tokenize.STRING):
                continue
            if sys.version_info >= (3, 12) and token.type in (
                tokenize.FSTRING_START,
                tokenize.FSTRING_MIDDLE,
                tokenize.FSTRING_END,
            ):
                continue
            kept.append(token.string)
    except (tokenize.TokenError, SyntaxError):
        return source
    return (
        " ".join(kept).replace(" . ", ".").replace(" .", ".").replace(". ", ".").replace(" (", "(")
    )


def is_kernel_bearing(path: Path) -> bool:
    """Whether the Python file at ``path`` defines or builds a kernel (see the module doc)."""
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    return bool(KERNEL_PATTERNS.search(code_without_comments_and_strings(source)))


def kernel_bearing_files(root: Path, candidates=None) -> list[str]:
    """Kernel-bearing files under the package directories (or among ``candidates``)."""
    if candidates is None:
        candidates = [p for d in PACKAGE_DIRS for p in sorted((root / d).rglob("*.py"))]
    else:
        candidates = [root / c for c in candidates]
    found = []
    for path in candidates:
        relative = path.relative_to(root).as_posix()
        if relative.split("/")[0] in PACKAGE_DIRS and path.is_file() and is_kernel_bearing(path):
            found.append(relative)
    return found


def load_manifest(path: Path) -> list[dict]:
    """The ``KERNELS`` list of the manifest file (executed in an empty namespace)."""
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - our own file
    return namespace["KERNELS"]


def _test_file(test: str) -> str:
    return test.split("::")[0]


def check(root: Path, manifest: list[dict], changed=None, allow_untested_changes=False):
    """Violations as readable lines (empty: the tree or change is covered)."""
    problems = []
    sources = {}
    for entry in manifest:
        for source in entry["sources"]:
            sources.setdefault(source, []).append(entry)
        if not entry.get("tests") and not entry.get("exempt"):
            problems.append(f"{entry['name']}: neither replay tests nor an exemption reason")
    to_check = kernel_bearing_files(root, changed)
    for path in to_check:
        if path not in sources:
            problems.append(
                f"{path}: kernel-bearing but not registered in {MANIFEST.as_posix()} "
                "(add an entry with its replay tests)"
            )
    if changed is not None and not allow_untested_changes:
        changed_set = set(changed)
        for path in to_check:
            for entry in sources.get(path, []):
                if entry.get("exempt"):
                    continue
                tests = {_test_file(t) for t in entry["tests"]}
                if not tests & changed_set:
                    problems.append(
                        f"{path} changed but none of {entry['name']}'s replay tests did "
                        f"({', '.join(sorted(tests))}); update them, or pass "
                        "--allow-untested-changes after review"
                    )
    return problems


def _changed_since(base: str, root: Path) -> list[str]:
    out = subprocess.run(
        ["git", "diff", "--name-only", base, "--"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in out.stdout.splitlines() if line.endswith(".py")]


def main(argv=None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--all", action="store_true", help="check the whole tree's registration")
    mode.add_argument("--base", help="check the files changed since this git ref")
    mode.add_argument("--files", nargs="+", help="check these files (repository-relative)")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root")
    parser.add_argument("--manifest", type=Path, help="manifest file (default: the project's)")
    parser.add_argument("--allow-untested-changes", action="store_true")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    manifest_path = args.manifest or root / MANIFEST
    if not manifest_path.is_file():
        parser.error(f"no manifest at {manifest_path}")
    manifest = load_manifest(manifest_path)
    if args.all:
        changed = None
    elif args.base:
        try:
            changed = _changed_since(args.base, root)
        except (subprocess.CalledProcessError, OSError) as err:
            parser.error(f"--base {args.base}: git diff failed ({err})")
    else:
        changed = args.files
    problems = check(root, manifest, changed, args.allow_untested_changes)
    for line in problems:
        print(f"check_kernel_determinism_coverage: {line}")
    scope = "the tree" if changed is None else f"{len(changed)} changed file(s)"
    print(f"check_kernel_determinism_coverage: {scope}, {len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
