"""Autograd mechanics of activation recomputation that never touch a random-number generator.

``tensor_parallel.random`` owns the checkpoint API (``checkpoint``, ``CheckpointWithoutOutput``
and its manager), because recomputation must replay the forward's random streams and the streams
live there. What those classes build on, and what needs no generator, lives here:

- saving a block's mixed tensor / non-tensor arguments in an autograd context and getting them
  back as fresh leaves for the recomputation;
- backpropagating through recomputed outputs;
- ``CheckpointWithoutOutputFunction``, the node that stands for a block whose outputs were freed;
- freeing an output's storage and refilling it with recomputed values in place.

``random`` re-exports ``CheckpointWithoutOutputFunction`` under upstream's import path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["CheckpointWithoutOutputFunction"]


def save_args_to_ctx(ctx, args: tuple) -> None:
    """Saves the tensor arguments with ``save_for_backward`` and keeps the others as they are.

    The tensors are saved as given, not detached: a detached leaf that requires grad would be
    pinned by autograd until backward even when saved-tensor hooks offload the original.
    """
    ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    ctx.other_args = [None if isinstance(a, torch.Tensor) else a for a in args]
    ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))


def saved_args(ctx) -> list:
    """The arguments :func:`save_args_to_ctx` saved, in order, tensors as saved."""
    args = list(ctx.other_args)
    for position, tensor in zip(ctx.tensor_positions, ctx.saved_tensors):
        args[position] = tensor
    return args


def load_args_from_ctx(ctx) -> tuple:
    """The arguments :func:`save_args_to_ctx` saved, in order, tensors as fresh leaves."""
    return detached_inputs(saved_args(ctx))


def detached_inputs(inputs: Iterable[Any]) -> tuple:
    """Detaches every tensor, keeping ``requires_grad``, so recomputation builds its own graph."""
    detached = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            leaf = value.detach()
            leaf.requires_grad_(value.requires_grad)
            detached.append(leaf)
        else:
            detached.append(value)
    return tuple(detached)


def input_grads(inputs: tuple) -> tuple:
    """The gradients a recomputation left on its leaves (None for non-tensor arguments)."""
    return tuple(i.grad if isinstance(i, torch.Tensor) else None for i in inputs)


def backward_through(outputs, grads) -> None:
    """Backpropagates ``grads`` through the outputs that are tensors requiring grad."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    pairs = [
        (out, grad)
        for out, grad in zip(outputs, grads)
        if isinstance(out, torch.Tensor) and out.requires_grad
    ]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def tensor_outputs(outputs) -> tuple:
    """The tensors among a block's outputs (a single tensor counts as a one-element tuple)."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return tuple(o for o in outputs if isinstance(o, torch.Tensor))


def free_storage(outputs: tuple, keep_storages: set) -> list:
    """Frees the storage of every output whose storage pointer is not in ``keep_storages``.

    Returns:
        ``(tensor, nbytes)`` for each freed tensor, what :func:`refill_storage` needs.
    """
    # Sizes are read before anything is freed: two outputs may be views of one storage, and the
    # second would otherwise record the already-emptied size.
    freed = [
        (out, out.untyped_storage().nbytes())
        for out in outputs
        if out.untyped_storage().data_ptr() not in keep_storages
    ]
    for out, _ in freed:
        out.untyped_storage().resize_(0)
    return freed


def refill_storage(freed: list, fresh: tuple) -> None:
    """Gives each freed tensor its storage back and writes the recomputed value into it."""
    with torch.no_grad():
        for (out, nbytes), new in zip(freed, fresh):
            storage = out.untyped_storage()
            if storage.nbytes() < nbytes:  # a view of a storage refilled earlier keeps it
                storage.resize_(nbytes)
            # Write through a separate tensor on the same storage: an in-place copy into ``out``
            # would bump its version, and every consumer that saved it for backward would then
            # refuse to run.
            alias = torch.empty(0, dtype=out.dtype, device=out.device)
            alias.set_(storage, out.storage_offset(), out.size(), out.stride())
            alias.copy_(new)


class CheckpointWithoutOutputFunction(torch.autograd.Function):
    """The autograd node that stands for a ``CheckpointWithoutOutput`` block.

    Forward runs the block without building a graph, saves its arguments and hands this context
    to the owner (``owner.ctx``), which later recomputes the block and stores the recomputation
    as ``ctx.inputs`` / ``ctx.outputs``. Backward propagates through that recomputation.
    """

    @staticmethod
    def forward(ctx, run_function: Callable, checkpoint_without_output_obj, *args):
        """Runs ``run_function(*args)`` under ``no_grad`` and keeps only its arguments.

        Args:
            ctx: The autograd context.
            run_function: The checkpointed block.
            checkpoint_without_output_obj: The ``CheckpointWithoutOutput`` that recomputes it.
            *args: The block's arguments, tensors or not.
        """
        with torch.no_grad():
            outputs = run_function(*args)
        save_args_to_ctx(ctx, args)
        ctx.inputs = None
        ctx.outputs = None
        checkpoint_without_output_obj.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        """Backpropagates through the recomputed block and returns its inputs' gradients.

        Raises:
            RuntimeError: The block was not recomputed before its gradient was needed.
        """
        if ctx.outputs is None:
            raise RuntimeError(
                "CheckpointWithoutOutput: backward reached the checkpointed block before its "
                "recomputation; call discard_output_and_register_recompute(t) (or the manager's "
                "discard_all_outputs_and_register_unified_recompute(t)) with a tensor t whose "
                "gradient is computed before the block's outputs are needed."
            )
        inputs, outputs = ctx.inputs, ctx.outputs
        # The recomputed graph is used once; dropping it here frees it before the rest of backward.
        ctx.inputs = ctx.outputs = None
        backward_through(outputs, grads)
        return (None, None) + input_grads(inputs)
