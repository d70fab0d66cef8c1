"""The one Transformer Engine activation lowering: ActivationSpec -> ``te.pytorch.ops`` op.

Every TE path that computes an MLP activation asks :func:`lower_activation_to_te_op` for its op:
the fork's fused MLP classes, and upstream's classes once ``mcore_activations.patch`` is applied.
It maps an :class:`ActivationSpec` to the op and arguments that compute exactly
``spec.reference``, or raises :class:`UnsupportedActivationError` naming the path, the activation,
the reason and what to configure instead (the table is in docs/te-paths.md).

TE itself is read from the import seam (``te_import.te``) at call time, so a fake ``te`` set there
by a test is what the lowering sees, version checks included.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Optional

from mcore_activations import te_import
from mcore_activations.activation_spec import (
    QUICK_GELU_ALPHA,
    ActivationKind,
    ActivationSpec,
    UnsupportedActivationError,
    activation_kind_of,
)
from mcore_activations.te_import import (
    TE_CACHE_QUANTIZED_INPUT_MIN_VERSION,
    TE_CLAMPED_GLU_MIN_VERSION,
    TE_GROUPED_OPS_MIN_VERSION,
    TE_INSTALL_HINT,
    TE_OPS_MIN_VERSION,
    TE_SILU_MIN_VERSION,
    TE_SITU_GLU_MIN_VERSION,
)

# ----------------------------------------------------------------------------- the lowering


class TEVersionError(UnsupportedActivationError, RuntimeError):
    """The activation maps to a TE op, but the installed TE (or its absence) cannot provide it.

    It is an :class:`UnsupportedActivationError` (hence a ``ValueError``) like every other
    refusal, and also a ``RuntimeError``, which is what upstream raises for a too-old TE.
    """


@dataclasses.dataclass(frozen=True)
class _OpFacts:
    """What one ``te.pytorch.ops`` activation class accepts (TE 2.20.2 signatures)."""

    min_version: str
    scaled: bool = False  # takes a per-row scale tensor as an extra input
    cache_quantized_input: bool = False  # accepts the keyword (on TE >= 2.3)
    interleave: bool = False  # accepts glu_interleave_size


_OP_FACTS = {
    # Unary ops.
    "GELU": _OpFacts(TE_OPS_MIN_VERSION, cache_quantized_input=True),
    "QGELU": _OpFacts(TE_OPS_MIN_VERSION, cache_quantized_input=True),
    "ReLU": _OpFacts(TE_OPS_MIN_VERSION, cache_quantized_input=True),
    "SReLU": _OpFacts(TE_OPS_MIN_VERSION, cache_quantized_input=True),
    "SiLU": _OpFacts(TE_SILU_MIN_VERSION, cache_quantized_input=True),
    "ScaledSReLU": _OpFacts(TE_GROUPED_OPS_MIN_VERSION, scaled=True),
    "ScaledTanhSReLU": _OpFacts(TE_GROUPED_OPS_MIN_VERSION, scaled=True),
    # GLUs without a layout option.
    "GEGLU": _OpFacts(TE_OPS_MIN_VERSION, cache_quantized_input=True),
    "QGEGLU": _OpFacts(TE_OPS_MIN_VERSION, cache_quantized_input=True),
    "ReGLU": _OpFacts(TE_OPS_MIN_VERSION, cache_quantized_input=True),
    "SReGLU": _OpFacts(TE_OPS_MIN_VERSION, cache_quantized_input=True),
    # The SwiGLU family, which reads either layout.
    "SwiGLU": _OpFacts(TE_OPS_MIN_VERSION, cache_quantized_input=True, interleave=True),
    "ClampedSwiGLU": _OpFacts(
        TE_CLAMPED_GLU_MIN_VERSION, cache_quantized_input=True, interleave=True
    ),
    "SiTUGLU": _OpFacts(TE_SITU_GLU_MIN_VERSION, cache_quantized_input=True, interleave=True),
    "ScaledSwiGLU": _OpFacts(TE_GROUPED_OPS_MIN_VERSION, scaled=True, interleave=True),
    "ScaledClampedQGeGLU": _OpFacts(TE_CLAMPED_GLU_MIN_VERSION, scaled=True, interleave=True),
    "ScaledSiTUGLU": _OpFacts(TE_SITU_GLU_MIN_VERSION, scaled=True, interleave=True),
}

# The block-interleaved layout of the unscaled ops is implemented in Python by TE; the keyword
# arrived with the grouped-MLP work, so older builds are refused rather than handed a TypeError.
TE_GLU_INTERLEAVE_MIN_VERSION = TE_GROUPED_OPS_MIN_VERSION
# The row-scaled kernels read interleaved blocks of a multiple of 32 columns.
_SCALED_INTERLEAVE_MULTIPLE = 32

_UNFUSED_PATH_HINT = (
    "run this layer on a path that computes it, e.g. the unfused MLP "
    "(use_transformer_engine_op_fuser=False, optionally with bias_activation_fusion=True)"
)


def _or_unfused(first: str) -> str:
    return f"{first}, or {_UNFUSED_PATH_HINT}."


@dataclasses.dataclass(frozen=True)
class TEActivationLowering:
    """A resolved lowering: which ``te.pytorch.ops`` class to build, with which arguments.

    Produced by :func:`plan_te_activation` after every check has passed, so :meth:`build` can
    only fail if TE itself changes underneath. Fused modules plan in ``__init__`` (an unsupported
    config fails at model build) and build when their ops are first needed.

    Attributes:
        spec: The activation (with the GLU layout the op reads).
        path: The MLP path it was lowered for (used in messages).
        op_name: Name of the class in ``te.pytorch.ops``, e.g. ``"ClampedSwiGLU"``.
        kwargs: Constructor keyword arguments, as sorted ``(name, value)`` pairs.
        scaled: The op takes a per-row scale tensor as an extra input.
    """

    spec: ActivationSpec
    path: str
    op_name: str
    kwargs: tuple[tuple[str, Any], ...]
    scaled: bool

    @property
    def op_kwargs(self) -> dict:
        """The constructor keyword arguments as a dict."""
        return dict(self.kwargs)

    def build(self):
        """Constructs the op from the current ``te`` (looked up now, so tests can patch it)."""
        return getattr(te_import.te.pytorch.ops, self.op_name)(**self.op_kwargs)

    def describe(self) -> str:
        """E.g. ``ClampedSwiGLU(alpha=1.0, glu_linear_offset=0.0, limit=10.0)``."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs)
        return f"{self.op_name}({args})"


