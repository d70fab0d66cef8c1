"""What the fused kernels need of one activation spec, derived once for a layer's every call.

A call of the fused kernels needs the spec's :class:`KernelVariant` (its structure, with or
without a bias and per-row probabilities) and its runtime numbers as the float32 ``params``
tensor on the input's device. ``fused_activation`` derives both on every call, which suits an
entry point that may see a new spec each time; a layer's spec is fixed at construction, so the
layer builds a :class:`KernelPlan` then and its calls only look the two up.
"""

from __future__ import annotations

from typing import Optional

import torch

from mcore_activations.activation_spec import ActivationSpec
from mcore_activations.fusions.activation_kernels import KernelVariant
from mcore_activations.kernel_params import (
    _tracing_with_fake_tensors,
    params_tensor,
    spec_params,
)


class KernelPlan:
    """The kernel variants and the ``params`` tensors of one spec the fused kernels compute.

    Args:
        spec: An activation the fused kernels implement (not a custom callable: lower it with
            ``fused_activation.lower_to_fused_kernel`` first).

    Raises:
        ValueError: ``spec`` is a custom activation, which has no kernel.
    """

    __slots__ = ("spec", "_variants", "_values", "_params")

    def __init__(self, spec: ActivationSpec):
        self.spec = spec
        self._variants = {
            (has_bias, has_probs): KernelVariant.of(spec, has_bias=has_bias, has_probs=has_probs)
            for has_bias in (False, True)
            for has_probs in (False, True)
        }
        self._values = spec_params(spec)
        # One tensor per device, made at the first call there: a layer is often built on the CPU
        # or the meta device and moved later, and its inputs' device is the one that counts.
        self._params: dict[torch.device, torch.Tensor] = {}

    def variant(self, bias: Optional[torch.Tensor], probs: Optional[torch.Tensor]) -> KernelVariant:
        """The variant for a call with or without ``bias`` and ``probs``."""
        return self._variants[bias is not None, probs is not None]

    def params(self, device: torch.device) -> torch.Tensor:
        """The spec's ``params`` tensor on ``device`` (``kernel_params.params_tensor``'s).

        Under a fake-tensor mode or a compile the tensor is made as ``params_tensor`` makes it
        there, and never kept: a fake or traced tensor would break every later real call.
        """
        tensor = self._params.get(device)
        if tensor is not None and not _tracing_with_fake_tensors():
            return tensor
        tensor = params_tensor(self._values, device)
        if not (torch.compiler.is_compiling() or _tracing_with_fake_tensors()):
            self._params[device] = tensor
        return tensor

    def __getstate__(self):
        # The tensors are a cache: a copied or unpickled layer makes its own on first use.
        return {"spec": self.spec, "variants": self._variants, "values": self._values}

    def __setstate__(self, state):
        self.spec = state["spec"]
        self._variants = state["variants"]
        self._values = state["values"]
        self._params = {}
