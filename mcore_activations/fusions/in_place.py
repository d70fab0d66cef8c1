"""The in-place backward option: the input gradient written over the saved activation input.

With the option on, a fused activation's backward writes ``dx`` over the tensor it saved for the
backward (fc1's output) instead of allocating a new one: the activation's backward then needs
one fc1-output-sized buffer instead of two, with the same kernel and the same bits. The saved
tensor is dead after the backward in a normal training step (fc1's backward needs ``dx``, never
its own output), which is what makes this legal; every case where it is not dead, or may not be,
is either handled or refused here (docs/performance.md, "Low-memory backward").

The option is off by default, as upstream behaves. Where it comes from, first match wins:

1. the ``in_place_backward`` keyword of a fused entry point (``True`` / ``False``);
2. the process default set by :func:`set_in_place_backward` (or :func:`use_in_place_backward`);
3. the environment variable ``MCORE_ACTIVATIONS_IN_PLACE_BACKWARD``, read when this module is
   first imported and parsed as strictly as ``MCORE_ACTIVATIONS_PATCH``.

This module holds the option and the safety rules; the kernels take a plain ``in_place`` flag,
and ``fused_activation`` applies the rules around its autograd Function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Optional

import torch

from mcore_activations.patch_env import Switch

ENV_VAR = "MCORE_ACTIVATIONS_IN_PLACE_BACKWARD"
OPTION = "in_place_backward"

# What to do instead, quoted by every runtime refusal (it starts a sentence).
_TURN_OFF = (
    f"Pass {OPTION}=False to this activation, or turn the process default off "
    f"({ENV_VAR}=0 or mcore_activations.fusions.in_place.set_in_place_backward(False))"
)


class InPlaceBackwardError(RuntimeError):
    """Writing the input gradient over the saved activation input is unsafe for this call."""


_SWITCH = Switch(
    ENV_VAR,
    OPTION,
    "set_in_place_backward",
    "the fused activations' backward writes the input gradient over the saved fc1 output",
    "a new buffer, as upstream",
)


def in_place_backward_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """What ``MCORE_ACTIVATIONS_IN_PLACE_BACKWARD`` asks for; unset means off.

    Case and surrounding blanks are ignored.

    Args:
        environ: The environment to read; default ``os.environ``.

    Raises:
        ValueError: Any value other than 1 / true / yes / on, 0 / false / no / off or empty: a
            typo must not decide silently whether the backward overwrites its input.
    """
    return _SWITCH.from_env(environ)


def check_option(value, name: str = OPTION) -> Optional[bool]:
    """``value`` if it is ``True``, ``False`` or ``None``.

    Raises:
        TypeError: anything else (a string such as ``"0"`` would otherwise be truthy).
    """
    return _SWITCH.check(value, name)


def in_place_backward_enabled() -> bool:
    """The process default of the option (see the module docstring)."""
    return _SWITCH.enabled()


def set_in_place_backward(enabled: bool) -> bool:
    """Sets the process default of the option; returns the previous default.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    return _SWITCH.set(enabled)


def configure_in_place_backward(value: Optional[bool]) -> None:
    """``set_in_place_backward(value)`` unless ``value`` is None (then nothing changes).

    The form a ``patch_megatron_core(in_place_backward=None)`` keyword forwards to: None keeps
    what the environment variable (or an earlier call) chose.

    Raises:
        TypeError: ``value`` is not True, False or None.
    """
    if check_option(value) is not None:
        set_in_place_backward(value)


@contextlib.contextmanager
def use_in_place_backward(enabled: bool) -> Iterator[None]:
    """Sets the process default inside the block and restores it on the way out."""
    previous = set_in_place_backward(enabled)
    try:
        yield
    finally:
        set_in_place_backward(previous)


def resolve(value: Optional[bool]) -> bool:
    """The option for one call: ``value``, or the process default when it is None."""
    return _SWITCH.resolve(value)


# ------------------------------------------------------------------ configurations refused
_OFFLOADED_MODULES = frozenset({"expert_fc1", "moe_act"})


