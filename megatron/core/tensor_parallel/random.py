"""Named random-number streams for model-parallel training.

Tensor-parallel ranks need two kinds of randomness: the same numbers on every rank (dropout on
replicated activations) and different numbers per rank (initializing or dropping out a weight or
activation shard). ``CudaRNGStatesTracker`` keeps one generator state per named stream; inside
``fork(name)`` the device generator runs that stream, and afterwards it resumes exactly where the
outer stream was, as if the fork never happened.

``model_parallel_cuda_manual_seed(seed)`` seeds the default generator with ``seed`` and registers:

- ``"data-parallel-rng"``: ``seed``, identical on every rank;
- ``"model-parallel-rng"``: ``seed + 2718 + tp_rank``, one stream per tensor-parallel rank;
- ``"expert-parallel-rng"``: ``seed + 1024 + 100 * ep_rank + etp_rank``, one stream per expert
  shard.

Device: with CUDA the tracker manages the current CUDA device's generator (as upstream). On a
machine without CUDA it manages the CPU default generator instead (``torch.get_rng_state`` /
``torch.set_rng_state``), and ``model_parallel_cuda_manual_seed`` seeds the CPU generator. Code
written for GPUs (``with get_cuda_rng_tracker().fork(): dropout(...)``) therefore runs, with the
same stream semantics, on CPU-only machines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch

from megatron.core import parallel_state

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"


# ------------------------------------------------------------------ device generator access


def _use_cuda() -> bool:
    return torch.cuda.is_available()


def _get_rng_state() -> torch.Tensor:
    """Returns the state of the device generator (current CUDA device, else the CPU)."""
    if _use_cuda():
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    """Restores the device generator (current CUDA device, else the CPU) to ``state``."""
    if _use_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    """Seeds the device generator only (``torch.manual_seed`` would seed every device)."""
    if _use_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)


# ----------------------------------------------------------------------------- the tracker


class CudaRNGStatesTracker:
    """Keeps named generator states and runs code under one of them.

    States are stored as generator-state tensors, so a tracker can be saved (``get_states``) and
    restored (``set_states``) with a checkpoint.

    Args:
        use_cudagraphable_rng: Graph-safe generators for CUDA graph capture. Not supported.
        is_inference_rng_tracker: Inference-specific tracker. Not supported.
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
        if use_cudagraphable_rng or is_inference_rng_tracker:
            raise ValueError(
                "use_cudagraphable_rng / inference_rng_tracker are not supported by this fork; "
                "leave them False."
            )
        self.reset()

    def is_initialized(self) -> bool:
        """Whether a state was added or set since the last reset."""
        return self._is_initialized

    def reset(self) -> None:
        """Forgets every stream and seed."""
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """Returns a copy of the name -> state mapping (the tensors are shared, not cloned)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replaces every stream with ``states`` (e.g. from ``get_states`` or a checkpoint)."""
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Registers the stream ``name`` starting from ``seed``.

        The device generator is left as it was.

        Raises:
            Exception: ``seed`` or ``name`` is already registered (two streams with one seed
                would silently produce identical "independent" numbers).
        """
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        outer_state = _get_rng_state()
        try:
            _manual_seed(seed)
            self.states_[name] = _get_rng_state()
        finally:
            _set_rng_state(outer_state)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Runs the body on stream ``name``, then restores the outer stream.

        The stream's state advances by what the body consumed, so the next fork continues it.

        Raises:
            Exception: ``name`` was never added (call ``model_parallel_cuda_manual_seed``).
        """
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        outer_state = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(outer_state)


