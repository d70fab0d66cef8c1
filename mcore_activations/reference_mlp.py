"""The float64 reference MLP, ``fc2(spec.reference(fc1(x)))``, on a layer's own weights.

The one model of an MLP (or of one expert) that the activation audits
(``megatron.core.transformer.activation_audit``, ``mcore_activations.upstream_audit``) and the
layer tests compare every path with. Callers pass float64 tensors; autograd through the result
gives the reference gradients of the input, the weights, the biases and the probabilities.
:func:`layer_reference` and :func:`grouped_layer_reference` read the weights from a layer's
``named_parameters()`` names, which this fork shares with upstream megatron-core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.nn.functional as F

from mcore_activations.activation_spec import ActivationSpec


def straight_through(value64: torch.Tensor, value: Optional[torch.Tensor]) -> torch.Tensor:
    """``value64`` with the value of ``value`` but the gradient of ``value64`` (None: unchanged).

    A layer in bf16 evaluates its activation at fc1's output rounded to bf16. Near a clamp edge
    that rounding decides an element's side and with it the element's gradient, so the reference
    evaluates the activation at the layer's value while differentiating the float64 fc1 exactly.
    """
    if value is None:
        return value64
    return value64 + (value.detach().to(value64.dtype) - value64).detach()


def at_precision(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``h`` rounded to ``dtype`` in value, with the gradient of ``h`` (float32 / 64: ``h``)."""
    if dtype in (torch.float64, torch.float32):
        return h
    return straight_through(h, h.to(dtype))


def reference_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    spec: ActivationSpec,
    *,
    fc1_bias: Optional[torch.Tensor] = None,
    fc2_bias: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
    at: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """``fc2(spec.reference(fc1(x) + fc1_bias, probs)) + probs * fc2_bias``, computed in float64.

    Args:
        x: fc1's input ``[..., in]`` (after any norm fused into fc1).
        fc1_weight: ``[out1, in]``, in the GLU layout ``spec`` reads.
        fc2_weight: ``[out, out1 / 2]`` (gated) or ``[out, out1]``.
        spec: The activation.
        fc1_bias: Added to fc1's output before the activation.
        fc2_bias: fc2's bias, weighted by ``probs`` when given.
        probs: Per-row weights ``x.shape[:-1]`` or ``x.shape[:-1] + (1,)`` (MoE probabilities,
            ``per_token_scale``).
        at: Maps fc1's output (without ``fc1_bias``) to the value the activation is evaluated at,
            e.g. :func:`straight_through` to the layer's own fc1 output; default: itself.

    Returns:
        The MLP output ``[..., out]``.
    """
    h = x @ fc1_weight.T
    if at is not None:
        h = at(h)
    out = spec.reference(h, bias=fc1_bias, probs=probs) @ fc2_weight.T
    if fc2_bias is None:
        return out
    if probs is None:
        return out + fc2_bias
    if probs.dim() == out.dim() - 1:
        probs = probs.unsqueeze(-1)
    return out + fc2_bias * probs


def reference_experts(
    x: torch.Tensor,
    tokens_per_expert: Sequence[int],
    experts: Sequence[dict],
    spec: ActivationSpec,
    probs: Optional[torch.Tensor] = None,
    at: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """Routed experts: :func:`reference_mlp` of expert ``i`` on its ``tokens_per_expert[i]`` rows.

    Args:
        x: ``[tokens, in]``, sorted by expert.
        tokens_per_expert: Rows of each expert.
        experts: One dict per expert with ``fc1_weight`` and ``fc2_weight`` and, optionally,
            ``fc1_bias`` and ``fc2_bias``.
        spec: The activation.
        probs: ``[tokens]`` router probabilities, or None.
        at: As for :func:`reference_mlp`, called with the expert's index first.
    """
    sizes = [int(n) for n in tokens_per_expert]
    rows = torch.split(x, sizes)
    row_probs = torch.split(probs, sizes) if probs is not None else [None] * len(sizes)
    outputs = []
    for index, (x_i, p_i, weights) in enumerate(zip(rows, row_probs, experts)):
        at_i = None if at is None else (lambda h, i=index: at(i, h))
        outputs.append(reference_mlp(x_i, spec=spec, probs=p_i, at=at_i, **weights))
    return torch.cat(outputs)


def _norm(x, params, prefix, config):
    # The LayerNorm / RMSNorm a TE LayerNorm linear fuses into fc1, if the layer has one.
    weight = params.get(f"{prefix}layer_norm_weight")
    if weight is None:
        return x
    if config.layernorm_zero_centered_gamma:
        weight = weight + 1
    if config.normalization == "RMSNorm":
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon)
        return x * rms * weight
    bias = params.get(f"{prefix}layer_norm_bias")
    return F.layer_norm(x, (x.shape[-1],), weight, bias, config.layernorm_epsilon)


def _fc1_at(bias, dtype):
    # The activation sees fc1's output (bias included) rounded as the layer rounds it
    # (at_precision): near a clamp edge the rounding decides the gradient.
    def at(h):
        return at_precision(h if bias is None else h + bias, dtype)

    return at


def layer_reference(params, x, spec, config, prefix="", probs=None, dtype=torch.float64):
    """:func:`reference_mlp` of an ``MLP`` layer from its parameters.

    Args:
        params: ``{name: float64 tensor}`` keyed as the layer's ``named_parameters()``
            (``linear_fc1.weight``, optional ``linear_fc1.bias``, ``linear_fc2.bias``, and
            ``linear_fc1.layer_norm_weight`` / ``_bias`` of a TE LayerNorm linear).
        x: The layer's input, float64.
        spec: The layer's activation.
        config: The layer's ``TransformerConfig`` (its norm settings).
        prefix: Prefix of the names, e.g. ``local_experts.0.``.
        probs: Per-row weights, or None.
        dtype: The layer's compute dtype: the activation is evaluated at fc1's output rounded to
            it (:func:`at_precision`).
    """
    return reference_mlp(
        _norm(x, params, f"{prefix}linear_fc1.", config),
        params[f"{prefix}linear_fc1.weight"],
        params[f"{prefix}linear_fc2.weight"],
        spec,
        fc2_bias=params.get(f"{prefix}linear_fc2.bias"),
        probs=probs,
        at=_fc1_at(params.get(f"{prefix}linear_fc1.bias"), dtype),
    )


def grouped_layer_reference(params, x, spec, tokens_per_expert, probs, dtype=torch.float64):
    """:func:`reference_experts` of a grouped-GEMM expert layer from its parameters.

    ``params`` is keyed as ``TEGroupedMLP.named_parameters()``: ``linear_fc1.weight{i}``,
    ``linear_fc2.weight{i}`` and optional ``linear_fc1.bias{i}`` / ``linear_fc2.bias{i}``.
    Other arguments as for :func:`layer_reference`.
    """
    experts = [
        dict(
            fc1_weight=params[f"linear_fc1.weight{i}"],
            fc2_weight=params[f"linear_fc2.weight{i}"],
            fc2_bias=params.get(f"linear_fc2.bias{i}"),
        )
        for i in range(len(tokens_per_expert))
    ]

    def at(i, h):
        return _fc1_at(params.get(f"linear_fc1.bias{i}"), dtype)(h)

    return reference_experts(x, tokens_per_expert, experts, spec, probs, at)
