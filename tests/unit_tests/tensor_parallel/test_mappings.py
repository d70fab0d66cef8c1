"""The autograd collectives on two gloo ranks: forward values and backward adjoints."""

import pytest
import torch

from megatron.core.tensor_parallel import mappings
from tests.unit_tests.test_utilities import run_distributed


def _rank_tensor(rank, *shape):
    # Distinct, rank-dependent values so a swapped or dropped piece changes the result.
    numel = 1
    for size in shape:
        numel *= size
    return (torch.arange(numel, dtype=torch.float64).reshape(shape) + 100 * rank).requires_grad_()


def _forward_backward(fn, x, grad):
    out = fn(x)
    out.backward(grad)
    return out.detach(), x.grad


def _mappings_worker(rank, world_size):
    group = torch.distributed.new_group([0, 1])
    other = 1 - rank
    # Every "gradient" below is rank-dependent too, so reductions are visible.
    x = _rank_tensor(rank, 4, 2)
    x_other = _rank_tensor(other, 4, 2).detach()
    g = _rank_tensor(rank, 4, 2).detach() * 0.5
    g_other = _rank_tensor(other, 4, 2).detach() * 0.5

    def close(actual, expected, what):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=f"rank {rank}: {what}")

    out, grad = _forward_backward(
        lambda t: mappings.copy_to_tensor_model_parallel_region(t, group), x, g
    )
    close(out, x.detach(), "copy forward")
    close(grad, g + g_other, "copy backward")

    x.grad = None
    out, grad = _forward_backward(
        lambda t: mappings.reduce_from_tensor_model_parallel_region(t, group), x, g
    )
    close(out, x.detach() + x_other, "reduce forward")
    close(grad, g, "reduce backward")
    close(x.detach(), _rank_tensor(rank, 4, 2).detach(), "reduce leaves its input unchanged")

    # Last-dimension scatter / gather: [4, 2] per rank <-> [4, 4] whole.
    whole = torch.cat([_rank_tensor(0, 4, 2), _rank_tensor(1, 4, 2)], dim=-1).detach()
    x.grad = None
    out, grad = _forward_backward(
        lambda t: mappings.gather_from_tensor_model_parallel_region(t, group),
        x,
        whole * 3,
    )
    close(out, whole, "gather last dim forward")
    close(grad, (whole * 3).chunk(2, dim=-1)[rank], "gather last dim backward")

    y = whole.clone().requires_grad_()
    out, grad = _forward_backward(
        lambda t: mappings.scatter_to_tensor_model_parallel_region(t, group), y, g
    )
    close(out, whole.chunk(2, dim=-1)[rank], "scatter last dim forward")
    close(grad, torch.cat([g, g_other] if rank == 0 else [g_other, g], dim=-1), "scatter backward")

    # First-dimension (sequence) mappings: [4, 2] per rank <-> [8, 2] whole.
    seq_whole = torch.cat([_rank_tensor(0, 4, 2), _rank_tensor(1, 4, 2)]).detach()
    x.grad = None
    grad_out = _rank_tensor(rank, 8, 2).detach()
    grad_sum = _rank_tensor(0, 8, 2).detach() + _rank_tensor(1, 8, 2).detach()
    out, grad = _forward_backward(
        lambda t: mappings.gather_from_sequence_parallel_region(t, group=group), x, grad_out
    )
    close(out, seq_whole, "sequence gather forward")
    close(grad, grad_sum.chunk(2)[rank], "sequence gather backward (reduce-scatter)")

    x.grad = None
    out, grad = _forward_backward(
        lambda t: mappings.gather_from_sequence_parallel_region(
            t, tensor_parallel_output_grad=False, group=group
        ),
        x,
        grad_sum,
    )
    close(grad, grad_sum.chunk(2)[rank], "sequence gather backward (split)")

    y = _rank_tensor(rank, 8, 2)
    out, grad = _forward_backward(
        lambda t: mappings.reduce_scatter_to_sequence_parallel_region(t, group=group), y, g
    )
    close(out, grad_sum.chunk(2)[rank], "reduce-scatter forward")
    close(grad, torch.cat([g, g_other] if rank == 0 else [g_other, g]), "reduce-scatter backward")

    y = seq_whole.clone().requires_grad_()
    out, grad = _forward_backward(
        lambda t: mappings.scatter_to_sequence_parallel_region(t, group=group), y, g
    )
    close(out, seq_whole.chunk(2)[rank], "sequence scatter forward")
    close(grad, torch.cat([g, g_other] if rank == 0 else [g_other, g]), "sequence scatter backward")

    # Uneven pieces (MoE token counts): rank 0 holds 1 row, rank 1 holds 3.
    sizes = [1, 3]
    piece = _rank_tensor(rank, sizes[rank], 2)
    uneven_whole = torch.cat([_rank_tensor(0, 1, 2), _rank_tensor(1, 3, 2)]).detach()
    grad_out = _rank_tensor(rank, 4, 2).detach()
    grad_sum = _rank_tensor(0, 4, 2).detach() + _rank_tensor(1, 4, 2).detach()
    out, grad = _forward_backward(
        lambda t: mappings.gather_from_sequence_parallel_region(
            t, group=group, output_split_sizes=sizes
        ),
        piece,
        grad_out,
    )
    close(out, uneven_whole, "uneven gather forward")
    close(grad, grad_sum.split(sizes)[rank], "uneven gather backward")

    y = _rank_tensor(rank, 4, 2)
    out, grad = _forward_backward(
        lambda t: mappings.reduce_scatter_to_sequence_parallel_region(
            t, group=group, input_split_sizes=sizes
        ),
        y,
        _rank_tensor(rank, sizes[rank], 2).detach(),
    )
    close(out, grad_sum.split(sizes)[rank], "uneven reduce-scatter forward")
    close(grad, uneven_whole, "uneven reduce-scatter backward")

    # all_to_all: rank r sends rows [send[r][0]] to rank 0 and [send[r][1]] to rank 1.
    send = [[1, 2], [2, 1]]
    received = [send[0][rank], send[1][rank]]
    y = _rank_tensor(rank, 3, 2)
    out = mappings.all_to_all(group, y, output_split_sizes=received, input_split_sizes=send[rank])
    expected = torch.cat(
        [_rank_tensor(src, 3, 2).detach().split(send[src])[rank] for src in range(2)]
    )
    close(out.detach(), expected, "all_to_all forward")
    out.backward(out.detach() * 2)
    close(y.grad, y.detach() * 2, "all_to_all backward (inverse exchange)")


