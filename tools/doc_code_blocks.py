"""The fenced code blocks of README.md and docs/*.md, and how the doc tests run each.

Every ``python`` / ``bash`` block runs in a test as written
(tests/unit_tests/test_doc_code_blocks.py in the project's environment,
tests/upstream/test_doc_code_blocks.py next to upstream megatron-core). An HTML comment on the
line before a fence, invisible when rendered, says where:

    <!-- doc-test: upstream -->             needs upstream megatron-core (the upstream tier runs it)
    <!-- doc-test: skip: <reason> -->       not run; the reason says why (e.g. needs a GPU)

Unmarked blocks run in the project's environment: the standalone fork importable, from a
scratch directory. ``/path/to/megatron-core-activations`` in a block means this checkout.
Standard library only: the upstream tier loads this file by path.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKOUT_PLACEHOLDER = "/path/to/megatron-core-activations"
LANGUAGES = ("python", "bash")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[A-Za-z]*)[ \t]*$")
_MARK = re.compile(r"<!--\s*doc-test:\s*(?P<kind>upstream|skip)(?::\s*(?P<reason>.*?))?\s*-->")


@dataclasses.dataclass(frozen=True)
class CodeBlock:
    """One fenced block: where it is, its language, code and doc-test marker."""

    doc: str  # path relative to the repository
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    where: str  # "project", "upstream" or "skip"
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def documents() -> list[Path]:
    """README.md and every page of docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def code_blocks(path: Path) -> list[CodeBlock]:
    """The ``python`` and ``bash`` blocks of one markdown file, in order.

    Raises:
        ValueError: A fence is not closed, or a skip marker gives no reason.
    """
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: a code fence is not closed")
        language = opening["lang"].lower()
        if language in LANGUAGES:
            mark = _MARK.search(lines[i - 1]) if i > 0 else None
            where, reason = "project", ""
            if mark:
                where, reason = mark["kind"], (mark["reason"] or "").strip()
                if where == "skip" and not reason:
                    raise ValueError(f"{path}:{i}: a doc-test skip marker needs a reason")
            code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
            code = code.replace(CHECKOUT_PLACEHOLDER, str(REPO))
            doc = str(path.relative_to(REPO))
            blocks.append(CodeBlock(doc, i + 1, language, code, where, reason))
        i = end + 1
    return blocks


def all_code_blocks() -> list[CodeBlock]:
    """Every ``python`` / ``bash`` block of README.md and docs/."""
    return [block for doc in documents() for block in code_blocks(doc)]
