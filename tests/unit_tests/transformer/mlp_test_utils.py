"""Helpers shared by the MLP / expert tests: configs per activation path, and float64 references.

Every numerical test builds a layer from ``activation_catalog`` entry, runs forward and backward,
and compares output, input gradient and every parameter gradient with a float64 model written
out by hand on the same weights (fc1 -> ``ActivationSpec.reference`` -> fc2), within the dtype's
tolerance from ``tests.unit_tests.tolerances``.

Inputs are drawn so that fc1's pre-activations have a standard deviation of about 8, far beyond
the catalogue's clamp values and tanh scales: every clamp is active on a large fraction of the
elements, and :func:`assert_clamps_active` checks that.

bf16 and clamp boundaries: a hard clamp's gradient jumps at the boundary. Rounding fc1's output
to bf16 moves some pre-activations across it, which changes those elements' gradients by their
full size, so no bf16 tolerance could hold against a reference that takes its clamp decisions
from the exact float64 pre-activations. In bf16 the reference therefore takes the *value* of
fc1's output from the layer (a straight-through anchor; the float64 graph still differentiates
``x @ W1.T`` exactly) and a separate check compares that fc1 output with the float64 one. The
bias added before the activation is kept at zero in bf16 dense tests for the same reason (an
unfused bias add rounds again); its gradient is still checked. float32 tests anchor nothing.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from mcore_activations.fusions.activation_ops import use_compiled_kernels
from mcore_activations.reference_mlp import straight_through
from megatron.core.transformer.activation_spec import ActivationSpec, deinterleave_glu
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.activation_catalog import CONFIGS
from tests.unit_tests.tolerances import assert_close_to_reference

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}

# Activation paths. "compiled" is the fused path with the kernels run through torch.compile.
UNFUSED, FUSED, COMPILED = "unfused", "fused", "compiled"

PRE_ACTIVATION_STD = 8.0

# A clamp must change at least this fraction of the elements, and leave at least this fraction
# unchanged, for a test to exercise both sides of it.
_MIN_ACTIVE_FRACTION = 0.05


def path_flags(path: str) -> dict:
    """TransformerConfig kwargs that select ``path``."""
    return {"bias_activation_fusion": path in (FUSED, COMPILED)}


def kernel_mode(path: str):
    """Context in which a layer on ``path`` runs its fused kernels eagerly or compiled."""
    if path == UNFUSED:
        return contextlib.nullcontext()
    return use_compiled_kernels(path == COMPILED)


def make_config(entry: str, dtype: torch.dtype, path: str, **overrides) -> TransformerConfig:
    """A TransformerConfig for catalogue ``entry`` on ``path`` (raises if the config refuses)."""
    kwargs = dict(
        num_layers=2,
        hidden_size=24,
        num_attention_heads=4,
        ffn_hidden_size=40,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        add_bias_linear=True,
    )
    kwargs.update(CONFIGS[entry])
    kwargs.update(path_flags(path))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def config_accepts(entry: str, path: str, **overrides) -> bool:
    """Whether TransformerConfig validation accepts ``entry`` on ``path``."""
    try:
        make_config(entry, torch.float32, path, **overrides)
    except ValueError:
        return False
    return True


def fill_weights_(
    weight: torch.Tensor, fan_in: int, std: float, generator: torch.Generator
) -> None:
    """Fills ``weight`` so that unit-variance inputs give outputs of standard deviation ``std``."""
    values = torch.randn(weight.shape, generator=generator) * (std / fan_in**0.5)
    with torch.no_grad():
        weight.copy_(values.to(weight.dtype))


def fill_bias_(bias: Optional[torch.Tensor], std: float, generator: torch.Generator) -> None:
    """Fills ``bias`` (if any) with N(0, std) values (zeros for ``std == 0``)."""
    if bias is None:
        return
    values = torch.randn(bias.shape, generator=generator) * std
    with torch.no_grad():
        bias.copy_(values.to(bias.dtype))


def leaf64(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A float64 copy of ``tensor`` that requires grad (None stays None)."""
    if tensor is None:
        return None
    return tensor.detach().double().requires_grad_()


# A float64 value with the layer's value (bf16 only, see the module docstring).
anchored = straight_through


def capture_output(module: torch.nn.Module) -> dict:
    """Records the first output of each call of ``module`` in the returned dict's ``"out"``."""
    record = {}

    def hook(_module, _inputs, output):
        record["out"] = output[0] if isinstance(output, tuple) else output

    module.register_forward_hook(hook)
    return record


def clamp_activity(spec: ActivationSpec, h: torch.Tensor) -> dict:
    """Fraction of elements on which each of ``spec``'s clamps changes the value.

    Args:
        spec: The activation.
        h: The activation input (bias included), in ``spec``'s GLU layout.
    """
    h = h.detach().double()
    active = {}
    if spec.gated:
        gate, lin = deinterleave_glu(h, spec.glu_interleave_size)
        if spec.clamp_value is not None:
            active["gate clamp"] = (gate > spec.clamp_value).double().mean().item()
            active["linear clamp"] = (lin.abs() > spec.clamp_value).double().mean().item()
        if spec.gate_tanh_scale is not None:
            active["gate tanh"] = (gate.abs() > spec.gate_tanh_scale).double().mean().item()
        if spec.linear_tanh_scale is not None:
            active["linear tanh"] = (lin.abs() > spec.linear_tanh_scale).double().mean().item()
    elif spec.gate_tanh_scale is not None:
        active["tanh"] = (h.abs() > spec.gate_tanh_scale).double().mean().item()
    return active


def assert_clamps_active(spec: ActivationSpec, h: torch.Tensor) -> None:
    """Asserts each clamp of ``spec`` is active on a nontrivial fraction of ``h``, not on all."""
    for name, fraction in clamp_activity(spec, h).items():
        assert _MIN_ACTIVE_FRACTION < fraction < 1.0 - _MIN_ACTIVE_FRACTION, (
            f"{spec.name}: {name} active on {fraction:.1%} of the elements; the test inputs do "
            "not exercise both sides of it"
        )


def assert_grads_match(
    named_params: dict, reference_params: dict, dtype: torch.dtype, what: str
) -> None:
    """Compares the gradient of every parameter with its float64 reference's gradient.

    Args:
        named_params: ``name -> parameter`` of the layer under test (every one is checked).
        reference_params: ``name -> float64 leaf`` used by the reference; must have the same
            names.
        dtype: Tolerance key.
        what: Label for error messages.
    """
    assert set(named_params) == set(reference_params), (
        f"{what}: parameters {sorted(named_params)} vs reference {sorted(reference_params)}"
    )
    for name, param in named_params.items():
        reference = reference_params[name]
        assert param.grad is not None, f"{what}: {name} received no gradient"
        assert reference.grad is not None, f"{what}: reference {name} received no gradient"
        assert_close_to_reference(param.grad, reference.grad, dtype, f"{what} d{name}")
