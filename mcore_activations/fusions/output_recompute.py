"""The output-recompute option: fc2 does not keep the activation's output between the passes.

An MLP saves two activation-sized tensors for its backward: fc1's output ``x`` (the activation's
backward reads it) and the activation's output ``y`` (fc2 saves it for its weight gradient).
``y`` is a function of ``x``, so with the option on fc2 saves, in place of ``y``, a recipe for
it: while fc2's forward runs, saved-tensor hooks replace every tensor fc2 saves on ``y``'s
storage by a note of its layout, and fc2's backward, when it unpacks it, gets ``y`` computed
again from ``x`` by the same kernel. ``y`` itself is then freed as soon as the layer's forward
drops it: one ``[tokens, ffn]`` tensor less per layer between the forward and the backward, for
one activation forward more in the backward (docs/performance.md, "Low-memory backward", has the
measured trade).

Nothing visible to the caller is freed or changed: ``y`` stays a normal tensor for as long as
anything holds it (a hook, an auxiliary loss, a logger), and then nothing is saved by the option.
The recomputation gives the same bits (the same activation, on the same ``x``, bias and
probabilities, through the same kernel backend as the forward's); if any of those was changed in
place between the passes (an in-place backward that already ran, a reused buffer), the backward
raises instead of computing from the changed values. So does a change of the output itself made
in place after fc2 saved it, as torch would. A tensor fc2 saves that the recomputation would not
reproduce (the output after an in-place change before fc2 saved it, say by a forward pre-hook, or
a view of it in another dtype) is saved as it is. fc2 needs no change, whichever linear it is.

It composes with the in-place backward (``in_place``): fc2's backward, which recomputes ``y``,
runs before the activation's backward, which may write over ``x``.

The option is off by default, as upstream behaves. Where it comes from, first match wins:

1. the layer's own setting (``LayerActivation(recompute_output=...)``);
2. the process default set by :func:`set_recompute_output` (or :func:`use_recompute_output`);
3. the environment variable ``MCORE_ACTIVATIONS_RECOMPUTE_OUTPUT``, read when this module is
   first imported and parsed as strictly as ``MCORE_ACTIVATIONS_PATCH``.

fc2 saves ``y`` as it always does where the recipe would save nothing or could go wrong: no
gradient is recorded; ``y`` has no autograd node of its own (then nothing else keeps ``x``, and
the recipe would keep it, twice ``y``'s size); other saved-tensor hooks are active (activation
offloading, ``torch.utils.checkpoint(use_reentrant=False)``: they own what is saved); a CUDA
graph is being captured or ``torch.compile`` is tracing; ``y`` is not contiguous or does not fill
its storage.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Optional

import torch

from mcore_activations.patch_env import Switch

ENV_VAR = "MCORE_ACTIVATIONS_RECOMPUTE_OUTPUT"
OPTION = "recompute_output"


_SWITCH = Switch(
    ENV_VAR,
    OPTION,
    "set_recompute_output",
    "layers free the activation's output after fc2's forward and recompute it before fc2's "
    "backward",
    "keep it, as upstream",
)


def recompute_output_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """What ``MCORE_ACTIVATIONS_RECOMPUTE_OUTPUT`` asks for; unset means off.

    Args:
        environ: The environment to read; default ``os.environ``.

    Raises:
        ValueError: Any value other than 1 / true / yes / on, 0 / false / no / off or empty.
    """
    return _SWITCH.from_env(environ)


def check_option(value) -> Optional[bool]:
    """``value`` if it is True, False or None (the process default).

    Raises:
        TypeError: any other value, naming the option.
    """
    return _SWITCH.check(value)


def recompute_output_enabled() -> bool:
    """The process default: whether layers that do not set the option recompute their output."""
    return _SWITCH.enabled()


def set_recompute_output(enabled: bool) -> bool:
    """Sets the process default; returns the previous one.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    return _SWITCH.set(enabled)


@contextlib.contextmanager
def use_recompute_output(enabled: bool) -> Iterator[None]:
    """Sets the process default inside the block and restores it on the way out."""
    previous = set_recompute_output(enabled)
    try:
        yield
    finally:
        set_recompute_output(previous)


def resolve(value: Optional[bool]) -> bool:
    """The option for one call: ``value``, or the process default when it is None."""
    return _SWITCH.resolve(value)


def _fills_its_storage(t: torch.Tensor) -> bool:
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


