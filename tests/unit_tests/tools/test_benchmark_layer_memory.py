"""The layer benchmark's plumbing on CPU: argument rules, the table, and a dry run of real
candidates in their own processes (no timing or memory is judged; those need a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.benchmark_layer_memory import DRY, markdown, parse

ROOT = Path(__file__).resolve().parents[3]
TOOL = ROOT / "tools" / "benchmark_layer_memory.py"
# The upstream tier's environment (scripts/upstream_env.sh): megatron-core 0.19.2 on CPU torch.
UPSTREAM_PYTHONS = sorted(
    Path.home().glob(".cache/megatron-core-activations/venv-upstream-*0.19.2*/bin/python")
)


def test_dry_run_shapes_and_overrides():
    args = parse(["--dry-run", "--shape", '{"hidden": 32}'])
    assert args.shape == DRY | {"hidden": 32} and (args.iters, args.warmup) == (1, 0)
    with pytest.raises(SystemExit):
        parse(["--shape", '{"width": 3}'])
    with pytest.raises(SystemExit):
        parse(["--iters", "0"])


def test_markdown_ratios_to_upstream_and_skips():
    rows = [
        {
            "layer": "dense",
            "candidate": "upstream",
            "status": "ok",
            "ms": 2.0,
            "held_mib": 400.0,
            "peak_mib": 300.0,
        },
        {
            "layer": "dense",
            "candidate": "patched_inplace_recompute",
            "status": "ok",
            "ms": 1.9,
            "held_mib": 300.0,
            "peak_mib": 200.0,
        },
        {"layer": "dense", "candidate": "liger", "status": "skipped", "reason": "not installed"},
    ]
    lines = markdown(rows).splitlines()
    assert (
        "| dense | patched_inplace_recompute | 1.900 | 300 | 200 | 0.950 / 0.750 / 0.667 | |"
        in lines
    )
    assert lines[-1].endswith("| not installed |")


def test_a_candidate_without_megatron_is_skipped_by_name(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--dry-run",
            "--candidates",
            "upstream",
            "--layers",
            "dense",
            "--python",
            sys.executable,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] in ("skipped", "error"), row
    if row["status"] == "skipped":
        assert "megatron" in row["reason"]


@pytest.mark.skipif(not UPSTREAM_PYTHONS, reason="no upstream megatron-core 0.19.2 environment")
def test_dry_run_against_upstream_in_separate_processes(tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, str(TOOL), "--dry-run", "--python", str(UPSTREAM_PYTHONS[-1])]
    command += ["--candidates", "upstream", "patched_inplace", "patched_inplace_recompute"]
    command += ["liger", "--layers", "dense", "experts", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = {(r["layer"], r["candidate"]): r for r in json.loads(out.read_text())["rows"]}
    for layer in ("dense", "experts"):
        upstream, in_place = rows[layer, "upstream"], rows[layer, "patched_inplace"]
        assert upstream["status"] == in_place["status"] == "ok", (upstream, in_place)
        assert upstream["in_place_backward"] is False and in_place["in_place_backward"] is True
        # The same weights and inputs: the patched layer computes what upstream computes.
        assert in_place["out_sum"] == pytest.approx(upstream["out_sum"], rel=1e-4, abs=1e-4)
        assert in_place["dx_norm"] == pytest.approx(upstream["dx_norm"], rel=1e-4)
        assert in_place["wgrad_norm"] == pytest.approx(upstream["wgrad_norm"], rel=1e-4)
        both = rows[layer, "patched_inplace_recompute"]
        assert both["status"] == "ok" and both["in_place_backward"] and both["recompute_output"]
        for key in ("out_sum", "dx_norm", "wgrad_norm"):
            assert both[key] == pytest.approx(upstream[key], rel=1e-4, abs=1e-4), key
    assert rows["dense", "liger"]["status"] == "skipped"
    assert rows["experts", "liger"]["reason"].startswith("dense only")