def config_conflicts(config, *, moe_act_on_graph: bool = False) -> list[str]:
    """The settings of ``config`` under which an in-place backward is unsafe, as phrases.

    Reads the fields of the fork's ``TransformerConfig`` and of upstream's (0.19.2 and main);
    a field a config does not have counts as off.

    Args:
        config: The layer's config.
        moe_act_on_graph: The layer recomputes its ``moe_act`` output from fc1's output itself
            (the fork's ``TEGroupedMLP``, ``output_recompute``), not from upstream's detached
            checkpoint copy, so that recompute is no conflict.
    """
    found = []
    if getattr(config, "cpu_offloading", False) and getattr(
        config, "cpu_offloading_activations", False
    ):
        found.append(
            "cpu_offloading=True with cpu_offloading_activations=True (the offload handler "
            "hands the backward a host copy of the saved input, which it may share)"
        )
    offloaded = _OFFLOADED_MODULES & set(getattr(config, "offload_modules", None) or ())
    if getattr(config, "fine_grained_activation_offloading", False) and offloaded:
        found.append(
            f"fine_grained_activation_offloading=True with offload_modules "
            f"{sorted(offloaded)} (the saved fc1 output is offloaded and reloaded)"
        )
    recompute = set(getattr(config, "recompute_modules", None) or ())
    selective = getattr(config, "recompute_granularity", None) == "selective"
    if selective and "moe_act" in recompute and not moe_act_on_graph:
        found.append(
            "recompute_modules containing 'moe_act' (the recomputed activation's input is the "
            "checkpoint's detached copy of fc1's output, not a tensor of the graph)"
        )
    graph_impl = getattr(config, "cuda_graph_impl", None)
    if graph_impl not in (None, "none"):
        found.append(f"cuda_graph_impl={graph_impl!r}")
    for flag in ("enable_cuda_graph", "external_cuda_graph"):
        if getattr(config, flag, False):
            found.append(f"{flag}=True")
    return found


def check_config(config, owner: str, *, moe_act_on_graph: bool = False) -> None:
    """Refuses, at construction, a layer whose config makes an in-place backward unsafe.

    Called only when the option is on for the layer's fused activation.

    Raises:
        ValueError: ``config`` has a setting of :func:`config_conflicts`; the message names
            the layer, the settings, why and what to change.
    """
    found = config_conflicts(config, moe_act_on_graph=moe_act_on_graph)
    if found:
        raise ValueError(
            f"{owner}: the in-place activation backward ({OPTION}=True or {ENV_VAR}=1) writes "
            "the input gradient over the saved fc1 output, which is unsafe with "
            f"{'; '.join(found)}. Turn {OPTION} off ({ENV_VAR}=0 or "
            "set_in_place_backward(False)), or drop those settings."
        )


def check_layer_config(config, owner: str, *, moe_act_on_graph: bool = False) -> None:
    """:func:`check_config` for a layer being built, when the process default is on.

    The layers' construction-time check: with the option off nothing is refused.
    """
    if in_place_backward_enabled():
        check_config(config, owner, moe_act_on_graph=moe_act_on_graph)


