"""The CI workflow runs every test tier with the command the README documents for it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
WORKFLOW = (REPO / ".github" / "workflows" / "ci.yml").read_text()
README = (REPO / "README.md").read_text()


def _tier_commands() -> dict[str, str]:
    """``{tier: first command}`` of the README's "Test tiers" table."""
    table = README[README.index("## Test tiers") :].split("\n\n")[1]
    commands = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        first = re.search(r"`([^`]+)`", cells[1])
        commands[cells[0]] = first.group(1)
    return commands


def test_the_readme_lists_the_tiers():
    assert set(_tier_commands()) >= {"CPU (CI)", "GPU", "multi-GPU", "upstream GPU"}


def test_every_tier_runs_its_readme_command():
    missing = {}
    for tier, command in _tier_commands().items():
        if tier.startswith("upstream (CI)"):
            continue  # part of scripts/test.sh, the CPU tier's command
        script = re.search(r"scripts/\S+\.sh", command).group(0)
        if script not in WORKFLOW:
            missing[tier] = command
    assert missing == {}


def test_the_multigpu_tests_are_not_wrapped_in_torchrun():
    """They spawn their own ranks; torchrun would start every test once per GPU."""
    assert "torchrun" not in WORKFLOW
    assert "scripts/multigpu_tier.sh" in WORKFLOW
