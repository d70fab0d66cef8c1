"""Bit-exact replay: run a computation twice (and in a fresh process) and compare every output
and gradient bit for bit, reporting the first element that differs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[4]


def first_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    """Where and how two tensors first differ bitwise ("" if they are identical).

    Bits, not values, are compared: NaN payloads and -0.0 against 0.0 count as the differences
    they are for a replay.
    """
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return (
            f"shape/dtype {tuple(got.shape)} {got.dtype} != "
            f"{tuple(expected.shape)} {expected.dtype}"
        )
    a = got.detach().cpu().contiguous().reshape(-1)
    b = expected.detach().cpu().contiguous().reshape(-1)
    if a.numel() == 0:
        return ""
    differs = (
        a.view(torch.uint8).reshape(a.numel(), -1) != b.view(torch.uint8).reshape(b.numel(), -1)
    ).any(dim=1)
    if not differs.any():
        return ""
    index = int(differs.nonzero()[0])
    position = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), got.shape))
    return f"first difference at {position}: {a[index].item()!r} vs {b[index].item()!r}"


def assert_bitwise_equal(got: dict, expected: dict, what: str) -> None:
    """Every tensor of ``got`` equals the same-named one of ``expected`` bit for bit."""
    assert got.keys() == expected.keys(), f"{what}: outputs {sorted(got)} != {sorted(expected)}"
    for name in got:
        difference = first_difference(got[name], expected[name])
        assert not difference, f"{what}: {name}: {difference}"


def replay_twice(run: Callable[[], dict], what: str) -> dict:
    """Runs ``run()`` twice in this process and checks the two results are bitwise equal."""
    first = run()
    second = run()
    assert_bitwise_equal(second, first, f"{what} (second run in the same process)")
    return first


def run_in_fresh_process(case_names: list[str], out_dir: Path, env: dict | None = None) -> dict:
    """Runs the named cases of ``cases.py`` in a new interpreter; returns ``{case: results}``."""
    out_file = out_dir / "fresh.pt"
    command = [sys.executable, "-m", "tests.unit_tests.determinism.kernels.cases", str(out_file)]
    environment = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    proc = subprocess.run(
        [*command, *case_names],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (
        f"fresh process failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
    return torch.load(out_file)


__all__ = ["assert_bitwise_equal", "first_difference", "replay_twice", "run_in_fresh_process"]
