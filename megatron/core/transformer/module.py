"""Base class of every megatron.core module."""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core import utils as _utils
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank, get_pg_size


class MegatronModule(torch.nn.Module):
    """A ``torch.nn.Module`` that keeps the config it was built from.

    Subclasses read their settings from ``self.config`` instead of copying fields, so a module and
    its config never disagree.

    Args:
        config: The configuration the module was built from, usually a ``TransformerConfig``.
    """

    def __init__(self, config: ModelParallelConfig):
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """Returns the state dict to save in a checkpoint (the plain ``state_dict`` here).

        Args:
            prefix: Prefix prepended to every key.
            keep_vars: Keep tensors attached to autograd instead of detaching them.
        """
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def refresh_cache(self) -> None:
        """Recomputes state derived from parameters after they were changed in place (a weight
        refit that bypasses loading and train/eval). Nothing is cached here; modules that cache
        override it."""

    def set_is_first_microbatch(self) -> None:
        """Sets ``is_first_microbatch = True`` on every submodule that has the flag (TE modules),
        so that they refresh their quantized weight caches in the next forward.

        Only under quantized execution: ``config.fp8`` or ``config.fp4`` set, ``use_kitchen``, or
        a ``quant_recipe``. Without one TE keeps no such cache and the flag is left alone (it
        would only change TE's gradient accumulation). The flagged submodules are found once,
        on the first call, and remembered in ``modules_with_is_first_microbatch``.
        """
        config = self.config
        quantized = (
            getattr(config, "fp8", None) is not None
            or getattr(config, "fp4", None) is not None
            or bool(getattr(config, "use_kitchen", False))
            or getattr(config, "quant_recipe", None) is not None
        )
        if not quantized:
            return
        if not hasattr(self, "modules_with_is_first_microbatch"):
            self.modules_with_is_first_microbatch = [
                module for module in self.modules() if hasattr(module, "is_first_microbatch")
            ]
        for module in self.modules_with_is_first_microbatch:
            module.is_first_microbatch = True

    def set_symmetric_ar(self, set_to: Optional[str] = None) -> None:
        """Sets ``_symmetric_ar_cache = set_to`` on every submodule that has a
        ``symmetric_ar_type`` (the all-reduce algorithm its next all-reduce uses).

        The submodules are found once, on the first call, and remembered in this module's
        ``_symmetric_ar_cache`` list.

        Args:
            set_to: ``"two_shot"``, ``"one_shot"``, ``"multimem_all_reduce"`` or None (off).

        Raises:
            AssertionError: ``set_to`` is none of those (upstream's error type).
        """
        assert set_to in SYMMETRIC_AR_TYPES, (
            f"set_symmetric_ar: {set_to!r} is not one of {SYMMETRIC_AR_TYPES}"
        )
        if not hasattr(self, "_symmetric_ar_cache"):
            self._symmetric_ar_cache = [
                module for module in self.modules() if hasattr(module, "symmetric_ar_type")
            ]
        for module in self._symmetric_ar_cache:
            module._symmetric_ar_cache = set_to


# The all-reduce algorithms a module's symmetric_ar_type may name (None: off).
SYMMETRIC_AR_TYPES = ("two_shot", "one_shot", "multimem_all_reduce", None)


