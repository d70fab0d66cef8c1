"""Checkpoint recomputation re-enters the FP8 state its forward ran under (``checkpoint_fp8``).

CPU tier: a Transformer Engine stand-in with TE's global FP8 state, its autocast context and its
activation-recompute phases records what a checkpointed block saw in its forward and in its
recomputation. GPU tier (real TE, FP8-capable GPU): a TE ``Linear`` under delayed scaling,
checkpointed and not, gives the same output and gradients.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from mcore_activations import te_import
from megatron.core.tensor_parallel import checkpoint_fp8
from megatron.core.tensor_parallel.random import (
    CheckpointWithoutOutput,
    checkpoint,
    model_parallel_cuda_manual_seed,
)


class FakeFP8Manager:
    """TE's global FP8 autocast state, as the FP8GlobalStateManager queries expose it."""

    enabled, calibrating, recipe, group = False, False, None, None

    @classmethod
    def is_fp8_enabled(cls):
        return cls.enabled

    @classmethod
    def is_fp8_calibration(cls):
        return cls.calibrating

    @classmethod
    def get_fp8_recipe(cls):
        return cls.recipe

    @classmethod
    def get_fp8_group(cls):
        return cls.group


def _fake_te(with_autocast=True, manager_module="quantization"):
    manager = type("FP8GlobalStateManager", (FakeFP8Manager,), {})
    phases = []  # (activation_recompute, recompute_phase) of each phase entered
    current_phase = []

    @contextlib.contextmanager
    def set_state(enabled, recipe, group, calibrating=False):
        saved = (manager.enabled, manager.calibrating, manager.recipe, manager.group)
        manager.enabled, manager.calibrating = enabled, calibrating
        manager.recipe, manager.group = recipe, group
        try:
            yield
        finally:
            manager.enabled, manager.calibrating, manager.recipe, manager.group = saved

    @contextlib.contextmanager
    def activation_recompute_forward(activation_recompute, recompute_phase):
        phases.append((activation_recompute, recompute_phase))
        current_phase.append(recompute_phase)
        try:
            yield
        finally:
            current_phase.pop()

    pytorch = SimpleNamespace(
        distributed=SimpleNamespace(activation_recompute_forward=activation_recompute_forward),
        fp8_autocast=lambda enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None: (
            set_state(enabled, fp8_recipe, fp8_group, calibrating)
        ),
    )
    setattr(pytorch, manager_module, SimpleNamespace(FP8GlobalStateManager=manager))
    if with_autocast:
        pytorch.autocast = lambda enabled=True, recipe=None, amax_reduction_group=None, **kw: (
            set_state(enabled, recipe, amax_reduction_group, kw.get("calibrating", False))
        )
    fake = SimpleNamespace(pytorch=pytorch, manager=manager, phases=phases)
    fake.phase = lambda: current_phase[-1] if current_phase else None
    return fake


@pytest.fixture
def fake_te(monkeypatch):
    fake = _fake_te()
    monkeypatch.setattr(te_import, "te", fake)
    monkeypatch.setattr(te_import, "HAVE_TE", True)
    model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    return fake


def _recording_block(fake, seen):
    def block(x):
        manager = fake.manager
        seen.append((manager.enabled, manager.recipe, manager.group, fake.phase()))
        return x * 3.0

    return block


def _leaf():
    return torch.ones(4, requires_grad=True)


def test_recomputation_runs_under_the_forward_fp8_state(fake_te):
    recipe, group = object(), object()
    seen = []
    x = _leaf()
    with fake_te.pytorch.autocast(enabled=True, recipe=recipe, amax_reduction_group=group):
        y = checkpoint(_recording_block(fake_te, seen), False, x)
    assert not fake_te.manager.enabled
    y.sum().backward()  # outside the autocast
    assert seen == [(True, recipe, group, False), (True, recipe, group, True)]
    assert fake_te.phases == [(True, False), (True, True)]
    assert not fake_te.manager.enabled  # the recomputation's autocast has closed again
    torch.testing.assert_close(x.grad, torch.full((4,), 3.0))


def test_recomputation_of_a_forward_without_fp8_runs_without_it(fake_te):
    seen = []
    x = _leaf()
    y = checkpoint(_recording_block(fake_te, seen), False, x)
    with fake_te.pytorch.autocast(enabled=True, recipe=object()):
        y.sum().backward()  # backward inside an autocast must not quantize the recomputation
    assert [s[0] for s in seen] == [False, False]
    assert seen[1][1] is None


