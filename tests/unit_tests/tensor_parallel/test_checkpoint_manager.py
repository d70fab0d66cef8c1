"""is_checkpointing during checkpoint's forward and recomputation, the public
CheckpointWithoutOutputFunction, and CheckpointWithoutOutputManager recomputing a chain of
CheckpointWithoutOutput blocks together (freed storage, replayed randomness, exact gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import random as tp_random
from megatron.core.tensor_parallel.checkpoint_autograd import (
    CheckpointWithoutOutputFunction as CanonicalFunction,
)
from megatron.core.tensor_parallel.random import (
    CheckpointWithoutOutput,
    CheckpointWithoutOutputFunction,
    CheckpointWithoutOutputManager,
    checkpoint,
    get_cuda_rng_tracker,
    is_checkpointing,
    model_parallel_cuda_manual_seed,
)


@pytest.fixture(autouse=True)
def seeded(single_rank_model_parallel):
    model_parallel_cuda_manual_seed(321)
    yield
    get_cuda_rng_tracker().reset()


def _leaf(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


# ------------------------------------------------------------------------ is_checkpointing


def test_is_checkpointing_only_while_the_checkpointed_block_runs():
    seen = []

    def block(x):
        seen.append(is_checkpointing())
        return x.sin()

    def outside_hook(grad):
        seen.append(("hook", is_checkpointing()))
        return grad

    x = _leaf(4)
    assert not is_checkpointing()
    y = checkpoint(block, False, x)
    assert not is_checkpointing()
    z = y * 2
    z.register_hook(outside_hook)  # runs in backward, before the recomputation
    z.sum().backward()
    assert not is_checkpointing()
    # Forward, then the hook outside the block, then the recomputation (upstream sets the flag
    # around both runs of the block).
    assert seen == [True, ("hook", False), True]
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())


def test_is_checkpointing_is_cleared_when_the_block_raises():
    def failing(x):
        raise ZeroDivisionError("inside the block")

    with pytest.raises(ZeroDivisionError):
        checkpoint(failing, False, _leaf(2))
    assert not is_checkpointing()


def test_is_checkpointing_stays_set_for_the_outer_of_two_nested_checkpoints():
    seen = []

    def inner(x):
        return x * 3

    def outer(x):
        h = checkpoint(inner, False, x)
        seen.append(is_checkpointing())  # after the inner checkpoint has returned
        return h.exp()

    x = _leaf(3)
    checkpoint(outer, False, x).sum().backward()
    assert seen == [True, True]  # forward and recomputation of the outer block
    torch.testing.assert_close(x.grad, 3 * (3 * x.detach()).exp())


# -------------------------------------------------------- CheckpointWithoutOutputFunction


def test_checkpoint_without_output_function_is_public_and_refuses_backward_before_recompute():
    assert CheckpointWithoutOutputFunction is CanonicalFunction
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(torch.tanh, _leaf(4))
    assert type(y.grad_fn).__name__ == "CheckpointWithoutOutputFunctionBackward"
    # Nothing registered a recomputation, so backward reaches the node without outputs.
    with pytest.raises(RuntimeError, match="before its recomputation"):
        (y * 3).sum().backward()


# ------------------------------------------------------------ CheckpointWithoutOutputManager


def _block_a(x, w):
    # Draws from the default generator and from a tracker stream: the recomputation must replay
    # both exactly for the gradients to match.
    h = F.dropout(x @ w, p=0.25)
    with get_cuda_rng_tracker().fork():
        return F.dropout(torch.tanh(h), p=0.25)


def _block_b(h, scale):
    return F.gelu(h) * scale


def _plain(x, w):
    b = _block_b(_block_a(x, w), 1.5)
    return (b * b).sum()  # the consumer saves b for its backward


def test_manager_recomputes_a_chain_and_matches_the_plain_gradients():
    x, w = _leaf(5, 6, seed=1), _leaf(6, 6, seed=2)
    states = tp_random._capture_rng()
    _plain(x, w).backward()
    expected = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None

    tp_random._restore_rng(states)
    calls = []
    manager = CheckpointWithoutOutputManager()
    assert manager.checkpoints == [] and manager.is_last_layer_in_recompute_block is False
    first, second = (CheckpointWithoutOutput(ckpt_manager=manager) for _ in range(2))
    a = first.checkpoint(lambda *args: calls.append("a") or _block_a(*args), x, w)
    b = second.checkpoint(lambda *args: calls.append("b") or _block_b(*args), a, 1.5)
    assert manager.checkpoints == [first, second]  # registered by checkpoint(), in order
    kept_b = b.detach().clone()
    loss = (b * b).sum()

    # With a manager the per-checkpoint call frees nothing; the manager frees both outputs.
    second.discard_output_and_register_recompute(loss)
    assert b.untyped_storage().size() > 0
    manager.discard_all_outputs_and_register_unified_recompute(loss)
    assert a.untyped_storage().size() == 0 and b.untyped_storage().size() == 0

    loss.backward()
    assert calls == ["a", "b", "a", "b"]  # one forward and one recomputation each, in order
    torch.testing.assert_close(b.detach(), kept_b, rtol=0, atol=0)
    torch.testing.assert_close((x.grad, w.grad), expected, rtol=0, atol=0)
    assert first.ctx is None and second.ctx is None  # recomputation state released


def test_manager_add_checkpoint_errors():
    manager = CheckpointWithoutOutputManager()
    with pytest.raises(TypeError, match="expects a CheckpointWithoutOutput, got object"):
        manager.add_checkpoint(object())
    with pytest.raises(ValueError, match=r"call ckpt.checkpoint\(fn, \*args\) before adding"):
        manager.add_checkpoint(CheckpointWithoutOutput())
    assert manager.checkpoints == []


def test_outputs_that_share_one_storage_are_freed_once_and_both_restored():
    x = _leaf(4, 3)

    def block(a):
        h = a.exp()
        return h, h[1:3]  # the second output is a view of the first one's storage

    ckpt = CheckpointWithoutOutput()
    h, part = ckpt.checkpoint(block, x)
    kept = (h.detach().clone(), part.detach().clone())
    loss = (h * h).sum() + (part * part).sum()  # both saved by their consumers
    ckpt.discard_output_and_register_recompute(loss)
    assert h.untyped_storage().size() == 0
    loss.backward()
    torch.testing.assert_close((h.detach(), part.detach()), kept, rtol=0, atol=0)
    expected = 2 * kept[0] ** 2
    expected[1:3] += 2 * kept[1] ** 2
    torch.testing.assert_close(x.grad, expected)
