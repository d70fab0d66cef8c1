"""linear_with_grad_accumulation_and_async_allreduce (and the frozen-weight form) against a full
single-device linear, on two gloo ranks: column-parallel with an all-reduced input gradient,
sequence parallel, weight-gradient accumulation into main_grad, and deferred weight gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import (
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from tests.unit_tests.test_utilities import run_distributed

S, B, H, OUT = 4, 2, 6, 8


def _full():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(S, B, H, generator=gen, dtype=torch.float64)
    w = torch.randn(OUT, H, generator=gen, dtype=torch.float64)
    b = torch.randn(OUT, generator=gen, dtype=torch.float64)
    g = torch.randn(S, B, OUT, generator=gen, dtype=torch.float64)
    return x, w, b, g


def _worker(rank, world):
    group = dist.new_group(list(range(world)))
    x, w, b, g = _full()
    rows = slice(rank * OUT // world, (rank + 1) * OUT // world)  # this rank's output features
    xf, wf, bf = (t.clone().requires_grad_() for t in (x, w, b))
    (xf @ wf.T + bf).backward(g)

    # Column parallel: replicated input, sharded weight, input gradient all-reduced.
    xi, wi, bi = x.clone().requires_grad_(), w[rows].clone().requires_grad_(), b[rows].clone()
    bi.requires_grad_()
    out = linear_with_grad_accumulation_and_async_allreduce(
        xi, wi, bi, False, True, False, tp_group=group
    )
    out.backward(g[..., rows])
    torch.testing.assert_close(out, (x @ w.T + b)[..., rows])
    torch.testing.assert_close(xi.grad, xf.grad)
    torch.testing.assert_close(wi.grad, wf.grad[rows])
    torch.testing.assert_close(bi.grad, bf.grad[rows])

    # Sequence parallel: this rank's half of the sequence in, full sequence used, input gradient
    # reduce-scattered back to the half.
    seq = slice(rank * S // world, (rank + 1) * S // world)
    xs, ws = x[seq].clone().requires_grad_(), w[rows].clone().requires_grad_()
    out = linear_with_grad_accumulation_and_async_allreduce(
        xs, ws, None, False, False, True, tp_group=group
    )
    out.backward(g[..., rows])
    torch.testing.assert_close(out, (x @ w.T)[..., rows])
    torch.testing.assert_close(xs.grad, xf.grad[seq])
    torch.testing.assert_close(ws.grad, wf.grad[rows])

    # Weight gradient accumulated into main_grad (float32), none returned.
    wm = w[rows].clone().requires_grad_()
    wm.main_grad = torch.ones(wm.shape, dtype=torch.float32)
    linear_with_grad_accumulation_and_async_allreduce(
        x, wm, None, True, True, False, tp_group=group
    ).backward(g[..., rows])
    assert wm.grad is None
    torch.testing.assert_close(wm.main_grad, 1 + wf.grad[rows].float())

    # Deferred: the output gradient goes to the buffer, no weight gradient now.
    buffer = []
    wd = w[rows].clone().requires_grad_()
    linear_with_grad_accumulation_and_async_allreduce(
        x, wd, None, False, True, False, grad_output_buffer=buffer, tp_group=group
    ).backward(g[..., rows])
    assert wd.grad is None and len(buffer) == 1 and torch.equal(buffer[0], g[..., rows])

    # Frozen weight: input gradient only.
    xz = x.clone().requires_grad_()
    out = linear_with_frozen_weight(xz, w[rows], None, False, True, False, group)
    out.backward(g[..., rows])
    torch.testing.assert_close(xz.grad, xf.grad)


def test_linear_function_matches_a_full_linear_on_two_ranks():
    run_distributed(_worker, world_size=2, timeout_s=120)


def test_linear_function_argument_errors(single_rank_model_parallel):
    x, w, b, _ = _full()
    with pytest.raises(ValueError, match="allreduce_dgrad and sequence_parallel are exclusive"):
        linear_with_grad_accumulation_and_async_allreduce(x, w, b, False, True, True)
    with pytest.raises(ValueError, match="gtp_remat_size=2"):
        linear_with_grad_accumulation_and_async_allreduce(
            x, w, b, False, False, False, gtp_remat_size=2
        )
    with pytest.raises(ValueError, match="the weight requires a gradient"):
        linear_with_frozen_weight(x, w.requires_grad_(), b, False, False, False, None)
    w.requires_grad_(False)
    wm = w.clone().requires_grad_()
    out = linear_with_grad_accumulation_and_async_allreduce(x, wm, None, True, False, False)
    with pytest.raises(RuntimeError, match="weight.main_grad"):
        out.sum().backward()


def test_a_wider_output_dtype_is_accumulated_in_it_not_rounded_first():
    # 512 products of integers up to 8 in size: every partial sum is an exact float32 integer,
    # but most are not bf16 values. A bf16 matmul cast to float32 afterwards loses them.
    from megatron.core.tensor_parallel.layers import (
        linear_with_frozen_weight,
        linear_with_grad_accumulation_and_async_allreduce,
    )

    generator = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 9, (3, 512), generator=generator).to(torch.bfloat16).requires_grad_()
    weight = torch.randint(-8, 9, (4, 512), generator=generator).to(torch.bfloat16)
    exact = x.detach().double() @ weight.double().t()
    out = linear_with_grad_accumulation_and_async_allreduce(
        x, weight.requires_grad_(), None, False, False, False, tp_group=None,
        output_dtype=torch.float32,
    )  # fmt: skip
    assert out.dtype == torch.float32
    assert torch.equal(out.double(), exact)
    out.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert torch.equal(x.grad.double(), weight.detach().double().sum(0).expand(3, -1))
    frozen = linear_with_frozen_weight(
        x.detach(), weight.detach(), None, False, False, False, None, output_dtype=torch.float32
    )
    assert frozen.dtype == torch.float32 and torch.equal(frozen.double(), exact)