def _select_te_op(spec: ActivationSpec, path: str, scaled: bool) -> tuple[str, dict]:
    """Picks the op that computes ``spec`` and its math arguments, or refuses.

    Only the math is decided here; layout, caching and TE-version checks follow in
    :func:`plan_te_activation`.
    """
    _refuse_kinds_without_te_op(spec, path)
    if spec.gated and spec.is_situ_glu:
        return _situ_glu_op(spec, path, scaled)
    if spec.gated and spec.kind in (ActivationKind.SILU, ActivationKind.QUICK_GELU):
        return _swiglu_family_op(spec, scaled)
    if spec.gated:
        return _other_glu_op(spec, path, scaled)
    return _non_gated_op(spec, path, scaled)


def _refuse(spec: ActivationSpec, path: str, reason: str, alternative: str):
    raise UnsupportedActivationError(path, spec, reason, alternative)


def _refuse_kinds_without_te_op(spec: ActivationSpec, path: str) -> None:
    if spec.kind == ActivationKind.CUSTOM:
        func = getattr(spec.custom_func, "__qualname__", repr(spec.custom_func))
        _refuse(
            spec,
            path,
            "Transformer Engine ops implement a fixed set of activations and cannot run the "
            f"Python callable {func}",
            _or_unfused(
                "Use a built-in activation_func (F.silu, activations.fast_gelu, quick_gelu, "
                "F.relu, activations.squared_relu)"
            ),
        )
    if spec.kind == ActivationKind.GELU:
        _refuse(
            spec,
            path,
            "F.gelu is the exact (erf) GELU, but Transformer Engine's GELU ops compute the tanh "
            "approximation, which differs by up to ~1e-3",
            _or_unfused(
                "Set activation_func=megatron.core.activations.fast_gelu to run the tanh "
                "approximation through Transformer Engine"
            ),
        )


