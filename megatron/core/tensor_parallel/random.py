"""Named random-number streams for model-parallel training.

Tensor-parallel ranks need two kinds of randomness: the same numbers on every rank (dropout on
replicated activations) and different numbers per rank (initializing or dropping out a weight or
activation shard). ``CudaRNGStatesTracker`` keeps one generator state per named stream; inside
``fork(name)`` the device generator runs that stream, and afterwards it resumes exactly where the
outer stream was, as if the fork never happened.

``model_parallel_cuda_manual_seed(seed)`` seeds the default generator with ``seed`` and registers:

- ``"data-parallel-rng"``: ``seed``, identical on every rank;
- ``"model-parallel-rng"``: ``seed + 2718 + tp_rank``, one stream per tensor-parallel rank;
- ``"expert-parallel-rng"``: ``seed + 1024 + 100 * ep_rank + etp_rank``, one stream per expert
  shard.

Device: with CUDA the tracker manages the current CUDA device's generator (as upstream). On a
machine without CUDA it manages the CPU default generator instead (``torch.get_rng_state`` /
``torch.set_rng_state``), and ``model_parallel_cuda_manual_seed`` seeds the CPU generator. Code
written for GPUs (``with get_cuda_rng_tracker().fork(): dropout(...)``) therefore runs, with the
same stream semantics, on CPU-only machines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch

from mcore_activations import te_import
from megatron.core import parallel_state
from megatron.core.extensions.te_rng import TECudaRNGStatesTracker

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"


# ------------------------------------------------------------------ device generator access


def _use_cuda() -> bool:
    return torch.cuda.is_available()


def _get_rng_state() -> torch.Tensor:
    """Returns the state of the device generator (current CUDA device, else the CPU)."""
    if _use_cuda():
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    """Restores the device generator (current CUDA device, else the CPU) to ``state``."""
    if _use_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    """Seeds the device generator only (``torch.manual_seed`` would seed every device)."""
    if _use_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)


# ----------------------------------------------------------------------------- the tracker


class CudaRNGStatesTracker:
    """Keeps named generator states and runs code under one of them.

    States are stored as generator-state tensors, so a tracker can be saved (``get_states``) and
    restored (``set_states``) with a checkpoint.

    Args:
        use_cudagraphable_rng: Graph-safe generators for CUDA graph capture. Not supported.
        is_inference_rng_tracker: Inference-specific tracker. Not supported.
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
        if use_cudagraphable_rng or is_inference_rng_tracker:
            raise ValueError(
                "use_cudagraphable_rng / inference_rng_tracker are not supported by this fork; "
                "leave them False."
            )
        self.reset()

    def is_initialized(self) -> bool:
        """Whether a state was added or set since the last reset."""
        return self._is_initialized

    def reset(self) -> None:
        """Forgets every stream and seed."""
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """Returns a copy of the name -> state mapping (the tensors are shared, not cloned)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replaces every stream with ``states`` (e.g. from ``get_states`` or a checkpoint)."""
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Registers the stream ``name`` starting from ``seed``.

        The device generator is left as it was.

        Raises:
            Exception: ``seed`` or ``name`` is already registered (two streams with one seed
                would silently produce identical "independent" numbers).
        """
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        outer_state = _get_rng_state()
        try:
            _manual_seed(seed)
            self.states_[name] = _get_rng_state()
        finally:
            _set_rng_state(outer_state)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Runs the body on stream ``name``, then restores the outer stream.

        The stream's state advances by what the body consumed, so the next fork continues it.

        Raises:
            Exception: ``name`` was never added (call ``model_parallel_cuda_manual_seed``).
        """
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        outer_state = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(outer_state)


