"""``MCORE_ACTIVATIONS_PATCH`` in a regular install: strict values, never a silent no-op."""

from __future__ import annotations

import pytest
from conftest import run_python

STATE = """
import megatron.core
from mcore_activations import megatron_patch as mp
print("PATCHED" if mp.patch_report() is not None else "NOT PATCHED")
"""


@pytest.mark.parametrize("value", ["false", "off", "0"])
def test_off_values_patch_nothing(target, value):
    done = run_python(STATE, target, env={"MCORE_ACTIVATIONS_PATCH": value})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "NOT PATCHED"


def test_yes_patches_at_import(target):
    done = run_python(STATE, target, env={"MCORE_ACTIVATIONS_PATCH": "yes"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "PATCHED"


def test_an_unknown_value_stops_the_run_naming_the_variable(target):
    done = run_python(STATE, target, env={"MCORE_ACTIVATIONS_PATCH": "ture"})
    assert done.returncode != 0 and "PATCHED" not in done.stdout
    assert "MCORE_ACTIVATIONS_PATCH='ture' is not understood" in done.stderr
