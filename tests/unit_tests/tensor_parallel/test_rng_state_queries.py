"""Upstream's RNG query functions in tensor_parallel.random: the GTP stream names,
get_all_rng_states and is_graph_safe_cuda_rng_tracker, on this module's tracker, Transformer
Engine's (a stand-in instance and a fake TE registry) and foreign trackers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import megatron.core.tensor_parallel as tp
from mcore_activations import te_import
from megatron.core.extensions.te_rng import TECudaRNGStatesTracker
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.tensor_parallel.random import (
    CudaRNGStatesTracker,
    get_all_rng_states,
    get_cuda_rng_tracker,
    get_gtp_remat_rng_tracker_name,
    is_graph_safe_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)


def _te_tracker_instance():
    # An instance of the TE tracker class that skips its constructor, which needs a real TE:
    # the functions under test only ask which class a tracker is.
    return object.__new__(TECudaRNGStatesTracker)


def test_gtp_remat_stream_names_and_that_they_are_not_registered_without_gtp():
    assert get_gtp_remat_rng_tracker_name() == "gtp-remat-rng"
    assert get_gtp_remat_rng_tracker_name(is_expert=False) == "gtp-remat-rng"
    assert get_gtp_remat_rng_tracker_name(is_expert=True) == "egtp-remat-rng"
    # As upstream with GTP off: seeding registers the three streams, not the GTP ones.
    model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    for is_expert in (False, True):
        name = get_gtp_remat_rng_tracker_name(is_expert)
        with pytest.raises(Exception, match=f"cuda rng state {name} is not added"):
            with get_cuda_rng_tracker().fork(name):
                pass


def test_get_all_rng_states_is_the_trackers_live_mapping():
    model_parallel_cuda_manual_seed(9, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = get_cuda_rng_tracker()
    states = get_all_rng_states()
    assert set(states) == {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}
    for name, state in tracker.get_states().items():
        assert torch.equal(states[name], state), name
    # Not a snapshot: upstream's CUDA-graph code reads it after later forks have advanced a state.
    before = states["model-parallel-rng"].clone()
    with tracker.fork():
        torch.rand(3)
    assert get_all_rng_states() is states
    assert not torch.equal(states["model-parallel-rng"], before)


def test_get_all_rng_states_before_any_tracker_exists(monkeypatch):
    monkeypatch.setattr(tp_random, "_CUDA_RNG_STATE_TRACKER", None)
    with pytest.raises(AssertionError, match=r"model_parallel_cuda_manual_seed\(seed\)"):
        get_all_rng_states()


def test_get_all_rng_states_asks_te_for_its_trackers_states(monkeypatch):
    registry = {"model-parallel-rng": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    fake_te = SimpleNamespace(
        pytorch=SimpleNamespace(distributed=SimpleNamespace(get_all_rng_states=lambda: registry))
    )
    monkeypatch.setattr(te_import, "te", fake_te, raising=False)
    monkeypatch.setattr(tp_random, "_CUDA_RNG_STATE_TRACKER", _te_tracker_instance())
    assert get_all_rng_states() is registry


def test_get_all_rng_states_of_a_foreign_tracker_is_empty(monkeypatch):
    monkeypatch.setattr(tp_random, "_CUDA_RNG_STATE_TRACKER", SimpleNamespace(states_={"x": 1}))
    assert get_all_rng_states() == {}


def test_is_graph_safe_cuda_rng_tracker():
    assert is_graph_safe_cuda_rng_tracker(CudaRNGStatesTracker()) is False
    assert is_graph_safe_cuda_rng_tracker(_te_tracker_instance()) is True
    # Any tracker built with graph-safe generators counts, whatever its class.
    assert is_graph_safe_cuda_rng_tracker(SimpleNamespace(use_cudagraphable_rng=True)) is True
    assert is_graph_safe_cuda_rng_tracker(SimpleNamespace(use_cudagraphable_rng=False)) is False
    assert is_graph_safe_cuda_rng_tracker(object()) is False


def test_package_exports_upstreams_random_names():
    assert tp.is_graph_safe_cuda_rng_tracker is is_graph_safe_cuda_rng_tracker
    assert "is_graph_safe_cuda_rng_tracker" in tp.__all__
