"""The tensor-parallel linear as an autograd function.

What ``ColumnParallelLinear`` / ``RowParallelLinear`` run: the matmul with the backward's
collective (all-reduce of the input gradient, or the sequence-parallel all-gather /
reduce-scatter) and optional fp32 gradient accumulation into ``weight.main_grad``, plus the
frozen-weight variant. ``megatron.core.tensor_parallel.layers`` re-exports these names.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.tensor_parallel.mappings import (
    _gather_along_first_dim,
    _reduce_scatter_along_first_dim,
)
from megatron.core.utils import (
    get_pg_size,
    get_tensor_model_parallel_group_if_none,
)


def _linear_output(input, weight, bias, output_dtype):
    """``input @ weight.T + bias`` written in ``output_dtype`` (None: the input's).

    A wider output than the operands (bf16 in, float32 out) is accumulated and written in that
    dtype, never rounded to the operands' dtype first: through Transformer Engine's
    ``general_gemm`` on CUDA where TE has it (as upstream), else by one matmul of the operands
    widened to ``output_dtype`` (exact: a bf16 or fp16 value is a float32 value).
    """
    if output_dtype is None or output_dtype == input.dtype:
        output = torch.matmul(input, weight.t())
        return output + bias if bias is not None else output
    # Deferred: the TE extension imports the tensor-parallel layers.
    from megatron.core.extensions.te_gemm import te_general_gemm_or_none

    gemm = te_general_gemm_or_none()
    if gemm is not None and input.is_cuda:
        rows = input.reshape(-1, input.shape[-1])
        output = gemm(weight, rows, out_dtype=output_dtype, layout="TN", bias=bias)[0]
        return output.reshape(*input.shape[:-1], output.shape[-1])
    output = torch.matmul(input.to(output_dtype), weight.to(output_dtype).t())
    return output + bias.to(output_dtype) if bias is not None else output


# ------------------------------------------------------------------- the linear as a function
class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``input @ weight.T + bias`` with the tensor-parallel communication of its backward.

    Forward all-gathers a sequence-parallel input along dim 0. Backward computes the input
    gradient and either reduce-scatters it (sequence parallel) or all-reduces it
    (``allreduce_dgrad``); the weight gradient is returned, or added in float32 to
    ``weight.main_grad`` (``gradient_accumulation_fusion``), or deferred by appending the output
    gradient to ``grad_output_buffer`` for the caller to use later.
    """

    @staticmethod
    def forward(
        ctx,
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        tp_group,
        output_dtype=None,
    ):
        """Runs the (gathered) input through the linear, written in ``output_dtype``."""
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        ctx.options = (
            gradient_accumulation_fusion,
            allreduce_dgrad,
            sequence_parallel,
            grad_output_buffer,
            wgrad_deferral_limit or 0,
            tp_group,
        )
        total_input = _gather_along_first_dim(input, tp_group) if sequence_parallel else input
        return _linear_output(total_input, weight, bias, output_dtype)

    @staticmethod
    def backward(ctx, grad_output):
        """Input gradient (reduced across the group), weight and bias gradients."""
        input, weight = ctx.saved_tensors
        fusion, allreduce_dgrad, sequence_parallel, buffer, limit, tp_group = ctx.options
        # A wider output's gradient comes back in its dtype; the gradients are the operands'.
        grad_output = grad_output.to(input.dtype)
        grad_input = grad_output.matmul(weight)
        if sequence_parallel:
            grad_input = _reduce_scatter_along_first_dim(grad_input, tp_group)
        elif allreduce_dgrad and get_pg_size(tp_group) > 1:
            torch.distributed.all_reduce(grad_input, group=tp_group)

        grad_weight = None
        if ctx.needs_input_grad[1]:
            if buffer is not None and (limit == 0 or len(buffer) < limit):
                buffer.append(grad_output)  # the caller computes this weight gradient later
            else:
                total_input = (
                    _gather_along_first_dim(input, tp_group) if sequence_parallel else input
                )
                rows_out = grad_output.reshape(-1, grad_output.shape[-1])
                rows_in = total_input.reshape(-1, total_input.shape[-1])
                if fusion:
                    main_grad = getattr(weight, "main_grad", None)
                    if main_grad is None:
                        raise RuntimeError(
                            "gradient_accumulation_fusion=True adds the weight gradient to "
                            "weight.main_grad, which this weight does not have; allocate it "
                            "(as the distributed optimizer does) or pass False."
                        )
                    main_grad.add_(rows_out.t().float() @ rows_in.float())
                else:
                    grad_weight = rows_out.t().matmul(rows_in)
        grad_bias = (
            grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.use_bias else None
        )
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: Optional[list[torch.Tensor]] = None,
    wgrad_deferral_limit: Optional[int] = 0,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
    gtp_remat_size: int = 1,
    output_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """The tensor-parallel linear as a function (see
    :class:`LinearWithGradAccumulationAndAsyncCommunication`).

    Args:
        input: ``[sequence, batch, in]``; this rank's sequence share under sequence parallelism.
        weight: ``[out, in]`` (this rank's shard).
        bias: ``[out]`` or None.
        gradient_accumulation_fusion: Add the weight gradient to ``weight.main_grad`` (float32)
            instead of returning it.
        allreduce_dgrad: All-reduce the input gradient across ``tp_group``.
        sequence_parallel: All-gather the input in forward, reduce-scatter its gradient.
        grad_output_buffer: Defer weight gradients: output gradients are appended here.
        wgrad_deferral_limit: Defer at most this many (0: no limit).
        tp_group: The tensor-parallel group; the global one when None.
        gtp_remat_size: Must be 1 (weight rematerialization is not implemented).
        output_dtype: The output's dtype (None: the input's). A wider one is accumulated in it,
            through Transformer Engine's ``general_gemm`` on CUDA (``te_general_gemm``).

    Raises:
        ValueError: ``allreduce_dgrad`` together with ``sequence_parallel``, or
            ``gtp_remat_size != 1``.
    """
    if allreduce_dgrad and sequence_parallel:
        raise ValueError(
            "allreduce_dgrad and sequence_parallel are exclusive: under sequence parallelism the "
            "input gradient is reduce-scattered, not all-reduced."
        )
    if gtp_remat_size != 1:
        raise ValueError(
            f"gtp_remat_size={gtp_remat_size}: weight rematerialization is not "
            "implemented by this fork; use 1."
        )
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    output = LinearWithGradAccumulationAndAsyncCommunication.apply(
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        tp_group,
        output_dtype,
    )
    return output


class LinearWithFrozenWeight(torch.autograd.Function):
    """``input @ weight.T + bias`` whose backward computes the input gradient only.

    The weight (and bias) are treated as constants: their gradients are None. With
    ``allreduce_dgrad`` the input gradient is all-reduced over ``tp_group`` (the backward of a
    column-parallel layer whose input was copied to every rank).
    """

    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group, output_dtype):
        """Runs the linear; ``output_dtype`` (None: the input's) is the output's dtype."""
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        ctx.input_dtype = input.dtype
        return _linear_output(input, weight, bias, output_dtype)

    @staticmethod
    def backward(ctx, grad_output):
        """Returns the input gradient; None for the weight, bias and the options."""
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.to(ctx.input_dtype).matmul(weight)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None, None


def linear_with_frozen_weight(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group: Optional[torch.distributed.ProcessGroup],
    grad_output_buffer: Optional[list[torch.Tensor]] = None,
    wgrad_deferral_limit: None = None,
    gtp_remat_size: int = 1,
    output_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """:func:`linear_with_grad_accumulation_and_async_allreduce` for a weight that is not trained
    (``weight.requires_grad`` False): only the input (and bias) gradients are computed.

    Raises:
        ValueError: The weight requires a gradient, or weight-gradient deferral is requested.
    """
    if weight.requires_grad:
        raise ValueError(
            "linear_with_frozen_weight: the weight requires a gradient; use "
            "linear_with_grad_accumulation_and_async_allreduce."
        )
    if grad_output_buffer is not None or wgrad_deferral_limit:
        raise ValueError("linear_with_frozen_weight: a frozen weight has no gradient to defer.")
    return linear_with_grad_accumulation_and_async_allreduce(
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        tp_group=tp_group,
        gtp_remat_size=gtp_remat_size,
        output_dtype=output_dtype,
    )
