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

# Defined in their own modules, exported here under upstream's paths.
from megatron.core.tensor_parallel.embedding import VocabParallelEmbedding  # noqa: E402, F401
from megatron.core.tensor_parallel.linear_function import (  # noqa: E402, F401
    LinearWithFrozenWeight,
    LinearWithGradAccumulationAndAsyncCommunication,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.parameter_setup import (  # noqa: E402, F401
    _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS,
    _check_gradient_accumulation_fusion,
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    _partition_size,
    _resolve_tp_group,
    _use_cpu_initialization,
    copy_gtp_attributes,
    copy_tensor_model_parallel_attributes,
    param_is_not_gtp_duplicate,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.utils import (
    get_pg_rank,
    get_pg_size,
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