_CUDA_RNG_STATE_TRACKER: Optional[CudaRNGStatesTracker] = None


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
) -> None:
    """Creates the global tracker, unless one exists and ``force_reset`` is False.

    Args:
        use_te_rng_tracker: Use Transformer Engine's tracker (needed by TE's CUDA-graph support).
        inference_rng_tracker: Not supported; must be False.
        use_cudagraphable_rng: Not supported; must be False.
        force_reset: Replace an existing tracker.
    """
    global _CUDA_RNG_STATE_TRACKER
    if _CUDA_RNG_STATE_TRACKER is not None and not force_reset:
        return
    if use_te_rng_tracker:
        if not te_import.have_te():
            raise ValueError(
                "use_te_rng_tracker=True needs Transformer Engine (>= 1.5) and "
                "megatron.core.extensions.transformer_engine.TECudaRNGStatesTracker; install "
                "Transformer Engine or leave te_rng_tracker=False."
            )
        tracker = TECudaRNGStatesTracker(
            is_inference_rng_tracker=inference_rng_tracker,
            use_cudagraphable_rng=use_cudagraphable_rng,
        )
    else:
        tracker = CudaRNGStatesTracker(
            use_cudagraphable_rng=use_cudagraphable_rng,
            is_inference_rng_tracker=inference_rng_tracker,
        )
    _CUDA_RNG_STATE_TRACKER = tracker


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
) -> CudaRNGStatesTracker:
    """Returns the global tracker, creating it on first use with the given options."""
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    return _CUDA_RNG_STATE_TRACKER


