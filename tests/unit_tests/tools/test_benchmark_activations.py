"""The side-by-side benchmark's batch sizes and row filters (the timing itself needs a GPU)."""

import pytest

from tools.benchmark_activations import batch_calls


def test_batch_calls_by_size_without_a_minimum_batch_time():
    assert batch_calls(16384, 16384) == 20  # large rows: the fewest calls
    assert batch_calls(256, 2048) == 200  # small, host-bound rows: the most
    assert batch_calls(4096, 4096) == 119
    assert batch_calls(4096, 4096, floor_ms=0.01) == 119  # no minimum asked for


def test_batch_calls_fill_the_minimum_batch_time_within_bounds():
    # 65536 x 1536 forward+backward: a 0.38 ms floor fills 25 ms in 66 calls.
    assert batch_calls(65536, 3072, floor_ms=0.38, min_batch_ms=25) == 66
    # Never fewer than the size rule gives, never more than 2000.
    assert batch_calls(256, 2048, floor_ms=1.0, min_batch_ms=25) == 200
    assert batch_calls(256, 2048, floor_ms=0.001, min_batch_ms=25) == 2000


def test_markdown_marks_bias_rows_and_reads_rows_without_the_field():
    """Rows timed with ``--bias`` say so in their own column; rows of earlier JSON files, which
    have no ``bias`` field, read as without."""
    from tools.benchmark_activations import markdown

    base = {"spec": "SwiGLU", "dtype": "bfloat16", "T": 8, "H": 64, "weighted": True}
    base |= {"floor_fwd_ms": 1.0, "floor_fwd_bwd_ms": 2.0, "ours_fwd_ms": 1.5}
    base |= {"ours_fwd_bwd_ms": 3.0}
    lines = markdown([base | {"bias": True}, base]).splitlines()
    assert lines[0].split("|")[4:6] == [" probs ", " bias "]
    assert [line.split("|")[4:6] for line in lines[2:]] == [[" yes ", " yes "], [" yes ", "  "]]
    assert "1.500 (1.50) / 3.000 (1.50)" in lines[2]


def test_row_filters_select_by_spec_width_rows_and_dtype():
    """``--spec``, ``--h``, ``--t`` and ``--dtype`` each narrow the suite; together they all
    apply, and an absent filter keeps every row."""
    import argparse

    import torch

    from tools.benchmark_activations import configurations, selected

    def rows(**filters):
        args = argparse.Namespace(**({"spec": None, "h": None, "t": None, "dtype": None} | filters))
        return [
            (name, T, H, dtype)
            for name, _, T, H, dtype, _, _ in configurations("full")
            if selected(args, name, T, H, dtype)
        ]

    everything = rows()
    assert len(everything) == len(list(configurations("full")))
    assert {T for _, T, _, _ in rows(t=[65536])} == {65536}
    assert {H for _, T, H, _ in rows(t=[65536])} == {1024, 1536, 2880, 8192, 16384}
    picked = rows(spec=["GELU"], h=[1536], t=[65536], dtype=["bfloat16"])
    assert picked == [("GELU", 65536, 1536, torch.bfloat16)]
    assert rows(t=[65536], h=[2048]) == []  # 4096 x 2048 is the only H = 2048 shape


def test_repeats_must_be_positive():
    """``--repeats 0`` would time nothing and take the median of no samples: refused by name
    before anything needs a GPU."""
    import pytest

    from tools.benchmark_activations import main

    with pytest.raises(SystemExit) as refused:
        main(["--repeats", "0"])
    assert refused.value.code == 2


