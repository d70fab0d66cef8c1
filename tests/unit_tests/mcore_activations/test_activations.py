"""Upstream's activation callables (``megatron.core.activations``) against the spec's reference."""

from __future__ import annotations

import pytest
import torch

from megatron.core import activations
from megatron.core.transformer.activation_spec import ActivationKind, ActivationSpec


@pytest.mark.parametrize("linear_scale", [None, 2.5])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_situ_glu_matches_the_reference(linear_scale, offset):
    x = (4 * torch.randn(6, 16, dtype=torch.float64)).requires_grad_()
    spec = ActivationSpec(
        ActivationKind.SILU,
        gated=True,
        gate_tanh_scale=3.0,
        linear_tanh_scale=linear_scale,
        linear_offset=offset,
    )
    got = activations.situ_glu(x.float(), 3.0, linear_scale, offset)
    torch.testing.assert_close(got.double(), spec.reference(x), rtol=1e-6, atol=1e-6)
    got.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize(
    "args", [(0.0, None, 0.0), (3.0, -1.0, 0.0), (3.0, None, float("nan"))], ids=str
)
def test_situ_glu_refuses_bad_numbers(args):
    with pytest.raises(ValueError, match="must be finite"):
        activations.situ_glu(torch.ones(2, 4), *args)