class _Source:
    """How to compute the output again, shared by every tensor fc2 saved on its storage."""

    __slots__ = (
        "shape",
        "dtype",
        "device",
        "output",
        "version",
        "recompute",
        "inputs",
        "versions",
        "packed",
        "held",
        "left",
    )

    def __init__(self, output: torch.Tensor, recompute, inputs):
        self.shape, self.dtype, self.device = output.shape, output.dtype, output.device
        # The output's values as the activation wrote them: its version now, and a weak
        # reference through which a change made while it lives is seen.
        self.output, self.version = weakref.ref(output), output._version
        self.recompute = recompute
        self.inputs = [t for t in inputs if t is not None]
        self.versions = [t._version for t in self.inputs]
        # fc2 may save several views of the output (a grouped GEMM saves one per expert), which
        # one recomputation serves: it is held until every view saved has been unpacked (once
        # per backward), and recomputed for the next backward of a retained graph. A weak
        # reference would not do: views made in the backward (no grad mode) do not keep their
        # base's Python object alive.
        self.packed = 0  # how many views fc2 saved
        self.held = None  # the recomputation, until ``left`` views are unpacked
        self.left = 0

    def materialize(self) -> torch.Tensor:
        """The output's values, recomputed for the first view unpacked in a backward."""
        if self.held is not None:
            return self.held
        output = self.output()
        if output is not None and output._version != self.version:
            # What fc2 saved was changed in place after it was saved; keeping the output, torch
            # would refuse the backward the same way.
            raise RuntimeError(
                f"{OPTION}: the activation's output, which fc2 saved for its backward, was "
                "modified in place after fc2's forward, so the saved values are gone. Leave it "
                f"unchanged until the backward, or turn {OPTION} off ({ENV_VAR}=0)."
            )
        if [t._version for t in self.inputs] != self.versions:
            raise RuntimeError(
                f"{OPTION}: fc1's output, bias or token weights were modified in place after the "
                "forward (by an in-place backward that already ran, or by a reused buffer), so "
                "fc2's saved input cannot be computed again. Backpropagate through the graph "
                f"once, keep those tensors unchanged until the backward, or turn {OPTION} off "
                f"({ENV_VAR}=0)."
            )
        fresh = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            self.recompute(fresh)
        self.held, self.left = fresh, self.packed
        return fresh

    def unpacked(self) -> None:
        """One saved view was handed to the backward; the last one lets go of the held copy."""
        self.left -= 1
        if self.left <= 0:
            self.held = None


class _Saved:
    """What fc2's node keeps in place of a tensor on the output's storage: its layout."""

    __slots__ = ("source", "size", "stride", "offset")

    def __init__(self, source: _Source, t: torch.Tensor):
        self.source, self.size, self.stride, self.offset = (
            source,
            t.shape,
            t.stride(),
            t.storage_offset(),
        )


def recompute_when_saved(
    output: torch.Tensor,
    recompute: Callable[[torch.Tensor], object],
    inputs: Iterable[Optional[torch.Tensor]] = (),
):
    """A context in which tensors saved for backward on ``output``'s storage become recipes.

    Wrap the consumer's forward (fc2's) in it. Each tensor the consumer saves that lives on
    ``output``'s storage is kept as its layout instead; when the backward unpacks it,
    ``recompute(target)`` fills ``target`` (a new tensor of ``output``'s shape and dtype) under
    ``torch.no_grad()`` and the saved view is taken of that. Upstream's
    ``CheckpointWithoutOutput`` frees a block's output after the fact; here nothing is freed that
    a caller can see, and the activation's own graph, which saves fc1's output, is kept.

    Args:
        output: The activation's output, about to be consumed.
        recompute: Fills the tensor it is given with ``output``'s values.
        inputs: The tensors ``recompute`` reads; modifying one in place before the backward makes
            the unpack raise instead of recomputing from it.

    Returns:
        The context manager; a no-op one where the option cannot help (module docstring).
    """
    if not _applies_to(output):
        return contextlib.nullcontext()
    return _RecipeHooks(_Source(output, recompute, inputs), output)


class _RecipeHooks(torch.autograd.graph.saved_tensors_hooks):
    """The hooks of :func:`recompute_when_saved`; ``recipes`` counts the tensors they replaced."""

    def __init__(self, source: _Source, output: torch.Tensor):
        pointer = output.untyped_storage().data_ptr()
        # The pack hook must not refer to this object: the hooks hold it, and a cycle through it
        # would keep ``source`` (and with it fc1's output) alive after the backward until
        # Python's cycle collector ran, twice the output's size per layer.
        replaced = self._replaced = [0]

        def pack(t: torch.Tensor):
            # Only what the recomputation reproduces: the output's own values (not changed in
            # place since the activation wrote them, e.g. by a pre-hook of fc2's), seen in its
            # own dtype. Anything else on the storage is saved as it is.
            if (
                t.device == source.device
                and t.dtype == source.dtype
                and t._version == source.version
                and t.untyped_storage().data_ptr() == pointer
            ):
                replaced[0] += 1
                source.packed += 1
                return _Saved(source, t)
            # Autograd checks the version of what it saves itself, not of what hooks hand back:
            # the check is kept here, so a tensor fc2 (or a hook of fc2's) saved and that is
            # changed in place before the backward still raises instead of being read.
            return _Kept(t)

        super().__init__(pack, _unpack)

    @property
    def recipes(self) -> int:
        return self._replaced[0]


class _Kept:
    """A tensor fc2 saved as it is, with its version then, checked at unpack as autograd would."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        self.tensor, self.version = t, t._version

    def get(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
                f"expected version {self.version} instead (saved during fc2's forward under "
                f"{OPTION}; an in-place backward of a block of fc1's output wrote over it, or "
                "your code changed it after the forward)."
            )
        return t


def _unpack(saved):
    if isinstance(saved, _Kept):
        return saved.get()
    if not isinstance(saved, _Saved):
        return saved
    source = saved.source
    fresh = source.materialize()
    source.unpacked()
    if saved.size == fresh.shape and saved.offset == 0 and saved.stride == fresh.stride():
        return fresh
    return fresh.as_strided(saved.size, saved.stride, saved.offset)


def _applies_to(output: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return False  # a traced graph plans its own memory
    if not torch.is_grad_enabled() or output.grad_fn is None or output.numel() == 0:
        return False
    if not _fills_its_storage(output):
        return False
    if output.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    # Other saved-tensor hooks own what is saved (offloading packs a copy; a non-reentrant
    # checkpoint drops fc1's output, which the recipe would keep alive).
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None