class GraphableMegatronModule(MegatronModule):
    """A module whose forward can be captured into CUDA graphs and replayed (upstream's base of
    ``TransformerLayer`` and ``MambaLayer``).

    With ``config.cuda_graph_impl == "transformer_engine"`` it keeps the graphs a training script
    makes with TE's ``make_graphed_callables`` in ``cuda_graphs`` (one per microbatch) and, in
    training, replays the one of ``current_microbatch`` instead of running ``forward``; the
    forward pre-hooks a graph cannot hold run from ``cuda_graph_manual_hooks`` first. With
    ``"local"`` a subclass's ``create_mcore_cudagraph_manager(config)`` makes the manager that
    ``__call__`` hands every call to. This fork ships no local graph manager of its own (the
    field is one of the feature fields that warn when set): without that method the module runs
    eagerly.

    Args:
        config: The layer's ``TransformerConfig``.
        vp_stage: Virtual pipeline stage of the layer (accepted as upstream does).

    Raises:
        AssertionError: ``config`` is not a ``TransformerConfig`` (upstream's check).
    """

    def __init__(self, config: TransformerConfig, vp_stage: Optional[int] = None):
        super().__init__(config)
        assert isinstance(config, TransformerConfig), "config must be a TransformerConfig"
        if config.cuda_graph_impl == "local":
            if hasattr(self, "create_mcore_cudagraph_manager"):
                self.create_mcore_cudagraph_manager(config)
        elif config.cuda_graph_impl == "transformer_engine":
            # One graph per microbatch: pipelining runs several microbatches' forward graphs
            # before their backward graphs. The training script fills the list before step one.
            self.cuda_graphs = []
            # (hook, args) pairs of the forward pre-hooks a graph replay skips; they are called
            # before each replay so that parameter all-gathers still overlap with compute.
            self.cuda_graph_manual_hooks = []
            self.cuda_graph_backward_dw_wrapper = None

    def init_backward_dw_wrapper(self):
        """Upstream builds a ``_BackwardDWWrapper`` of a ``TransformerLayer`` here (delayed
        weight-gradient scheduling); the fork has neither.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.init_backward_dw_wrapper: the delayed weight-gradient wrapper "
            "belongs to upstream's TransformerLayer, which this fork does not ship; use "
            "megatron-core with mcore_activations.patch_megatron_core() for it."
        )

    def set_te_cuda_graph_backward_dw_wrapper(self):
        """Makes ``backward_dw_wrapper`` run the weight-gradient graph of ``current_microbatch``."""
        assert self.backward_dw_wrapper is not None, (
            "`backward_dw_wrapper` must be set when cuda graphs are enabled for ep overlap."
        )
        self.backward_dw_wrapper.set_graphed_backward_dw_callable(
            partial(self._te_cuda_graph_backward_dw_graph, self.current_microbatch)
        )

    def _te_cuda_graph_backward_dw_graph(self, microbatch_idx):
        """Runs the weight-gradient graph of ``microbatch_idx``, if that graph has one."""
        graph = self.cuda_graphs[microbatch_idx % len(self.cuda_graphs)]
        if hasattr(graph, "backward_dw"):
            graph.backward_dw()

    def get_layer_static_inputs(self, seq_length, micro_batch_size):
        """The static inputs to capture the layer with: ``{"hidden_states": ...}``, a bf16 tensor
        of ones on the current CUDA device, of shape ``[s, micro_batch_size, hidden_size]`` with
        ``s`` the sequence length split over context parallelism (and over tensor parallelism
        with sequence parallelism). Subclasses with more inputs override it.
        """
        config = self.config
        slen = seq_length // config.context_parallel_size
        if config.sequence_parallel:
            slen //= config.tensor_model_parallel_size
        return {
            "hidden_states": torch.ones(
                (slen, micro_batch_size, config.hidden_size),
                dtype=torch.bfloat16,
                requires_grad=True,
                device=torch.cuda.current_device(),
            )
        }

    def setup_manual_hooks(self, make_hook_func):
        """Registers ``(make_hook_func(), (module,))`` in ``cuda_graph_manual_hooks`` for every
        submodule under the graphs that holds parameters directly: a graph replay does not run
        their forward pre-hooks, so the replay calls them."""
        param_modules = {}
        for submodule in self._get_submodules_under_cudagraphs():
            for module in submodule.modules():
                if next(module.parameters(recurse=False), None) is not None:
                    param_modules[id(module)] = module
        self.cuda_graph_manual_hooks = [
            (make_hook_func(), (module,)) for module in param_modules.values()
        ]

    def _get_submodules_under_cudagraphs(self):
        """The submodules the graphs cover: the whole module unless a subclass says otherwise."""
        return [self]

    def _te_cuda_graph_capture(self, *args, **kwargs):
        """What TE captures: the forward of the whole module."""
        return self.forward(*args, **kwargs)

    def _te_cuda_graph_replay(self, *args, **kwargs):
        """Replays the graph of ``current_microbatch`` after the manual hooks.

        Raises:
            AssertionError: an argument is not a tensor (a graph takes tensors only; keyword
                arguments may also be None), with upstream's message.
        """
        for arg in args:
            assert isinstance(arg, torch.Tensor), "CUDA graph accepts only Tensor inputs."
        for value in kwargs.values():
            assert value is None or isinstance(value, torch.Tensor), (
                "CUDA graph accepts only Tensor inputs."
            )
        graph = self.cuda_graphs[getattr(self, "current_microbatch", 0) % len(self.cuda_graphs)]
        graph_args, graph_kwargs = self._get_te_cuda_graph_replay_args(*args, **kwargs)
        for hook, hook_args in self.cuda_graph_manual_hooks:
            hook(*hook_args)
        return graph(*graph_args, **graph_kwargs)

    def _get_te_cuda_graph_replay_args(self, *args, **kwargs):
        """The graph's ``(args, kwargs)``: ``hidden_states`` first (given by position or by
        name, not both) and ``is_first_microbatch`` set from ``current_microbatch``.

        Upstream also passes its fine-grained activation-offloading streams here; the fork has no
        offloading manager (``fine_grained_activation_offloading`` is a feature field that warns
        when set), so none are passed.
        """
        if not args:
            assert "hidden_states" in kwargs, "hidden_states is required."
            graph_args = (kwargs.pop("hidden_states"),)
        else:
            assert "hidden_states" not in kwargs, (
                "hidden_states should only be passed as either a positional or keyword argument."
            )
            graph_args = tuple(args)
        graph_kwargs = dict(kwargs)
        graph_kwargs["is_first_microbatch"] = getattr(self, "current_microbatch", 0) == 0
        return graph_args, graph_kwargs

    def _should_call_local_cudagraph(self, *args, **kwargs):
        """Whether calls go to the local graph manager (one was made)."""
        return hasattr(self, "cudagraph_manager")

    def _should_call_te_cudagraph(self, *args, **kwargs):
        """Whether a training call goes through TE's graphs: when they exist (replay) or while
        one is being captured."""
        return (
            self.config.cuda_graph_impl == "transformer_engine"
            and self.training
            and (_is_graph_capturing() or bool(self.cuda_graphs))
        )

    def __call__(self, *args, **kwargs):
        if self._should_call_local_cudagraph(*args, **kwargs):
            return self.cudagraph_manager(self, args, kwargs)
        if self._should_call_te_cudagraph(*args, **kwargs):
            if not self.cuda_graphs:
                return self._te_cuda_graph_capture(*args, **kwargs)
            return self._te_cuda_graph_replay(*args, **kwargs)
        return super().__call__(*args, **kwargs)


def _is_graph_capturing() -> bool:
    # Upstream asks a flag its own capture helper sets; the fork has no such helper, so it asks
    # CUDA whether the current stream is capturing.
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ----------------------------------------------------------------------------- mixed precision
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for a parameter marked ``shared = True`` (e.g. tied embeddings), else True."""
    return not getattr(param, "shared", False)


