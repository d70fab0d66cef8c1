"""CudaRNGStatesTracker and model_parallel_cuda_manual_seed.

The tracker drives the CUDA generator when CUDA is available and the CPU generator otherwise;
these tests draw on that same device, so they check the same semantics on both.
"""

import pytest
import torch

from megatron.core.extensions.te_import import have_te
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.tensor_parallel.random import (
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    initialize_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from tests.unit_tests.test_utilities import Utils

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _draw(n=6, generator=None):
    return torch.rand(n, device=DEVICE, generator=generator)


def _stream(seed, draws=1):
    """What a generator seeded with ``seed`` returns for ``draws`` calls of ``_draw``.

    Draws are compared call by call: on CUDA one draw of 12 numbers differs from two of 6.
    """
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.cat([_draw(generator=generator) for _ in range(draws)])


def _default_seed(seed):
    if DEVICE == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


@pytest.fixture
def tracker():
    tracker = CudaRNGStatesTracker()
    tracker.add("stream", 11)
    return tracker


def test_fork_draws_from_its_stream_and_leaves_the_outer_one_untouched(tracker):
    _default_seed(5)
    expected_outer = torch.cat([_draw(), _draw()])

    _default_seed(5)
    before = _draw()
    with tracker.fork("stream"):
        inside_first = _draw()
    after = _draw()
    with tracker.fork("stream"):
        inside_second = _draw()

    # The outer stream continues as if the forks never happened...
    torch.testing.assert_close(torch.cat([before, after]), expected_outer, rtol=0, atol=0)
    # ...and the forked stream continues from where its previous fork stopped.
    torch.testing.assert_close(
        torch.cat([inside_first, inside_second]), _stream(11, draws=2), rtol=0, atol=0
    )
    assert not torch.equal(inside_first, before)


def test_nested_forks_continue_each_stream(tracker):
    # A inside B inside A: every stream's draws are its own sequence, in order, as if each draw
    # had been made in a fork of its own; none is replayed.
    tracker.add("other", 12)
    _default_seed(5)
    expected_outer = torch.cat([_draw(), _draw()])
    _default_seed(5)
    outer, stream, other = [_draw()], [], []
    with tracker.fork("stream"):
        stream.append(_draw())
        with tracker.fork("other"):
            other.append(_draw())
            with tracker.fork("stream"):
                stream.append(_draw())
            other.append(_draw())
        stream.append(_draw())
    outer.append(_draw())
    with tracker.fork("stream"):
        stream.append(_draw())

    torch.testing.assert_close(torch.cat(stream), _stream(11, draws=4), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(other), _stream(12, draws=2), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(outer), expected_outer, rtol=0, atol=0)


def test_nested_fork_error_resumes_the_enclosing_stream(tracker):
    with tracker.fork("stream"):
        first = _draw()
        with pytest.raises(ZeroDivisionError):
            with tracker.fork("stream"):
                second = _draw()
                1 / 0  # noqa: B018
        third = _draw()
    torch.testing.assert_close(torch.cat([first, second, third]), _stream(11, 3), rtol=0, atol=0)


def test_fork_restores_the_outer_state_on_error(tracker):
    _default_seed(5)
    expected = _draw()
    _default_seed(5)
    with pytest.raises(ZeroDivisionError):
        with tracker.fork("stream"):
            _draw()
            1 / 0  # noqa: B018
    torch.testing.assert_close(_draw(), expected, rtol=0, atol=0)


def test_add_rejects_duplicate_names_and_seeds(tracker):
    with pytest.raises(Exception, match="cuda rng state stream already exists"):
        tracker.add("stream", 12)
    with pytest.raises(Exception, match="seed 11 already exists"):
        tracker.add("other", 11)
    # A rejected add registers nothing.
    assert set(tracker.get_states()) == {"stream"}
    tracker.add("other", 12)
    assert set(tracker.get_states()) == {"stream", "other"}


def test_add_leaves_the_default_generator_alone():
    _default_seed(5)
    expected = _draw()
    _default_seed(5)
    CudaRNGStatesTracker().add("x", 1234)
    torch.testing.assert_close(_draw(), expected, rtol=0, atol=0)


def test_fork_of_an_unknown_name_raises(tracker):
    with pytest.raises(Exception, match="cuda rng state missing is not added"):
        with tracker.fork("missing"):
            pass
    # The default name is the model-parallel stream, which this tracker lacks.
    with pytest.raises(Exception, match="cuda rng state model-parallel-rng is not added"):
        with tracker.fork():
            pass


def test_get_and_set_states_replay_a_stream(tracker):
    saved = tracker.get_states()
    with tracker.fork("stream"):
        first = _draw()
    tracker.set_states(saved)
    with tracker.fork("stream"):
        replay = _draw()
    torch.testing.assert_close(replay, first, rtol=0, atol=0)


def test_reset(tracker):
    assert tracker.is_initialized()
    tracker.reset()
    assert not tracker.is_initialized()
    assert tracker.get_states() == {}
    tracker.add("stream", 11)  # the seed is free again


def test_unsupported_tracker_options():
    with pytest.raises(ValueError, match="not supported"):
        model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0, gtp_remat_world_size=2)


