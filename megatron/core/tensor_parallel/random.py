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

Graph-safe trackers (``use_cudagraphable_rng=True``, CUDA only) keep ``torch.Generator`` state
objects instead of state tensors, for CUDA-graph capture; inference trackers
(``inference_rng_tracker=True``) keep no streams at all.

The second half of the module is activation checkpointing (``checkpoint``,
``CheckpointWithoutOutput`` and ``CheckpointWithoutOutputManager``): recomputation must replay the
forward's random streams, so it lives next to them (and the module is longer than most). Its
generator-free autograd mechanics are in ``checkpoint_autograd``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Optional

import torch

from mcore_activations import te_import
from megatron.core import parallel_state
from megatron.core.extensions.te_rng import TECudaRNGStatesTracker
from megatron.core.tensor_parallel import checkpoint_fp8
from megatron.core.tensor_parallel.checkpoint_autograd import (
    CheckpointWithoutOutputFunction,
    backward_through,
    detached_inputs,
    free_storage,
    input_grads,
    load_args_from_ctx,
    refill_storage,
    save_args_to_ctx,
    saved_args,
    tensor_outputs,
)

# The device generator under the streams; the error is raised through this module's trackers and
# imported from here by their users.
from megatron.core.tensor_parallel.rng_state import (
    GraphSafeRNGUnavailableError,  # noqa: F401
    _cuda_generator,
    _get_rng_state,
    _manual_seed,
    _require_graph_safe_rng,
    _set_rng_state,
    _snapshot,
    _use_cuda,
)

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
# Upstream's GTP weight-rematerialization streams. This fork runs without GTP, so they are never
# registered; the names exist for code that asks for them.
_GTP_REMAT_RNG_TRACKER_NAME = "gtp-remat-rng"
_EXPERT_GTP_REMAT_RNG_TRACKER_NAME = "egtp-remat-rng"


def __getattr__(name: str):
    # Upstream's ``HAVE_TE``: whether Transformer Engine imports. Answered by the TE seam at each
    # read, not copied at import, so a fake TE set on the seam shows here. A test that patches
    # ``random.HAVE_TE`` binds a module global instead, which _have_te() reads first.
    if name == "HAVE_TE":
        return te_import.have_te()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _have_te() -> bool:
    """``HAVE_TE`` as patched into this module, else the seam's."""
    namespace = globals()
    return bool(namespace["HAVE_TE"]) if "HAVE_TE" in namespace else te_import.have_te()


# ----------------------------------------------------------------------------- the tracker


class CudaRNGStatesTracker:
    """Keeps named generator states and runs code under one of them.

    States are stored as generator-state tensors, so a tracker can be saved (``get_states``) and
    restored (``set_states``) with a checkpoint. With ``use_cudagraphable_rng`` they are
    ``torch.Generator`` objects instead (graph-safe states): ``fork`` switches the default CUDA
    generator onto a stream's own state object, so work captured in a CUDA graph that registered
    the stream (``CUDAGraph.register_generator_state``, see :func:`get_all_rng_states`) draws
    fresh numbers on every replay. Such states change in place as they are used; take
    ``state.clone_state()`` for a copy that stays put.

    Args:
        use_cudagraphable_rng: Keep graph-safe generator states (needs CUDA and PyTorch's
            graph-safe generator API).
        is_inference_rng_tracker: Marks a tracker made for inference (read by CUDA-graph code).
            The tracker behaves the same; ``initialize_rng_tracker(inference_rng_tracker=True)``
            is what builds one whose streams do nothing.

    Raises:
        GraphSafeRNGUnavailableError: ``use_cudagraphable_rng`` without CUDA or without the API.
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
        if use_cudagraphable_rng:
            _require_graph_safe_rng()
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker
        # Names of the forks being run, innermost last (see fork).
        self._active: list[str] = []
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
        if self.use_cudagraphable_rng:
            # A state object of the stream's own, seeded in place; the default generator's is
            # only copied, never touched.
            state = _cuda_generator().clone_state()
            state.manual_seed(seed)
            self.states_[name] = state
            return
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
        Forks nest: entering one stores how far the enclosing fork's stream has got, and leaving
        one resumes the enclosing stream from its stored state, so a stream forked again inside
        itself (A, then B, then A) continues where it was rather than replaying its numbers.

        Raises:
            Exception: ``name`` was never added (call ``model_parallel_cuda_manual_seed``).
        """
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        graph_safe = self.use_cudagraphable_rng
        outer_state = _get_rng_state(graph_safe)
        if self._active:
            self.states_[self._active[-1]] = outer_state
        _set_rng_state(self.states_[name], graph_safe)
        self._active.append(name)
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state(graph_safe)
            self._active.pop()
            # The enclosing stream may have advanced inside this fork (forked again within it).
            outer = self.states_[self._active[-1]] if self._active else outer_state
            _set_rng_state(outer, graph_safe)


