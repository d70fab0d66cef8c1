"""Autograd-aware collectives between the ranks of a tensor-parallel group.

Each mapping is a pair of a forward collective and its adjoint in the backward pass:

============================================== ======================= =======================
mapping                                        forward                 backward
============================================== ======================= =======================
``copy_to_tensor_model_parallel_region``       identity                all-reduce
``reduce_from_tensor_model_parallel_region``   all-reduce              identity
``scatter_to_tensor_model_parallel_region``    keep own last-dim chunk all-gather last dim
``gather_from_tensor_model_parallel_region``   all-gather last dim     keep own last-dim chunk
``scatter_to_sequence_parallel_region``        keep own dim-0 chunk    all-gather dim 0
``gather_from_sequence_parallel_region``       all-gather dim 0        reduce-scatter dim 0
``reduce_scatter_to_sequence_parallel_region`` reduce-scatter dim 0    all-gather dim 0
``all_to_all``                                 all-to-all dim 0        the inverse all-to-all
============================================== ======================= =======================

``group=None`` means the global tensor-parallel group of ``parallel_state`` (deprecated: pass
the group); without ``torch.distributed`` every mapping is the identity. Collectives never
modify their input in place, so a tensor passed in may still be used elsewhere.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.utils import get_pg_rank, get_pg_size, get_tensor_model_parallel_group_if_none

# torch >= 2.12 renames the single-tensor collectives and deprecates the old names.
_all_gather_single = getattr(
    torch.distributed,
    "all_gather_single",
    getattr(torch.distributed, "all_gather_into_tensor", None),
)
_reduce_scatter_single = getattr(
    torch.distributed,
    "reduce_scatter_single",
    getattr(torch.distributed, "reduce_scatter_tensor", None),
)


# ------------------------------------------------------------------------------ primitives


def _reduce(input_: torch.Tensor, group) -> torch.Tensor:
    if get_pg_size(group) == 1:
        return input_
    output = input_.clone(memory_format=torch.contiguous_format)
    torch.distributed.all_reduce(output, group=group)
    return output


def _split_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world_size = get_pg_size(group)
    if world_size == 1:
        return input_
    if input_.size(-1) % world_size != 0:
        raise ValueError(
            f"last dimension ({input_.size(-1)}) is not divisible by the tensor-parallel size "
            f"({world_size})"
        )
    return input_.chunk(world_size, dim=-1)[get_pg_rank(group)].contiguous()


def _gather_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world_size = get_pg_size(group)
    if world_size == 1:
        return input_
    # Gather along dim 0 (the layout every backend supports), then move the pieces to the end.
    gathered = input_.new_empty((world_size * input_.size(0), *input_.shape[1:]))
    _all_gather_single(gathered, input_.contiguous(), group=group)
    return torch.cat(gathered.chunk(world_size, dim=0), dim=-1)


def _reduce_scatter_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world_size = get_pg_size(group)
    if world_size == 1:
        return input_
    if input_.size(-1) % world_size != 0:
        raise ValueError(
            f"last dimension ({input_.size(-1)}) is not divisible by the tensor-parallel size "
            f"({world_size})"
        )
    # Reduce-scatter works on dim 0 everywhere: stack the last-dim chunks along dim 0 (chunk r
    # for rank r), reduce-scatter them, and give the result back its leading dims.
    shape = (*input_.shape[:-1], input_.size(-1) // world_size)
    flat = input_.reshape(-1, input_.size(-1))
    stacked = torch.cat(flat.chunk(world_size, dim=-1), dim=0)
    return _reduce_scatter_along_first_dim(stacked, group).reshape(shape)


def _split_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world_size = get_pg_size(group)
    if world_size == 1:
        return input_
    if input_.size(0) % world_size != 0:
        raise ValueError(
            f"first (sequence) dimension ({input_.size(0)}) is not divisible by the "
            f"tensor-parallel size ({world_size})"
        )
    return input_.chunk(world_size, dim=0)[get_pg_rank(group)].contiguous()


def _pad_first_dim(input_: torch.Tensor, length: int) -> torch.Tensor:
    if input_.size(0) == length:
        return input_
    padding = input_.new_zeros((length - input_.size(0), *input_.shape[1:]))
    return torch.cat([input_, padding], dim=0)


def _check_split_sizes(name: str, split_sizes: list[int], world_size: int) -> None:
    if len(split_sizes) != world_size:
        raise ValueError(f"{name} has {len(split_sizes)} entries, the group has {world_size} ranks")


def _gather_along_first_dim(
    input_: torch.Tensor, group, output_split_sizes: Optional[list[int]] = None
) -> torch.Tensor:
    world_size = get_pg_size(group)
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    if output_split_sizes is None:
        output = input_.new_empty((world_size * input_.size(0), *input_.shape[1:]))
        _all_gather_single(output, input_, group=group)
        return output
    # Uneven pieces: pad every piece to the longest one, so one equal-size all-gather works on
    # every backend (gloo has no uneven all-gather), then drop the padding.
    _check_split_sizes("output_split_sizes", output_split_sizes, world_size)
    longest = max(output_split_sizes)
    padded = input_.new_empty((world_size * longest, *input_.shape[1:]))
    _all_gather_single(padded, _pad_first_dim(input_, longest), group=group)
    pieces = [padded[i * longest : i * longest + n] for i, n in enumerate(output_split_sizes)]
    return torch.cat(pieces, dim=0)


def _reduce_scatter_along_first_dim(
    input_: torch.Tensor, group, input_split_sizes: Optional[list[int]] = None
) -> torch.Tensor:
    world_size = get_pg_size(group)
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    if input_split_sizes is None:
        if input_.size(0) % world_size != 0:
            raise ValueError(
                f"first (sequence) dimension ({input_.size(0)}) is not divisible by the "
                f"tensor-parallel size ({world_size})"
            )
        output = input_.new_empty((input_.size(0) // world_size, *input_.shape[1:]))
        _reduce_scatter_single(output, input_, group=group)
        return output
    _check_split_sizes("input_split_sizes", input_split_sizes, world_size)
    if sum(input_split_sizes) != input_.size(0):
        raise ValueError(
            f"input_split_sizes {list(input_split_sizes)} do not sum to the first dimension "
            f"({input_.size(0)})"
        )
    longest = max(input_split_sizes)
    pieces = torch.split(input_, list(input_split_sizes), dim=0)
    padded = torch.cat([_pad_first_dim(piece, longest) for piece in pieces], dim=0)
    output = input_.new_empty((longest, *input_.shape[1:]))
    _reduce_scatter_single(output, padded, group=group)
    return output[: input_split_sizes[get_pg_rank(group)]]


# ------------------------------------------------------------------ autograd functions


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad, group, output_split_sizes):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        return _gather_along_first_dim(input_, group, output_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            # Each rank's output fed a different computation (e.g. a column-parallel linear),
            # so every rank holds a partial gradient of the whole sequence: sum, then keep ours.
            grad_input = _reduce_scatter_along_first_dim(
                grad_output, ctx.group, ctx.output_split_sizes
            )
        elif ctx.output_split_sizes is None:
            # The gradient is already complete and identical on every rank: keep our chunk.
            grad_input = _split_along_first_dim(grad_output, ctx.group)
        else:
            start = sum(ctx.output_split_sizes[: get_pg_rank(ctx.group)])
            length = ctx.output_split_sizes[get_pg_rank(ctx.group)]
            grad_input = grad_output[start : start + length].contiguous()
        return grad_input, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group, input_split_sizes):
        ctx.group = group
        ctx.input_split_sizes = input_split_sizes
        return _reduce_scatter_along_first_dim(input_, group, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group, ctx.input_split_sizes), None, None


class _AllGatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gathers along the last dim; reduce-scatters the gradient along the last dim."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter_along_last_dim(grad_output, ctx.group), None


class _ReduceScatterToTensorParallelRegion(torch.autograd.Function):
    """Reduce-scatters along the last dim; all-gathers the gradient along the last dim."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        if get_pg_size(group) == 1:
            return input_
        input_ = input_.contiguous()
        if output_split_sizes is None:
            output = torch.empty_like(input_)
        else:
            output = input_.new_empty((sum(output_split_sizes), *input_.shape[1:]))
        torch.distributed.all_to_all_single(
            output,
            input_,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=group,
        )
        return output

    @staticmethod
    def backward(ctx, grad_output):
        # The adjoint of an all-to-all is the all-to-all with the split sizes swapped.
        grad_input = _AllToAll.apply(
            ctx.group, grad_output, ctx.input_split_sizes, ctx.output_split_sizes
        )
        return None, grad_input, None, None


