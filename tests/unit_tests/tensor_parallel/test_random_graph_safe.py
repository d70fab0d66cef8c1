"""Graph-safe and inference RNG trackers.

A graph-safe tracker (``use_cudagraphable_rng=True``) keeps ``torch.Generator`` state objects
and switches the default CUDA generator onto them, so a CUDA graph that registered them draws
fresh numbers on each replay. Its semantics must equal the tensor tracker's draw for draw; the
CPU tier checks what can be checked without CUDA (refusals, the inference tracker), the GPU tier
the streams, conversion, graph capture and checkpoint replay.
"""

import pytest
import torch

from megatron.core.tensor_parallel import random as tp_random
from megatron.core.tensor_parallel import rng_state
from megatron.core.tensor_parallel.random import (
    CheckpointFunction,
    CudaRNGStatesTracker,
    GraphSafeRNGUnavailableError,
    convert_cuda_rng_state,
    get_all_rng_states,
    get_cuda_rng_tracker,
    initialize_rng_tracker,
    is_graph_safe_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _own_global_tracker(monkeypatch):
    # Each test builds the global tracker it needs; the suite's one comes back afterwards.
    monkeypatch.setattr(tp_random, "_CUDA_RNG_STATE_TRACKER", None)


def _draw(n=8):
    return torch.rand(n, device=DEVICE)


# ------------------------------------------------------------------------------- CPU tier


def test_graph_safe_tracker_without_cuda_is_refused_naming_the_option(monkeypatch):
    monkeypatch.setattr(tp_random, "_use_cuda", lambda: False)
    monkeypatch.setattr(rng_state, "_use_cuda", lambda: False)
    with pytest.raises(GraphSafeRNGUnavailableError, match="use_cudagraphable_rng=True") as info:
        CudaRNGStatesTracker(use_cudagraphable_rng=True)
    assert "CUDA device" in str(info.value)
    # Upstream asserts; code catching its AssertionError catches this too.
    assert isinstance(info.value, AssertionError)
    with pytest.raises(GraphSafeRNGUnavailableError):
        model_parallel_cuda_manual_seed(
            1, use_cudagraphable_rng=True, tp_rank=0, ep_rank=0, etp_rank=0
        )


def test_graph_safe_tracker_without_the_pytorch_api_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(rng_state, "_use_cuda", lambda: True)
    monkeypatch.setattr(rng_state, "_GRAPH_SAFE_API", ("clone_state", "graphsafe_teleport"))
    with pytest.raises(GraphSafeRNGUnavailableError, match="graphsafe_teleport"):
        CudaRNGStatesTracker(use_cudagraphable_rng=True)


def test_tracker_records_its_options():
    tracker = CudaRNGStatesTracker(is_inference_rng_tracker=True)
    assert tracker.is_inference_rng_tracker and not tracker.use_cudagraphable_rng
    assert not is_graph_safe_cuda_rng_tracker(tracker)


def test_inference_tracker_keeps_no_streams_and_forks_on_the_default_generator():
    model_parallel_cuda_manual_seed(
        123, inference_rng_tracker=True, force_reset_rng=True, tp_rank=0, ep_rank=0, etp_rank=0
    )
    tracker = get_cuda_rng_tracker()
    assert isinstance(tracker, CudaRNGStatesTracker)
    assert type(tracker).__name__ == "InferenceCudaRNGStatesTracker"
    assert tracker.is_inference_rng_tracker
    assert tracker.get_states() == {}
    tracker.set_states({"stream": torch.get_rng_state()})
    assert tracker.get_states() == {}

    state = tp_random._get_rng_state()
    plain = _draw()
    tp_random._set_rng_state(state)
    with tracker.fork("any-name-at-all"):
        forked = _draw()
    torch.testing.assert_close(forked, plain, rtol=0, atol=0)


def test_inference_tracker_class_is_built_once_per_base():
    first = tp_random._inference_tracker_class(CudaRNGStatesTracker)
    assert tp_random._inference_tracker_class(CudaRNGStatesTracker) is first
    assert issubclass(first, CudaRNGStatesTracker)


def test_recomputation_copies_graph_safe_states_except_during_capture(monkeypatch):
    # Copies keep a recomputation on the forward's numbers; inside a CUDA-graph capture only
    # the registered (live) states can be drawn from, so they are used as they are.
    state = torch.Generator().manual_seed(3)
    copy = tp_random._snapshot(state)
    assert copy is not state and torch.equal(copy.get_state(), state.get_state())
    tensor_state = torch.get_rng_state()
    assert tp_random._snapshot(tensor_state) is tensor_state
    monkeypatch.setattr(rng_state, "_use_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tp_random._snapshot(state) is state


# ------------------------------------------------------------------------------- GPU tier


def _sequence(tracker):
    """A, B, A nested forks plus draws outside: what one round of a training step looks like."""
    out = []
    with tracker.fork("a"):
        out.append(_draw())
        with tracker.fork("b"):
            out.append(_draw())
            with tracker.fork("a"):
                out.append(_draw())
            out.append(_draw())
        out.append(_draw())
    with tracker.fork("b"):
        out.append(_draw())
    return torch.stack(out)


def _seeded(graph_safe):
    tracker = CudaRNGStatesTracker(use_cudagraphable_rng=graph_safe)
    tracker.add("a", 1234)
    tracker.add("b", 5678)
    return tracker


@pytest.mark.gpu
def test_graph_safe_streams_draw_what_tensor_streams_draw():
    tensor_tracker = _seeded(False)
    graph_tracker = _seeded(True)
    assert all(isinstance(s, torch.Generator) for s in graph_tracker.get_states().values())
    torch.cuda.manual_seed(7)
    outer = _draw()
    torch.cuda.manual_seed(7)
    for _ in range(3):
        torch.testing.assert_close(
            _sequence(graph_tracker), _sequence(tensor_tracker), rtol=0, atol=0
        )
    # Neither tracker's forks consumed the default generator's own stream.
    torch.testing.assert_close(_draw(), outer, rtol=0, atol=0)
    for name in ("a", "b"):
        graph_state = graph_tracker.get_states()[name].get_state()
        torch.testing.assert_close(graph_state, tensor_tracker.get_states()[name], rtol=0, atol=0)


@pytest.mark.gpu
def test_convert_cuda_rng_state_both_ways_continues_the_stream():
    tensor_tracker = _seeded(False)
    with tensor_tracker.fork("a"):
        _draw()
    generator = convert_cuda_rng_state(tensor_tracker.get_states()["a"], to_graphable=True)
    assert isinstance(generator, torch.Generator) and generator.device.type == "cuda"
    assert convert_cuda_rng_state(generator, to_graphable=True) is generator

    graph_tracker = CudaRNGStatesTracker(use_cudagraphable_rng=True)
    graph_tracker.set_states({"a": generator.clone_state()})
    for _ in range(3):
        with tensor_tracker.fork("a"):
            expected = _draw()
        with graph_tracker.fork("a"):
            torch.testing.assert_close(_draw(), expected, rtol=0, atol=0)

    back = convert_cuda_rng_state(graph_tracker.get_states()["a"], to_graphable=False)
    assert isinstance(back, torch.Tensor)
    assert convert_cuda_rng_state(back, to_graphable=False) is back
    tensor_again = CudaRNGStatesTracker()
    tensor_again.set_states({"a": back})
    with tensor_tracker.fork("a"):
        expected = _draw()
    with tensor_again.fork("a"):
        torch.testing.assert_close(_draw(), expected, rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_graph_replays_draw_fresh_numbers_from_a_registered_stream():
    tracker = _seeded(True)
    eager = _seeded(True)
    graph = torch.cuda.CUDAGraph()
    for state in tracker.get_states().values():
        graph.register_generator_state(state)
    out = torch.empty(8, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        with tracker.fork("a"):
            out.copy_(_draw())
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append(out.clone())
    assert not torch.equal(replays[0], replays[1])
    assert not torch.equal(replays[1], replays[2])
    # Replay k draws what the k-th eager fork of an identically seeded stream draws.
    for replay in replays:
        with eager.fork("a"):
            torch.testing.assert_close(replay, _draw(), rtol=0, atol=0)


def _dropout_block(x):
    with get_cuda_rng_tracker().fork():
        return torch.nn.functional.dropout(x * 2.0, p=0.5, training=True)


@pytest.mark.gpu
@pytest.mark.parametrize("graph_safe", [False, True], ids=["tensor", "graph-safe"])
def test_checkpoint_replays_the_forward_masks_after_the_stream_moved_on(graph_safe):
    model_parallel_cuda_manual_seed(
        99, use_cudagraphable_rng=graph_safe, force_reset_rng=True, tp_rank=0, ep_rank=0, etp_rank=0
    )
    assert is_graph_safe_cuda_rng_tracker(get_cuda_rng_tracker()) is graph_safe
    x = torch.randn(4096, device="cuda", requires_grad=True)
    out = CheckpointFunction.apply(_dropout_block, False, x)
    kept = out.detach() != 0
    # Draws between forward and backward advance the live stream (in place when graph-safe).
    for _ in range(3):
        _dropout_block(torch.ones(4096, device="cuda"))
    out.backward(torch.ones_like(out))
    # Where the forward dropped, the recomputation must drop too: gradient 2 / (1 - p) or 0.
    torch.testing.assert_close(x.grad, kept.float() * 4.0, rtol=0, atol=0)
    assert set(get_all_rng_states()) == {
        "data-parallel-rng",
        "model-parallel-rng",
        "expert-parallel-rng",
    }


@pytest.mark.gpu
def test_initialize_rng_tracker_builds_a_graph_safe_tracker():
    initialize_rng_tracker(use_cudagraphable_rng=True, force_reset=True)
    tracker = get_cuda_rng_tracker()
    assert tracker.use_cudagraphable_rng and is_graph_safe_cuda_rng_tracker(tracker)
