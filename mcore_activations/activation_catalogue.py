"""The activations the audits and the tests run: one table, one vocabulary.

Each :class:`Activation` names one configuration by a key (``"swiglu_clamp"``: test ids and
lookups), the ``TransformerConfig`` fields that select it, and its scalar values in each use
that runs it (:data:`USES` says why those values differ). Its label, the column the audits print,
is derived, never written by hand: the model family, then :attr:`ActivationSpec.name` at the
use's values, e.g. ``DeepSeek-V4 SwiGLU(clamp=7)``.

The fork's audit (``megatron.core.transformer.activation_audit``), the upstream audit
(``mcore-activations-audit``) and the tests' catalogue (``tests/unit_tests/activation_catalog.py``)
all read this table. Functions are named, not imported: each caller resolves the names with the
callables of the megatron-core it runs (upstream compares ``quick_gelu`` by identity, so the
upstream audit must pass upstream's object).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping

from mcore_activations.activation_spec import ActivationSpec
from mcore_activations.audit_config import FUNCTION_NAMES

TESTS = "tests"
FORK_AUDIT = "fork audit"
UPSTREAM_AUDIT = "upstream audit"

# Why each use has its own clamp and tanh-scale values. A value must be small enough that the
# use's pre-activations land beyond it on many elements, or the clamp goes untested.
USES = {
    TESTS: "the layer and kernel tests draw inputs with std ~3, so clamps and tanh scales of "
    "1.5-3 bite on a large fraction of elements while a share stays inside (both branches of "
    "every gradient are exercised).",
    FORK_AUDIT: "the model families' own values (DeepSeek-V4 and gpt-oss clamp 7, Kimi-K3 "
    "s_g=4 / s_l=25): the audit scales fc1 so pre-activations have std ~8, which reaches them, "
    "and a column then reads as the model's configuration.",
    UPSTREAM_AUDIT: "upstream's layers get N(0, 1) weights on hidden 32 (fc1 outputs std ~6), "
    "so clamps of 0.5 and 1.5 cut most elements; its before/after tables in "
    "docs/using-with-megatron-lm.md were recorded at these values on an H200.",
}


@dataclasses.dataclass(frozen=True)
class Activation:
    """One configuration of the catalogue.

    Attributes:
        key: Its id in tests and lookups (snake case).
        function: ``activation_func`` by name, one of :data:`FUNCTION_NAMES`.
        gated: ``gated_linear_unit``.
        values: Use (a key of :data:`USES`) -> the scalar config fields at that use (clamp,
            tanh scales); a use not listed does not run this configuration.
        fields: Config fields that are the same in every use (e.g. ``glu_linear_offset``).
        family: The model family the label starts with, if any.
        needs_moe: Upstream's config rule: the SwiGLU clamp is allowed for MoE layers only.
    """

    key: str
    function: str
    gated: bool
    values: Mapping[str, Mapping[str, float]]
    fields: Mapping[str, float] = dataclasses.field(default_factory=dict)
    family: str = ""
    needs_moe: bool = False

    def __post_init__(self):
        if self.function not in FUNCTION_NAMES:
            raise ValueError(f"{self.key}: function {self.function!r} is not in {FUNCTION_NAMES}")
        unknown = sorted(set(self.values) - set(USES))
        if unknown:
            raise ValueError(f"{self.key}: unknown uses {unknown}; the uses are {list(USES)}")

    def config(self, use: str, functions: Mapping[str, Callable]) -> dict:
        """The ``TransformerConfig`` activation fields of this entry at ``use``.

        Args:
            use: A key of :data:`USES` that runs this entry.
            functions: :data:`FUNCTION_NAMES` -> the callables of the megatron-core in use.

        Raises:
            KeyError: ``use`` does not run this entry.
        """
        if use not in self.values:
            raise KeyError(f"{self.key} is not run by the {use}; it is run by {list(self.values)}")
        kwargs = dict(activation_func=functions[self.function])
        if self.gated:
            kwargs["gated_linear_unit"] = True
        return {**kwargs, **self.fields, **self.values[use]}

    def label(self, use: str, functions: Mapping[str, Callable]) -> str:
        """The column label at ``use``: the family, then the spec's name at the use's values."""
        name = ActivationSpec.from_config(types.SimpleNamespace(**self.config(use, functions)))
        return f"{self.family} {name.name}" if self.family else name.name


_ALL = (TESTS, FORK_AUDIT, UPSTREAM_AUDIT)


def _everywhere(**fields):
    return {use: dict(fields) for use in _ALL}


def _tests(**fields):
    return {TESTS: dict(fields)}


def _clamp(*, tests: float, fork: float, upstream: float):
    field = "activation_func_clamp_value"
    return {TESTS: {field: tests}, FORK_AUDIT: {field: fork}, UPSTREAM_AUDIT: {field: upstream}}


CATALOGUE = (
    Activation("swiglu", "silu", True, _everywhere()),
    Activation(
        "swiglu_clamp",
        "silu",
        True,
        _clamp(tests=1.5, fork=7.0, upstream=0.5),
        family="DeepSeek-V4",
        needs_moe=True,
    ),
    Activation(
        "situ_glu",
        "silu",
        True,
        {
            TESTS: dict(
                activation_func_tanh_clamp_scale=2.0, activation_func_tanh_clamp_scale_linear=3.0
            ),
            FORK_AUDIT: dict(
                activation_func_tanh_clamp_scale=4.0, activation_func_tanh_clamp_scale_linear=25.0
            ),
        },
        family="Kimi-K3",
    ),
    Activation("situ_glu_gate_only", "silu", True, _tests(activation_func_tanh_clamp_scale=2.0)),
    Activation(
        "quick_geglu_gpt_oss",
        "quick_gelu",
        True,
        _clamp(tests=2.5, fork=7.0, upstream=1.5),
        fields=dict(glu_linear_offset=1.0),
        family="gpt-oss",
    ),
    Activation("quick_geglu_offset", "quick_gelu", True, _tests(), dict(glu_linear_offset=1.0)),
    # GEGLU is the tanh form (fast_gelu), GEGLU (erf) upstream's F.gelu: ActivationSpec.name.
    Activation("geglu", "fast_gelu", True, {TESTS: {}, FORK_AUDIT: {}}),
    Activation("geglu_erf", "gelu", True, {TESTS: {}, UPSTREAM_AUDIT: {}}),
    Activation("geglu_clamp", "fast_gelu", True, _tests(activation_func_clamp_value=2.0)),
    Activation("reglu", "relu", True, _tests()),
    Activation("gelu", "gelu", False, _tests()),
    Activation("fast_gelu", "fast_gelu", False, _tests()),
    Activation("fast_gelu_tanh", "fast_gelu", False, _tests(activation_func_tanh_clamp_scale=1.5)),
    Activation("silu", "silu", False, _tests()),
    Activation("silu_tanh", "silu", False, _tests(activation_func_tanh_clamp_scale=1.5)),
    Activation("relu", "relu", False, _tests()),
    Activation("relu_tanh", "relu", False, _tests(activation_func_tanh_clamp_scale=1.5)),
    Activation("squared_relu", "squared_relu", False, {TESTS: {}, UPSTREAM_AUDIT: {}}),
    Activation(
        "squared_relu_tanh",
        "squared_relu",
        False,
        {
            TESTS: dict(activation_func_tanh_clamp_scale=2.0),
            FORK_AUDIT: dict(activation_func_tanh_clamp_scale=10.0),
        },
    ),
    Activation("quick_gelu", "quick_gelu", False, _tests()),
    Activation(
        "quick_gelu_tanh", "quick_gelu", False, _tests(activation_func_tanh_clamp_scale=1.5)
    ),
)

BY_KEY = {entry.key: entry for entry in CATALOGUE}


def entries(use: str) -> tuple[Activation, ...]:
    """The entries ``use`` runs, in catalogue order.

    Raises:
        KeyError: ``use`` is not a key of :data:`USES`.
    """
    if use not in USES:
        raise KeyError(f"unknown use {use!r}; the uses are {list(USES)}")
    return tuple(entry for entry in CATALOGUE if use in entry.values)


def columns(use: str, functions: Mapping[str, Callable]) -> dict[str, dict]:
    """``{label: TransformerConfig fields}`` of every entry ``use`` runs: an audit's columns."""
    return {entry.label(use, functions): entry.config(use, functions) for entry in entries(use)}