def _situ_glu_op(spec: ActivationSpec, path: str, scaled: bool) -> tuple[str, dict]:
    if spec.linear_tanh_scale is None:
        _refuse(
            spec,
            path,
            "Transformer Engine's SiTUGLU / ScaledSiTUGLU always soft-clamp the linear half "
            "with a finite beta2, but activation_func_tanh_clamp_scale_linear is not set, so "
            "the configured SiTU-GLU leaves the linear half unscaled",
            _or_unfused("Set activation_func_tanh_clamp_scale_linear (TE's beta2)"),
        )
    if spec.linear_offset != 0.0:
        _refuse(
            spec,
            path,
            f"Transformer Engine's SiTU-GLU ops have no linear offset "
            f"(glu_linear_offset={spec.linear_offset:g})",
            _or_unfused("Set glu_linear_offset=0.0"),
        )
    betas = dict(beta1=spec.gate_tanh_scale, beta2=spec.linear_tanh_scale)
    return ("ScaledSiTUGLU" if scaled else "SiTUGLU"), betas


def _swiglu_family_op(spec: ActivationSpec, scaled: bool) -> tuple[str, dict]:
    """Gated SiLU and quick-GELU: TE computes every clamp and offset of these."""
    kind, clamp, offset = spec.kind, spec.clamp_value, spec.linear_offset
    if clamp is None and offset == 0.0:
        if kind == ActivationKind.SILU:
            return ("ScaledSwiGLU" if scaled else "SwiGLU"), {}
        if not scaled and spec.glu_interleave_size is None:
            return "QGEGLU", {}
    # ClampedSwiGLU computes min(g, limit) * sigmoid(alpha * min(g, limit))
    # * (clamp(u, -limit, limit) + offset): SwiGLU for alpha=1, quick-GEGLU for 1.702.
    # Without a configured clamp the limit is +inf, never TE's default of 7.
    clamped = dict(
        limit=clamp if clamp is not None else math.inf,
        alpha=1.0 if kind == ActivationKind.SILU else QUICK_GELU_ALPHA,
        glu_linear_offset=offset,
    )
    return ("ScaledClampedQGeGLU" if scaled else "ClampedSwiGLU"), clamped


def _other_glu_op(spec: ActivationSpec, path: str, scaled: bool) -> tuple[str, dict]:
    op_name = {
        ActivationKind.GELU_TANH: "GEGLU",
        ActivationKind.RELU: "ReGLU",
        ActivationKind.SQUARED_RELU: "SReGLU",
    }[spec.kind]
    if spec.clamp_value is not None or spec.linear_offset != 0.0:
        _refuse(
            spec,
            path,
            f"Transformer Engine has no clamped or offset {op_name}: only SwiGLU and "
            "quick-GEGLU take a clamp and a linear offset (ClampedSwiGLU)",
            _or_unfused("Leave activation_func_clamp_value and glu_linear_offset unset"),
        )
    if scaled:
        _refuse_missing_scaled_form(spec, path, op_name)
    return op_name, {}


def _non_gated_op(spec: ActivationSpec, path: str, scaled: bool) -> tuple[str, dict]:
    kind = spec.kind
    if spec.gate_tanh_scale is not None:
        if kind != ActivationKind.SQUARED_RELU:
            _refuse(
                spec,
                path,
                f"Transformer Engine has no tanh soft-clamped {spec.name.split('(')[0]}; only "
                "squared ReLU has one (ScaledTanhSReLU)",
                _or_unfused("Leave activation_func_tanh_clamp_scale unset"),
            )
        if not scaled:
            _refuse(
                spec,
                path,
                "Transformer Engine's tanh soft-clamped squared ReLU exists only as the "
                "row-scaled ScaledTanhSReLU of the grouped-MLP ops",
                _or_unfused(
                    "Use a grouped path (TEFusedMLPWithGroupedLinear, FusedSharedExpertMLP, "
                    "fused TEGroupedMLP)"
                ),
            )
        return "ScaledTanhSReLU", dict(tanh_clamp_scale=spec.gate_tanh_scale)
    if kind == ActivationKind.SQUARED_RELU:
        return ("ScaledSReLU" if scaled else "SReLU"), {}
    op_name = {
        ActivationKind.GELU_TANH: "GELU",
        ActivationKind.RELU: "ReLU",
        ActivationKind.SILU: "SiLU",
        ActivationKind.QUICK_GELU: "QGELU",
    }[kind]
    if scaled:
        _refuse_missing_scaled_form(spec, path, op_name)
    return op_name, {}