def test_mappings_on_two_ranks():
    run_distributed(_mappings_worker, world_size=2, timeout_s=120)


def test_mappings_are_identity_without_distributed(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    x = torch.randn(4, 2, requires_grad=True)
    for fn in (
        mappings.copy_to_tensor_model_parallel_region,
        mappings.reduce_from_tensor_model_parallel_region,
        mappings.scatter_to_tensor_model_parallel_region,
        mappings.gather_from_tensor_model_parallel_region,
        mappings.scatter_to_sequence_parallel_region,
        mappings.gather_from_sequence_parallel_region,
        mappings.reduce_scatter_to_sequence_parallel_region,
    ):
        out = fn(x)
        torch.testing.assert_close(out, x, msg=fn.__name__)
        (grad,) = torch.autograd.grad(out.sum(), x)
        torch.testing.assert_close(grad, torch.ones_like(x), msg=fn.__name__)


def test_split_sizes_are_checked(monkeypatch):
    # Pretend to be one of two ranks: the checks run before any communication.
    monkeypatch.setattr(mappings, "get_pg_size", lambda group: 2)
    with pytest.raises(ValueError, match="do not sum"):
        mappings._reduce_scatter_along_first_dim(torch.zeros(4, 2), None, [1, 2])
    with pytest.raises(ValueError, match="has 3 entries, the group has 2 ranks"):
        mappings._gather_along_first_dim(torch.zeros(1, 2), None, [1, 2, 1])
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        mappings._split_along_first_dim(torch.zeros(3, 2), None)
