"""Activation checkpointing in tensor_parallel.random: recomputation replays the forward's random
numbers (default generator and tracker streams), gradients equal the uncheckpointed ones, and
CheckpointWithoutOutput frees and restores its outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.tensor_parallel.random import (
    CheckpointWithoutOutput,
    checkpoint,
    convert_cuda_rng_state,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from tests.unit_tests.test_utilities import run_distributed  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def seeded(single_rank_model_parallel):
    model_parallel_cuda_manual_seed(123)
    yield
    get_cuda_rng_tracker().reset()


def _block(x, weight, scale):
    # Random numbers from the default generator and from a tracker stream, both of which the
    # recomputation must replay exactly.
    h = F.dropout(x @ weight, p=0.3)
    with get_cuda_rng_tracker().fork():
        h = F.dropout(h, p=0.2)
    return torch.tanh(h) * scale


def _leaves():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=gen).to(DEVICE).requires_grad_()
    weight = torch.randn(8, 8, generator=gen).to(DEVICE).requires_grad_()
    return x, weight


def test_checkpoint_matches_the_plain_block_and_replays_randomness():
    x, weight = _leaves()
    states = tp_random._capture_rng()
    expected = _block(x, weight, 2.0)
    expected.sum().backward()
    grads = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None

    tp_random._restore_rng(states)
    out = checkpoint(_block, False, x, weight, 2.0)
    after_forward = tp_random._capture_rng()
    assert type(out.grad_fn).__name__ == "CheckpointFunctionBackward"  # nothing inside was kept
    out.sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close((x.grad, weight.grad), grads, rtol=0, atol=0)
    # The recomputation leaves the generators where the forward left them.
    for now, then in zip(tp_random._capture_rng()[1:3], after_forward[1:3]):
        assert torch.equal(now, then)


def _distributed_checkpoint_worker(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        model_parallel_cuda_manual_seed(7)
        gen = torch.Generator().manual_seed(0)  # the same input on both ranks, as under TP
        x = torch.randn(4, 6, generator=gen).requires_grad_()
        weight = torch.randn(6, 6, generator=gen).requires_grad_()
        hidden = x * 1.0  # a non-leaf the checkpoint may shrink to this rank's share
        out = checkpoint(lambda h, w: torch.tanh(h @ w), True, hidden, weight)
        assert hidden.numel() == 12  # half of the 24 elements kept on each rank
        out.sum().backward()
        expected = (1 - torch.tanh(x.detach() @ weight.detach()) ** 2) @ weight.detach().T
        torch.testing.assert_close(x.grad, expected)
    finally:
        ps.destroy_model_parallel()


def test_checkpoint_distributes_the_saved_input_across_tensor_parallel_ranks():
    run_distributed(_distributed_checkpoint_worker, world_size=2, timeout_s=120)


def test_checkpoint_refuses_autograd_grad():
    x, weight = _leaves()
    out = checkpoint(_block, False, x, weight, 1.0)
    with pytest.raises(RuntimeError, match=r"support .backward\(\) only"):
        torch.autograd.grad(out.sum(), x)


def test_checkpoint_without_output_frees_and_restores_the_outputs():
    x, weight = _leaves()
    states = tp_random._capture_rng()
    expected_out = (_block(x, weight, 1.5) * 3).sum()
    expected_out.backward()
    grads = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None

    tp_random._restore_rng(states)
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(_block, x, weight, 1.5)
    z = y * 3  # the consumer saves nothing of y; the sum below is the loss
    ckpt.discard_output_and_register_recompute(z)
    assert y.untyped_storage().size() == 0  # freed
    z.sum().backward()
    assert y.untyped_storage().size() > 0
    torch.testing.assert_close((x.grad, weight.grad), grads, rtol=0, atol=0)


def test_checkpoint_without_output_restores_data_a_consumer_saved():
    x, weight = _leaves()
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(lambda a, w: torch.tanh(a @ w), x, weight)
    kept = y.detach().clone()
    z = y * y  # saves y for its backward
    ckpt.discard_output_and_register_recompute(z)
    z.sum().backward()  # would fail on a modified or empty y
    torch.testing.assert_close(y.detach(), kept, rtol=0, atol=0)
    expected = ((1 - kept**2) * 2 * kept) @ weight.detach().T
    torch.testing.assert_close(x.grad, expected)


def test_checkpoint_without_output_refuses_what_is_not_a_manager():
    with pytest.raises(TypeError, match="ckpt_manager=.*CheckpointWithoutOutputManager or None"):
        CheckpointWithoutOutput(ckpt_manager=object())


def test_convert_cuda_rng_state_round_trip():
    state = tp_random._get_rng_state()
    generator = convert_cuda_rng_state(state, to_graphable=True)
    assert isinstance(generator, torch.Generator)
    assert torch.equal(convert_cuda_rng_state(generator), state)
    assert convert_cuda_rng_state(state) is state
    assert convert_cuda_rng_state(generator, to_graphable=True) is generator
    with pytest.raises(ValueError, match="expected a state tensor or a generator"):
        convert_cuda_rng_state("state")
