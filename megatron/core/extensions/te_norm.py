"""``TENorm``: Transformer Engine's ``LayerNorm`` or ``RMSNorm``, the one ``config.normalization``
names, built with Megatron's arguments.

Without Transformer Engine the class still imports; constructing it raises ``ImportError`` naming
it and the install command, as the other TE wrappers do. TE is read from the import seam
(``mcore_activations.te_import``) at construction.
"""

from __future__ import annotations

import torch

from mcore_activations import te_import
from mcore_activations.te_import import require_te

__all__ = ["TENorm"]

_NORMS = ("LayerNorm", "RMSNorm")


def _device(config):
    # Where TE allocates the weight: as upstream, plus the CPU when this machine has no GPU.
    if getattr(config, "use_cpu_initialization", False):
        return "cpu"
    if getattr(config, "init_model_with_meta_device", False):
        return "meta"
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


class TENorm:
    """Builds ``te.pytorch.LayerNorm`` or ``te.pytorch.RMSNorm`` as ``config.normalization`` says.

    Calling ``TENorm(config, hidden_size)`` returns the TE module itself (not a ``TENorm``), as
    upstream's does, with ``returns_residual`` set on it.

    Args:
        config: Model configuration: ``normalization`` (``"LayerNorm"`` or ``"RMSNorm"``),
            ``sequence_parallel``, ``layernorm_zero_centered_gamma``, ``params_dtype``, where to
            allocate (``use_cpu_initialization``, ``init_model_with_meta_device``) and
            ``fused_residual_rmsnorm``.
        hidden_size: The normalized (last) dimension.
        eps: Added to the variance.
        has_residual: The norm is followed by a residual add (the build site's half of the
            fused-residual opt-in; ``config.fused_residual_rmsnorm`` is the other half).

    Raises:
        ImportError: Transformer Engine is unavailable.
        ValueError: ``normalization`` is neither ``"LayerNorm"`` nor ``"RMSNorm"``, or the fused
            residual is asked for with ``"LayerNorm"`` (upstream's error for that case).
        RuntimeError: RMSNorm is asked for and this TE has none.

    Upstream fuses the residual add into the RMSNorm when both ``config.fused_residual_rmsnorm``
    and ``has_residual`` are set (``TEFusedResidualRMSNorm``); this fork has no such module and
    builds the plain RMSNorm with ``returns_residual = False``, so the caller adds the residual
    itself: the same result, without the fusion.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, has_residual: bool = False):
        require_te("TENorm")
        normalization = config.normalization
        if normalization not in _NORMS:
            raise ValueError(
                f"TENorm: normalization={normalization!r} is not supported; use one of {_NORMS}."
            )
        fused_residual = getattr(config, "fused_residual_rmsnorm", False) and has_residual
        if fused_residual and normalization != "RMSNorm":
            raise ValueError(
                "TENorm: fused_residual_rmsnorm fuses the residual into an RMSNorm only; "
                f"normalization is {normalization!r}. Set normalization='RMSNorm' or "
                "fused_residual_rmsnorm=False."
            )
        pytorch = te_import.te.pytorch
        if not hasattr(pytorch, normalization):
            raise RuntimeError(
                f"TENorm: this Transformer Engine ({te_import.te_version()}) has no "
                f"te.pytorch.{normalization}; RMSNorm needs TE >= 0.11."
            )
        instance = getattr(pytorch, normalization)(
            normalized_shape=hidden_size,
            eps=eps,
            sequence_parallel=config.sequence_parallel,
            zero_centered_gamma=config.layernorm_zero_centered_gamma,
            params_dtype=config.params_dtype,
            device=_device(config),
        )
        instance.returns_residual = False
        return instance
