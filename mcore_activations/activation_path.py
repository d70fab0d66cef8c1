"""How an MLP layer computes its activation: one decision at construction, one call per forward.

A layer (``MLP``, the routed experts, the shared experts; the fork's classes and, through
``mcore_activations.megatron_patch``, upstream's) turns its config into an
:class:`ActivationSpec`, asks :func:`select_layer_activation` (or, for a layer that already holds
its callable, :func:`select_activation_path`) once which path computes it, and calls
:func:`activate` on every forward:

- **Transformer Engine module** (``use_te_activation_func`` with a TE activation builder): TE's
  activation module. It takes no clamp, tanh scale or offset, so such a spec is refused.
- **Fused kernels** (``bias_activation_fusion``): :func:`fused_activation`, which fuses the bias
  add, every non-custom spec (clamps, SiTU-GLU, offsets) and the per-row probabilities.
- **Unfused** (otherwise): :func:`unfused_activation`, plain torch ops calling the configured
  ``activation_func`` itself, so any callable works.

All three compute what :meth:`ActivationSpec.reference` defines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Optional

import torch

from mcore_activations.activation_spec import (
    ActivationSpec,
    UnsupportedActivationError,
    deinterleave_glu,
    unfused_activation,
)
from mcore_activations.fusions import in_place
from mcore_activations.fusions.fused_activation import fused_activation, lower_to_fused_kernel

TE_MODULE_PATH = "te_module"
FUSED_KERNEL_PATH = "fused_kernel"
UNFUSED_PATH = "unfused"


def select_activation_path(
    config,
    spec: ActivationSpec,
    has_te_activation_builder: bool,
    owner: str,
) -> str:
    """Chooses how a layer computes ``spec``, refusing what that path cannot compute.

    Args:
        config: Source of the path flags ``use_te_activation_func`` and
            ``bias_activation_fusion`` (a ``TransformerConfig``, the fork's or upstream's).
        spec: The activation to compute.
        has_te_activation_builder: The layer's submodules name a TE activation module.
            ``use_te_activation_func`` without one (e.g. with the local layer spec) computes the
            same activation on the unfused path.
        owner: The layer's class name, used in error messages.

    Returns:
        One of ``TE_MODULE_PATH``, ``FUSED_KERNEL_PATH`` and ``UNFUSED_PATH``.

    Raises:
        UnsupportedActivationError: The selected path cannot compute ``spec``.
        ValueError: The fused path with the in-place backward on
            (``mcore_activations.fusions.in_place``) and a config under which it is unsafe.
    """
    if getattr(config, "use_te_activation_func", False) and has_te_activation_builder:
        if not spec.is_plain:
            raise UnsupportedActivationError(
                f"{owner}(use_te_activation_func=True)",
                spec,
                "Transformer Engine's activation modules take no clamp, tanh clamp scale or "
                "linear offset",
                "Set use_te_activation_func=False; bias_activation_fusion=True computes it "
                "with the fused kernels.",
            )
        return TE_MODULE_PATH
    if config.bias_activation_fusion:
        # Lowering now, not at the first forward, makes an unsupported config fail at build.
        lower_to_fused_kernel(spec, f"{owner}(bias_activation_fusion=True)")
        if in_place.in_place_backward_enabled():
            in_place.check_config(config, owner)
        return FUSED_KERNEL_PATH
    return UNFUSED_PATH


class LayerActivation(NamedTuple):
    """What :func:`select_layer_activation` decided for a layer."""

    path: str  # TE_MODULE_PATH, FUSED_KERNEL_PATH or UNFUSED_PATH
    activation_func: Callable  # the TE module on TE_MODULE_PATH, else the configured callable
    fp8_input_store: bool  # the fused kernels keep their saved input in FP8


def select_layer_activation(
    config,
    spec: ActivationSpec,
    owner: str,
    *,
    te_module_factory: Optional[Callable[[], Callable]] = None,
    fused_kernel_opt_in: bool = False,
) -> LayerActivation:
    """The one path selector of ``MLP``, the routed experts and the shared experts.

    Reads every activation field the path needs from ``config`` once: a config edited after the
    layer is built changes nothing about what the layer computes or saves.

    Args:
        config: The layer's config (path flags, ``activation_func``,
            ``activation_func_fp8_input_store``).
        spec: The activation to compute (``ActivationSpec.from_config``).
        owner: The layer's class name, used in error messages.
        te_module_factory: Builds the TE activation module the layer's submodules name; None
            when they name none.
        fused_kernel_opt_in: The layer runs the fused kernels even without
            ``bias_activation_fusion`` (upstream's ``use_fused_weighted_squared_relu``).

    Raises:
        UnsupportedActivationError: The selected path cannot compute ``spec``.
    """
    path = select_activation_path(config, spec, te_module_factory is not None, owner)
    if path == UNFUSED_PATH and fused_kernel_opt_in:
        lower_to_fused_kernel(spec, owner)
        if in_place.in_place_backward_enabled():
            in_place.check_config(config, owner)
        path = FUSED_KERNEL_PATH
    func = te_module_factory() if path == TE_MODULE_PATH else config.activation_func
    return LayerActivation(
        path, func, bool(getattr(config, "activation_func_fp8_input_store", False))
    )


def per_token_probs(per_token_scale: Optional[torch.Tensor], x: torch.Tensor):
    """``per_token_scale`` (one weight per row of ``x``) as ``[..., 1]`` probabilities, or None.

    An integer or boolean scale is converted to float32, so every path computes what upstream's
    MLP computes with it (its product with the activation promotes it to a float).

    Raises:
        TypeError: the scale is not a real tensor (e.g. complex).
        ValueError: the scale is not shaped like ``x.shape[:-1]``; a ``[s, 1]`` or 0-d scale
            would broadcast on the unfused path and be refused by the fused kernels.
    """
    if per_token_scale is None:
        return None
    if not isinstance(per_token_scale, torch.Tensor) or per_token_scale.is_complex():
        got = getattr(per_token_scale, "dtype", type(per_token_scale).__name__)
        raise TypeError(f"per_token_scale must be a real tensor, one weight per token; got {got}.")
    if not per_token_scale.is_floating_point():
        per_token_scale = per_token_scale.to(torch.float32)
    if tuple(per_token_scale.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"per_token_scale of shape {tuple(per_token_scale.shape)} does not match the "
            f"{tuple(x.shape[:-1])} tokens of the MLP input: pass one weight per token, shaped "
            "like hidden_states without its last dimension."
        )
    return per_token_scale.unsqueeze(-1)


def activate(
    x: torch.Tensor,
    bias: Optional[torch.Tensor],
    probs: Optional[torch.Tensor],
    *,
    spec: ActivationSpec,
    path: str,
    activation_func: Callable,
    fp8_input_store: bool = False,
    cpu_offload_input: bool = False,
    in_place_backward: Optional[bool] = None,
) -> torch.Tensor:
    """The activation of fc1's output ``x`` (and fc1's unadded ``bias``) on ``path``.

    Args:
        x: fc1's output, in the GLU layout of ``spec``.
        bias: fc1's bias when fc1 skipped adding it, else None.
        probs: Optional per-row weights ``x.shape[:-1] + (1,)`` (MoE probabilities).
        spec: The layer's activation.
        path: The layer's path from :func:`select_activation_path`.
        activation_func: The TE module on ``TE_MODULE_PATH``, else the configured callable.
        fp8_input_store: Keep the fused kernels' saved input in FP8 (a memory saving).
        cpu_offload_input: Tag the fused kernels' saved input for TE's CPU offloading.
        in_place_backward: The fused kernels' backward writes the input gradient over ``x``;
            None: the process default (``mcore_activations.fusions.in_place``). The other
            paths ignore it.

    Returns:
        The activation in ``x.dtype``, with each row multiplied by ``probs``.
    """
    if path == FUSED_KERNEL_PATH:
        return fused_activation(
            x,
            spec,
            bias=bias,
            probs=probs,
            fp8_input_store=fp8_input_store,
            cpu_offload_input=cpu_offload_input,
            in_place_backward=in_place_backward,
        )
    if bias is not None:
        x = x + bias
    if path == TE_MODULE_PATH:
        if spec.glu_interleave_size is not None:
            # TE's GLU modules read the two-halves layout.
            x = torch.cat(deinterleave_glu(x, spec.glu_interleave_size), dim=-1)
        out = activation_func(x)
        return (out * probs).to(out.dtype) if probs is not None else out
    return unfused_activation(x, spec, activation_func, probs=probs)


def add_weighted_output_bias(
    output: torch.Tensor, bias: torch.Tensor, per_token_scale: torch.Tensor
) -> torch.Tensor:
    """An expert's fc2 output plus its bias weighted by each token's router probability.

    Computes ``output + bias * per_token_scale[..., None]`` out of place and rounds once to
    ``output.dtype``: the same bits as adding the (float32) product in place, which is what
    upstream does. In place is not an option: when fc2 is a Transformer Engine linear its output
    is a view made inside a custom autograd Function, and autograd refuses to modify it (an
    expert with biases and token weights, as in gpt-oss, could not train).
    """
    return (output + bias * per_token_scale.unsqueeze(-1)).to(output.dtype)
