"""The audits' command line: help on every flag, the command's own name, one-line errors, one
vocabulary, reasons cut between words only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_activations import audit_cells
from mcore_activations.activation_spec import ActivationSpec
from mcore_activations.audit_cli import PROG_ENV, AuditArgumentParser
from megatron.core.transformer import activation_audit as audit
from megatron.core.transformer.activation_audit_paths import _config

REPO = Path(__file__).resolve().parents[3]


def _module(*args):
    env = {k: v for k, v in os.environ.items() if k != PROG_ENV}
    return subprocess.run(
        [sys.executable, "-m", audit.MODULE, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_every_option_has_help():
    for action in audit.build_parser()._actions:
        assert action.help, action.option_strings


def test_help_names_the_command_typed_and_keeps_the_examples_lines():
    done = _module("--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: python -m {audit.MODULE}")
    first = "examples:\n  the built-in activation set:\n"
    assert f"{first}    python -m {audit.MODULE}\n" in done.stdout
    assert "exit status:" in done.stdout


def test_a_usage_error_is_one_line_and_a_pointer_to_help():
    done = _module("--dtype", "float16")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert "usage:" not in done.stderr
    assert lines[-2].startswith(f"python -m {audit.MODULE}: error: argument --dtype")
    assert lines[-1] == f"(`python -m {audit.MODULE} --help` lists the options)"


def test_the_prog_variable_names_the_wrapper_script(monkeypatch, capsys):
    monkeypatch.setenv(PROG_ENV, "scripts/main.sh")
    with pytest.raises(SystemExit):
        audit.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: scripts/main.sh ")


def test_builtin_labels_end_with_the_spec_name():
    """One vocabulary: a column is the activation's ActivationSpec.name, after its model family."""
    for label, kwargs in audit.BUILT_IN.items():
        assert label.endswith(ActivationSpec.from_config(_config(kwargs)).name), label


@pytest.mark.parametrize(
    "text, limit, expected",
    [
        ("short reason", 160, "short reason"),
        ("first line\nsecond line", 160, "first line"),
        ("alpha beta gamma delta", 12, "alpha..."),
        ("alpha beta, gamma delta", 17, "alpha beta..."),
    ],
)
def test_reasons_are_cut_between_words(text, limit, expected):
    assert audit_cells.reason(text, limit) == expected


def test_a_long_reason_never_ends_inside_a_word():
    text = "TEGroupedMLP(bias_activation_fusion=True) cannot compute SwiGLU(clamp=7): " * 5
    cut = audit_cells.reason(text, 100)
    assert len(cut) <= 100 and cut.endswith("...")
    assert text.startswith(cut[:-3]) and not text[len(cut) - 3].isalnum()


def test_the_parser_is_the_shared_one():
    assert isinstance(audit.build_parser(), AuditArgumentParser)
