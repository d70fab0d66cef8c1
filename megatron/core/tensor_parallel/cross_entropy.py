"""Cross-entropy loss over logits whose vocabulary is split across tensor-parallel ranks.

Each rank holds ``[..., vocab / tp]`` logits (the output of a column-parallel output layer); no
rank ever sees a whole row. The loss per token is ``log(sum_i exp(z_i)) - z_target``, computed as

1. ``m``: the row maximum, all-reduced with MAX, subtracted from every logit (so every ``exp``
   argument is <= 0 and cannot overflow, whatever the logits' magnitude);
2. the target's shifted logit (only the rank owning the target contributes; the others add 0)
   and the sum of ``exp`` of the shifted logits, each all-reduced with SUM;
3. ``loss = log(sum_exp) - shifted_target_logit``; the ``exp`` buffer divided by ``sum_exp`` is
   the softmax, saved for the backward pass (``grad = softmax - onehot(target)``).

Everything runs in float32 whatever the logits' dtype: bf16 has 8 mantissa bits, too few for a
sum over a large vocabulary, and the max-subtraction is exact in float32 for logits close to the
maximum (Sterbenz), so large offsets (logits around 1e4) lose nothing beyond the input rounding.
The loss is returned in float32; the gradient comes back in the logits' dtype.

Label smoothing follows upstream (NeMo's formula): ``alpha`` of the target's probability mass is
spread over the other ``K - 1`` classes, i.e. with ``s = alpha * K / (K - 1)``

    loss = (1 - s) * nll - s * mean_i(log p_i),

which is ``torch.nn.functional.cross_entropy(..., label_smoothing=s)``, not ``label_smoothing=
alpha``. ``K`` is the whole vocabulary and the mean runs over every rank's classes. The mean
log-probability is formed as ``mean_i(z_i - m) - log(sum_exp)`` from the shifted logits, never
as ``log(softmax)``, which is ``-inf`` where a probability underflows float32.
"""

from __future__ import annotations

from typing import Optional

import torch

# Imported by name, as upstream does: code and tests that patch
# ``cross_entropy.get_tensor_model_parallel_group`` see their patch used here.
from megatron.core.parallel_state import get_tensor_model_parallel_group
from megatron.core.tensor_parallel.utils import VocabUtility
from megatron.core.utils import get_pg_rank, get_pg_size

__all__ = ["VocabParallelCrossEntropy", "vocab_parallel_cross_entropy"]


