"""Linear layers whose weights are split across the ranks of a tensor-parallel group.

An MLP uses the two as a pair, so that only one collective runs per direction:

- ``ColumnParallelLinear`` splits the weight by output features: ``Y = X A`` with
  ``A = [A_1, ..., A_p]``; rank i computes ``Y_i = X A_i``, its slice of the output features.
- ``RowParallelLinear`` splits the weight by input features: ``Z = Y B`` with
  ``B = [B_1; ...; B_p]``; rank i computes ``Y_i B_i`` and an all-reduce sums the partial
  results.

With sequence parallelism the activations outside the pair are split along the sequence
(first) dimension instead of replicated: the column layer all-gathers its input, and the row
layer reduce-scatters its output instead of all-reducing it.

Initialization: on CPU (``use_cpu_initialization``, or any machine without CUDA) every rank draws
the full "master" weight from the default generator and keeps its slice, so a tensor-parallel
layer holds exactly the weights a single-device layer would for the same seed. On GPU each rank
initializes only its shard, inside the tracker's ``"model-parallel-rng"`` stream (the
``"expert-parallel-rng"`` stream for experts), as upstream.

Process group: ``tp_group`` if given, else ``pg_collection.tp`` (``pg_collection.expt_tp`` for
experts), else the global group from ``parallel_state`` (deprecated). Without
``torch.distributed`` a layer is a plain single-device linear.

Expert layers (``is_expert=True``) under tensor or expert parallelism do no communication of
their own: the MoE token dispatcher moves tokens to and from them. Their weights are split over
the expert-tensor-parallel group.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.mappings import (
    _gather_along_first_dim,
    _reduce_scatter_along_first_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.tensor_parallel.utils import VocabUtility
from megatron.core.utils import (
    divide,
    get_pg_rank,
    get_pg_size,
    get_tensor_model_parallel_group_if_none,
)

# Upstream's set: the expert and fused-QKV markers travel with the tensor-parallel ones, so a
# copied parameter (e.g. an optimizer's fp32 master) keeps every attribute upstream code reads.
_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "expert_tp": False,
    "is_qkv": False,
    "qkv_split_shapes": None,
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}

# Attributes of GTP weight rematerialisation that a parameter's copies must keep (which axis
# counts the parameter once, its checkpoint writer group, and its shard padding).
_GTP_ATTRIBUTES = ("is_gtp_weight_remat", "allreduce", "gtp_replica_group", "pad_length")


# ------------------------------------------------------------------- parameter attributes


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
    expert_tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> bool:
    """Whether ``param`` counts once per tensor-parallel group (a shard, or on TP rank 0).

    Used to avoid counting replicated parameters once per rank (e.g. in gradient norms).

    Args:
        param: The parameter.
        tp_group: The tensor-parallel group to judge rank 0 in; None reads ``parallel_state``.
        expert_tp_group: Used instead of ``tp_group`` for a parameter marked
            ``allreduce=False`` (reduced over the expert data-parallel group, so duplicated
            across the expert tensor-parallel group).
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    if not getattr(param, "allreduce", True) and expert_tp_group is not None:
        tp_group = expert_tp_group
    if tp_group is not None:
        return tp_group.rank() == 0
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() == 0


