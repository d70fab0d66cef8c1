"""tensor_parallel.random.HAVE_TE: upstream's flag, answered by the TE seam at each read (no TE
import of its own), and patchable as upstream's tests patch it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from unittest import mock

import pytest

from mcore_activations import te_import
from megatron.core.tensor_parallel import random as tp_random


def test_follows_the_seam(monkeypatch):
    assert tp_random.HAVE_TE is te_import.have_te()
    monkeypatch.setattr(te_import, "HAVE_TE", not te_import.have_te())
    assert tp_random.HAVE_TE is te_import.have_te()


def test_from_import_works():
    from megatron.core.tensor_parallel.random import HAVE_TE

    assert HAVE_TE is te_import.have_te()


def test_other_names_still_raise():
    with pytest.raises(AttributeError, match="has no attribute 'NOT_A_NAME'"):
        tp_random.NOT_A_NAME  # noqa: B018 - the attribute access is the test


def test_patching_it_steers_the_te_tracker_choice(monkeypatch):
    # Even with the seam saying TE is there, a patched HAVE_TE=False refuses the TE tracker,
    # before any tracker is replaced.
    monkeypatch.setattr(te_import, "HAVE_TE", True)
    with mock.patch("megatron.core.tensor_parallel.random.HAVE_TE", False):
        assert tp_random.HAVE_TE is False
        with pytest.raises(ValueError, match="use_te_rng_tracker=True needs Transformer Engine"):
            tp_random.initialize_rng_tracker(use_te_rng_tracker=True, force_reset=True)
    # The patch is undone: the attribute answers from the seam again, not a stale global.
    assert "HAVE_TE" not in vars(tp_random)
    assert tp_random.HAVE_TE is True


def test_false_where_transformer_engine_cannot_import():
    # A fresh interpreter in which ``import transformer_engine`` fails, as on a machine without
    # TE: the module imports and HAVE_TE says False, as upstream's does there.
    script = textwrap.dedent(
        """
        import sys
        sys.modules["transformer_engine"] = None
        import megatron.core.tensor_parallel.random as tp_random
        assert tp_random.HAVE_TE is False, tp_random.HAVE_TE
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