def test_manual_seed_registers_the_three_streams_with_upstream_offsets():
    seed, tp_rank, ep_rank, etp_rank = 1000, 1, 2, 3
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank)
    tracker = get_cuda_rng_tracker()
    assert set(tracker.get_states()) == {
        "data-parallel-rng",
        "model-parallel-rng",
        "expert-parallel-rng",
    }
    assert get_data_parallel_rng_tracker_name() == "data-parallel-rng"
    assert get_expert_parallel_rng_tracker_name() == "expert-parallel-rng"

    # The default generator is seeded with the base seed.
    torch.testing.assert_close(_draw(), _stream(seed), rtol=0, atol=0)
    expected_seeds = {
        "data-parallel-rng": seed,
        "model-parallel-rng": seed + 2718 + tp_rank,
        "expert-parallel-rng": seed + 1024 + 100 * ep_rank + etp_rank,
    }
    for name, expected_seed in expected_seeds.items():
        with tracker.fork(name):
            torch.testing.assert_close(_draw(), _stream(expected_seed), rtol=0, atol=0, msg=name)


def test_manual_seed_takes_ranks_from_parallel_state():
    Utils.initialize_model_parallel(1, 1)
    try:
        model_parallel_cuda_manual_seed(7)
        with get_cuda_rng_tracker().fork():
            torch.testing.assert_close(_draw(), _stream(7 + 2718), rtol=0, atol=0)
    finally:
        Utils.destroy_model_parallel()


def test_manual_seed_resets_the_tracker():
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = get_cuda_rng_tracker()
    # Seeding again must not trip the duplicate checks: the old streams are dropped first.
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    assert get_cuda_rng_tracker() is tracker
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    assert get_cuda_rng_tracker() is not tracker


@pytest.mark.skipif(have_te(), reason="checks the error raised without Transformer Engine")
def test_te_tracker_without_te_is_refused(monkeypatch):
    monkeypatch.setattr(tp_random, "_CUDA_RNG_STATE_TRACKER", None)
    with pytest.raises(ValueError, match="Transformer Engine"):
        initialize_rng_tracker(use_te_rng_tracker=True)


def test_dropout_inside_the_model_parallel_stream():
    # The typical use: dropout on a tensor-parallel shard draws from the per-rank stream.
    model_parallel_cuda_manual_seed(3, tp_rank=0, ep_rank=0, etp_rank=0)
    x = torch.ones(64, device=DEVICE)
    with get_cuda_rng_tracker().fork():
        first = torch.nn.functional.dropout(x, p=0.5)
    model_parallel_cuda_manual_seed(3, tp_rank=0, ep_rank=0, etp_rank=0)
    with get_cuda_rng_tracker().fork():
        again = torch.nn.functional.dropout(x, p=0.5)
    model_parallel_cuda_manual_seed(3, tp_rank=1, ep_rank=0, etp_rank=0)
    with get_cuda_rng_tracker().fork():
        other_rank = torch.nn.functional.dropout(x, p=0.5)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first, other_rank)
