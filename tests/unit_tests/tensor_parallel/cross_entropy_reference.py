"""Float64 reference of ``vocab_parallel_cross_entropy`` and the inputs its tests draw.

Upstream's label smoothing spreads ``alpha`` over the ``K - 1`` non-target classes, which is
torch's ``label_smoothing = alpha * K / (K - 1)`` (torch spreads it over all ``K`` classes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_label_smoothing(alpha: float, vocab_size: int) -> float:
    """torch's ``label_smoothing`` that gives upstream's loss for smoothing ``alpha``."""
    return alpha * vocab_size / (vocab_size - 1)


def reference_loss_and_grad(
    logits: torch.Tensor, target: torch.Tensor, grad_output: torch.Tensor, alpha: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 loss per token and its gradient w.r.t. the (whole-vocabulary) logits."""
    vocab = logits.size(-1)
    x = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(
        x.reshape(-1, vocab),
        target.reshape(-1),
        reduction="none",
        label_smoothing=torch_label_smoothing(alpha, vocab),
    ).view_as(target)
    loss.backward(grad_output.double())
    return loss.detach(), x.grad


def draw_inputs(
    seed: int, shape: tuple, vocab: int, dtype: torch.dtype, offset: float = 0.0, spread=3.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits [*shape, vocab] in dtype, target [*shape], grad_output [*shape] float32)``.

    The logits are drawn in float64 and rounded once to ``dtype``, so the same seed gives the
    same values on every rank; ``offset`` shifts them all (large offsets test stability).
    """
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=generator, dtype=torch.float64) * spread
    logits = (logits + offset).to(dtype)
    target = torch.randint(0, vocab, shape, generator=generator)
    grad_output = torch.rand(*shape, generator=generator, dtype=torch.float64) + 0.5
    return logits, target, grad_output.float()