class VocabParallelCrossEntropy:
    """The steps of the vocab-parallel cross entropy, shared by the unfused and fused losses.

    Every method works on one rank's partition ``[..., partition_vocab]``. Several update their
    first argument in place (noted per method) so that one float32 buffer holds the shifted
    logits, then their ``exp``, then the softmax, then the gradient.
    """

    @staticmethod
    def calculate_logits_max(
        vocab_parallel_logits: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the logits in float32 and their maximum over this partition's vocabulary.

        A float32 input comes back as the same tensor (no copy), as upstream's.
        """
        logits = vocab_parallel_logits.float()
        return logits, logits.amax(dim=-1)

    @staticmethod
    def calculate_predicted_logits(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        logits_max: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shifts the logits by the global maximum and gathers the target logits of this rank.

        ``vocab_parallel_logits`` (float32) is overwritten with ``exp(logits - logits_max)``.

        Returns:
            ``(target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits)``:
            True where the target lies outside ``[vocab_start_index, vocab_end_index)``; the
            target's index in this partition (0 where masked), flat; the target's shifted logit
            (0 where masked); this partition's sum of ``exp``; the ``exp`` buffer.
        """
        vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)
        target_mask, masked_target_1d, predicted_logits = _target_logits(
            vocab_parallel_logits, target, vocab_start_index, vocab_end_index
        )
        exp_logits, sum_exp_logits = _exp_and_sum(vocab_parallel_logits)
        return target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits

    @staticmethod
    def calculate_cross_entropy_loss(
        exp_logits: torch.Tensor, predicted_logits: torch.Tensor, sum_exp_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(softmax, loss)``; the softmax is ``exp_logits`` divided in place.

        ``predicted_logits`` and ``sum_exp_logits`` are the all-reduced (whole-vocabulary) values.
        """
        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        return exp_logits, loss

    @staticmethod
    def prepare_gradient_calculation_operands(
        softmax: torch.Tensor, target_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(grad_2d, arange_1d, softmax_update, grad_input)`` for the backward pass.

        ``grad_input`` is ``softmax`` itself (the gradient is built in its buffer) and ``grad_2d``
        its ``[tokens, partition_vocab]`` view; ``softmax_update`` is 1 for the tokens whose
        target this rank owns, else 0.
        """
        grad_2d = softmax.view(-1, softmax.size(-1))
        arange_1d = torch.arange(grad_2d.size(0), device=grad_2d.device)
        softmax_update = 1.0 - target_mask.view(-1).float()
        return grad_2d, arange_1d, softmax_update, softmax

    @staticmethod
    def calculate_gradients(
        grad_2d: torch.Tensor,
        arange_1d: torch.Tensor,
        masked_target_1d: torch.Tensor,
        softmax_update: torch.Tensor,
        grad_input: torch.Tensor,
        grad_output: torch.Tensor,
    ) -> torch.Tensor:
        """``(softmax - onehot(target)) * grad_output``, built in place in ``grad_input``."""
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input


def _target_logits(
    logits: torch.Tensor, target: torch.Tensor, vocab_start_index: int, vocab_end_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(target_mask, masked_target_1d, predicted_logits)`` of one partition (see above)."""
    target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
    # Masked tokens index column 0, a valid column; their gathered value is zeroed below.
    masked_target_1d = torch.where(target_mask, 0, target - vocab_start_index).view(-1)
    logits_2d = logits.view(-1, logits.size(-1))
    # gather copies, so the later in-place exp of ``logits`` leaves these values alone.
    predicted_1d = logits_2d.gather(1, masked_target_1d.unsqueeze(1)).squeeze(1)
    predicted_logits = predicted_1d.masked_fill(target_mask.view(-1), 0.0).view_as(target)
    return target_mask, masked_target_1d, predicted_logits


def _exp_and_sum(shifted_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp`` of the shifted logits in place (every argument <= 0: no overflow) and its sum."""
    torch.exp(shifted_logits, out=shifted_logits)
    return shifted_logits, shifted_logits.sum(dim=-1)


def _smoothing(label_smoothing: float, vocab_size: int) -> float:
    """Upstream's rescaled smoothing ``alpha * K / (K - 1)`` (``alpha`` spread over ``K - 1``)."""
    return label_smoothing * vocab_size / (vocab_size - 1)


def _check_arguments(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing < 1.0:
        # Upstream asserts 0 < label_smoothing < 1 when smoothing; a negative value, which it
        # silently treats as none, is refused here too.
        raise AssertionError(
            f"vocab_parallel_cross_entropy: label_smoothing={label_smoothing!r} is outside "
            "[0.0, 1.0); pass 0.0 for no smoothing or a fraction below 1 (e.g. 0.1)."
        )
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"vocab_parallel_cross_entropy: target has shape {tuple(target.shape)}, but the "
            f"logits of shape {tuple(logits.shape)} need {tuple(logits.shape[:-1])} (one class "
            "index per row of logits)."
        )
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(
            f"vocab_parallel_cross_entropy: target has dtype {target.dtype}; pass class indices "
            "as an integer tensor (torch.long)."
        )


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    # One collective per reduced quantity, on any group given (a one-rank group too), as
    # upstream: code that counts or intercepts them sees upstream's calls. Only a single process
    # without torch.distributed (no group at all) skips them.
    if group is not None:
        torch.distributed.all_reduce(tensor, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Loss per token of logits split along the vocabulary (module docstring for the math)."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
        """Returns the float32 loss of every token, shaped like ``target``."""
        _check_arguments(vocab_parallel_logits, target, label_smoothing)
        if tp_group is None and torch.distributed.is_initialized():
            tp_group = get_tensor_model_parallel_group()
        world_size, rank = get_pg_size(tp_group), get_pg_rank(tp_group)

        # A private float32 copy: the steps below overwrite it in place, and a float32 input
        # would otherwise be the caller's own tensor (upstream overwrites the caller's logits).
        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(
            vocab_parallel_logits.to(torch.float32, copy=True)
        )
        _all_reduce(logits_max, torch.distributed.ReduceOp.MAX, tp_group)

        partition_vocab_size = logits.size(-1)
        vocab_size = partition_vocab_size * world_size
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, rank, world_size
        )
        logits -= logits_max.unsqueeze(dim=-1)
        target_mask, masked_target_1d, predicted_logits = _target_logits(
            logits, target, vocab_start, vocab_end
        )
        # Sums over the partition, each all-reduced in upstream's order: the target's logit, then
        # sum(exp); with smoothing also sum(shifted logits), for the mean log-probability.
        shifted_sum = logits.sum(dim=-1) if label_smoothing > 0 else None
        exp_logits, sum_exp_logits = _exp_and_sum(logits)
        _all_reduce(predicted_logits, torch.distributed.ReduceOp.SUM, tp_group)
        _all_reduce(sum_exp_logits, torch.distributed.ReduceOp.SUM, tp_group)

        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(
            exp_logits, predicted_logits, sum_exp_logits
        )
        if shifted_sum is not None:
            _all_reduce(shifted_sum, torch.distributed.ReduceOp.SUM, tp_group)
            smoothing = _smoothing(label_smoothing, vocab_size)
            mean_log_probs = shifted_sum / vocab_size - torch.log(sum_exp_logits)
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        """``(softmax - (1 - s) * onehot(target) - s / K) * grad_output`` (``s = 0`` unsmoothed)."""
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, softmax_update, grad_input = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask)
        )
        if ctx.label_smoothing > 0:
            smoothing = _smoothing(ctx.label_smoothing, ctx.vocab_size)
            grad_2d[arange_1d, masked_target_1d] -= (1.0 - smoothing) * softmax_update
            grad_2d -= smoothing / ctx.vocab_size
            grad_input.mul_(grad_output.unsqueeze(dim=-1))
        else:
            grad_input = VocabParallelCrossEntropy.calculate_gradients(
                grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output
            )
        return grad_input, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> torch.Tensor:
    """Cross-entropy loss of every token, with the vocabulary split across tensor-parallel ranks.

    Args:
        vocab_parallel_logits: This rank's logits, ``[sequence, batch, vocab / tp]`` (any leading
            shape); rank ``r`` holds classes ``[r * vocab / tp, (r + 1) * vocab / tp)``. Any
            floating dtype; the computation runs in float32 and the input is not modified.
        target: Class indices into the whole vocabulary, shaped like the logits without their
            last dimension (``[sequence, batch]``), the same on every rank.
        label_smoothing: Upstream's smoothing factor ``alpha`` in ``[0.0, 1.0)``; 0.0 is none.
            It equals torch's ``label_smoothing = alpha * vocab / (vocab - 1)``.
        tp_group: The group the vocabulary is split over; parallel_state's tensor-parallel group
            when None (a single rank without ``torch.distributed``).

    Returns:
        The float32 loss of every token, shaped like ``target`` (no reduction).

    Raises:
        AssertionError: ``label_smoothing`` is outside ``[0.0, 1.0)`` (upstream's error type).
        ValueError: ``target`` does not match the logits' leading shape or is not integral.
    """
    return _VocabParallelCrossEntropy.apply(
        vocab_parallel_logits, target, label_smoothing, tp_group
    )
