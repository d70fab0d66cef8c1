"""The patch report: one line by default, on rank 0; the full list on request."""

from __future__ import annotations

import io

import pytest
import torch

from mcore_activations.megatron_patch import PatchedObject, PatchReport

REPORT = PatchReport(
    upstream="megatron-core 0.19.2",
    patched=tuple(
        PatchedObject(f"megatron.core.transformer.mlp:Object{i}", "replaced", f"reason {i}")
        for i in range(50)
    ),
    skipped=(("megatron.core.extensions.transformer_engine:TEFusedMLP", "no TE"),),
)


def test_str_is_one_line_naming_the_details():
    text = str(REPORT)
    assert "\n" not in text
    assert text == (
        "mcore_activations patched megatron-core 0.19.2: 50 objects, 1 skipped "
        "(report.details() lists them)"
    )


def test_details_lists_every_object_and_why():
    lines = REPORT.details().splitlines()
    assert len(lines) == 1 + 50 + 1
    assert lines[1] == "  replaced megatron.core.transformer.mlp:Object0: reason 0"
    assert lines[-1].startswith("  skipped  megatron.core.extensions.transformer_engine:TEFusedMLP")


@pytest.mark.parametrize("rank, printed", [(None, True), ("0", True), ("1", False), ("7", False)])
def test_print_speaks_on_rank_0_only(monkeypatch, rank, printed):
    # Before torch.distributed starts, the rank is torchrun's RANK (another test of this worker
    # may have left a process group behind: it is not this test's rank).
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    out = io.StringIO()
    REPORT.print(file=out)
    assert out.getvalue() == (str(REPORT) + "\n" if printed else "")


@pytest.mark.parametrize("rank, printed", [(0, True), (3, False)])
def test_print_follows_the_process_group_once_started(monkeypatch, rank, printed):
    monkeypatch.setenv("RANK", "0" if rank else "5")  # the group's rank wins over the variable
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank)
    out = io.StringIO()
    REPORT.print(file=out)
    assert out.getvalue() == (str(REPORT) + "\n" if printed else "")


def test_print_details_on_request(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    out = io.StringIO()
    REPORT.print(details=True, file=out)
    assert out.getvalue() == REPORT.details() + "\n"