_CUDA_RNG_STATE_TRACKER: Optional[CudaRNGStatesTracker] = None


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
) -> None:
    """Creates the global tracker, unless one exists and ``force_reset`` is False.

    Args:
        use_te_rng_tracker: Use Transformer Engine's tracker (needed by TE's CUDA-graph support).
        inference_rng_tracker: Not supported; must be False.
        use_cudagraphable_rng: Not supported; must be False.
        force_reset: Replace an existing tracker.
    """
    global _CUDA_RNG_STATE_TRACKER
    if _CUDA_RNG_STATE_TRACKER is not None and not force_reset:
        return
    if use_te_rng_tracker:
        from mcore_activations.te_import import have_te

        tracker_class = None
        if have_te():
            try:
                from megatron.core.extensions.transformer_engine import TECudaRNGStatesTracker

                tracker_class = TECudaRNGStatesTracker
            except ImportError:
                pass
        if tracker_class is None:
            raise ValueError(
                "use_te_rng_tracker=True needs Transformer Engine (>= 1.5) and "
                "megatron.core.extensions.transformer_engine.TECudaRNGStatesTracker; install "
                "Transformer Engine or leave te_rng_tracker=False."
            )
        tracker = tracker_class(
            is_inference_rng_tracker=inference_rng_tracker,
            use_cudagraphable_rng=use_cudagraphable_rng,
        )
    else:
        tracker = CudaRNGStatesTracker(
            use_cudagraphable_rng=use_cudagraphable_rng,
            is_inference_rng_tracker=inference_rng_tracker,
        )
    _CUDA_RNG_STATE_TRACKER = tracker


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
) -> CudaRNGStatesTracker:
    """Returns the global tracker, creating it on first use with the given options."""
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    return _CUDA_RNG_STATE_TRACKER


def get_data_parallel_rng_tracker_name() -> str:
    """Returns the name of the stream shared by every rank."""
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def get_expert_parallel_rng_tracker_name() -> str:
    """Returns the name of the per-expert-shard stream."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: Optional[int] = None,
    ep_rank: Optional[int] = None,
    etp_rank: Optional[int] = None,
    gtp_remat_rank: Optional[int] = None,
    egtp_remat_rank: Optional[int] = None,
    force_reset_rng: bool = False,
    gtp_remat_world_size: Optional[int] = None,
    egtp_remat_world_size: Optional[int] = None,
) -> None:
    """Seeds the device generator and (re)registers the model-parallel streams.

    Call it after ``parallel_state.initialize_model_parallel`` (or pass the ranks) and before
    building the model. The resulting streams are listed in the module docstring. On a machine
    without CUDA the CPU generator plays the device generator's role.

    Args:
        seed: Base seed, the same on every rank.
        te_rng_tracker: Use Transformer Engine's tracker class.
        inference_rng_tracker: Not supported; must be False.
        use_cudagraphable_rng: Not supported; must be False.
        tp_rank: Tensor-parallel rank (default: from ``parallel_state``).
        ep_rank: Expert-model-parallel rank (default: from ``parallel_state``).
        etp_rank: Expert-tensor-parallel rank (default: from ``parallel_state``).
        gtp_remat_rank: Unused (GTP rematerialization is not supported).
        egtp_remat_rank: Unused (GTP rematerialization is not supported).
        force_reset_rng: Replace the global tracker object, not only its streams.
        gtp_remat_world_size: GTP rematerialization size; only None or 1 is supported.
        egtp_remat_world_size: Expert GTP rematerialization size; only None or 1 is supported.
    """
    for name, value in (
        ("gtp_remat_world_size", gtp_remat_world_size),
        ("egtp_remat_world_size", egtp_remat_world_size),
    ):
        if value not in (None, 1):
            raise ValueError(
                f"{name}={value} is not supported: this fork has no GTP rematerialization "
                "streams. Leave it None."
            )
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
    if etp_rank is None:
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()

    # The offsets keep the three families of seeds apart for any realistic rank counts.
    tensor_model_parallel_seed = seed + 2718 + tp_rank
    expert_parallel_seed = seed + 1024 + 100 * ep_rank + etp_rank

    initialize_rng_tracker(
        te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=force_reset_rng
    )
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    _manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_model_parallel_seed)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_parallel_seed)
