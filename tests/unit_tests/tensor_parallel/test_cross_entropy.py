"""vocab_parallel_cross_entropy on one rank: loss and gradient against float64 torch, label
smoothing with upstream's formula, stability at large logits, argument checks, the helper steps.
The vocabulary split over two ranks is in tests/unit_tests/parallel/test_cross_entropy_and_data.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megatron.core.tensor_parallel as tp
import megatron.core.tensor_parallel.cross_entropy as cross_entropy_module
from megatron.core import parallel_state
from megatron.core.tensor_parallel.cross_entropy import (
    VocabParallelCrossEntropy,
    vocab_parallel_cross_entropy,
)
from tests.unit_tests.tensor_parallel.cross_entropy_reference import (
    draw_inputs,
    reference_loss_and_grad,
)
from tests.unit_tests.tolerances import assert_close_to_reference

# tp_group=None means parallel_state's group: a one-rank world for every test here.
pytestmark = pytest.mark.usefixtures("single_rank_model_parallel")

SHAPE, VOCAB = (5, 3), 24  # [sequence, batch], vocabulary
ALPHAS = [0.0, 0.1]
DTYPES = [torch.float32, torch.bfloat16]


def _loss_and_grad(logits, target, grad_output, alpha=0.0, tp_group=None):
    x = logits.detach().clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, target, label_smoothing=alpha, tp_group=tp_group)
    loss.backward(grad_output)
    return loss.detach(), x.grad


def _check(logits, target, grad_output, alpha, what):
    loss, grad = _loss_and_grad(logits, target, grad_output, alpha)
    ref_loss, ref_grad = reference_loss_and_grad(logits, target, grad_output, alpha)
    assert loss.dtype == torch.float32, f"{what}: loss dtype {loss.dtype}"
    assert grad.dtype == logits.dtype, f"{what}: gradient dtype {grad.dtype}"
    # The loss is computed in float32 from the exactly representable inputs: float32 tolerance
    # whatever the input dtype; the gradient is rounded to the input's dtype.
    assert_close_to_reference(loss, ref_loss, torch.float32, f"{what}: loss")
    assert_close_to_reference(grad, ref_grad, logits.dtype, f"{what}: gradient")


@pytest.mark.parametrize("alpha", ALPHAS, ids=lambda a: f"smoothing{a}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_torch_cross_entropy(dtype, alpha):
    logits, target, grad_output = draw_inputs(0, SHAPE, VOCAB, dtype)
    _check(logits, target, grad_output, alpha, f"{dtype}, smoothing {alpha}")


@pytest.mark.parametrize("alpha", ALPHAS, ids=lambda a: f"smoothing{a}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stable_at_large_offsets(dtype, alpha):
    # exp(1e4) overflows every float type: only the max-subtraction keeps this finite.
    logits, target, grad_output = draw_inputs(1, SHAPE, VOCAB, dtype, offset=1e4)
    _check(logits, target, grad_output, alpha, f"{dtype} + 1e4, smoothing {alpha}")


@pytest.mark.parametrize("alpha", ALPHAS, ids=lambda a: f"smoothing{a}")
def test_stable_when_probabilities_underflow(alpha):
    # Logits 1e4 apart: most probabilities underflow to 0 in float32, where log(softmax) is
    # -inf; the smoothed loss needs the mean log-probability, formed from the shifted logits.
    logits, target, grad_output = draw_inputs(2, SHAPE, VOCAB, torch.float32, spread=3e3)
    probs = torch.softmax(logits, dim=-1)
    assert (probs == 0).any(), "the test needs underflowing probabilities"
    _check(logits, target, grad_output, alpha, f"underflow, smoothing {alpha}")


def test_smoothing_is_upstreams_not_torchs():
    # Upstream spreads alpha over K - 1 classes; torch's label_smoothing=alpha over K. The two
    # differ by far more than the tolerance, so the reference's conversion is what matches.
    logits, target, _ = draw_inputs(3, SHAPE, VOCAB, torch.float32)
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing=0.3)
    torch_alpha = F.cross_entropy(
        logits.double().view(-1, VOCAB), target.view(-1), reduction="none", label_smoothing=0.3
    ).view_as(target)
    assert (loss.double() - torch_alpha).abs().max() > 1e-3


def test_leaves_float32_logits_unchanged():
    logits, target, grad_output = draw_inputs(4, SHAPE, VOCAB, torch.float32)
    before = logits.clone()
    _loss_and_grad(logits, target, grad_output, 0.1)
    vocab_parallel_cross_entropy(logits, target)
    assert torch.equal(logits, before)


def test_single_rank_without_torch_distributed(monkeypatch):
    # Without torch.distributed there is no group: one rank holds the whole vocabulary.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)

    def no_groups():
        raise AssertionError("parallel_state consulted without torch.distributed")

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_group", no_groups)
    monkeypatch.setattr(cross_entropy_module, "get_tensor_model_parallel_group", no_groups)
    logits, target, grad_output = draw_inputs(5, SHAPE, VOCAB, torch.float32)
    _check(logits, target, grad_output, 0.1, "without torch.distributed")


class _OneRankGroup:
    """Stands in for a process group of one rank (what get_pg_size / get_pg_rank ask)."""

    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.mark.parametrize("alpha", ALPHAS, ids=lambda a: f"smoothing{a}")
def test_given_group_gets_one_collective_per_reduced_quantity(monkeypatch, alpha):
    # Upstream's calls, in upstream's order: MAX of the row maxima, then SUM of the target
    # logits and SUM of sum(exp), each on the group passed, a one-rank group included; with
    # smoothing a fourth SUM (of the shifted logits) follows. The global group is not read.
    group, calls = _OneRankGroup(), []

    def record(tensor, op=None, group=None):
        calls.append((op, group))

    def no_global_group():
        raise AssertionError("the global tensor-parallel group was read")

    monkeypatch.setattr(torch.distributed, "all_reduce", record)
    monkeypatch.setattr(cross_entropy_module, "get_tensor_model_parallel_group", no_global_group)
    logits, target, grad_output = draw_inputs(9, SHAPE, VOCAB, torch.float32)
    loss, grad = _loss_and_grad(logits, target, grad_output, alpha, tp_group=group)

    max_, sum_ = torch.distributed.ReduceOp.MAX, torch.distributed.ReduceOp.SUM
    expected = [(max_, group), (sum_, group), (sum_, group)] + ([(sum_, group)] if alpha else [])
    assert calls == expected
    ref_loss, ref_grad = reference_loss_and_grad(logits, target, grad_output, alpha)
    assert_close_to_reference(loss, ref_loss, torch.float32, "loss on a given group")
    assert_close_to_reference(grad, ref_grad, torch.float32, "gradient on a given group")


def test_default_group_is_looked_up_through_this_module(monkeypatch):
    # tp_group=None asks the name this module imported from parallel_state, as upstream's
    # does, so a patch of cross_entropy.get_tensor_model_parallel_group takes effect.
    group, asked = _OneRankGroup(), []

    def patched():
        asked.append(True)
        return group

    monkeypatch.setattr(cross_entropy_module, "get_tensor_model_parallel_group", patched)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None, group=None: None)
    logits, target, grad_output = draw_inputs(10, SHAPE, VOCAB, torch.float32)
    _check(logits, target, grad_output, 0.0, "patched default group")
    assert asked


@pytest.mark.parametrize("alpha", [1.0, 1.5, -0.1])
def test_label_smoothing_outside_range_is_refused(alpha):
    logits, target, _ = draw_inputs(6, SHAPE, VOCAB, torch.float32)
    with pytest.raises(AssertionError, match=rf"label_smoothing={alpha}.*\[0\.0, 1\.0\)"):
        vocab_parallel_cross_entropy(logits, target, label_smoothing=alpha)


def test_target_shape_and_dtype_are_checked():
    logits, target, _ = draw_inputs(7, SHAPE, VOCAB, torch.float32)
    with pytest.raises(ValueError, match=r"target has shape \(3, 5\).*need \(5, 3\)"):
        vocab_parallel_cross_entropy(logits, target.T)
    with pytest.raises(ValueError, match="target has dtype torch.float32.*integer"):
        vocab_parallel_cross_entropy(logits, target.float())


def test_helper_steps_compose_to_the_loss_and_gradient():
    # The fused losses call these steps one by one; composed they give the reference.
    logits, target, grad_output = draw_inputs(8, SHAPE, VOCAB, torch.float32)
    ref_loss, ref_grad = reference_loss_and_grad(logits, target, grad_output)
    steps = VocabParallelCrossEntropy
    buffer = logits.clone()
    shifted, logits_max = steps.calculate_logits_max(buffer)
    assert shifted is buffer, "a float32 input is used in place, as upstream's"
    mask, masked_target_1d, predicted, sum_exp, exp_logits = steps.calculate_predicted_logits(
        shifted, target, logits_max, 0, VOCAB
    )
    assert not mask.any()
    softmax, loss = steps.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
    assert_close_to_reference(loss, ref_loss, torch.float32, "loss")
    torch.testing.assert_close(softmax, torch.softmax(logits, dim=-1))
    grad_2d, arange_1d, update, grad_input = steps.prepare_gradient_calculation_operands(
        softmax, mask
    )
    grad = steps.calculate_gradients(
        grad_2d, arange_1d, masked_target_1d, update, grad_input, grad_output
    )
    assert_close_to_reference(grad, ref_grad, torch.float32, "gradient")


def test_targets_of_another_partition_are_masked():
    logits, target, _ = draw_inputs(9, SHAPE, VOCAB, torch.float32)
    steps = VocabParallelCrossEntropy
    shifted, logits_max = steps.calculate_logits_max(logits.clone())
    # This "rank" holds classes [VOCAB, 2 * VOCAB): no target is its own.
    mask, masked_target_1d, predicted, sum_exp, _ = steps.calculate_predicted_logits(
        shifted, target, logits_max, VOCAB, 2 * VOCAB
    )
    assert mask.all() and not masked_target_1d.any() and not predicted.any()
    torch.testing.assert_close(sum_exp, torch.exp(logits - logits_max[..., None]).sum(-1))


def test_exported_from_the_package():
    assert tp.vocab_parallel_cross_entropy is vocab_parallel_cross_entropy
    assert "vocab_parallel_cross_entropy" in tp.__all__ and "broadcast_data" in tp.__all__