# --------------------------------------------------------------------------- public API


def _group_or_default(group):
    return get_tensor_model_parallel_group_if_none(group)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; all-reduces the gradient (input of a column-parallel computation)."""
    return _CopyToModelParallelRegion.apply(input_, _group_or_default(group))


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduces forward (sums row-parallel partial results); identity gradient."""
    return _ReduceFromModelParallelRegion.apply(input_, _group_or_default(group))


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Keeps this rank's chunk of the last dimension; all-gathers the gradient."""
    return _ScatterToModelParallelRegion.apply(input_, _group_or_default(group))


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-gathers along the last dimension; keeps this rank's chunk of the gradient."""
    return _GatherFromModelParallelRegion.apply(input_, _group_or_default(group))


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Keeps this rank's chunk of the first (sequence) dimension; all-gathers the gradient."""
    return _ScatterToSequenceParallelRegion.apply(input_, _group_or_default(group))


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    tensor_parallel_output_grad: bool = True,
    group=None,
    output_split_sizes: Optional[list[int]] = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """All-gathers along the first (sequence) dimension.

    Args:
        input_: This rank's piece of the sequence.
        tensor_parallel_output_grad: The gathered output feeds a tensor-parallel computation,
            so the gradient is partial on each rank and is reduce-scattered. With False the
            gradient is complete everywhere and each rank keeps its own piece.
        group: The group to gather over (default: the global tensor-parallel group).
        output_split_sizes: Length of each rank's piece when they differ (MoE token counts).
        use_global_buffer: Accepted for compatibility; a fresh output tensor is always used.

    Returns:
        The whole sequence, pieces in rank order.
    """
    return _GatherFromSequenceParallelRegion.apply(
        input_, tensor_parallel_output_grad, _group_or_default(group), output_split_sizes
    )


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    group=None,
    input_split_sizes: Optional[list[int]] = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """Sums across ranks and keeps this rank's piece of the first (sequence) dimension.

    Args:
        input_: The partial result over the whole sequence.
        group: The group to reduce over (default: the global tensor-parallel group).
        input_split_sizes: Length of each rank's piece when they differ.
        use_global_buffer: Accepted for compatibility; a fresh output tensor is always used.

    Returns:
        This rank's piece of the summed tensor.
    """
    return _ReduceScatterToSequenceParallelRegion.apply(
        input_, _group_or_default(group), input_split_sizes
    )