def _refuse_missing_scaled_form(spec: ActivationSpec, path: str, op_name: str):
    raise UnsupportedActivationError(
        path,
        spec,
        f"Transformer Engine has no row-scaled form of {op_name}; the grouped-MLP ops exist for "
        "SwiGLU, clamped SwiGLU / quick-GEGLU, SiTU-GLU, squared ReLU and tanh soft-clamped "
        "squared ReLU",
        _or_unfused("Use TEFusedMLP (unscaled ops) for a dense layer"),
    )


def plan_te_activation(
    spec: ActivationSpec,
    *,
    path: str,
    scaled: bool,
    glu_interleave_size: Optional[int] = None,
    cache_quantized_input: bool = False,
) -> TEActivationLowering:
    """Resolves ``spec`` to a ``te.pytorch.ops`` op and its arguments, without building it.

    Args:
        spec: The activation.
        path: The MLP path asking (e.g. ``"TEFusedMLP"``), named in every error.
        scaled: The caller feeds a per-row scale tensor (MoE probabilities, or ones): pick the
            ``Scaled*`` op of the grouped-MLP fusions.
        glu_interleave_size: Block layout of the op's input. None means ``spec``'s own
            (``spec.glu_interleave_size``); giving a different non-None value is a bug.
        cache_quantized_input: Ask ops that support it to cache their input quantized for the
            backward pass (``activation_func_fp8_input_store``). It is a memory saving, not part
            of the math: it is passed on TE >= 2.3 to the ops that take it and dropped
            otherwise, as upstream does.

    Returns:
        The lowering; ``lowering.build()`` constructs the op.

    Raises:
        UnsupportedActivationError: No TE op computes ``spec`` on this path.
        TEVersionError: An op computes it, but TE is absent or too old (also a RuntimeError).
        ValueError: ``glu_interleave_size`` contradicts ``spec.glu_interleave_size``.
    """
    spec = _with_interleave(spec, glu_interleave_size, path)
    k = spec.glu_interleave_size
    op_name, kwargs = _select_te_op(spec, path, scaled)
    facts = _OP_FACTS[op_name]

    if k is not None:
        _check_interleave_layout(spec, path, op_name, facts)
    _check_te_provides(spec, path, op_name, facts.min_version, f"te.pytorch.ops.{op_name}")
    if k is not None and not facts.scaled:
        _check_te_provides(
            spec,
            path,
            op_name,
            TE_GLU_INTERLEAVE_MIN_VERSION,
            f"the glu_interleave_size option of te.pytorch.ops.{op_name}",
        )

    if facts.interleave and (k is not None or facts.scaled):
        kwargs["glu_interleave_size"] = k
    if facts.cache_quantized_input and te_import.is_te_min_version(
        TE_CACHE_QUANTIZED_INPUT_MIN_VERSION
    ):
        kwargs["cache_quantized_input"] = bool(cache_quantized_input)
    return TEActivationLowering(
        spec=spec,
        path=path,
        op_name=op_name,
        kwargs=tuple(sorted(kwargs.items())),
        scaled=facts.scaled,
    )


def _with_interleave(
    spec: ActivationSpec, glu_interleave_size: Optional[int], path: str
) -> ActivationSpec:
    """``spec`` with the caller's GLU block layout, which may only add to the spec's own."""
    if glu_interleave_size is None:
        return spec
    if spec.glu_interleave_size not in (None, glu_interleave_size):
        raise ValueError(
            f"plan_te_activation({path}): glu_interleave_size={glu_interleave_size} "
            f"contradicts the spec's layout ({spec.name})."
        )
    if not spec.gated:
        raise UnsupportedActivationError(
            path,
            spec,
            f"glu_interleave_size={glu_interleave_size} describes a gated (GLU) input, but "
            "the activation is not gated",
            "Leave glu_interleave_size unset for non-gated activations.",
        )
    return spec.with_interleave(glu_interleave_size)