_CUDA_RNG_STATE_TRACKER: Optional[CudaRNGStatesTracker] = None


@functools.cache
def _inference_tracker_class(base: type) -> type:
    """``base`` (this module's tracker or TE's) with streams that do nothing, for inference.

    Inference draws no dropout masks and must not spend time switching generator states (nor
    trip a CUDA graph over them), so registering and restoring streams are no-ops and ``fork``
    runs the body on whatever the device generator is. One class per base, as upstream builds.
    """

    def add(self, name, seed):
        """Does nothing: an inference tracker keeps no streams."""

    def set_states(self, states):
        """Does nothing: an inference tracker keeps no streams."""

    def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Runs the body on the current device generator (no stream switch)."""
        return contextlib.nullcontext()

    namespace = {"add": add, "set_states": set_states, "fork": fork, "__module__": __name__}
    namespace["__doc__"] = f"{base.__name__} whose streams do nothing (inference)."
    return type("InferenceCudaRNGStatesTracker", (base,), namespace)


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
) -> None:
    """Creates the global tracker, unless one exists and ``force_reset`` is False.

    Args:
        use_te_rng_tracker: Use Transformer Engine's tracker (graph-safe under TE's CUDA graphs).
        inference_rng_tracker: Build an inference tracker: ``add``, ``set_states`` and ``fork``
            do nothing (see ``_inference_tracker_class``).
        use_cudagraphable_rng: Keep graph-safe generator states (this module's tracker only; TE's
            is graph-safe already and ignores it, as upstream).
        force_reset: Replace an existing tracker.

    Raises:
        ValueError: ``use_te_rng_tracker`` without Transformer Engine.
        GraphSafeRNGUnavailableError: ``use_cudagraphable_rng`` without CUDA or PyTorch's
            graph-safe generator API.
    """
    global _CUDA_RNG_STATE_TRACKER
    if _CUDA_RNG_STATE_TRACKER is not None and not force_reset:
        return
    if use_te_rng_tracker:
        if not _have_te():
            raise ValueError(
                "use_te_rng_tracker=True needs Transformer Engine (>= 1.5) and "
                "megatron.core.extensions.transformer_engine.TECudaRNGStatesTracker; install "
                "Transformer Engine or leave te_rng_tracker=False."
            )
        base, kwargs = TECudaRNGStatesTracker, {"is_inference_rng_tracker": inference_rng_tracker}
    else:
        base = CudaRNGStatesTracker
        kwargs = {
            "use_cudagraphable_rng": use_cudagraphable_rng,
            "is_inference_rng_tracker": inference_rng_tracker,
        }
    if inference_rng_tracker:
        base = _inference_tracker_class(base)
    _CUDA_RNG_STATE_TRACKER = base(**kwargs)


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


def get_gtp_remat_rng_tracker_name(is_expert: bool = False) -> str:
    """Returns the name of the GTP weight-rematerialization stream (the expert one if asked).

    Upstream registers these streams only while GTP rematerialization is active, which this fork
    never runs, so forking one raises "cuda rng state ... is not added".
    """
    return _EXPERT_GTP_REMAT_RNG_TRACKER_NAME if is_expert else _GTP_REMAT_RNG_TRACKER_NAME


def get_all_rng_states() -> dict:
    """Returns the name -> state mapping the global tracker holds.

    For this module's tracker it is the tracker's own dictionary (not a copy), as upstream's CUDA
    graph code expects; for Transformer Engine's tracker, TE's registry of every state; for any
    other tracker, an empty dict.

    Raises:
        AssertionError: No tracker exists yet (call ``model_parallel_cuda_manual_seed`` or
            ``get_cuda_rng_tracker`` first), upstream's error type.
    """
    tracker = _CUDA_RNG_STATE_TRACKER
    if tracker is None:
        raise AssertionError(
            "get_all_rng_states: the RNG tracker has not been initialized; call "
            "model_parallel_cuda_manual_seed(seed) (or get_cuda_rng_tracker()) first."
        )
    if isinstance(tracker, CudaRNGStatesTracker):
        return tracker.states_
    if isinstance(tracker, TECudaRNGStatesTracker):
        # TE keeps the states of all its trackers in one module-level registry.
        return te_import.te.pytorch.distributed.get_all_rng_states()
    return {}


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker) -> bool:
    """Whether ``cuda_rng_tracker`` keeps graph-safe generator states (CUDA-graph capturable).

    True for Transformer Engine's tracker and for any tracker built with
    ``use_cudagraphable_rng=True``.
    """
    if isinstance(cuda_rng_tracker, TECudaRNGStatesTracker):
        return True
    return bool(getattr(cuda_rng_tracker, "use_cudagraphable_rng", False))


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
        inference_rng_tracker: Build an inference tracker (its streams do nothing).
        use_cudagraphable_rng: Keep graph-safe generator states (CUDA only).
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
# around the recomputation, then put back (copies of graph-safe states, which change in place).
# Transformer Engine's FP8 state is replayed too (checkpoint_fp8).


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


def _capture_rng(copy: bool = True) -> tuple:
    """Every generator state a block's forward draws from: the CPU's, the device's and each
    tracker stream's, with whether they are graph-safe.

    ``copy`` takes copies, for a recomputation: graph-safe states change in place as later
    forks draw, so a recomputation holding the live objects would draw past the forward's
    numbers (upstream keeps the live ones; docs/activations.md lists the difference). Without it
    the live objects are kept, to be put back as they are (a CUDA graph may have registered
    them).
    """
    # TE's tracker is graph-safe too; a fake one on a machine without CUDA keeps tensors.
    graph_safe = _use_cuda() and is_graph_safe_cuda_rng_tracker(get_cuda_rng_tracker())
    device = _get_rng_state(graph_safe)
    tracker = get_cuda_rng_tracker().get_states()
    if copy:
        device = _snapshot(device)
        tracker = {name: _snapshot(state) for name, state in tracker.items()}
    return graph_safe, torch.get_rng_state(), device, tracker


def _restore_rng(states: tuple, copy: bool = False) -> None:
    """Puts back what :func:`_capture_rng` took; ``copy`` restores copies of it instead, so the
    same captured states replay the same numbers however often they are restored."""
    graph_safe, cpu, device, tracker = states
    if copy:
        device = _snapshot(device)
        tracker = {name: _snapshot(state) for name, state in tracker.items()}
    torch.set_rng_state(cpu)
    _set_rng_state(device, graph_safe)
    get_cuda_rng_tracker().set_states(tracker)


@contextlib.contextmanager
def _replayed_rng(states: tuple) -> Iterator[None]:
    """Runs the block with the generators as they were at ``states``, then puts back the live
    ones."""
    current = _capture_rng(copy=False)
    _restore_rng(states, copy=True)
    try:
        yield
    finally:
        _restore_rng(current)


# True while a ``checkpoint``ed block runs, in its forward and in its recomputation (upstream's
# name). Code that must not act twice, or must act differently without a graph, reads it.
IS_CHECKPOINTING = False


def is_checkpointing() -> bool:
    """Whether a block run by :func:`checkpoint` is executing (its forward or recomputation)."""
    return IS_CHECKPOINTING


@contextlib.contextmanager
def _checkpointing() -> Iterator[None]:
    # Restores the previous value rather than clearing it, so a checkpoint nested in another
    # leaves the outer one still reported; and an exception in the block clears it too.
    global IS_CHECKPOINTING
    previous = IS_CHECKPOINTING
    IS_CHECKPOINTING = True
    try:
        yield
    finally:
        IS_CHECKPOINTING = previous


def _require_checkpoint_valid() -> None:
    if not torch.autograd._is_checkpoint_valid():
        raise RuntimeError(
            "checkpointed blocks support .backward() only, not torch.autograd.grad(); use "
            ".backward() or run the block without checkpointing."
        )


class CheckpointFunction(torch.autograd.Function):
    """Runs ``run_function`` without keeping its activations; recomputes them in backward.

    Only the inputs are saved. With ``distribute_saved_activations`` the first input is kept as
    this rank's 1/tp share (it is identical on every tensor-parallel rank) and gathered back in
    backward. :func:`is_checkpointing` is True while ``run_function`` runs, both times. The
    recomputation replays the forward's random streams and Transformer Engine's FP8 autocast
    state (``checkpoint_fp8``), so it computes the forward's math again.
    """

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        """Runs ``run_function(*args)`` under ``no_grad`` and saves what recomputation needs."""
        ctx.run_function = run_function
        ctx.distribute_saved_activations = distribute_saved_activations
        ctx.rng_states = _capture_rng()
        ctx.fp8_state = checkpoint_fp8.capture()
        with _checkpointing(), torch.no_grad(), checkpoint_fp8.forward_phase(ctx.fp8_state):
            outputs = run_function(*args)
        if distribute_saved_activations:
            from megatron.core.tensor_parallel.utils import split_tensor_into_1d_equal_chunks
            from megatron.core.utils import safely_set_viewless_tensor_data

            ctx.first_input_shape = args[0].shape
            safely_set_viewless_tensor_data(
                args[0], split_tensor_into_1d_equal_chunks(args[0].data, new_buffer=True)
            )
        save_args_to_ctx(ctx, args)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        """Recomputes the forward with the saved random state and backpropagates through it."""
        _require_checkpoint_valid()
        args = saved_args(ctx)
        if ctx.distribute_saved_activations:
            from megatron.core.tensor_parallel.utils import gather_split_1d_tensor
            from megatron.core.utils import safely_set_viewless_tensor_data

            safely_set_viewless_tensor_data(
                args[0], gather_split_1d_tensor(args[0].data).view(ctx.first_input_shape)
            )
        inputs = detached_inputs(args)
        with _checkpointing(), _replayed_rng(ctx.rng_states), torch.enable_grad():
            with checkpoint_fp8.recompute_phase(ctx.fp8_state):
                outputs = ctx.run_function(*inputs)
        backward_through(outputs, grads)
        return (None, None) + input_grads(inputs)


def checkpoint(function, distribute_saved_activations: bool, *args):
    """``function(*args)`` with activation checkpointing (see :class:`CheckpointFunction`)."""
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)


class CheckpointWithoutOutput:
    """Checkpoints a block and also frees its outputs until backward needs them.

    ``checkpoint(fn, *args)`` runs ``fn`` keeping only its inputs. After the outputs' consumers
    have run, ``discard_output_and_register_recompute(t)`` frees the outputs' storage and, when
    the gradient of ``t`` is computed, recomputes the block (with the forward's random state)
    into the same tensors, so the consumers' saved references see the data again.

    With a ``ckpt_manager`` the checkpoint registers itself with the manager, which frees and
    recomputes all its checkpoints at once
    (:meth:`CheckpointWithoutOutputManager.discard_all_outputs_and_register_unified_recompute`);
    ``discard_output_and_register_recompute`` then does nothing.

    Args:
        fp8: None turns off replaying Transformer Engine's FP8 state in the recomputation
            (``checkpoint_fp8``); any other value keeps it on. The default False keeps it on too,
            as upstream's does: blocks built with ``CheckpointWithoutOutput()`` rely on it.
        ckpt_manager: The :class:`CheckpointWithoutOutputManager` that recomputes this block
            together with others, or None.
        retain_input_tensors: Keep an output that shares storage with an input instead of
            freeing it (freeing it would destroy the input the recomputation reads).
    """

    def __init__(self, fp8=False, ckpt_manager=None, retain_input_tensors: bool = False):
        if ckpt_manager is not None and not isinstance(
            ckpt_manager, CheckpointWithoutOutputManager
        ):
            raise TypeError(
                f"CheckpointWithoutOutput(ckpt_manager=...) expects a "
                f"CheckpointWithoutOutputManager or None, got {type(ckpt_manager).__name__}."
            )
        self.fp8 = fp8 is not None
        self.fp8_state = None
        self.ckpt_manager = ckpt_manager
        self.retain_input_tensors = retain_input_tensors
        self.run_function = None
        self.rng_states = None
        self.ctx = None
        self.outputs = None
        self._freed = []

    def checkpoint(self, run_function, *args):
        """Runs ``run_function(*args)``, keeping only what recomputation needs.

        Returns:
            ``run_function``'s outputs; with a manager, the checkpoint is registered with it.
        """
        self.run_function = run_function
        self.rng_states = _capture_rng()
        self.fp8_state = checkpoint_fp8.capture() if self.fp8 else None
        with checkpoint_fp8.forward_phase(self.fp8_state):
            outputs = CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = outputs
        if self.ckpt_manager is not None:
            self.ckpt_manager.add_checkpoint(self)
        return outputs

    def _discard_outputs(self) -> None:
        """Frees the outputs' storage (except outputs aliasing an input, if asked to keep them)."""
        keep = set()
        if self.retain_input_tensors:
            keep = {t.untyped_storage().data_ptr() for t in self.ctx.saved_tensors}
        self._freed = free_storage(tensor_outputs(self.outputs), keep)

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Frees the outputs' storage; recomputes them when ``hook_tensor``'s gradient is ready.

        Does nothing when a manager owns this checkpoint: the manager frees and recomputes.
        """
        if self.ckpt_manager is not None:
            return
        self._discard_outputs()
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad) -> None:
        """Recomputes the block into its freed outputs (a gradient hook; runs once)."""
        if self.ctx is None:
            return
        _require_checkpoint_valid()
        inputs = load_args_from_ctx(self.ctx)
        with _replayed_rng(self.rng_states), torch.enable_grad():
            with checkpoint_fp8.recompute_phase(self.fp8_state):
                recomputed = self.run_function(*inputs)
        freed_ids = {id(out) for out, _ in self._freed}
        fresh = [
            new
            for out, new in zip(tensor_outputs(self.outputs), tensor_outputs(recomputed))
            if id(out) in freed_ids
        ]
        refill_storage(self._freed, fresh)
        self.ctx.inputs, self.ctx.outputs = inputs, recomputed
        # Drop every reference the recomputation no longer needs: the autograd node holds the
        # recomputed graph until its backward, and nothing here may keep it alive after that.
        self.ctx = self.outputs = self.run_function = self.rng_states = self.fp8_state = None
        self._freed = []


class CheckpointWithoutOutputManager:
    """Frees and recomputes several :class:`CheckpointWithoutOutput` blocks together.

    Useful when the blocks form a chain (one block's output is the next one's input): one hook
    recomputes all of them, in forward order, before backward reaches the first.

    Usage::

        manager = CheckpointWithoutOutputManager()
        y = CheckpointWithoutOutput(ckpt_manager=manager).checkpoint(block_a, x)
        z = CheckpointWithoutOutput(ckpt_manager=manager).checkpoint(block_b, y)
        out = consumer(z)
        manager.discard_all_outputs_and_register_unified_recompute(out)

    Attributes:
        checkpoints: The registered checkpoints, in forward order.
        is_last_layer_in_recompute_block: Set by upstream's transformer block before each layer's
            forward: the last layer of a recompute block keeps its output uncheckpointed.
    """

    def __init__(self):
        self.checkpoints = []
        self.is_last_layer_in_recompute_block = False

    def add_checkpoint(self, ckpt: CheckpointWithoutOutput) -> None:
        """Registers ``ckpt``, which must have run its ``checkpoint``.

        Raises:
            TypeError: ``ckpt`` is not a ``CheckpointWithoutOutput``.
            ValueError: ``ckpt.checkpoint(...)`` has not run yet.
        """
        if not isinstance(ckpt, CheckpointWithoutOutput):
            raise TypeError(
                f"CheckpointWithoutOutputManager.add_checkpoint expects a CheckpointWithoutOutput, "
                f"got {type(ckpt).__name__}."
            )
        if ckpt.outputs is None:
            raise ValueError(
                "CheckpointWithoutOutputManager.add_checkpoint: call ckpt.checkpoint(fn, *args) "
                "before adding the checkpoint (it has no outputs yet)."
            )
        self.checkpoints.append(ckpt)

    def discard_all_outputs_and_register_unified_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Frees every registered output; recomputes them all when ``hook_tensor``'s grad is ready.

        ``hook_tensor`` must be computed from the last block's output, so that its gradient
        arrives before backward needs any of the freed tensors.
        """
        for ckpt in self.checkpoints:
            ckpt._discard_outputs()
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._unified_recompute_hook)

    def _unified_recompute_hook(self, _grad) -> None:
        # Forward order: each block's recomputation reads the refilled output of the one before.
        for ckpt in self.checkpoints:
            ckpt._recompute(None)