# ------------------------------------------------------------------ runtime rules
def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _saved_tensor_hooks_active() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def check_forward(x: torch.Tensor, cpu_offload_input: bool) -> None:
    """Refuses, in the forward, an in-place backward that would overwrite a tensor still needed.

    ``x`` is the activation input about to be saved unrounded (not with ``fp8_input_store``,
    whose backward overwrites a private upcast instead and needs none of these rules).

    Raises:
        ValueError: ``cpu_offload_input`` is set: the offload handler owns the saved input.
        InPlaceBackwardError: a CUDA graph is being captured; saved-tensor hooks are active
            (activation offloading, non-reentrant checkpointing: the tensor the backward gets
            is the hook's, and may be shared with other saved tensors, unchecked); ``x`` is a
            leaf tensor or a view of one (its gradient would overwrite its own data, e.g. a
            parameter, a user's tensor, or the detached input of an activation recompute); or
            another in-place fused activation already saved ``x``.
    """
    if cpu_offload_input:
        raise ValueError(
            f"{OPTION}=True with cpu_offload_input=True: the offload handler moves the saved "
            "input to the host and back, and may share what it returns. Leave "
            f"cpu_offload_input off, or: {_TURN_OFF}."
        )
    if _capturing():
        raise InPlaceBackwardError(
            f"{OPTION}=True inside a CUDA graph capture: the checks that make writing over the "
            "saved input safe (a second backward, other users of the input) run on the host "
            f"once, at capture, and a replay would skip them. {_TURN_OFF} for captured layers."
        )
    if _saved_tensor_hooks_active():
        raise InPlaceBackwardError(
            f"{OPTION}=True while saved-tensor hooks are active (activation offloading, "
            "torch.utils.checkpoint(use_reentrant=False), or torch.autograd.graph."
            "saved_tensors_hooks): the tensor the backward receives is the hook's and may be "
            "shared with other saved tensors without a version check. Use reentrant "
            f"checkpointing (megatron's tensor_parallel.checkpoint), or: {_TURN_OFF}."
        )
    root = x._base if x._base is not None else x
    # A leaf, or a view of a leaf that wants a gradient (a parameter, a user's tensor). A view
    # made inside a custom autograd Function (Transformer Engine's linears return one) has the
    # Function's node and a base that wants no gradient: fc1's output buffer, dead after this.
    if x.grad_fn is None or (root.grad_fn is None and root.requires_grad):
        raise InPlaceBackwardError(
            f"{OPTION}=True on a leaf tensor (shape {tuple(root.shape)}): its gradient would be "
            "written over its own data, e.g. a parameter, a tensor of yours, or the detached "
            "input of an activation recompute (upstream's 'moe_act'). The option is for "
            f"activations of an intermediate result such as fc1's output. {_TURN_OFF}."
        )
    if getattr(root, "_mcore_in_place_backward", False):
        raise InPlaceBackwardError(
            f"{OPTION}=True on an input that another in-place fused activation already saved "
            "(the same fc1 output used twice): the first backward would destroy the input the "
            f"second one reads. {_TURN_OFF} for one of the two."
        )
    # A plain attribute on the caller's tensor: the marker lives exactly as long as the storage.
    root._mcore_in_place_backward = True


# A part of a larger buffer with a version counter of its own (fusions.fc2_chunks' row blocks).
_WHOLE = "_mcore_in_place_whole"


def mark_part_of(part: torch.Tensor, whole: torch.Tensor) -> None:
    """Declares ``part`` a tensor on ``whole``'s memory with a version counter of its own.

    An in-place backward that writes over ``part`` then bumps ``whole``'s counter too, at the
    write: a node that saved ``whole`` and runs after it refuses to read the overwritten values.
    """
    setattr(part, _WHOLE, whole)


def note_written(x: torch.Tensor) -> None:
    """After an in-place backward wrote over ``x`` (a part, or a view of one): bumps the counter
    of the buffer the part belongs to."""
    whole = getattr(x, _WHOLE, None)
    if whole is None and x._base is not None:
        whole = getattr(x._base, _WHOLE, None)
    if whole is not None:
        torch.autograd.graph.increment_version(whole)


def check_backward(already_ran: bool) -> None:
    """Refuses an in-place backward that runs a second time or inside a CUDA graph capture.

    Raises:
        InPlaceBackwardError: the node's backward already wrote over its input (a second
            backward through a graph kept with ``retain_graph=True``), or a CUDA graph is being
            captured.
    """
    if already_ran:
        raise InPlaceBackwardError(
            f"a second backward through an activation computed with {OPTION}=True: the first "
            "one wrote the input gradient over the saved input (retain_graph=True keeps the "
            f"graph, not that input). {_TURN_OFF} for graphs you backpropagate more than once."
        )
    if _capturing():
        raise InPlaceBackwardError(
            f"{OPTION}=True inside a CUDA graph capture of the backward: a replay would "
            f"overwrite the saved input without the host-side checks. {_TURN_OFF} for captured "
            "layers."
        )