def _check_interleave_layout(spec: ActivationSpec, path: str, op_name: str, facts) -> None:
    """Refuses a block-interleaved GLU input the chosen op cannot read."""
    k = spec.glu_interleave_size
    if not facts.interleave:
        raise UnsupportedActivationError(
            path,
            spec,
            f"Transformer Engine's {op_name} has no glu_interleave_size option, so it cannot "
            f"read the block-interleaved GLU layout (blocks of {k})",
            _or_unfused("Use the two-halves GLU layout (no interleave) for this activation"),
        )
    if facts.scaled and k % _SCALED_INTERLEAVE_MULTIPLE:
        raise UnsupportedActivationError(
            path,
            spec,
            f"Transformer Engine's {op_name} kernel reads interleaved GLU blocks whose size "
            f"is a multiple of {_SCALED_INTERLEAVE_MULTIPLE}, not {k}",
            f"Set the GLU interleave to a multiple of {_SCALED_INTERLEAVE_MULTIPLE} (TE's "
            "fused grouped-MLP kernels use 32).",
        )


def _check_te_provides(
    spec: ActivationSpec, path: str, op_name: str, min_version: str, what: str
) -> None:
    upgrade = f"Upgrade with: pip install --upgrade 'transformer-engine[pytorch]>={min_version}'."
    if not te_import.have_te():
        raise TEVersionError(
            path,
            spec,
            f"it lowers to te.pytorch.ops.{op_name}, but Transformer Engine cannot be imported "
            "here",
            _or_unfused(f"Install it with: {TE_INSTALL_HINT}"),
        )
    if not te_import.is_te_min_version(min_version):
        raise TEVersionError(
            path,
            spec,
            f"{what} needs Transformer Engine >= {min_version}, found {te_import.te_version()}",
            upgrade,
        )
    if not hasattr(te_import.te.pytorch.ops, op_name):
        raise TEVersionError(
            path,
            spec,
            f"this Transformer Engine build ({te_import.te_version()}) has no "
            f"te.pytorch.ops.{op_name}",
            upgrade,
        )


def lower_activation_to_te_op(
    spec: ActivationSpec,
    *,
    path: str,
    scaled: bool,
    glu_interleave_size: Optional[int] = None,
    cache_quantized_input: bool = False,
):
    """Builds the ``te.pytorch.ops`` op that computes ``spec``: the one TE activation lowering.

    See :func:`plan_te_activation` for the arguments and the errors; this is
    ``plan_te_activation(...).build()``.

    Returns:
        A new op. Unscaled ops take ``x``; ``Scaled*`` ops take ``(x, scales)`` with one scale per
        row of ``x``.
    """
    return plan_te_activation(
        spec,
        path=path,
        scaled=scaled,
        glu_interleave_size=glu_interleave_size,
        cache_quantized_input=cache_quantized_input,
    ).build()


def _make_te_ops_activation(
    activation_func: Callable, gated_linear_unit: bool, cache_quantized_input: bool
):
    """Upstream-compatible entry point: the TE op for a plain ``activation_func``.

    Kept with upstream's signature. It describes the activation as an :class:`ActivationSpec`
    with no clamp, scale or offset (the arguments carry none) and calls the lowering; configs with
    those options must go through :func:`lower_activation_to_te_op` with the full spec.

    Raises:
        UnsupportedActivationError: No TE op computes the activation, e.g. the exact-erf
            ``F.gelu`` (TE's GELU is the tanh form); a ``ValueError`` subclass.
    """
    kind = activation_kind_of(activation_func)
    spec = ActivationSpec(
        kind=kind,
        gated=bool(gated_linear_unit),
        custom_func=activation_func if kind == ActivationKind.CUSTOM else None,
    )
    return lower_activation_to_te_op(
        spec, path="TEFusedMLP", scaled=False, cache_quantized_input=cache_quantized_input
    )


class TEActivationOp:
    """The TE activation op of a config: ``TEActivationOp(config)`` returns a ``te.pytorch.ops`` op.

    Used as ``MLPSubmodules.activation_func`` with ``use_te_activation_func``. The op comes from
    :func:`lower_activation_to_te_op` (non-gated SiLU is ``ops.SiLU``), and every config it
    cannot compute is refused with its reason.

    Raises:
        UnsupportedActivationError: No TE op computes the configured activation.
    """

    def __new__(cls, config):
        te_import.require_te(cls.__name__, TE_OPS_MIN_VERSION)
        return lower_activation_to_te_op(
            ActivationSpec.from_config(config),
            path=cls.__name__,
            scaled=False,
            cache_quantized_input=bool(getattr(config, "activation_func_fp8_input_store", False)),
        )
