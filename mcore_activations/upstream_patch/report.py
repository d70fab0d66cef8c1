"""What a patch did: the objects it replaced or wrapped, and the targets it skipped."""

from __future__ import annotations

import dataclasses
import os
import sys

import torch


@dataclasses.dataclass(frozen=True)
class PatchedObject:
    """One upstream object the patch replaced.

    Attributes:
        target: ``module:qualname`` of the upstream object.
        action: ``"replaced"`` (ours instead of upstream's) or ``"wrapped"`` (upstream's runs,
            with a check or a lowering added around it).
        reason: Why, in one sentence.
    """

    target: str
    action: str
    reason: str


@dataclasses.dataclass(frozen=True)
class PatchReport:
    """What :func:`~mcore_activations.megatron_patch.patch_megatron_core` did.

    Attributes:
        upstream: The upstream target, e.g. ``"megatron-core 0.19.2"``.
        patched: Every replaced or wrapped object, in the order applied.
        skipped: ``(target, reason)`` for targets absent from this installation (e.g. the TE
            classes when Transformer Engine cannot be imported).
    """

    upstream: str
    patched: tuple[PatchedObject, ...]
    skipped: tuple[tuple[str, str], ...]

    def summary(self) -> str:
        """One line: the upstream and how many objects were patched or skipped."""
        skipped = f", {len(self.skipped)} skipped" if self.skipped else ""
        return f"patched {self.upstream}: {len(self.patched)} objects{skipped}"

    def details(self) -> str:
        """The full report: the summary, then every patched object and why, then the skipped."""
        lines = [f"mcore_activations {self.summary()}"]
        lines += [f"  {p.action:8s} {p.target}: {p.reason}" for p in self.patched]
        lines += [f"  skipped  {target}: {reason}" for target, reason in self.skipped]
        return "\n".join(lines)

    def __str__(self) -> str:
        # One line: a training log gets one line per process, not the full list.
        return f"mcore_activations {self.summary()} (report.details() lists them)"

    def print(self, details: bool = False, file=None) -> None:
        """Prints the one-line summary, or :meth:`details`, on rank 0 only.

        Args:
            details: Print the full report instead of the one line.
            file: Where to print; default ``sys.stderr``.

        The rank is ``torch.distributed``'s once it is initialized, else the ``RANK`` environment
        variable that torchrun sets (0 when unset).
        """
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        else:
            rank = int(os.environ.get("RANK", "0") or 0)
        if rank == 0:
            print(self.details() if details else str(self), file=file or sys.stderr)
