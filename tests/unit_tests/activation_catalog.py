"""The activations every test parametrizes over, as config kwargs and as ActivationSpecs.

The tests' entries of the one catalogue, ``mcore_activations.activation_catalogue`` (which the
audits read too), at the tests' values: clamp values small enough that inputs with std ~3 hit
them on a large fraction of elements (``activation_catalogue.USES`` says why each use has its own).
"""

from __future__ import annotations

from mcore_activations import activation_catalogue
from megatron.core.transformer.activation_audit_paths import FUNCTIONS
from megatron.core.transformer.activation_spec import ActivationSpec

_TESTS = activation_catalogue.entries(activation_catalogue.TESTS)

# name -> TransformerConfig activation kwargs
CONFIGS = {entry.key: entry.config(activation_catalogue.TESTS, FUNCTIONS) for entry in _TESTS}

NEEDS_MOE = {entry.key for entry in _TESTS if entry.needs_moe}  # the SwiGLU clamp is MoE-only


class _Fields:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def spec_of(name: str, glu_interleave_size=None) -> ActivationSpec:
    """The ActivationSpec of catalogue entry ``name``."""
    return ActivationSpec.from_config(
        _Fields(**CONFIGS[name]), glu_interleave_size=glu_interleave_size
    )


SPECS = {name: spec_of(name) for name in CONFIGS}
GATED = [name for name, spec in SPECS.items() if spec.gated]


def layout_cases() -> list[tuple[str, object]]:
    """``(name, glu_interleave_size)`` for every entry: each GLU also in a 4-column interleave."""
    return [
        (name, interleave)
        for name in sorted(SPECS)
        for interleave in ((None, 4) if SPECS[name].gated else (None,))
    ]
