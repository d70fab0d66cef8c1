"""The side-by-side benchmark's batch sizes (the timing itself needs a GPU)."""

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