def get_data_parallel_rng_tracker_name() -> str:
    """Returns the name of the stream shared by every rank."""
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def get_expert_parallel_rng_tracker_name() -> str:
    """Returns the name of the per-expert-shard stream."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: Optional[int] = None,
    ep_rank: Optional[int] = None,
    etp_rank: Optional[int] = None,
    gtp_remat_rank: Optional[int] = None,
    egtp_remat_rank: Optional[int] = None,
    force_reset_rng: bool = False,
    gtp_remat_world_size: Optional[int] = None,
    egtp_remat_world_size: Optional[int] = None,
) -> None:
    """Seeds the device generator and (re)registers the model-parallel streams.

    Call it after ``parallel_state.initialize_model_parallel`` (or pass the ranks) and before
    building the model. The resulting streams are listed in the module docstring. On a machine
    without CUDA the CPU generator plays the device generator's role.

    Args:
        seed: Base seed, the same on every rank.
        te_rng_tracker: Use Transformer Engine's tracker class.
        inference_rng_tracker: Not supported; must be False.
        use_cudagraphable_rng: Not supported; must be False.
        tp_rank: Tensor-parallel rank (default: from ``parallel_state``).
        ep_rank: Expert-model-parallel rank (default: from ``parallel_state``).
        etp_rank: Expert-tensor-parallel rank (default: from ``parallel_state``).
        gtp_remat_rank: Unused (GTP rematerialization is not supported).
        egtp_remat_rank: Unused (GTP rematerialization is not supported).
        force_reset_rng: Replace the global tracker object, not only its streams.
        gtp_remat_world_size: GTP rematerialization size; only None or 1 is supported.
        egtp_remat_world_size: Expert GTP rematerialization size; only None or 1 is supported.
    """
    for name, value in (
        ("gtp_remat_world_size", gtp_remat_world_size),
        ("egtp_remat_world_size", egtp_remat_world_size),
    ):
        if value not in (None, 1):
            raise ValueError(
                f"{name}={value} is not supported: this fork has no GTP rematerialization "
                "streams. Leave it None."
            )
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
    if etp_rank is None:
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()

    # The offsets keep the three families of seeds apart for any realistic rank counts.
    tensor_model_parallel_seed = seed + 2718 + tp_rank
    expert_parallel_seed = seed + 1024 + 100 * ep_rank + etp_rank

    initialize_rng_tracker(
        te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=force_reset_rng
    )
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    _manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_model_parallel_seed)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_parallel_seed)


# ----------------------------------------------------------------------------- checkpointing
# Activation checkpointing recomputes a block's forward during backward. The recomputation must
# draw the same random numbers as the original forward (dropout masks), so the CPU generator,
# the device generator and every tracker stream are captured before the forward and replayed
# around the recomputation, then put back.


def convert_cuda_rng_state(state, to_graphable: bool = False):
    """Converts a device generator state between a state tensor and a ``torch.Generator``.

    Args:
        state: A state tensor (``get_rng_state()``) or a generator.
        to_graphable: Return a generator holding the state (the form CUDA graphs register);
            otherwise return the state tensor.

    Raises:
        ValueError: ``state`` is neither a tensor nor a generator.
    """
    if isinstance(state, torch.Generator):
        return state if to_graphable else state.get_state()
    if not isinstance(state, torch.Tensor):
        raise ValueError(
            f"convert_cuda_rng_state: expected a state tensor or a generator, got "
            f"{type(state).__name__}"
        )
    if not to_graphable:
        return state
    generator = torch.Generator(device="cuda" if _use_cuda() else "cpu")
    generator.set_state(state)
    return generator


def _capture_rng() -> tuple:
    return torch.get_rng_state(), _get_rng_state(), get_cuda_rng_tracker().get_states()


def _restore_rng(states: tuple) -> None:
    cpu, device, tracker = states
    torch.set_rng_state(cpu)
    _set_rng_state(device)
    get_cuda_rng_tracker().set_states(tracker)


@contextlib.contextmanager
def _replayed_rng(states: tuple) -> Iterator[None]:
    """Runs the block with the generators as they were at ``states``, then puts them back."""
    current = _capture_rng()
    _restore_rng(states)
    try:
        yield
    finally:
        _restore_rng(current)


def _detached_inputs(inputs) -> tuple:
    detached = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            leaf = value.detach()
            leaf.requires_grad_(value.requires_grad)
            detached.append(leaf)
        else:
            detached.append(value)
    return tuple(detached)


def _save_inputs(ctx, args) -> None:
    """Saves the tensor arguments for backward and keeps the others as they are."""
    ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    ctx.other_args = [None if isinstance(a, torch.Tensor) else a for a in args]
    ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))


def _saved_inputs(ctx) -> list:
    args = list(ctx.other_args)
    for position, tensor in zip(ctx.tensor_positions, ctx.saved_tensors):
        args[position] = tensor
    return args


def _backward_through(outputs, grads) -> None:
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    pairs = [
        (out, grad)
        for out, grad in zip(outputs, grads)
        if isinstance(out, torch.Tensor) and out.requires_grad
    ]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


class CheckpointFunction(torch.autograd.Function):
    """Runs ``run_function`` without keeping its activations; recomputes them in backward.

    Only the inputs are saved. With ``distribute_saved_activations`` the first input is kept as
    this rank's 1/tp share (it is identical on every tensor-parallel rank) and gathered back in
    backward.
    """

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        """Runs ``run_function(*args)`` under ``no_grad`` and saves what recomputation needs."""
        ctx.run_function = run_function
        ctx.distribute_saved_activations = distribute_saved_activations
        ctx.rng_states = _capture_rng()
        with torch.no_grad():
            outputs = run_function(*args)
        if distribute_saved_activations:
            from megatron.core.tensor_parallel.utils import split_tensor_into_1d_equal_chunks
            from megatron.core.utils import safely_set_viewless_tensor_data

            ctx.first_input_shape = args[0].shape
            safely_set_viewless_tensor_data(
                args[0], split_tensor_into_1d_equal_chunks(args[0].data, new_buffer=True)
            )
        _save_inputs(ctx, args)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        """Recomputes the forward with the saved random state and backpropagates through it."""
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "checkpointed blocks support .backward() only, not torch.autograd.grad(); use "
                ".backward() or run the block without checkpointing."
            )
        args = _saved_inputs(ctx)
        if ctx.distribute_saved_activations:
            from megatron.core.tensor_parallel.utils import gather_split_1d_tensor
            from megatron.core.utils import safely_set_viewless_tensor_data

            safely_set_viewless_tensor_data(
                args[0], gather_split_1d_tensor(args[0].data).view(ctx.first_input_shape)
            )
        inputs = _detached_inputs(args)
        with _replayed_rng(ctx.rng_states), torch.enable_grad():
            outputs = ctx.run_function(*inputs)
        _backward_through(outputs, grads)
        input_grads = tuple(i.grad if isinstance(i, torch.Tensor) else None for i in inputs)
        return (None, None) + input_grads


def checkpoint(function, distribute_saved_activations: bool, *args):
    """``function(*args)`` with activation checkpointing (see :class:`CheckpointFunction`)."""
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)


class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, owner, *args):
        with torch.no_grad():
            outputs = run_function(*args)
        _save_inputs(ctx, _detached_inputs(args))
        owner.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if ctx.recomputed is None:
            raise RuntimeError(
                "CheckpointWithoutOutput: backward reached the checkpointed block before its "
                "recomputation; call discard_output_and_register_recompute(t) with a tensor t "
                "whose gradient is computed before the block's outputs are needed."
            )
        inputs, outputs = ctx.recomputed
        _backward_through(outputs, grads)
        return (None, None) + tuple(i.grad if isinstance(i, torch.Tensor) else None for i in inputs)


class CheckpointWithoutOutput:
    """Checkpoints a block and also frees its outputs until backward needs them.

    ``checkpoint(fn, *args)`` runs ``fn`` keeping only its inputs. After the outputs' consumers
    have run, ``discard_output_and_register_recompute(t)`` frees the outputs' storage and, when
    the gradient of ``t`` is computed, recomputes the block (with the forward's random state)
    into the same tensors, so the consumers' saved references see the data again.

    Args:
        fp8: Accepted for upstream's signature; this fork runs no FP8 recompute context.
        ckpt_manager: Upstream's shared manager of several checkpoints; not supported (None).
        retain_input_tensors: Keep an output that shares storage with an input instead of
            freeing it.
    """

    def __init__(self, fp8=False, ckpt_manager=None, retain_input_tensors: bool = False):
        if ckpt_manager is not None:
            raise ValueError(
                "CheckpointWithoutOutput(ckpt_manager=...) is not supported by this fork; use one "
                "CheckpointWithoutOutput per block (ckpt_manager=None)."
            )
        self.fp8 = fp8
        self.retain_input_tensors = retain_input_tensors
        self.run_function = None
        self.rng_states = None
        self.ctx = None
        self.outputs = None

    def checkpoint(self, run_function, *args):
        """Runs ``run_function(*args)``, keeping only what recomputation needs."""
        self.run_function = run_function
        self.rng_states = _capture_rng()
        outputs = _CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.ctx.recomputed = None
        self.outputs = outputs
        return outputs

    def _outputs(self) -> tuple:
        outs = self.outputs if isinstance(self.outputs, tuple) else (self.outputs,)
        return tuple(o for o in outs if isinstance(o, torch.Tensor))

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Frees the outputs' storage; recomputes them when ``hook_tensor``'s gradient is ready."""
        input_storages = {t.untyped_storage().data_ptr() for t in self.ctx.saved_tensors}
        # (only tensors are saved; the other arguments never share an output's storage)
        self._freed = []
        for out in self._outputs():
            storage = out.untyped_storage()
            if self.retain_input_tensors and storage.data_ptr() in input_storages:
                continue
            self._freed.append((out, storage.nbytes()))
            storage.resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad) -> None:
        inputs = _detached_inputs(_saved_inputs(self.ctx))
        with _replayed_rng(self.rng_states), torch.enable_grad():
            recomputed = self.run_function(*inputs)
        recomputed_list = recomputed if isinstance(recomputed, tuple) else (recomputed,)
        fresh = [r for r in recomputed_list if isinstance(r, torch.Tensor)]
        nbytes = {id(out): size for out, size in self._freed}
        with torch.no_grad():
            for out, new in zip(self._outputs(), fresh):
                if id(out) not in nbytes:
                    continue
                out.untyped_storage().resize_(nbytes[id(out)])
                # Write through a separate tensor on the same storage: an in-place copy into
                # ``out`` would bump its version, and every consumer that saved it for backward
                # would then refuse to run.
                alias = torch.empty(0, dtype=out.dtype, device=out.device)
                alias.set_(out.untyped_storage(), out.storage_offset(), out.size(), out.stride())
                alias.copy_(new)
        self.ctx.recomputed = (inputs, recomputed)
        self.outputs = None