def conversion_helper(val, conversion):
    """Applies ``conversion`` to ``val``, or to each leaf of nested tuples / lists (kept as is)."""
    if isinstance(val, tuple | list):
        converted = [conversion_helper(v, conversion) for v in val]
        return tuple(converted) if isinstance(val, tuple) else converted
    return conversion(val)


def fp32_to_float16(val, float16_convertor):
    """Converts every float32 tensor in ``val`` (nested tuples / lists) with ``float16_convertor``;
    other values pass through."""

    def convert(v):
        return float16_convertor(v) if _dtype_of(v) == torch.float32 else v

    return conversion_helper(val, convert)


def float16_to_fp32(val):
    """Converts every float16 / bfloat16 tensor in ``val`` to float32; other values pass through."""

    def convert(v):
        return v.float() if _dtype_of(v) in _HALF_DTYPES else v

    return conversion_helper(val, convert)


def _dtype_of(value):
    return value.dtype if isinstance(value, torch.Tensor) else None


def mark_keep_in_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """Marks a parameter or buffer so that :class:`Float16Module` leaves it in float32."""
    tensor.keep_in_fp32 = True
    return tensor


def convert_module_to_dtype_except_fp32_marked(module: torch.nn.Module, dtype: torch.dtype):
    """Casts ``module``'s floating-point parameters and buffers to ``dtype`` in place, except
    those marked with :func:`mark_keep_in_fp32`; returns ``module``."""

    def cast(tensor):
        if tensor.is_floating_point() and not getattr(tensor, "keep_in_fp32", False):
            return tensor.to(dtype)
        return tensor

    return module._apply(cast)


