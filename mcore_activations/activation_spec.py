"""ActivationSpec: the one description of an MLP activation that every code path follows.

:meth:`ActivationSpec.from_config` turns the config's activation fields into a frozen value (the
only place they are read); every backend *lowers* that value to its implementation or refuses it
with :class:`UnsupportedActivationError`; :meth:`ActivationSpec.reference` is the formula every
test compares against. This module is the second rung of the activation ladder: it imports only
the upstream callables (``activations``) below it, never an implementation above it
(docs/activations.md).

Formulas (``g`` / ``u``: gate / linear half of the fc1 output, ``act``: the base function):

* gated: ``act(g') * (L + offset)`` with ``g' = min(g, c)`` when a clamp ``c`` is set; ``L = u``,
  or ``clamp(u, -c, c)`` with a clamp, or ``s_l * tanh(u / s_l)`` with a linear tanh scale.
* SiTU-GLU (gated SiLU with a tanh scale ``s_g``): the gate is ``s_g * tanh(g / s_g) * sigmoid(g)``;
  the sigmoid takes the *raw* gate.
* non-gated: ``act(x)``, or ``act(s_g * tanh(x / s_g))`` with a tanh scale.
* per-token probabilities (MoE) multiply the result row-wise.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from mcore_activations import activations
from mcore_activations.activations import (  # noqa: F401 - named once, beside the callables
    GELU_TANH_COEF,
    QUICK_GELU_ALPHA,
    situ,
    tanh_soft_clamp,
)

FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


def as_float32(value: float) -> float:
    """``value`` rounded to float32, as the kernels receive it (inf beyond float32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def is_positive_finite_float32(value: float) -> bool:
    """Whether ``value`` is a usable clamp or tanh scale once rounded to float32.

    A value finite in float64 can be inf in float32 (1e39: every output NaN) or round to zero or
    a subnormal (1e-46: 0/0 for a zero pre-activation).
    """
    rounded = as_float32(value)
    return math.isfinite(rounded) and rounded >= FLOAT32_TINY


def check_clamps_exclusive(
    clamp: Optional[float],
    gate_tanh_scale: Optional[float],
    names: tuple[str, str] = ("clamp_value", "gate_tanh_scale"),
) -> None:
    """The one rule that a hard clamp and a gate tanh scale are alternatives, never combined.

    Every path would have to agree on one order of composing the two (and Transformer Engine has
    no op for either order), so the config, the functional API and the spec all refuse the mix
    through this function, each naming the arguments as its caller spells them.

    Args:
        clamp: The hard clamp ``c`` in force (DeepSeek-V4), or None.
        gate_tanh_scale: The tanh soft-clamp scale ``s_g`` (SiTU-GLU), or None.
        names: How the caller names the two, e.g. the config's field names.

    Raises:
        ValueError: Both are set.
    """
    if clamp is not None and gate_tanh_scale is not None:
        raise ValueError(
            f"{names[0]}={clamp!r} and {names[1]}={gate_tanh_scale!r} are mutually exclusive: "
            "choose the hard clamp (DeepSeek-V4) or the tanh soft clamp (SiTU-GLU), not both."
        )


class UnsupportedActivationError(ValueError):
    """An MLP path cannot compute the configured activation.

    Raised at construction by the lowering of an :class:`ActivationSpec` to a backend, naming the
    path, the activation, the reason and what to configure instead.
    """

    def __init__(
        self,
        path: str,
        spec: Optional[ActivationSpec] = None,
        reason: Optional[str] = None,
        alternative: Optional[str] = None,
    ):
        self.path = path
        self.spec = spec
        self.reason = reason
        self.alternative = alternative
        if spec is None:
            # A whole message: how callers that re-raise with added context (upstream's
            # build_module does ``type(e)(f"{e} when instantiating ...")``) construct it.
            super().__init__(path)
        else:
            super().__init__(f"{path} cannot compute {spec.name}: {reason}. {alternative}")


class ActivationKind(str, enum.Enum):
    """The base elementwise function (applied to the gate half when gated)."""

    SILU = "silu"
    GELU = "gelu"  # exact (erf) GELU, ``F.gelu``
    GELU_TANH = "gelu_tanh"  # tanh approximation, ``activations.fast_gelu``
    QUICK_GELU = "quick_gelu"  # x * sigmoid(1.702 x)
    RELU = "relu"
    SQUARED_RELU = "squared_relu"
    CUSTOM = "custom"  # any other callable: only the unfused eager path can run it


_GATED_NAMES = {
    ActivationKind.SILU: "SwiGLU",
    ActivationKind.GELU: "GEGLU (erf)",
    ActivationKind.GELU_TANH: "GEGLU",
    ActivationKind.QUICK_GELU: "quick-GEGLU",
    ActivationKind.RELU: "ReGLU",
    ActivationKind.SQUARED_RELU: "squared-ReGLU",
    ActivationKind.CUSTOM: "GLU",
}
_UNARY_NAMES = {
    ActivationKind.SILU: "SiLU",
    ActivationKind.GELU: "GELU (erf)",
    ActivationKind.GELU_TANH: "GELU",
    ActivationKind.QUICK_GELU: "quick-GELU",
    ActivationKind.RELU: "ReLU",
    ActivationKind.SQUARED_RELU: "squared-ReLU",
    ActivationKind.CUSTOM: "custom activation",
}


# Upstream megatron-core's activation callables, by module and name.
_UPSTREAM_CALLABLES = {
    "megatron.core.activations": {
        "fast_gelu": ActivationKind.GELU_TANH,
        "quick_gelu": ActivationKind.QUICK_GELU,
        "squared_relu": ActivationKind.SQUARED_RELU,
    },
    "megatron.core.fusions.fused_bias_geglu": {"quick_gelu": ActivationKind.QUICK_GELU},
}


# The callables the spec recognises, by identity; modules above the spec add theirs with
# register_activation_callable (fused_bias_geglu's quick_gelu copy).
_KNOWN_CALLABLES: list[tuple[Callable, ActivationKind]] = [
    (F.silu, ActivationKind.SILU),
    (F.gelu, ActivationKind.GELU),
    (activations.fast_gelu, ActivationKind.GELU_TANH),
    (activations.quick_gelu, ActivationKind.QUICK_GELU),
    (F.relu, ActivationKind.RELU),
    (torch.relu, ActivationKind.RELU),
    (activations.squared_relu, ActivationKind.SQUARED_RELU),
]


def register_activation_callable(func: Callable, kind: ActivationKind) -> None:
    """Makes :func:`activation_kind_of` classify ``func`` (by identity) as ``kind``.

    For callables defined in modules above the spec, which the spec must not import: a config can
    only hold such a callable once its module is imported, and importing it registers it.
    """
    if not any(known is func for known, _ in _KNOWN_CALLABLES):
        _KNOWN_CALLABLES.append((func, ActivationKind(kind)))


def activation_kind_of(func: Callable) -> ActivationKind:
    """Classifies an ``activation_func`` by identity (never by name or behaviour).

    Both of megatron.core's ``quick_gelu`` copies map to QUICK_GELU. When an upstream
    megatron-core is installed (the patch of docs/using-with-megatron-lm.md), its callables of
    the same names are recognised too: they are other objects computing the same functions.
    """
    for known, kind in _KNOWN_CALLABLES:
        if func is known:
            return kind
    for module_name, names in _UPSTREAM_CALLABLES.items():
        # Only modules the caller already imported: the spec never imports megatron.core.
        module = sys.modules.get(module_name)
        for name, kind in names.items():
            if module is not None and func is getattr(module, name, None):
                return kind
    return ActivationKind.CUSTOM


def _fmt(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class ActivationSpec:
    """A complete, immutable description of an MLP activation.

    Build it with :meth:`from_config` (the one place that reads the config's activation fields) or
    directly in tests and tools. Values are validated on construction.

    Attributes:
        kind: Base elementwise function.
        gated: Whether the input holds ``[gate, linear]`` halves (a GLU).
        clamp_value: Hard clamp ``c`` of a GLU: gate ``<= c``, linear half in ``[-c, c]``.
        gate_tanh_scale: Tanh soft-clamp scale ``s_g`` (SiTU-GLU gate, or the input of a
            non-gated activation).
        linear_tanh_scale: SiTU-GLU linear-half scale ``s_l``.
        linear_offset: Added to a GLU's linear half after clamping (gpt-oss uses 1.0).
        glu_interleave_size: When set, the GLU input is laid out in blocks
            ``[g_0..g_{k-1}, u_0..u_{k-1}, g_k.., u_k.., ...]`` instead of two halves.
        custom_func: The callable of a CUSTOM kind.
    """

    kind: ActivationKind
    gated: bool = False
    clamp_value: Optional[float] = None
    gate_tanh_scale: Optional[float] = None
    linear_tanh_scale: Optional[float] = None
    linear_offset: float = 0.0
    glu_interleave_size: Optional[int] = None
    custom_func: Optional[Callable] = field(default=None, compare=True)

    def __post_init__(self):
        # Entry points build specs inside a caller's torch.compile; some Dynamo releases (2.11)
        # cannot trace the Enum constructor, so a member already given is kept as it is.
        if not isinstance(self.kind, ActivationKind):
            object.__setattr__(self, "kind", ActivationKind(self.kind))
        for name in ("clamp_value", "gate_tanh_scale", "linear_tanh_scale"):
            value = getattr(self, name)
            if value is not None:
                value = float(value)
                if not (math.isfinite(value) and value > 0.0):
                    raise ValueError(
                        f"ActivationSpec.{name} must be finite and greater than zero, "
                        f"got {value!r}."
                    )
                if not is_positive_finite_float32(value):
                    raise ValueError(
                        f"ActivationSpec.{name}={value!r} is {as_float32(value)!r} in float32, "
                        "the precision the kernels compute in; use a value between "
                        f"{FLOAT32_TINY:g} and {FLOAT32_MAX:g}."
                    )
                object.__setattr__(self, name, value)
        offset = float(self.linear_offset)
        if not math.isfinite(as_float32(offset)):
            raise ValueError(
                f"ActivationSpec.linear_offset must be finite in float32 (the kernels' "
                f"precision), got {offset!r}."
            )
        object.__setattr__(self, "linear_offset", offset)
        if not self.gated:
            for name in ("clamp_value", "linear_tanh_scale", "glu_interleave_size"):
                if getattr(self, name) is not None:
                    raise ValueError(f"ActivationSpec.{name} requires gated=True.")
            if offset != 0.0:
                raise ValueError("ActivationSpec.linear_offset requires gated=True.")
        check_clamps_exclusive(
            self.clamp_value,
            self.gate_tanh_scale,
            ("ActivationSpec.clamp_value", "ActivationSpec.gate_tanh_scale"),
        )
        if self.gated and self.gate_tanh_scale is not None and self.kind != ActivationKind.SILU:
            raise ValueError("ActivationSpec: a gated tanh clamp (SiTU-GLU) requires kind=SILU.")
        if self.linear_tanh_scale is not None and self.gate_tanh_scale is None:
            raise ValueError("ActivationSpec.linear_tanh_scale requires gate_tanh_scale.")
        k = self.glu_interleave_size
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k <= 0):
            raise ValueError(
                f"ActivationSpec.glu_interleave_size must be a positive int, got {k!r}."
            )
        if (self.kind == ActivationKind.CUSTOM) != (self.custom_func is not None):
            raise ValueError(
                "ActivationSpec.custom_func is required for, and only for, kind=CUSTOM."
            )

    # ------------------------------------------------------------------ building
    @classmethod
    def from_config(cls, config, *, glu_interleave_size: Optional[int] = None) -> ActivationSpec:
        """Builds the spec from a ``TransformerConfig`` (or any object with its fields).

        Args:
            config: Source of ``activation_func``, ``gated_linear_unit``,
                ``activation_func_clamp_value``, ``activation_func_tanh_clamp_scale``,
                ``activation_func_tanh_clamp_scale_linear`` and ``glu_linear_offset``. Missing
                fields (e.g. on a ``SimpleNamespace``) take their defaults.
            glu_interleave_size: The GLU block layout of the caller's fc1 output (routed / shared
                experts); None for the two-halves layout.
        """
        func = getattr(config, "activation_func", F.gelu)
        kind = activation_kind_of(func)
        gated = bool(getattr(config, "gated_linear_unit", False))
        return cls(
            kind=kind,
            gated=gated,
            clamp_value=getattr(config, "activation_func_clamp_value", None),
            gate_tanh_scale=getattr(config, "activation_func_tanh_clamp_scale", None),
            linear_tanh_scale=getattr(config, "activation_func_tanh_clamp_scale_linear", None),
            linear_offset=getattr(config, "glu_linear_offset", 0.0) or 0.0,
            glu_interleave_size=glu_interleave_size if gated else None,
            custom_func=func if kind == ActivationKind.CUSTOM else None,
        )

    def with_interleave(self, glu_interleave_size: Optional[int]) -> ActivationSpec:
        """Returns a copy with another GLU layout (same math)."""
        return dataclasses.replace(self, glu_interleave_size=glu_interleave_size)

    # ------------------------------------------------------------------ queries
    @property
    def is_situ_glu(self) -> bool:
        """Gated SiLU with a tanh gate scale (Kimi-K3 SiTU-GLU)."""
        return self.gated and self.gate_tanh_scale is not None

    @property
    def is_plain(self) -> bool:
        """No clamp, tanh scale or offset: the textbook form of ``kind``."""
        return (
            self.clamp_value is None
            and self.gate_tanh_scale is None
            and self.linear_tanh_scale is None
            and self.linear_offset == 0.0
        )

    @property
    def name(self) -> str:
        """Readable name for tables and error messages, e.g. ``SwiGLU(clamp=7)``."""
        if self.is_situ_glu:
            base = "SiTU-GLU"
        elif self.gated:
            base = _GATED_NAMES[self.kind]
        else:
            base = _UNARY_NAMES[self.kind]
        if self.kind == ActivationKind.CUSTOM:
            base = f"{base} {getattr(self.custom_func, '__name__', repr(self.custom_func))}"
        params = []
        if self.clamp_value is not None:
            params.append(f"clamp={_fmt(self.clamp_value)}")
        if self.gate_tanh_scale is not None:
            label = "s_g" if self.gated else "tanh_scale"
            params.append(f"{label}={_fmt(self.gate_tanh_scale)}")
        if self.linear_tanh_scale is not None:
            params.append(f"s_l={_fmt(self.linear_tanh_scale)}")
        if self.linear_offset != 0.0:
            params.append(f"offset={_fmt(self.linear_offset)}")
        if self.glu_interleave_size is not None:
            params.append(f"interleave={self.glu_interleave_size}")
        return f"{base}({', '.join(params)})" if params else base

    def __str__(self) -> str:
        return self.name

    def base_function(self, x: torch.Tensor) -> torch.Tensor:
        """The base function ``act`` in the dtype of ``x`` (no clamp, scale or offset)."""
        if self.kind == ActivationKind.SILU:
            return F.silu(x)
        if self.kind == ActivationKind.GELU:
            return F.gelu(x)
        if self.kind == ActivationKind.GELU_TANH:
            return F.gelu(x, approximate="tanh")
        if self.kind == ActivationKind.QUICK_GELU:
            return x * torch.sigmoid(QUICK_GELU_ALPHA * x)
        if self.kind == ActivationKind.RELU:
            return F.relu(x)
        if self.kind == ActivationKind.SQUARED_RELU:
            return F.relu(x) ** 2
        return self.custom_func(x)

    # ------------------------------------------------------------------ reference
    def reference(
        self,
        x: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        probs: Optional[torch.Tensor] = None,
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        """The reference formula, evaluated eagerly in ``dtype`` (float64 by default).

        Differentiable with plain autograd: ``torch.clamp``'s gradient masks are inclusive at
        the boundary, the semantics every fused backward must reproduce.

        Args:
            x: fc1 output ``[..., 2F]`` (gated) or ``[..., F]``.
            bias: Optional fc1 bias added before the activation.
            probs: Optional per-row probabilities ``[...]`` or ``[..., 1]`` multiplied into the
                output.
            dtype: Compute and result dtype.
        """
        h = x.to(dtype)
        if bias is not None:
            h = h + bias.to(dtype)
        out = _compose(h, self, self.base_function, _EXACT)
        if probs is not None:
            probs = probs.to(dtype)
            if probs.dim() == out.dim() - 1:
                probs = probs.unsqueeze(-1)
            out = out * probs
        return out


def deinterleave_glu(x: torch.Tensor, block: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Splits a GLU input into (gate, linear).

    Without ``block`` the halves are ``x[..., :F]`` and ``x[..., F:]``. With ``block = k`` the last
    dim holds blocks ``[g(k), u(k), g(k), u(k), ...]`` (the routed-experts layout); the result is
    the same as for the de-interleaved halves.
    """
    if block is None:
        gate, lin = torch.chunk(x, 2, dim=-1)
        return gate, lin
    width = x.shape[-1]
    if width % (2 * block):
        raise ValueError(
            f"glu_interleave_size={block} does not divide the GLU width {width} into "
            "[gate, linear] block pairs."
        )
    blocks = x.unflatten(-1, (width // (2 * block), 2, block))
    return blocks[..., 0, :].flatten(-2), blocks[..., 1, :].flatten(-2)


def interleave_glu(gate: torch.Tensor, lin: torch.Tensor, block: Optional[int]) -> torch.Tensor:
    """Inverse of :func:`deinterleave_glu`."""
    if block is None:
        return torch.cat([gate, lin], dim=-1)
    pairs = torch.stack([gate.unflatten(-1, (-1, block)), lin.unflatten(-1, (-1, block))], dim=-2)
    return pairs.flatten(-3)


def glu_rows_to_blocks(weight: torch.Tensor, block: int) -> torch.Tensor:
    """A gated fc1 weight ``[gate rows; linear rows]`` with its rows in the blocks of
    :func:`interleave_glu` (``[g(k), u(k), g(k), u(k), ...]`` along dim 0)."""
    gate, lin = weight.t().chunk(2, dim=-1)
    return interleave_glu(gate, lin, block).t().contiguous()


def glu_rows_to_halves(weight: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of :func:`glu_rows_to_blocks`."""
    gate, lin = deinterleave_glu(weight.t(), block)
    return torch.cat([gate, lin], dim=-1).t().contiguous()


def fc1_weight_to_halves(module, state_dict, prefix, *args) -> None:
    """State-dict post-hook of a layer that keeps its fc1 rows block-interleaved in memory
    (``module.glu_interleave_size``): the saved ``linear_fc1.weight`` is in halves, as the
    unfused MLP's, so weights move between the two classes unchanged."""
    key = f"{prefix}linear_fc1.weight"
    if key in state_dict:
        state_dict[key] = glu_rows_to_halves(state_dict[key], module.glu_interleave_size)


def fc1_weight_to_blocks(module, state_dict, prefix, *args) -> None:
    """Load-state-dict pre-hook, the inverse of :func:`fc1_weight_to_halves`."""
    key = f"{prefix}linear_fc1.weight"
    if key in state_dict:
        state_dict[key] = glu_rows_to_blocks(state_dict[key], module.glu_interleave_size)


def _clamp_in_float32(t: torch.Tensor, low: Optional[float], high: float) -> torch.Tensor:
    if t.dtype in (torch.float32, torch.float64):
        return torch.clamp(t, low, high)
    return torch.clamp(t.float(), low, high).to(t.dtype)


def _clamp_exact(t: torch.Tensor, low: Optional[float], high: float) -> torch.Tensor:
    return torch.clamp(t, low, high)


def _soft_clamp_exact(t: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * torch.tanh(t / scale)


def _situ_exact(t: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * torch.tanh(t / scale) * torch.sigmoid(t)


class _Primitives(NamedTuple):
    """The elementwise pieces one evaluation of a spec's formula is built from."""

    clamp: Callable[[torch.Tensor, Optional[float], float], torch.Tensor]
    soft_clamp: Callable[[torch.Tensor, float], torch.Tensor]
    situ: Callable[[torch.Tensor, float], torch.Tensor]


# The reference: every piece in the tensor's own dtype (float64 there).
_EXACT = _Primitives(_clamp_exact, _soft_clamp_exact, _situ_exact)
# The unfused path: clamps, soft clamps and SiTU in float32, results in the input's dtype. The
# clamp and its gradient masks are taken in float32, as the fused kernels and the reference take
# them: clamping a bf16 / fp16 tensor with a Python bound rounds the bound to that dtype (7.02 ->
# 7.03125 in bf16), so an input just above the true bound would keep its gradient. The clamped
# values are rounded back to the input dtype, so the forward is the one upstream's eager clamp
# computes.
_UNFUSED = _Primitives(_clamp_in_float32, tanh_soft_clamp, situ)


def _compose(
    h: torch.Tensor, spec: ActivationSpec, func: Callable, ops: _Primitives
) -> torch.Tensor:
    """The formula of ``spec`` on ``h``, composed once for the reference and the unfused path."""
    if not spec.gated:
        if spec.gate_tanh_scale is not None:
            h = ops.soft_clamp(h, spec.gate_tanh_scale)
        return func(h)
    gate, lin = deinterleave_glu(h, spec.glu_interleave_size)
    if spec.clamp_value is not None:
        gate = ops.clamp(gate, None, spec.clamp_value)
        lin = ops.clamp(lin, -spec.clamp_value, spec.clamp_value)
    act = ops.situ(gate, spec.gate_tanh_scale) if spec.is_situ_glu else func(gate)
    if spec.linear_tanh_scale is not None:
        lin = ops.soft_clamp(lin, spec.linear_tanh_scale)
    return act * (lin + spec.linear_offset) if spec.linear_offset else act * lin


def unfused_activation(
    x: torch.Tensor,
    spec: ActivationSpec,
    activation_func: Optional[Callable] = None,
    probs: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The unfused eager path: plain torch ops with autograd, in ``x.dtype``.

    This is the path upstream's ``MLP`` takes without fusion. It applies the configured callable
    itself (``activation_func``, default: the spec's base function), so a custom activation runs
    here unchanged. Clamps use ``torch.clamp`` (inclusive gradient masks); tanh soft clamps and the
    SiTU gate use ``activations.tanh_soft_clamp`` / ``activations.situ`` (float32 math).

    Args:
        x: Activation input (bias already added), GLU layout per ``spec.glu_interleave_size``.
        spec: The activation.
        activation_func: The configured callable; must be the function ``spec`` was built from.
        probs: Optional per-row probabilities ``x.shape[:-1] + (1,)``; the product is cast back
            to ``x.dtype``.
    """
    func = activation_func if activation_func is not None else spec.base_function
    out = _compose(x, spec, func, _UNFUSED)
    if probs is not None:
        out = (out * probs).to(x.dtype)
    return out
