"""``TENorm``: Transformer Engine's ``LayerNorm`` or ``RMSNorm``, the one ``config.normalization``
names, built with Megatron's arguments; and ``TEFusedResidualRMSNorm``, the RMSNorm that also
hands its input on for the residual add that follows.

Without Transformer Engine both classes still import; constructing one raises ``ImportError``
naming it and the install command, as the other TE wrappers do (``transformer_engine.py``
exports ``TEFusedResidualRMSNorm`` as None then, as upstream). TE is read from the import seam
(``mcore_activations.te_import``); the base class of ``TEFusedResidualRMSNorm`` is chosen when
this module is imported, as for the TE linears.
"""

from __future__ import annotations

import torch

from mcore_activations import te_import
from mcore_activations.te_import import TE_OPS_MIN_VERSION, require_te
from megatron.core.extensions.te_fused_ops import TEFusedOpsMixin
from megatron.core.extensions.te_linears import _te_base
from megatron.core.extensions.te_ops_adapters import _make_te_ops_rmsnorm_from_te_rmsnorm
from megatron.core.extensions.te_public import require_te_min_version

__all__ = ["TEFusedResidualRMSNorm", "TENorm"]

_NORMS = ("LayerNorm", "RMSNorm")


def _device(config):
    # Where TE allocates the weight: as upstream, plus the CPU when this machine has no GPU.
    if getattr(config, "use_cpu_initialization", False):
        return "cpu"
    if getattr(config, "init_model_with_meta_device", False):
        return "meta"
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


class TEFusedResidualRMSNorm(TEFusedOpsMixin, _te_base("RMSNorm")):
    """``te.pytorch.RMSNorm`` whose forward also returns its input, the residual.

    The module is TE's RMSNorm (same constructor, same single ``weight`` parameter, same
    checkpoints); only ``forward`` differs. It runs ``te.pytorch.ops.Sequential(MakeExtraOutput,
    RMSNorm)``, whose RMSNorm op aliases ``self.weight``, so TE hands out the residual from the
    same fused pass and adds its gradient to the input's. The ops are built on the first forward
    and cached in a 1-tuple (:class:`TEFusedOpsMixin`): never a submodule, never in
    ``state_dict``; ``_reset_fused_impl()`` drops them.

    Args: as ``te.pytorch.RMSNorm``.

    Raises:
        ImportError: Transformer Engine is unavailable.
        RuntimeError: Transformer Engine is older than 1.13 (no op API).
    """

    def __init__(self, *args, **kwargs):
        require_te_min_version(type(self).__name__, TE_OPS_MIN_VERSION)
        super().__init__(*args, **kwargs)

    def _make_fused_impl(self):
        ops = te_import.te.pytorch.ops
        return ops.Sequential(
            ops.MakeExtraOutput(),
            _make_te_ops_rmsnorm_from_te_rmsnorm(self, type(self).__name__),
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(rmsnorm(hidden_states), hidden_states)``, both of the input's shape."""
        # TE's Sequential returns the extra output after the main one.
        return self._get_fused_impl()(hidden_states)


class TENorm:
    """Builds ``te.pytorch.LayerNorm`` or ``te.pytorch.RMSNorm`` as ``config.normalization`` says.

    Calling ``TENorm(config, hidden_size)`` returns the TE module itself (not a ``TENorm``), as
    upstream's does, with ``returns_residual`` set on it.

    The residual is fused into the norm when both halves of the opt-in are set:
    ``config.fused_residual_rmsnorm`` (the model allows it) and ``has_residual`` (this build site
    is followed by a residual add). The result is then a :class:`TEFusedResidualRMSNorm` with
    ``returns_residual = True``: its forward returns ``(normalized, residual)``. Otherwise it is
    the plain TE norm with ``returns_residual = False``.

    Args:
        config: Model configuration: ``normalization`` (``"LayerNorm"`` or ``"RMSNorm"``),
            ``sequence_parallel``, ``layernorm_zero_centered_gamma``, ``params_dtype``, where to
            allocate (``use_cpu_initialization``, ``init_model_with_meta_device``) and
            ``fused_residual_rmsnorm``.
        hidden_size: The normalized (last) dimension.
        eps: Added to the variance.
        has_residual: The norm is followed by a residual add.

    Raises:
        ImportError: Transformer Engine is unavailable.
        ValueError: ``normalization`` is neither ``"LayerNorm"`` nor ``"RMSNorm"``, or the fused
            residual is asked for with ``"LayerNorm"`` (upstream's error for that case).
        RuntimeError: RMSNorm is asked for and this TE has none, or the fused residual is asked
            for and this TE is older than 1.13.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, has_residual: bool = False):
        require_te("TENorm")
        normalization = config.normalization
        if normalization not in _NORMS:
            raise ValueError(
                f"TENorm: normalization={normalization!r} is not supported; use one of {_NORMS}."
            )
        fused_residual = bool(getattr(config, "fused_residual_rmsnorm", False) and has_residual)
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
        # Looked up at call time, so a test can stand in its own fused class.
        norm_class = TEFusedResidualRMSNorm if fused_residual else getattr(pytorch, normalization)
        instance = norm_class(
            normalized_shape=hidden_size,
            eps=eps,
            sequence_parallel=config.sequence_parallel,
            zero_centered_gamma=config.layernorm_zero_centered_gamma,
            params_dtype=config.params_dtype,
            device=_device(config),
        )
        instance.returns_residual = fused_residual
        return instance