def all_to_all(
    group,
    input_: torch.Tensor,
    output_split_sizes: Optional[list[int]] = None,
    input_split_sizes: Optional[list[int]] = None,
    use_nccl_stream: bool = False,
) -> torch.Tensor:
    """Exchanges pieces of the first dimension between all ranks of ``group``.

    Args:
        group: The group to exchange over (required: token dispatch uses the expert group).
        input_: Pieces to send, rank 0's first.
        output_split_sizes: Length of the piece received from each rank (None: equal pieces).
        input_split_sizes: Length of the piece sent to each rank (None: equal pieces).
        use_nccl_stream: Accepted for upstream's signature. Upstream may then run the exchange
            on NCCL's own stream; here it always runs on the current stream, which gives the
            same result (only the overlap with other work can differ).

    Returns:
        The received pieces, concatenated in rank order.

    Raises:
        ValueError: ``group`` is None.
    """
    del use_nccl_stream
    if group is None:
        raise ValueError("all_to_all needs a process group (e.g. the expert-parallel group).")
    return _AllToAll.apply(group, input_, output_split_sizes, input_split_sizes)


def all_gather_last_dim_from_tensor_parallel_region(
    input_: torch.Tensor, group=None
) -> torch.Tensor:
    """All-gathers the last dimension across ``group`` (default: the tensor-parallel group).

    The gradient is reduce-scattered along the last dimension.
    """
    return _AllGatherFromTensorParallelRegion.apply(input_, _group_or_default(group))


def reduce_scatter_last_dim_to_tensor_parallel_region(
    input_: torch.Tensor, group=None
) -> torch.Tensor:
    """Sums across ``group`` and keeps this rank's chunk of the last dimension.

    ``group`` defaults to the tensor-parallel group; the gradient is all-gathered along the last
    dimension.
    """
    return _ReduceScatterToTensorParallelRegion.apply(input_, _group_or_default(group))


def all_to_all_sp2hp(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Sequence-split ``[tokens / TP, H]`` to hidden-split ``[tokens, H / TP]`` by an all-to-all.

    Leading dims are flattened into the token dim. ``group`` defaults to the tensor-parallel
    group.

    Raises:
        ValueError: H is not divisible by the group size.
    """
    group = _group_or_default(group)
    world_size = get_pg_size(group)
    flat = input_.reshape(-1, input_.size(-1))
    if flat.size(-1) % world_size != 0:
        raise ValueError(
            f"all_to_all_sp2hp: hidden size {flat.size(-1)} is not divisible by the group size "
            f"{world_size}"
        )
    # Rank r receives hidden chunk r of every rank's tokens, in rank (= token) order.
    return all_to_all(group, torch.cat(flat.chunk(world_size, dim=-1), dim=0))


def all_to_all_hp2sp(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Hidden-split ``[tokens, H / TP]`` to sequence-split ``[tokens / TP, H]`` by an all-to-all.

    The inverse of :func:`all_to_all_sp2hp`. ``group`` defaults to the tensor-parallel group.

    Raises:
        ValueError: The token count is not divisible by the group size.
    """
    group = _group_or_default(group)
    world_size = get_pg_size(group)
    flat = input_.reshape(-1, input_.size(-1))
    if flat.size(0) % world_size != 0:
        raise ValueError(
            f"all_to_all_hp2sp: token count {flat.size(0)} is not divisible by the group size "
            f"{world_size}"
        )
    exchanged = all_to_all(group, flat)
    # Piece r now holds this rank's tokens' hidden chunk r; lay the chunks side by side.
    return torch.cat(exchanged.chunk(world_size, dim=0), dim=-1)
