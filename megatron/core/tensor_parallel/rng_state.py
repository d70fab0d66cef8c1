"""The device generator under the named streams: reading, setting, copying and seeding it.

One place decides which generator the streams of ``tensor_parallel.random`` run on: the current
CUDA device's default generator, or the CPU default generator on a machine without CUDA. Graph-safe
states (``torch.Generator`` objects a CUDA graph can register) are CUDA only.
"""

from __future__ import annotations

import torch


def _use_cuda() -> bool:
    return torch.cuda.is_available()


def _cuda_generator() -> torch.Generator:
    """The current CUDA device's default generator."""
    torch.cuda.init()  # fills torch.cuda.default_generators; a no-op once CUDA is up
    return torch.cuda.default_generators[torch.cuda.current_device()]


def _get_rng_state(graph_safe: bool = False):
    """Returns the state of the device generator (current CUDA device, else the CPU).

    With ``graph_safe`` the result is a ``torch.Generator`` that shares the default CUDA
    generator's current state object, not a copy: draws advance it, and a CUDA graph that
    registered it replays from wherever it has got to.
    """
    if graph_safe:
        return _cuda_generator().graphsafe_get_state()
    if _use_cuda():
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_rng_state(state, graph_safe: bool = False) -> None:
    """Makes the device generator (current CUDA device, else the CPU) run from ``state``.

    With ``graph_safe`` the default CUDA generator adopts the generator ``state``'s state object
    itself (later draws advance ``state``); otherwise it copies the state tensor.
    """
    if graph_safe:
        _cuda_generator().graphsafe_set_state(state)
    elif _use_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _snapshot(state):
    """A copy of ``state`` that later draws cannot advance (state tensors never change).

    Not during CUDA-graph capture: a copy is a generator state no graph has registered, and
    drawing from it there fails, so a block recomputed inside a capture runs on the live states,
    as upstream's always does (the graph registered them; their replays draw fresh numbers).
    """
    if not isinstance(state, torch.Generator):
        return state
    if _use_cuda() and torch.cuda.is_current_stream_capturing():
        return state
    return state.clone_state()


def _manual_seed(seed: int) -> None:
    """Seeds the device generator only (``torch.manual_seed`` would seed every device)."""
    if _use_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)


_GRAPH_SAFE_API = ("graphsafe_get_state", "graphsafe_set_state", "clone_state")


class GraphSafeRNGUnavailableError(RuntimeError, AssertionError):
    """``use_cudagraphable_rng=True`` where graph-safe generator states cannot exist.

    Also an ``AssertionError``, the type upstream raises when PyTorch lacks the API, so code
    written against upstream catches it.
    """


def _require_graph_safe_rng() -> None:
    if not _use_cuda():
        raise GraphSafeRNGUnavailableError(
            "use_cudagraphable_rng=True needs a CUDA device: graph-safe states are CUDA generator "
            "states and this machine has no CUDA device. Leave use_cudagraphable_rng=False here "
            "(the tracker then runs the CPU generator's streams)."
        )
    missing = [name for name in _GRAPH_SAFE_API if not hasattr(torch.Generator, name)]
    if not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
        missing.append("CUDAGraph.register_generator_state")
    if missing:
        raise GraphSafeRNGUnavailableError(
            f"use_cudagraphable_rng=True needs graph-safe generator states, which this PyTorch "
            f"({torch.__version__}) lacks ({', '.join(missing)}); upgrade PyTorch or leave "
            "use_cudagraphable_rng=False."
        )
