"""The side-by-side benchmark's batch sizes and row filters (the timing itself needs a GPU)."""

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