def test_markdown_marks_times_paced_by_the_host():
    """A time within 10 % of its host time per call carries the mark; a time well above it, a
    host time that could not be measured (None) and rows of earlier JSON files without the
    field do not."""
    from tools.benchmark_activations import HOST_PACED_MARK, host_paced, markdown

    row = {"spec": "SwiGLU", "dtype": "bfloat16", "T": 256, "H": 1024, "weighted": False}
    row |= {"floor_fwd_ms": 0.006, "floor_fwd_bwd_ms": 0.006}
    row |= {"ours_fwd_ms": 0.027, "ours_fwd_bwd_ms": 0.205}
    row |= {"ours_fwd_host_ms": 0.025, "ours_fwd_bwd_host_ms": 0.150}
    row |= {"te_fwd_ms": 0.043, "te_fwd_bwd_ms": 0.220}
    row |= {"te_fwd_host_ms": None}  # and no te_fwd_bwd_host_ms: an earlier file's row
    assert host_paced(row, "ours", "fwd")  # 0.025 >= 0.9 * 0.027
    assert not host_paced(row, "ours", "fwd_bwd")  # 0.150 < 0.9 * 0.205
    assert not host_paced(row, "te", "fwd") and not host_paced(row, "te", "fwd_bwd")
    line = markdown([row]).splitlines()[2]
    assert f"0.027{HOST_PACED_MARK} (4.50) / 0.205 (34.17)" in line
    assert "0.043 (7.17) / 0.220 (36.67)" in line
    assert line.count(HOST_PACED_MARK) == 1


@pytest.mark.gpu
def test_host_ms_is_the_host_time_of_a_call_and_refuses_a_synchronising_one():
    """Calls enqueued behind the GPU's sleep cost the host microseconds whatever their kernels
    take; a call that synchronises waits for the sleep, which host_ms reports as None."""
    import torch

    from tools.benchmark_activations import host_ms

    x = torch.randn(4096, 4096, device="cuda")
    # Ten float32 4096^3 matrix products a call: tens of ms of GPU work on an H100, about a
    # hundred microseconds of host; three calls stay well inside the 200 ms sleep.
    heavy = host_ms(lambda: [x @ x for _ in range(10)], calls=3, repeats=3, busy_ms=200.0)
    assert heavy is not None and heavy < 1.0
    assert host_ms(lambda: x.sum().item(), calls=3) is None


def test_markdown_shows_in_place_and_liger_columns_with_peak_memory():
    """The in-place and Liger candidates have columns of their own, and a measured
    forward+backward peak follows the times; a row without Liger shows a dash there."""
    from tools.benchmark_activations import markdown

    row = {"spec": "SwiGLU", "dtype": "bfloat16", "T": 8192, "H": 8192, "weighted": False}
    row |= {"floor_fwd_ms": 1.0, "floor_fwd_bwd_ms": 2.0}
    for label, peak in (("ours", 384.0), ("ours_inplace", 128.0)):
        row |= {f"{label}_fwd_ms": 1.0, f"{label}_fwd_bwd_ms": 2.0}
        row |= {f"{label}_fwd_bwd_peak_mib": peak}
    head, _, line = markdown([row]).splitlines()
    labels = [cell.split()[0] for cell in head.split("|")[7:-1]]
    assert labels == ["ours", "ours_inplace", "te", "compile", "eager", "liger", "liger_inplace"]
    cells = [cell.strip() for cell in line.split("|")[7:-1]]
    assert cells[:2] == [
        "1.000 (1.00) / 2.000 (1.00) / 384 MiB",
        "1.000 (1.00) / 2.000 (1.00) / 128 MiB",
    ]
    assert cells[5:] == ["-", "-"]


def test_liger_columns_only_for_plain_swiglu():
    from tools.benchmark_activations import SPECS, liger_candidates

    # Not installed here: no columns; for other specs or with weights or a bias, never.
    assert liger_candidates(SPECS["SwiGLU(clamp=7)"], False, None) == {}
    assert liger_candidates(SPECS["SwiGLU"], True, None) == {}


def test_memory_suite_covers_the_in_place_comparison_shapes():
    from tools.benchmark_activations import configurations

    rows = [(name, T, H, weighted) for name, _, T, H, _, weighted, _ in configurations("memory")]
    assert {(T, 2 * H) for _, T, H, _ in rows} == {(8192, 65536), (16384, 16384), (8192, 8192)}
    assert ("SwiGLU", 8192, 32768, False) in rows and ("SwiGLU(clamp=7)", 8192, 4096, True) in rows
