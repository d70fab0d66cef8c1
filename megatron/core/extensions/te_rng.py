"""Transformer Engine's CUDA RNG tracker with Megatron's interface.

A module of its own so that ``tensor_parallel.random`` offers it (``use_te_rng_tracker``) without
importing the TE linear wrappers or the fused MLPs: it imports only the TE import seam.
"""

from __future__ import annotations

from mcore_activations import te_import
from mcore_activations.te_import import require_te

__all__ = ["TECudaRNGStatesTracker"]


def _refuse_without_te(self, *args, **kwargs):
    require_te(type(self).__name__)


def _te_rng_tracker_base() -> type:
    # Chosen once, at import: a class statement needs a real class as its base.
    if te_import.have_te():
        return te_import.te.pytorch.distributed.CudaRNGStatesTracker
    return type("_MissingCudaRNGStatesTracker", (), {"__init__": _refuse_without_te})


class TECudaRNGStatesTracker(_te_rng_tracker_base()):
    """TE's RNG tracker (graph-safe under TE's CUDA graphs) with Megatron's ``is_initialized``.

    Args:
        is_inference_rng_tracker: Marks a tracker made for inference (read by CUDA-graph code);
            ``initialize_rng_tracker(inference_rng_tracker=True)`` builds one whose streams do
            nothing.
        use_cudagraphable_rng: Accepted for the signature of this fork's own tracker. TE's
            tracker keeps graph-safe states whenever PyTorch has them, so either value gives
            the same tracker.
    """

    def __init__(self, is_inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False):
        require_te(type(self).__name__)
        super().__init__()
        self._is_initialized = False
        self.is_inference_rng_tracker = is_inference_rng_tracker

    def is_initialized(self) -> bool:
        """Whether a state was added or set since the last reset."""
        return self._is_initialized

    def reset(self):
        """Forgets every stream."""
        super().reset()
        self._is_initialized = False

    def set_states(self, states):
        """Replaces every stream with ``states``."""
        super().set_states(states)
        self._is_initialized = True

    def add(self, name, seed):
        """Registers the stream ``name`` starting from ``seed``."""
        super().add(name, seed)
        self._is_initialized = True