class Float16Module(MegatronModule):
    """Runs ``module`` in fp16 or bf16 (``config.fp16`` / ``config.bf16``).

    The first pipeline stage converts float32 inputs to the module's precision; the last stage
    returns float32 outputs unless ``fp32_output=False``. Parameters marked with
    :func:`mark_keep_in_fp32` stay in float32. State dicts are the wrapped module's.

    Args:
        config: Holds ``fp16`` / ``bf16`` and the virtual-pipeline size.
        module: The module to wrap (converted in place).

    Raises:
        ValueError: Neither ``config.fp16`` nor ``config.bf16`` is set.
    """

    def __init__(self, config: ModelParallelConfig, module: torch.nn.Module):
        super().__init__(config)
        self.fp16, self.bf16 = config.fp16, config.bf16
        if not (self.fp16 or self.bf16):
            raise ValueError(
                "Float16Module needs config.fp16 or config.bf16 set; without either, use the "
                "module unwrapped."
            )
        dtype = torch.float16 if self.fp16 else torch.bfloat16
        self.add_module("module", convert_module_to_dtype_except_fp32_marked(module, dtype))
        self.float16_convertor = lambda t: t.to(dtype)
        self.vp_size = config.virtual_pipeline_model_parallel_size
        self.vp_stage = getattr(module, "vp_stage", None)
        self.pg_collection = getattr(module, "pg_collection", None)

    def _pipeline_position(self) -> tuple[bool, bool]:
        """Whether this is the (first, last) stage of the model, virtual stages included."""
        pp = self.pg_collection.pp if self.pg_collection is not None else None
        if pp is None:
            pp = parallel_state.get_pipeline_model_parallel_group(check_initialized=False)
        rank, size = get_pg_rank(pp), get_pg_size(pp)
        first, last = rank == 0, rank == size - 1
        if self.vp_size is not None and self.vp_stage is not None:
            first = first and self.vp_stage == 0
            last = last and self.vp_stage == self.vp_size - 1
        return first, last

    def set_input_tensor(self, input_tensor):
        """Forwards to the wrapped module (pipeline parallelism sets stage inputs this way)."""
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs, fp32_output: bool = True, **kwargs):
        """Runs the wrapped module; see the class docstring for the conversions."""
        first, last = self._pipeline_position()
        if first:
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if last and fp32_output:
            outputs = float16_to_fp32(outputs)
        return outputs

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        """The wrapped module's state dict (no ``module.`` prefix)."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        """The wrapped module's checkpoint state dict."""
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix="", *args, **kwargs):
        """The wrapped module's sharded state dict."""
        return self.module.sharded_state_dict(prefix, *args, **kwargs)

    def load_state_dict(self, state_dict, strict=True):
        """Loads into the wrapped module."""
        return self.module.load_state_dict(state_dict, strict=strict)


# unwrap_model strips this wrapper by default.
_utils._MODEL_WRAPPER_CLASSES.append(Float16Module)
