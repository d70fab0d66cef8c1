"""The step profiler's bookkeeping (the profile itself needs a GPU)."""

import pytest

from tools.profile_activation_step import Kernel, main, markdown, split_steps, summarize


def _steps(period=100.0, n=4):
    # Each step: a forward kernel of 30 us, 10 us idle, a backward kernel of 50 us; the next step
    # starts ``period`` us after this one.
    kernels = [Kernel("sum_kernel", -20.0, -10.0)]  # the tail of a step cut by the profile
    for s in range(n):
        t = s * period
        kernels += [
            Kernel("_activation_bwd_kernel", t + 40.0, t + 90.0),
            Kernel("_activation_fwd_kernel", t, t + 30.0),
        ]
    return kernels


def test_split_steps_cuts_at_each_forward_kernel_in_start_order():
    steps = split_steps(_steps())
    assert len(steps) == 4
    assert [[k.name for k in step] for step in steps] == [
        ["_activation_fwd_kernel", "_activation_bwd_kernel"]
    ] * 4


def test_summarize_takes_medians_of_durations_idle_times_and_the_period():
    summary = summarize(split_steps(_steps(period=100.0)))
    assert summary["steps"] == 4 and summary["period_us"] == 100.0
    assert summary["busy_us"] == 80.0
    forward, backward = summary["kernels"]
    # Before a forward: the previous step's backward ended at +90, this one starts at +100.
    assert forward == {
        "kernel": "_activation_fwd_kernel",
        "duration_us": 30.0,
        "idle_before_us": 10.0,
    }
    assert backward == {
        "kernel": "_activation_bwd_kernel",
        "duration_us": 50.0,
        "idle_before_us": 10.0,
    }
    assert "step period 100.0 us (median of 3), kernels 80.0 us (80% of it)" in markdown(summary)


def test_summarize_refuses_too_few_or_mismatched_steps():
    with pytest.raises(ValueError, match="time a period, got 1: the profile has one forward"):
        summarize(split_steps(_steps(n=1)))
    with pytest.raises(ValueError, match="got 0: the profile has no forward kernel"):
        summarize(split_steps([Kernel("sum_kernel", 0.0, 1.0)]))
    steps = split_steps(_steps())
    steps[2] = steps[2][:1]
    with pytest.raises(ValueError, match="different kernels"):
        summarize(steps)


def test_main_refuses_fewer_than_two_steps():
    with pytest.raises(SystemExit) as refused:
        main(["--steps", "1"])
    assert refused.value.code == 2


@pytest.mark.gpu
def test_cuda_profile_of_a_small_step(capsys):
    """On a GPU the profile finds the forward and backward kernels of every step, and nothing
    else for an unweighted call without a bias."""
    main(["--t", "256", "--h", "512", "--steps", "4"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")][1:]  # past the header
    assert [row.split("|")[1].strip() for row in rows] == [
        "_activation_fwd_kernel",
        "_activation_bwd_kernel",
    ]
    assert "step period" in out
