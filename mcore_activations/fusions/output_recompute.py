"""The output-recompute option: fc2 does not keep the activation's output between the passes.

An MLP saves two activation-sized tensors for its backward: fc1's output ``x`` (the activation's
backward reads it) and the activation's output ``y`` (fc2 saves it for its weight gradient).
``y`` is a function of ``x``, so with the option on the layer frees ``y``'s storage once fc2's
forward has run and recomputes it from ``x`` just before fc2's backward: one ``[tokens, ffn]``
tensor less per layer between the forward and the backward, for one activation forward more in
the backward (docs/performance.md, "Low-memory backward", has the measured trade).

The recomputation writes the same bits: the same activation, on the same ``x``, bias and
probabilities, through the same kernel (no randomness is involved). It refills the storage that
fc2's saved reference points at, so fc2 needs no change, whichever linear it is.

It composes with the in-place backward (``in_place``): the refill runs before fc2's backward, and
the activation's backward, which may write over ``x``, runs after fc2's.

The option is off by default, as upstream behaves. Where it comes from, first match wins:

1. the layer's own setting (``LayerActivation(recompute_output=...)``);
2. the process default set by :func:`set_recompute_output` (or :func:`use_recompute_output`);
3. the environment variable ``MCORE_ACTIVATIONS_RECOMPUTE_OUTPUT``, read when this module is
   first imported and parsed as strictly as ``MCORE_ACTIVATIONS_PATCH``.

The output is kept (nothing is freed, nothing recomputed) where freeing it would save nothing or
could not be undone in time: no gradient flows to fc2's output; a CUDA graph is being captured or
``torch.compile`` is tracing (a replay would neither free nor refill); saved-tensor hooks are
active (activation offloading, ``torch.utils.checkpoint(use_reentrant=False)``: the hooks own what
fc2 saves); the output is not
contiguous or shares its storage with other values (a slice of a larger buffer), which freeing
would destroy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Optional

import torch

from mcore_activations.patch_env import Switch

ENV_VAR = "MCORE_ACTIVATIONS_RECOMPUTE_OUTPUT"
OPTION = "recompute_output"


_SWITCH = Switch(
    ENV_VAR,
    OPTION,
    "set_recompute_output",
    "layers free the activation's output after fc2's forward and recompute it before fc2's "
    "backward",
    "keep it, as upstream",
)


def recompute_output_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """What ``MCORE_ACTIVATIONS_RECOMPUTE_OUTPUT`` asks for; unset means off.

    Args:
        environ: The environment to read; default ``os.environ``.

    Raises:
        ValueError: Any value other than 1 / true / yes / on, 0 / false / no / off or empty.
    """
    return _SWITCH.from_env(environ)


def check_option(value) -> Optional[bool]:
    """``value`` if it is True, False or None (the process default).

    Raises:
        TypeError: any other value, naming the option.
    """
    return _SWITCH.check(value)


def recompute_output_enabled() -> bool:
    """The process default: whether layers that do not set the option recompute their output."""
    return _SWITCH.enabled()


def set_recompute_output(enabled: bool) -> bool:
    """Sets the process default; returns the previous one.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    return _SWITCH.set(enabled)


@contextlib.contextmanager
def use_recompute_output(enabled: bool) -> Iterator[None]:
    """Sets the process default inside the block and restores it on the way out."""
    previous = set_recompute_output(enabled)
    try:
        yield
    finally:
        set_recompute_output(previous)


def resolve(value: Optional[bool]) -> bool:
    """The option for one call: ``value``, or the process default when it is None."""
    return _SWITCH.resolve(value)


def _fills_its_storage(t: torch.Tensor) -> bool:
    # Freeing the storage must destroy nothing but ``t``'s values; another view of the same
    # bytes (the fused kernels' 2-D output behind a 3-D result) is refilled with them.
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def discard_until_backward(
    output: torch.Tensor,
    consumer_output: torch.Tensor,
    recompute: Callable[[torch.Tensor], object],
) -> bool:
    """Frees ``output``'s storage now and refills it before ``consumer_output``'s backward.

    Call it after the consumer (fc2) has run its forward on ``output``. When the backward reaches
    the node that made ``consumer_output``, before that node runs, the storage is allocated
    again and ``recompute(target)`` is called under ``torch.no_grad()`` with ``target`` a tensor
    of ``output``'s shape and dtype on it, to fill with ``output``'s values. Writing straight
    into the storage keeps the backward's peak where it was: no second output-sized buffer.
    Upstream's ``CheckpointWithoutOutput`` frees a block's output the same way; here the
    activation's own graph is kept (it saves only fc1's output), so nothing but the output is
    computed again.

    Args:
        output: The tensor to free: the activation's output, which the consumer saved.
        consumer_output: The consumer's output; its gradient function triggers the refill.
        recompute: Fills the tensor it is given with the output's values, from inputs the
            backward still has.

    Returns:
        Whether the storage was freed (see the module docstring for when it is kept).
    """
    if torch.compiler.is_compiling():
        return False  # storage cannot be freed or refilled inside a traced graph
    node = consumer_output.grad_fn
    if node is None or not torch.is_grad_enabled() or output.numel() == 0:
        return False
    if not _fills_its_storage(output):
        return False
    if output.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        # Saved-tensor hooks own what the consumer saved (offloading packs a copy; a
        # non-reentrant checkpoint recomputes the forward, output and all, on unpack, and this
        # call would free the recomputed output too): nothing to gain, and a refill could miss.
        return False
    storage = output.untyped_storage()
    nbytes = storage.nbytes()
    shape, dtype, device = output.shape, output.dtype, output.device
    storage.resize_(0)
    # The hook holds the storage only until it refills it: after that the consumer's saved
    # tensor alone keeps it, so it is freed when the consumer's backward releases that tensor
    # (holding it longer would keep an output-sized buffer through the rest of the backward).
    pending = [storage]

    def refill(_grad_outputs):
        if not pending:
            return None  # a second backward through a retained graph: still filled
        target_storage = pending.pop()
        target_storage.resize_(nbytes)
        # A tensor of its own on the same storage: the consumer's saved reference sees the
        # values, and its version counter (autograd's check) is not bumped.
        target = torch.empty(0, dtype=dtype, device=device).set_(target_storage, 0, shape)
        with torch.no_grad():
            recompute(target)
        return None

    node.register_prehook(refill)
    return True