@pytest.mark.parametrize("fp8", [False, True, "a recipe"])
def test_checkpoint_without_output_replays_fp8_unless_fp8_is_none(fake_te, fp8):
    recipe = object()
    seen = []
    ckpt = CheckpointWithoutOutput(fp8=fp8)
    x = _leaf()
    with fake_te.pytorch.autocast(enabled=True, recipe=recipe):
        y = ckpt.checkpoint(_recording_block(fake_te, seen), x)
        z = y * 2.0
    ckpt.discard_output_and_register_recompute(z)
    z.sum().backward()
    assert seen == [(True, recipe, None, False), (True, recipe, None, True)]
    torch.testing.assert_close(x.grad, torch.full((4,), 6.0))


def test_checkpoint_without_output_fp8_none_recomputes_as_it_finds(fake_te):
    seen = []
    ckpt = CheckpointWithoutOutput(fp8=None)
    x = _leaf()
    with fake_te.pytorch.autocast(enabled=True, recipe=object()):
        y = ckpt.checkpoint(_recording_block(fake_te, seen), x)
        z = y * 2.0
    ckpt.discard_output_and_register_recompute(z)
    z.sum().backward()
    assert [s[0] for s in seen] == [True, False]
    assert fake_te.phases == []


def test_older_te_replays_through_fp8_autocast_and_the_fp8_module(monkeypatch):
    fake = _fake_te(with_autocast=False, manager_module="fp8")
    monkeypatch.setattr(te_import, "te", fake)
    monkeypatch.setattr(te_import, "HAVE_TE", True)
    recipe = object()
    with fake.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe, calibrating=True):
        state = checkpoint_fp8.capture()
    assert state == checkpoint_fp8.FP8State(True, True, recipe, None)
    seen = []
    with checkpoint_fp8.recompute_phase(state):
        seen.append((fake.manager.enabled, fake.manager.calibrating, fake.manager.recipe))
    assert seen == [(True, True, recipe)]


def test_calibration_keeps_its_recipe_for_the_recomputation(fake_te):
    recipe = object()
    with fake_te.pytorch.autocast(enabled=False, recipe=recipe, calibrating=True):
        state = checkpoint_fp8.capture()
    assert state == checkpoint_fp8.FP8State(False, True, recipe, None)
    seen = []
    with checkpoint_fp8.recompute_phase(state):
        manager = fake_te.manager
        seen.append((manager.enabled, manager.calibrating, manager.recipe))
    assert seen == [(False, True, recipe)]


def test_without_te_nothing_is_captured_or_entered(monkeypatch):
    monkeypatch.setattr(te_import, "HAVE_TE", False)
    assert checkpoint_fp8.capture() is None
    with checkpoint_fp8.forward_phase(None), checkpoint_fp8.recompute_phase(None):
        pass


# ------------------------------------------------------------------------------- GPU tier


def _fp8_recipe_or_skip():
    te = pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.common import recipe as te_recipe

    manager = checkpoint_fp8._state_manager()
    if manager is None or not manager.is_fp8_available()[0]:
        pytest.skip("FP8 is not available on this GPU")
    return te, te_recipe.DelayedScaling()


def _te_autocast(te, recipe):
    autocast = getattr(te, "autocast", None)
    if autocast is not None:
        return autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def _te_model_init(te, recipe, enabled):
    init = getattr(te, "quantized_model_init", None)
    if init is not None:
        return init(enabled=enabled, recipe=recipe)
    return te.fp8_model_init(enabled=enabled, recipe=recipe)


@pytest.mark.gpu
@pytest.mark.te
@pytest.mark.parametrize("fp8_weights", [False, True], ids=["bf16-weights", "fp8-weights"])
def test_checkpointed_te_linear_under_delayed_scaling_matches_the_plain_one(fp8_weights):
    te, recipe = _fp8_recipe_or_skip()
    model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    inputs = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)

    def run(checkpointed):
        torch.manual_seed(3)  # the same weights for both passes (and fresh scaling state)
        with _te_model_init(te, recipe, fp8_weights):
            linear = te.Linear(
                128,
                256,
                bias=False,
                params_dtype=torch.bfloat16,
                device="cuda",
                fuse_wgrad_accumulation=True,
            )
        linear.weight.main_grad = torch.zeros(256, 128, device="cuda", dtype=torch.float32)
        x = inputs.clone().requires_grad_()
        for _ in range(2):  # a second step runs with the scales the first step's amaxes set
            x.grad = None
            linear.weight.main_grad.zero_()
            with _te_autocast(te, recipe):
                out = checkpoint(linear, False, x) if checkpointed else linear(x)
            out.float().square().sum().backward()
        return out.detach(), x.grad, linear.weight.main_grad

    plain, ckpt = run(False), run(True)
    torch.testing.assert_close(ckpt[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(ckpt[1], plain[1], rtol=0, atol=0)
    torch.testing.assert_close(ckpt[2], plain[2], rtol=0, atol=0)