def copy_gtp_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copies the GTP weight-rematerialisation attributes ``source`` has to ``destination``.

    Args:
        destination: A view or copy of ``source`` (e.g. an optimizer's master shard).
        source: The model parameter.
    """
    for attribute in _GTP_ATTRIBUTES:
        if hasattr(source, attribute):
            setattr(destination, attribute, getattr(source, attribute))


def param_is_not_gtp_duplicate(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient counts once across the GTP weight-rematerialisation axis.

    A rematerialised shard (``is_gtp_weight_remat``) is unique on every rank of that axis; any
    other parameter is replicated across it and counts on its rank 0 only: the expert axis for
    parameters marked ``allreduce=False``, the dense axis otherwise. Without GTP every rank is
    rank 0, so every parameter counts.
    """
    if getattr(param, "is_gtp_weight_remat", False):
        return True
    from megatron.core import parallel_state

    if not getattr(param, "allreduce", True):
        return parallel_state.get_expert_gtp_weight_remat_rank() == 0
    return parallel_state.get_gtp_weight_remat_rank() == 0


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Marks ``tensor`` as a tensor-parallel shard split along ``dim`` with ``stride``.

    Raises:
        ValueError: The tensor already carries these attributes.
    """
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise ValueError(f"tensor already has the tensor-parallel attribute {attribute!r}")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Gives ``tensor`` the "not split" attributes where it has none."""
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(
    destination_tensor: torch.Tensor, source_tensor: torch.Tensor
) -> None:
    """Copies the tensor-parallel attributes ``source_tensor`` has to ``destination_tensor``."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


# --------------------------------------------------------------------------- initialization


def _initialize_affine_weight_cpu(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: Callable[[torch.Tensor], torch.Tensor],
    stride: int = 1,
    return_master_weight: bool = False,
    *,
    params_dtype: torch.dtype = torch.float32,
    rank: int = 0,
    world_size: int = 1,
) -> Optional[torch.Tensor]:
    """Initializes the full weight on CPU and copies this rank's slice into ``weight``.

    The master weight is drawn in float32 from the default generator, identically on every
    rank, then cast. With ``stride`` s the split dimension holds s consecutive blocks (e.g. the
    gate and linear halves of a gated MLP's fc1); each rank keeps its slice of every block, so
    rank i holds ``[block_1 slice i; ...; block_s slice i]``.
    """
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)

    master_weight = torch.empty(output_size, input_size, dtype=torch.float32)
    init_method(master_weight)
    master_weight = master_weight.to(dtype=params_dtype)

    piece = divide(per_partition_size, stride)
    pieces = torch.split(master_weight, piece, dim=partition_dim)
    with torch.no_grad():
        weight.copy_(torch.cat(pieces[rank::world_size], dim=partition_dim))
    return master_weight if return_master_weight else None


def _initialize_affine_weight_gpu(
    weight: torch.Tensor,
    init_method: Callable[[torch.Tensor], torch.Tensor],
    partition_dim: int,
    stride: int = 1,
    is_expert: bool = False,
) -> None:
    """Initializes this rank's shard in place, inside the rank's own RNG stream."""
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    if is_expert:
        stream = get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())
    else:
        stream = get_cuda_rng_tracker().fork()
    with stream:
        init_method(weight)


def _use_cpu_initialization(config: ModelParallelConfig) -> bool:
    return config.use_cpu_initialization or not torch.cuda.is_available()


def _partition_size(layer: str, dimension: str, size: int, tp_size: int, stride: int) -> int:
    if size % (tp_size * stride) != 0:
        raise ValueError(
            f"{layer}: {dimension} ({size}) must be divisible by the tensor-parallel size "
            f"({tp_size}) times stride ({stride}); change the size or the parallel layout."
        )
    return size // tp_size


def _resolve_tp_group(tp_group, pg_collection, is_expert: bool, layer: str):
    if tp_group is None and pg_collection is not None:
        attribute = "expt_tp" if is_expert else "tp"
        if getattr(pg_collection, attribute) is None:
            raise ValueError(
                f"{layer}(is_expert={is_expert}) needs pg_collection.{attribute}, which the given "
                f"ProcessGroupCollection lacks; add it or pass tp_group= instead."
            )
        tp_group = getattr(pg_collection, attribute)
    return get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)


def _check_gradient_accumulation_fusion(config: ModelParallelConfig, layer: str) -> None:
    if config.gradient_accumulation_fusion:
        raise ValueError(
            f"{layer}: gradient_accumulation_fusion=True needs APEX's fused weight-gradient "
            "kernels, which the local linear layers do not use; set "
            "gradient_accumulation_fusion=False or use the Transformer Engine linear layers."
        )


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
    ):
        """Runs the (gathered) input through the linear."""
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
        output = torch.matmul(total_input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        """Input gradient (reduced across the group), weight and bias gradients."""
        input, weight = ctx.saved_tensors
        fusion, allreduce_dgrad, sequence_parallel, buffer, limit, tp_group = ctx.options
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
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


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
        output_dtype: Cast the output to this dtype.

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
    )
    return output.to(output_dtype) if output_dtype is not None else output


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
        output = torch.matmul(input, weight.t())
        if bias is not None:
            output = output + bias
        return output if output_dtype is None else output.to(output_dtype)

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


# ----------------------------------------------------------------------------------- layers


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A + b`` with ``A`` split along its output features (columns of ``A``).

    Args:
        input_size: First dimension of ``A`` (input features).
        output_size: Second dimension of ``A`` (output features, across all ranks).
        config: Parallelism, precision and initialization settings.
        init_method: Initializes the weight in place.
        bias: Add a bias (split like the output; zero-initialized).
        gather_output: All-gather the output so every rank returns all ``output_size`` features.
        stride: Number of blocks along the output features that are split separately (2 for a
            gated MLP's ``[gate; linear]`` fc1).
        keep_master_weight_for_test: Keep the full CPU-initialized weight as ``master_weight``.
        skip_bias_add: Return the bias instead of adding it, so the caller can fuse the add.
        skip_weight_param_allocation: Allocate no weight; ``forward`` must receive one.
        embedding_activation_buffer: Accepted for compatibility (deferred embedding wgrad is not
            supported by the local layers).
        grad_output_buffer: Accepted for compatibility (see ``embedding_activation_buffer``).
        is_expert: The layer is an MoE expert: split over the expert-tensor-parallel group.
        tp_comm_buffer_name: Name of the Transformer Engine userbuffer (unused here).
        disable_grad_reduce: Skip the all-reduce of the input gradient (the caller reduces it).
        tp_group: Tensor-parallel group to split over.
        name: Name of the layer, for logs.
        output_dtype: Cast the output to this dtype.
        pg_collection: Process groups; ``tp`` (``expt_tp`` for experts) is used when
            ``tp_group`` is not given.

    Returns from ``forward``:
        ``(output, bias)``: ``bias`` is None unless ``skip_bias_add``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable[[torch.Tensor], torch.Tensor],
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: Optional[list[torch.Tensor]] = None,
        grad_output_buffer: Optional[list[torch.Tensor]] = None,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        disable_grad_reduce: bool = False,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        name: Optional[str] = None,
        output_dtype: Optional[torch.dtype] = None,
        pg_collection=None,
    ):
        super().__init__()
        _check_gradient_accumulation_fusion(config, "ColumnParallelLinear")
        self.config = config
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.disable_grad_reduce = disable_grad_reduce
        self.tp_comm_buffer_name = tp_comm_buffer_name
        self.name = name
        self.output_dtype = output_dtype
        self.embedding_activation_buffer = embedding_activation_buffer
        self.grad_output_buffer = grad_output_buffer

        self.tp_group = _resolve_tp_group(
            tp_group, pg_collection, is_expert, "ColumnParallelLinear"
        )
        self.tp_size = get_pg_size(self.tp_group)
        self.tp_rank = get_pg_rank(self.tp_group)
        self.output_size_per_partition = _partition_size(
            "ColumnParallelLinear", "output_size", output_size, self.tp_size, stride
        )
        self.explicit_expert_comm = is_expert and (self.tp_size > 1 or self.expert_parallel)

        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and self.tp_size <= 1:
            warnings.warn(
                "sequence_parallel is set but the tensor-parallel size of ColumnParallelLinear "
                "is 1; disabling sequence parallelism for this layer."
            )
            self.sequence_parallel = False

        allreduce = not (is_expert and self.expert_parallel)
        cpu_init = _use_cpu_initialization(config)
        device = torch.device("cpu") if cpu_init else torch.cuda.current_device()

        self.master_weight = None
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = Parameter(
                torch.empty(
                    self.output_size_per_partition,
                    input_size,
                    device=device,
                    dtype=config.params_dtype,
                )
            )
            if config.perform_initialization and cpu_init:
                self.master_weight = _initialize_affine_weight_cpu(
                    self.weight,
                    output_size,
                    input_size,
                    self.output_size_per_partition,
                    partition_dim=0,
                    init_method=init_method,
                    stride=stride,
                    return_master_weight=keep_master_weight_for_test,
                    params_dtype=config.params_dtype,
                    rank=self.tp_rank,
                    world_size=self.tp_size,
                )
            elif config.perform_initialization:
                _initialize_affine_weight_gpu(
                    self.weight, init_method, partition_dim=0, stride=stride, is_expert=is_expert
                )
            else:
                set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
            self.weight.allreduce = allreduce

        if bias:
            self.bias = Parameter(
                torch.empty(
                    self.output_size_per_partition, device=device, dtype=config.params_dtype
                )
            )
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            if config.perform_initialization:
                with torch.no_grad():
                    self.bias.zero_()
            self.bias.allreduce = allreduce
        else:
            self.register_parameter("bias", None)

    def forward(
        self,
        input_: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
        runtime_gather_output: Optional[bool] = None,
    ):
        """Applies the layer.

        Args:
            input_: ``[sequence, batch, input_size]`` (the sequence split across ranks under
                sequence parallelism).
            weight: Weight to use instead of ``self.weight`` (required with
                ``skip_weight_param_allocation``).
            runtime_gather_output: Overrides ``gather_output`` for this call.

        Returns:
            ``(output, bias)``: the output holds this rank's ``output_size / tp`` features, or
            all of them when gathering; ``bias`` is the bias when ``skip_bias_add``, else None.
        """
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True; pass "
                    "weight= to forward."
                )
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(
                f"weight of shape {tuple(weight.shape)} passed to ColumnParallelLinear, "
                f"expected {(self.output_size_per_partition, self.input_size)}"
            )

        if self.explicit_expert_comm:
            input_parallel = input_
        elif self.sequence_parallel:
            input_parallel = gather_from_sequence_parallel_region(input_, group=self.tp_group)
        elif self.disable_grad_reduce:
            input_parallel = input_
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)

        bias = None if self.skip_bias_add else self.bias
        output = F.linear(input_parallel, weight, bias)

        gather_output = (
            self.gather_output if runtime_gather_output is None else runtime_gather_output
        )
        if gather_output and not self.explicit_expert_comm:
            output = gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        if self.output_dtype is not None:
            output = output.to(self.output_dtype)
        return output, (self.bias if self.skip_bias_add else None)

    def backward_dw(self) -> None:
        """Computes deferred weight gradients; a no-op, as these layers never defer them."""

    def extra_repr(self) -> str:
        return (
            f"in_features={self.input_size}, out_features={self.output_size}, "
            f"bias={self.bias is not None}, TP={self.tp_size}"
        )


class RowParallelLinear(torch.nn.Module):
    """``Y = X A + b`` with ``A`` split along its input features (rows of ``A``).

    Args:
        input_size: First dimension of ``A`` (input features, across all ranks).
        output_size: Second dimension of ``A`` (output features).
        config: Parallelism, precision and initialization settings.
        init_method: Initializes the weight in place.
        bias: Add a bias (replicated on every rank; zero-initialized).
        input_is_parallel: The input is already split by features (e.g. a column-parallel
            output); otherwise this layer splits it.
        skip_bias_add: Return the bias instead of adding it, so the caller can fuse the add.
        stride: Number of blocks along the input features that are split separately.
        keep_master_weight_for_test: Keep the full CPU-initialized weight as ``master_weight``.
        is_expert: The layer is an MoE expert: split over the expert-tensor-parallel group.
        tp_comm_buffer_name: Name of the Transformer Engine userbuffer (unused here).
        tp_group: Tensor-parallel group to split over.
        name: Name of the layer, for logs.
        pg_collection: Process groups; ``tp`` (``expt_tp`` for experts) is used when
            ``tp_group`` is not given.

    Returns from ``forward``:
        ``(output, bias)``: ``bias`` is None unless ``skip_bias_add``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable[[torch.Tensor], torch.Tensor],
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        name: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__()
        _check_gradient_accumulation_fusion(config, "RowParallelLinear")
        self.config = config
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.tp_comm_buffer_name = tp_comm_buffer_name
        self.name = name

        self.tp_group = _resolve_tp_group(tp_group, pg_collection, is_expert, "RowParallelLinear")
        self.tp_size = get_pg_size(self.tp_group)
        self.tp_rank = get_pg_rank(self.tp_group)
        self.input_size_per_partition = _partition_size(
            "RowParallelLinear", "input_size", input_size, self.tp_size, stride
        )
        self.explicit_expert_comm = is_expert and (self.tp_size > 1 or self.expert_parallel)

        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and self.tp_size <= 1:
            warnings.warn(
                "sequence_parallel is set but the tensor-parallel size of RowParallelLinear is 1; "
                "disabling sequence parallelism for this layer."
            )
            self.sequence_parallel = False
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear with sequence_parallel=True needs input_is_parallel=True: "
                "under sequence parallelism its input comes split from a ColumnParallelLinear."
            )
        if self.explicit_expert_comm and bias and not skip_bias_add:
            raise ValueError(
                "RowParallelLinear(is_expert=True) under tensor or expert parallelism returns "
                "partial sums that the token dispatcher reduces, so the bias must be added after "
                "that reduction: set skip_bias_add=True."
            )

        allreduce = not (is_expert and self.expert_parallel)
        cpu_init = _use_cpu_initialization(config)
        device = torch.device("cpu") if cpu_init else torch.cuda.current_device()

        self.master_weight = None
        self.weight = Parameter(
            torch.empty(
                output_size, self.input_size_per_partition, device=device, dtype=config.params_dtype
            )
        )
        if config.perform_initialization and cpu_init:
            self.master_weight = _initialize_affine_weight_cpu(
                self.weight,
                output_size,
                input_size,
                self.input_size_per_partition,
                partition_dim=1,
                init_method=init_method,
                stride=stride,
                return_master_weight=keep_master_weight_for_test,
                params_dtype=config.params_dtype,
                rank=self.tp_rank,
                world_size=self.tp_size,
            )
        elif config.perform_initialization:
            _initialize_affine_weight_gpu(
                self.weight, init_method, partition_dim=1, stride=stride, is_expert=is_expert
            )
        else:
            set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        self.weight.allreduce = allreduce

        if bias:
            self.bias = Parameter(
                torch.empty(output_size, device=device, dtype=config.params_dtype)
            )
            if config.perform_initialization:
                with torch.no_grad():
                    self.bias.zero_()
            self.bias.allreduce = allreduce
            # Under sequence parallelism each rank adds the bias to its own piece of the
            # sequence, so its gradient must be summed across the tensor-parallel group.
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        """Applies the layer.

        Args:
            input_: ``[sequence, batch, input_size / tp]`` when ``input_is_parallel``, else
                ``[sequence, batch, input_size]``.

        Returns:
            ``(output, bias)``: the output holds all ``output_size`` features (the sequence split
            across ranks under sequence parallelism); ``bias`` is the bias when
            ``skip_bias_add``, else None.
        """
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)

        # The bias is added after the reduction: adding it to every partial sum would count
        # it tp times.
        output_parallel = F.linear(input_parallel, self.weight)
        if self.explicit_expert_comm:
            output = output_parallel
        elif self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(
                output_parallel, group=self.tp_group
            )
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)

        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None:
            output = output + self.bias
        return output, None

    def backward_dw(self) -> None:
        """Computes deferred weight gradients; a no-op, as these layers never defer them."""

    def extra_repr(self) -> str:
        return (
            f"in_features={self.input_size}, out_features={self.output_size}, "
            f"bias={self.bias is not None}, TP={self.tp_size}"
        )


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose vocabulary rows are split across the tensor-parallel group.

    Rank r holds rows ``[r * V/tp, (r + 1) * V/tp)``. A token outside the rank's range looks up
    zeros there, so summing the ranks' lookups (all-reduce) gives every token its one row; with
    ``reduce_scatter_embeddings`` the sum is reduce-scattered along the sequence instead (the
    input of a sequence-parallel model), after moving the sequence to dim 0.

    Args:
        num_embeddings: Vocabulary size, divisible by the tensor-parallel size.
        embedding_dim: Hidden size.
        init_method: Fills the weight (the full weight, sliced, on CPU initialization).
        reduce_scatter_embeddings: Reduce-scatter the ``[batch, seq]`` lookup as ``[seq, batch]``.
        config: ``params_dtype``, ``use_cpu_initialization``, ``perform_initialization`` and
            ``deterministic_mode`` (index instead of ``F.embedding``, whose backward adds
            atomically).
        tp_group: The tensor-parallel group; the global one when None.
        pg_collection: Its ``tp`` group is used when ``tp_group`` is None.

    Raises:
        ValueError: ``num_embeddings`` is not divisible by the tensor-parallel size.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: Callable,
        reduce_scatter_embeddings: bool = False,
        config: ModelParallelConfig,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        pg_collection=None,
    ):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.config = config
        self.deterministic_mode = bool(getattr(config, "deterministic_mode", False))
        self.tp_group = _resolve_tp_group(tp_group, pg_collection, False, "VocabParallelEmbedding")
        rank, size = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)
        if num_embeddings % size:
            raise ValueError(
                f"VocabParallelEmbedding: num_embeddings={num_embeddings} is not divisible by "
                f"the tensor-parallel size {size}; pad the vocabulary to a multiple of it."
            )
        self.vocab_start_index, self.vocab_end_index = (
            VocabUtility.vocab_range_from_global_vocab_size(num_embeddings, rank, size)
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        cpu_init = _use_cpu_initialization(config)
        device = torch.device("cpu") if cpu_init else torch.cuda.current_device()
        self.weight = Parameter(
            torch.empty(
                self.num_embeddings_per_partition,
                embedding_dim,
                device=device,
                dtype=config.params_dtype,
            )
        )
        if config.perform_initialization and cpu_init:
            _initialize_affine_weight_cpu(
                self.weight,
                num_embeddings,
                embedding_dim,
                self.num_embeddings_per_partition,
                partition_dim=0,
                init_method=init_method,
                params_dtype=config.params_dtype,
                rank=rank,
                world_size=size,
            )
        elif config.perform_initialization:
            _initialize_affine_weight_gpu(self.weight, init_method, partition_dim=0)
        else:
            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Embeds token ids ``[batch, seq]``: ``[batch, seq, hidden]``, or ``[seq / tp, batch,
        hidden]`` with ``reduce_scatter_embeddings``."""
        parallel = get_pg_size(self.tp_group) > 1
        if parallel:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        else:
            local_ids = input_
        if self.deterministic_mode:
            output = self.weight[local_ids]
        else:
            output = F.embedding(local_ids, self.weight)
        if parallel:
            output = output.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output = output.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output, group=self.tp_group)
        if parallel:
            return reduce_from_tensor_model_parallel_region(output, group=self.tp_group)
        return output

    def extra_repr(self) -> str:
        """``num_embeddings``, this rank's share, and ``embedding_dim``."""
        return (
            f"num_embeddings={self.num_embeddings}, per_partition="
            f"{self.num_embeddings_per_partition}, embedding_dim={self.embedding_dim}"
        )
