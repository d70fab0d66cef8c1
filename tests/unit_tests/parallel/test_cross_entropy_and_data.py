"""Two gloo ranks: vocab_parallel_cross_entropy with the vocabulary split over TP=2 gives one
rank's loss and gradient (label smoothing included), and broadcast_data delivers rank 0's batch
to rank 1 and refuses a bad batch on every rank without leaving a rank waiting."""

from __future__ import annotations

import pytest
import torch

import megatron.core.parallel_state as ps
from megatron.core.tensor_parallel import broadcast_data, vocab_parallel_cross_entropy
from tests.unit_tests.parallel.parallel_test_utils import TP2, gather_objects, init_layout
from tests.unit_tests.tensor_parallel.cross_entropy_reference import (
    draw_inputs,
    reference_loss_and_grad,
)
from tests.unit_tests.test_utilities import run_distributed
from tests.unit_tests.tolerances import assert_close_to_reference

SHAPE, VOCAB = (6, 2), 32  # each rank holds 16 classes
# (name, logits dtype, label smoothing, offset of every logit, spread)
CE_CASES = [
    ("fp32", torch.float32, 0.0, 0.0, 3.0),
    ("fp32-smoothing", torch.float32, 0.1, 0.0, 3.0),
    ("bf16-smoothing", torch.bfloat16, 0.1, 0.0, 3.0),
    ("fp32-offset-1e4-smoothing", torch.float32, 0.2, 1e4, 3.0),
    ("fp32-underflow-smoothing", torch.float32, 0.1, 0.0, 3e3),
]


def _cross_entropy_worker(rank, world_size):
    init_layout(TP2, "cpu")
    group = ps.get_tensor_model_parallel_group()
    results = {}
    for seed, (name, dtype, alpha, offset, spread) in enumerate(CE_CASES):
        logits, target, grad_output = draw_inputs(seed, SHAPE, VOCAB, dtype, offset, spread)
        shard = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
        # tp_group=None: parallel_state's group (upstream's default), on the last case only.
        tp_group = None if name == CE_CASES[-1][0] else group
        loss = vocab_parallel_cross_entropy(shard, target, alpha, tp_group)
        loss.backward(grad_output)
        results[name] = {"loss": loss.detach(), "grad": shard.grad}
    return gather_objects(results)


@pytest.mark.usefixtures("single_rank_model_parallel")  # the one-rank run, in this process
def test_vocab_split_over_two_ranks_matches_one_rank():
    per_rank = run_distributed(_cross_entropy_worker, world_size=2, timeout_s=180)
    for seed, (name, dtype, alpha, offset, spread) in enumerate(CE_CASES):
        logits, target, grad_output = draw_inputs(seed, SHAPE, VOCAB, dtype, offset, spread)
        one = logits.clone().requires_grad_()
        one_loss = vocab_parallel_cross_entropy(one, target, alpha)
        one_loss.backward(grad_output)
        ref_loss, ref_grad = reference_loss_and_grad(logits, target, grad_output, alpha)

        losses = [result[name]["loss"] for result in per_rank]
        # Both ranks finish from the same all-reduced sums: the same bits, smoothing included.
        assert torch.equal(losses[0], losses[1]), f"{name}: the ranks' losses differ"
        grad = torch.cat([result[name]["grad"] for result in per_rank], dim=-1)
        assert grad.dtype == dtype, f"{name}: gradient dtype {grad.dtype}"
        for what, got, ref, tol_dtype in (
            ("loss vs one rank", losses[0], one_loss.detach(), torch.float32),
            ("loss vs float64", losses[0], ref_loss, torch.float32),
            ("gradient vs one rank", grad, one.grad, dtype),
            ("gradient vs float64", grad, ref_grad, dtype),
        ):
            assert_close_to_reference(got, ref, tol_dtype, f"{name}: {what}")


def _batch() -> dict:
    generator = torch.Generator().manual_seed(7)
    return {
        "tokens": torch.randint(0, 1000, (3, 5), generator=generator),
        "count": torch.tensor(4),
        "empty": torch.zeros(2, 0, dtype=torch.long),
        "4d": torch.randint(0, 9, (1, 2, 3, 2), generator=generator),
    }


def _outcome(call) -> dict:
    try:
        return {"data": call(), "error": None}
    except Exception as error:  # noqa: BLE001 - the test compares each rank's error
        return {"data": None, "error": (type(error).__name__, str(error))}


def _broadcast_worker(rank, world_size):
    init_layout(TP2, "cpu")
    group = ps.get_tensor_model_parallel_group()
    keys = list(_batch())
    # Rank 1's data is never read: it passes None, or a batch that would be refused.
    mine = _batch() if rank == 0 else None
    wrong_dtype = dict(_batch(), count=torch.tensor(4.0)) if rank == 0 else None
    outcomes = {
        "ok": _outcome(lambda: broadcast_data(keys, mine, torch.long, group)),
        "missing key": _outcome(lambda: broadcast_data([*keys, "mask"], mine, torch.long, group)),
        "wrong dtype": _outcome(lambda: broadcast_data(keys, wrong_dtype, torch.long, group)),
        "rank 1 data ignored": _outcome(
            lambda: broadcast_data(keys, mine if rank == 0 else {"tokens": 1.0}, torch.long, group)
        ),
        "float": _outcome(
            lambda: broadcast_data(
                ["x"], {"x": torch.linspace(0, 1, 7)} if rank == 0 else None, torch.float32, group
            )
        ),
    }
    return gather_objects(outcomes)


def test_broadcast_data_on_two_ranks():
    per_rank = run_distributed(_broadcast_worker, world_size=2, timeout_s=180)
    expected = _batch()
    for case in ("ok", "rank 1 data ignored"):
        for rank, outcomes in enumerate(per_rank):
            got = outcomes[case]
            assert got["error"] is None, f"{case}, rank {rank}: {got['error']}"
            assert list(got["data"]) == list(expected), f"{case}, rank {rank}"
            for key, value in expected.items():
                assert got["data"][key].dtype == torch.long, (case, rank, key)
                assert torch.equal(got["data"][key], value), (case, rank, key)
    for rank, outcomes in enumerate(per_rank):
        assert torch.equal(outcomes["float"]["data"]["x"], torch.linspace(0, 1, 7)), rank

    # Rank 0 refuses with upstream's error type; rank 1 learns it from the header and raises
    # instead of waiting for data that never comes (the next cases ran: the group is in step).
    for case, source_error, match in (
        ("missing key", "KeyError", "key 'mask' is not in the data"),
        ("wrong dtype", "AssertionError", "'count' has data type torch.float32"),
    ):
        rank0, rank1 = per_rank[0][case]["error"], per_rank[1][case]["error"]
        assert rank0 is not None and rank0[0] == source_error and match in rank0[1], (case, rank0)
        assert rank1 is not None and rank1[0] == "RuntimeError", (case, rank1)
        assert "rank 0 (global rank 0) refused its data" in rank1[1], (case, rank1)
