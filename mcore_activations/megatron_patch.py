"""Patches an installed upstream megatron-core: every MLP path computes its configured activation.

``patch_megatron_core()`` is the one call a training script adds (or ``MCORE_ACTIVATIONS_PATCH=1``
for scripts nobody edits; see ``mcore_activations.autopatch``). It

1. reads the installed megatron-core's version and refuses one it does not know;
2. checks that every upstream function and class it touches has the source it was written
   against (``upstream_fingerprints``), and refuses otherwise, naming each difference;
3. replaces upstream's fused activation entry points with this package's compile-safe ones (a
   clamp or offset reaches compiled code as a tensor, never as a Python float), in their module
   and in every upstream module that imported them by name;
4. makes each MLP class decide its activation once, at construction, from one
   :class:`ActivationSpec` (``activation_path``; ``te_lowering`` for Transformer Engine ops), so
   the layer computes exactly the configured activation or raises
   :class:`UnsupportedActivationError` when it is built;
5. returns a :class:`PatchReport` naming every replaced object. ``unpatch_megatron_core()``
   restores the originals.

Patch before building the model: then an activation no path computes fails at construction. A
layer built before the patch decides at its first forward (or first op build) instead. What is
patched, and why, is listed in docs/using-with-megatron-lm.md.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import importlib
import inspect
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Optional

import torch

from mcore_activations import activation_path as paths
from mcore_activations.activation_spec import (
    ActivationKind,
    ActivationSpec,
    UnsupportedActivationError,
)
from mcore_activations.upstream_fingerprints import KNOWN_UPSTREAMS

ENV_VAR = "MCORE_ACTIVATIONS_PATCH"

_CORE = "megatron.core"
_MLP = "megatron.core.transformer.mlp"
_EXPERTS = "megatron.core.transformer.moe.experts"
_SHARED = "megatron.core.transformer.moe.shared_experts"
_TE = "megatron.core.extensions.transformer_engine"
FUSION_MODULES = (
    "fused_bias_swiglu",
    "fused_bias_geglu",
    "fused_bias_gelu",
    "fused_weighted_squared_relu",
)
# Upstream's dispatch compares config.activation_func with these objects by identity, and a
# config built before the patch holds upstream's: they are never rebound.
_IDENTITY_SENTINELS = frozenset({"quick_gelu"})
# The upstream methods the patch replaces, wraps, or relies on (their callers and the code whose
# op choice it checks); each must have the fingerprint recorded for the installed version.
METHOD_TARGETS = (
    f"{_MLP}:MLP.__init__",
    f"{_MLP}:MLP.forward",
    f"{_SHARED}:SharedExpertMLP.linear_fc1_forward_and_act",
    f"{_SHARED}:FusedSharedExpertMLP._validate_fused_grouped_swiglu",
    f"{_SHARED}:FusedSharedExpertMLP._make_fused_grouped_swiglu_ops",
    f"{_EXPERTS}:TEGroupedMLP.__init__",
    f"{_EXPERTS}:TEGroupedMLP._make_fused_ops",
    f"{_EXPERTS}:TEGroupedMLP.forward",
    f"{_EXPERTS}:SequentialMLP.forward",
    f"{_EXPERTS}:InferenceGroupedMLP._resolve_flashinfer_activation_type",
    f"{_EXPERTS}:InferenceGroupedMLP._resolve_mcore_activation_type",
    f"{_TE}:TEActivationOp.__new__",
    f"{_TE}:TEFusedMLP._make_activation_op",
    f"{_TE}:TEFusedMLP._make_fused_impl",
    f"{_TE}:TEFusedMLP.forward",
    f"{_TE}:_make_te_ops_activation",
    f"{_TE}:TEFusedMLPWithGroupedLinear._make_fused_impl",
)


class UnsupportedUpstreamError(RuntimeError):
    """The installed megatron-core is not a version (or not the source) this patch knows."""


@dataclasses.dataclass(frozen=True)
class PatchedObject:
    """One upstream object the patch replaced.

    Attributes:
        target: ``module:qualname`` of the upstream object.
        action: ``"replaced"`` (ours instead of upstream's) or ``"wrapped"`` (upstream's runs,
            with a check or a lowering added around it).
        reason: Why, in one sentence.
    """

    target: str
    action: str
    reason: str


@dataclasses.dataclass(frozen=True)
class PatchReport:
    """What :func:`patch_megatron_core` did.

    Attributes:
        upstream: The upstream target, e.g. ``"megatron-core 0.19.2"``.
        patched: Every replaced or wrapped object, in the order applied.
        skipped: ``(target, reason)`` for targets absent from this installation (e.g. the TE
            classes when Transformer Engine cannot be imported).
    """

    upstream: str
    patched: tuple[PatchedObject, ...]
    skipped: tuple[tuple[str, str], ...]

    def summary(self) -> str:
        """One line: the upstream and how many objects were patched or skipped."""
        skipped = f", {len(self.skipped)} skipped" if self.skipped else ""
        return f"patched {self.upstream}: {len(self.patched)} objects{skipped}"

    def details(self) -> str:
        """The full report: the summary, then every patched object and why, then the skipped."""
        lines = [f"mcore_activations {self.summary()}"]
        lines += [f"  {p.action:8s} {p.target}: {p.reason}" for p in self.patched]
        lines += [f"  skipped  {target}: {reason}" for target, reason in self.skipped]
        return "\n".join(lines)

    def __str__(self) -> str:
        # One line: a training log gets one line per process, not the full list.
        return f"mcore_activations {self.summary()} (report.details() lists them)"

    def print(self, details: bool = False, file=None) -> None:
        """Prints the one-line summary, or :meth:`details`, on rank 0 only.

        Args:
            details: Print the full report instead of the one line.
            file: Where to print; default ``sys.stderr``.

        The rank is ``torch.distributed``'s once it is initialized, else the ``RANK`` environment
        variable that torchrun sets (0 when unset).
        """
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        else:
            rank = int(os.environ.get("RANK", "0") or 0)
        if rank == 0:
            print(self.details() if details else str(self), file=file or sys.stderr)


# ----------------------------------------------------------------------- upstream identification


def source_fingerprint(module_file: str, qualname: str) -> Optional[str]:
    """SHA-256 (16 hex digits) of the source of ``qualname`` in ``module_file``, or None if absent.

    The definition is found in the parsed file, also inside ``if`` / ``try`` blocks, so a class
    that upstream defines only when Transformer Engine imports is fingerprinted without TE.
    Module-level assignments (``bias_gelu_impl = GeLUFunction.apply``) count as definitions.
    """
    with open(module_file, encoding="utf-8") as f:
        text = f.read()
    node = _find_definition(ast.parse(text).body, qualname.split("."))
    if node is None:
        return None
    segment = ast.get_source_segment(text, node) or ""
    decorators = "".join(ast.get_source_segment(text, d) or "" for d in _decorators(node))
    digest = hashlib.sha256((decorators + "\n" + segment).encode("utf-8")).hexdigest()
    return digest[:16]


def _decorators(node) -> list:
    return list(getattr(node, "decorator_list", []))


def _find_definition(body: list, parts: list[str]):
    for node in body:
        if isinstance(node, ast.If | ast.Try):
            nested = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                nested += handler.body
            found = _find_definition(nested, parts)
            if found is not None:
                return found
            continue
        name = getattr(node, "name", None)
        if name is None and isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            name = parts[0] if parts[0] in targets else None
        if name == parts[0]:
            if len(parts) == 1:
                return node
            return _find_definition(getattr(node, "body", []), parts[1:])
    return None


def installed_upstream() -> tuple[str, str]:
    """Returns ``(key, description)`` of the installed megatron-core, e.g. ``("0.19.2", ...)``.

    Raises:
        UnsupportedUpstreamError: megatron-core is not importable, or this is the standalone fork.
    """
    try:
        info = importlib.import_module(f"{_CORE}.package_info")
    except ImportError as err:
        raise UnsupportedUpstreamError(
            f"patch_megatron_core() needs an installed upstream megatron-core ({err}). Install "
            "it with: pip install megatron-core==0.19.2"
        ) from err
    if is_standalone_fork():
        # Name where the fork came from: most often the current directory is a clone of this
        # project, and Python's sys.path puts it before the installed upstream.
        core = sys.modules[_CORE]
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(core.__file__))))
        if os.path.samefile(root, os.getcwd()):
            cause = (
                f"It was imported from the current directory ({root}), a clone of this project: "
                "Python puts the current directory first on sys.path, so the clone's megatron/ "
                "hides the installed megatron-core. Run the script from another directory (or "
                "start Python with -P, 3.11+)."
            )
        else:
            cause = (
                f"It was imported from {root}. To patch upstream instead, make upstream's "
                "megatron.core the importable one (pip install megatron-core==0.19.2, or put "
                "your Megatron-LM checkout first on PYTHONPATH)."
            )
        raise UnsupportedUpstreamError(
            "megatron.core is this project's standalone fork, which already computes the "
            f"configured activations; patch_megatron_core() is for upstream megatron-core. {cause}"
        )
    key = ".".join(str(getattr(info, part, "?")) for part in ("MAJOR", "MINOR", "PATCH"))
    return key, f"megatron-core {getattr(info, '__version__', key)}"


def is_standalone_fork() -> bool:
    """Whether the importable ``megatron.core`` is this project's fork (nothing to patch)."""
    mlp_module = importlib.import_module(_MLP)
    return getattr(mlp_module, "select_activation_path", None) is paths.select_activation_path


def check_upstream(key: str) -> dict[str, str]:
    """Verifies the fingerprint of every target of upstream ``key``; returns the known table.

    Raises:
        UnsupportedUpstreamError: Unknown version, or a target whose source differs.
    """
    known = KNOWN_UPSTREAMS.get(key)
    if known is None:
        supported = ", ".join(f"{k} ({v['label']})" for k, v in KNOWN_UPSTREAMS.items())
        raise UnsupportedUpstreamError(
            f"mcore_activations does not know megatron-core {key}; it supports {supported}. "
            "Install a supported megatron-core, or use the standalone fork's megatron.core."
        )
    differences = []
    for target, expected in known["targets"].items():
        module_name, qualname = target.split(":")
        module = importlib.import_module(module_name)
        found = source_fingerprint(module.__file__, qualname)
        if found != expected:
            differences.append(f"{target} (expected {expected}, found {found})")
    if differences:
        raise UnsupportedUpstreamError(
            f"The installed megatron-core {key} is not the {known['label']} source this patch "
            "was written against; these objects differ: "
            + "; ".join(differences)
            + ". Install the released package, or the upstream commit named in "
            "docs/using-with-megatron-lm.md."
        )
    return known


# ------------------------------------------------------------------------- the replacements

# The TE fused MLP whose op sequence is being built in this thread (main's module-level
# _make_te_ops_activation has no `self`, so the layer is handed over through this variable).
_BUILDING_TE_FUSED_MLP: contextvars.ContextVar = contextvars.ContextVar("building_te_fused_mlp")


def _layer_spec(layer, glu_interleave_size: Optional[int] = None) -> ActivationSpec:
    return ActivationSpec.from_config(layer.config, glu_interleave_size=glu_interleave_size)


def _te_class(name: str):
    module = sys.modules.get(_TE)
    return getattr(module, name, None) if module is not None else None


def _is_instance(layer, class_name: str) -> bool:
    cls = _te_class(class_name)
    return isinstance(cls, type) and isinstance(layer, cls)


def _refuse(path: str, spec: ActivationSpec, reason: str, alternative: str):
    raise UnsupportedActivationError(path, spec, reason, alternative)


def _attach_mlp_activation(layer) -> None:
    """After upstream's ``MLP.__init__``: the layer's spec, and how it computes or refuses it."""
    owner = type(layer).__name__
    spec = _layer_spec(layer)
    layer.activation_spec = spec
    if _is_instance(layer, "TEFusedMLPWithGroupedLinear"):
        if not (spec.kind == ActivationKind.SILU and spec.gated and spec.is_plain):
            _refuse(
                owner,
                spec,
                "upstream's TEFusedMLPWithGroupedLinear always builds te.pytorch.ops.ScaledSwiGLU",
                "Use TEFusedMLP (use_grouped_gemm_for_dense_mlp=False), which lowers every "
                "activation Transformer Engine can compute.",
            )
    # Every activation field is read once, here, as in the fork (docs/activations.md).
    layer._mcore_fp8_input_store = bool(layer.config.activation_func_fp8_input_store)
    if _is_instance(layer, "TEFusedMLP"):
        from mcore_activations.te_lowering import plan_te_activation

        layer._mcore_te_activation = plan_te_activation(
            spec,
            path=owner,
            scaled=False,
            cache_quantized_input=bool(layer.config.activation_func_fp8_input_store),
        )
        return
    has_te_module = isinstance(layer.activation_func, torch.nn.Module)
    layer.activation_path = paths.select_activation_path(layer.config, spec, has_te_module, owner)


def _offload_flag(config) -> bool:
    from mcore_activations.te_import import have_te

    return bool(config.cpu_offloading and config.cpu_offloading_activations and have_te())


def _mlp_activate(layer, x, bias, per_token_scale):
    if not hasattr(layer, "activation_path"):
        _attach_mlp_activation(layer)  # a layer built before the patch: decide now
    probs = paths.per_token_probs(per_token_scale, x)
    return paths.activate(
        x,
        bias,
        probs,
        spec=layer.activation_spec,
        path=layer.activation_path,
        activation_func=layer.activation_func,
        fp8_input_store=layer._mcore_fp8_input_store,
        cpu_offload_input=_offload_flag(layer.config),
    )


def _nvtx(module, what: str, suffix: str) -> None:
    fn = getattr(module, f"nvtx_range_{what}", None)
    if fn is not None:
        fn(suffix=suffix)


def _make_mlp_forward(mlp_module):
    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        """MLP forward with the activation of ``self.activation_spec`` (mcore_activations)."""
        _nvtx(mlp_module, "push", "linear_fc1")
        intermediate, bias = self.linear_fc1(hidden_states)
        _nvtx(mlp_module, "pop", "linear_fc1")
        _nvtx(mlp_module, "push", "activation")
        intermediate = _mlp_activate(self, intermediate, bias, per_token_scale)
        _nvtx(mlp_module, "pop", "activation")
        _nvtx(mlp_module, "push", "linear_fc2")
        output, output_bias = self.linear_fc2(intermediate)
        _nvtx(mlp_module, "pop", "linear_fc2")
        if per_token_scale is not None and output_bias is not None:
            output = paths.add_weighted_output_bias(output, output_bias, per_token_scale)
            output_bias = None
        return output, output_bias

    return forward


def _make_shared_fc1_forward_and_act(shared_module):
    state = shared_module.SharedExpertState

    def linear_fc1_forward_and_act(self, overlapped_comm_output=None):
        """Shared-expert fc1 and activation on the side stream (mcore_activations)."""
        with torch.cuda.stream(self.stream):
            intermediate, bias = self.linear_fc1(self.cached_fc1_input)
            self.cached_fc1_input = None
            intermediate = _mlp_activate(self, intermediate, bias, None)
            self.cached_fc2_input = intermediate
        if overlapped_comm_output is not None and overlapped_comm_output.grad_fn is not None:
            # As upstream: order the backward so the dispatcher's communication launches first.
            target = overlapped_comm_output.grad_fn._sequence_nr() - 1
            shared_module.set_tensor_grad_fn_sequence_sr(intermediate, target)
            self.cached_fc2_input = shared_module._BackwardStreamWait.apply(
                intermediate, self.stream
            )

    return shared_module.overlap_state_check(state.PRE_FORWARD_COMM_DONE, state.FC1_FORWARD_DONE)(
        linear_fc1_forward_and_act
    )


def _wrap_init(original: Callable, after: Callable[[Any], None]) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        after(self)

    return __init__


def _check_grouped_mlp(key: str):
    def after(layer) -> None:
        config = layer.config
        k = getattr(config, "moe_mlp_glu_interleave_size", None)
        spec = _layer_spec(layer, k)
        layer.activation_spec = spec
        owner = type(layer).__name__
        if owner == "InferenceGroupedMLP" and not spec.is_plain:
            _refuse(
                owner,
                spec,
                "upstream's inference MoE kernels (FlashInfer and megatron's own) take no clamp or "
                "offset",
                "Serve this model with TEGroupedMLP or SequentialMLP experts.",
            )
        if getattr(layer, "_with_fused_impl", False):
            _check_grouped_ops_choice(key, spec, f"{owner}(use_transformer_engine_op_fuser=True)")
        elif (
            config.bias_activation_fusion
            and k is None
            and not isinstance(layer.activation_func, torch.nn.Module)
        ):
            path = f"{owner}(bias_activation_fusion=True)"
            if not (spec.gated and spec.kind in (ActivationKind.SILU, ActivationKind.QUICK_GELU)):
                _refuse(
                    path,
                    spec,
                    "upstream's TEGroupedMLP fuses only SwiGLU and quick-GEGLU (it raises at the "
                    "first forward otherwise)",
                    "Set bias_activation_fusion=False: its unfused activation computes it.",
                )
            if (
                key == "0.19.2"
                and spec.kind == ActivationKind.SILU
                and spec.clamp_value is not None
                and getattr(layer, "activation_recompute", False)
            ):
                # The layer's forward hands its spec to the fused call; a recompute re-runs that
                # call in the backward, outside the forward (_make_grouped_weighted_swiglu).
                _refuse(
                    path,
                    spec,
                    "megatron-core 0.19.2's TEGroupedMLP calls the fused SwiGLU without the clamp, "
                    "and with moe_act recompute the patch cannot hand it the layer's clamp",
                    "Leave 'moe_act' out of recompute_modules, or set bias_activation_fusion=False "
                    "(its unfused activation computes the clamp exactly).",
                )

    return after


# The TEGroupedMLP whose forward runs in this thread. megatron-core 0.19.2's fused branch calls
# weighted_bias_swiglu_impl without the layer's clamp; during the layer's forward the call is
# answered with the layer's whole spec instead (_make_grouped_weighted_swiglu).
_RUNNING_GROUPED_MLP: contextvars.ContextVar = contextvars.ContextVar("running_grouped_mlp")


def _wrap_grouped_forward(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        token = _RUNNING_GROUPED_MLP.set(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            _RUNNING_GROUPED_MLP.reset(token)

    return forward


def _make_grouped_weighted_swiglu(plain: Callable) -> Callable:
    """0.19.2's ``experts.weighted_bias_swiglu_impl``: the running TEGroupedMLP's spec, exactly."""
    from mcore_activations.fusions.fused_activation import fused_activation

    @functools.wraps(plain)
    def weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store=False, *args, **kwargs):
        layer = _RUNNING_GROUPED_MLP.get(None)
        spec = getattr(layer, "activation_spec", None)
        if spec is None or bias is not None or args or kwargs:
            return plain(input, bias, weights, fp8_input_store, *args, **kwargs)
        return fused_activation(input, spec, probs=weights, fp8_input_store=fp8_input_store)

    return weighted_bias_swiglu_impl


def _check_grouped_ops_choice(key: str, spec: ActivationSpec, path: str) -> None:
    """Refuses a spec whose op upstream's grouped-MLP op builder would pick wrongly."""
    offset = spec.linear_offset
    if spec.kind == ActivationKind.SILU and spec.gated and spec.is_plain:
        return  # ScaledSwiGLU
    if key != "0.19.2" and spec.kind == ActivationKind.SILU and spec.gated:
        if spec.clamp_value is not None and not offset and spec.gate_tanh_scale is None:
            return  # ScaledClampedQGeGLU(alpha=1, limit=c, glu_linear_offset=0)
    if spec.kind == ActivationKind.QUICK_GELU and spec.gated:
        if spec.clamp_value == 7.0 and offset == 1.0:
            return  # TE's defaults, which upstream always uses
    if spec.kind == ActivationKind.SQUARED_RELU and not spec.gated and spec.is_plain:
        return  # ScaledSReLU
    _refuse(
        path,
        spec,
        "upstream's grouped-MLP op builder does not pass this activation's clamp, offset or "
        "scale to Transformer Engine (it would silently compute another function)",
        "Set use_transformer_engine_op_fuser=False: the unfused TEGroupedMLP computes it.",
    )


def _check_fused_shared_expert(key: str):
    def after(layer) -> None:
        spec = _layer_spec(layer)
        plain_swiglu = spec.kind == ActivationKind.SILU and spec.gated and spec.is_plain
        clamped_swiglu = (
            key != "0.19.2"
            and spec.kind == ActivationKind.SILU
            and spec.gated
            and spec.clamp_value is not None
            and not spec.linear_offset
            and spec.gate_tanh_scale is None
        )
        if not (plain_swiglu or clamped_swiglu):
            _refuse(
                type(layer).__name__,
                spec,
                "upstream's FusedSharedExpertMLP builds "
                + ("ScaledSwiGLU only" if key == "0.19.2" else "ScaledSwiGLU or a clamped SwiGLU")
                + ", whatever else is configured",
                "Set use_grouped_gemm_for_shared_expert=False: SharedExpertMLP computes it.",
            )

    return after


def _make_activation_op(self, activation_func, gated_linear_unit, cache_quantized_input):
    """TEFusedMLP's activation op (0.19.2): the lowering of the layer's spec."""
    del activation_func, gated_linear_unit, cache_quantized_input  # the spec holds all of it
    if not hasattr(self, "_mcore_te_activation"):
        _attach_mlp_activation(self)  # a layer built before the patch: lower now
    return self._mcore_te_activation.build()


def _wrap_make_fused_impl(original: Callable) -> Callable:
    @functools.wraps(original)
    def _make_fused_impl(self):
        token = _BUILDING_TE_FUSED_MLP.set(self)
        try:
            return original(self)
        finally:
            _BUILDING_TE_FUSED_MLP.reset(token)

    return _make_fused_impl


def _make_te_ops_activation(activation_func, gated_linear_unit, cache_quantized_input):
    """Upstream main's TE activation-op builder, answered by the lowering of the layer's spec."""
    layer = _BUILDING_TE_FUSED_MLP.get(None)
    if layer is not None:
        if not hasattr(layer, "_mcore_te_activation"):
            _attach_mlp_activation(layer)  # a layer built before the patch: lower now
        return layer._mcore_te_activation.build()
    from mcore_activations.te_lowering import _make_te_ops_activation as plain_lowering

    return plain_lowering(activation_func, gated_linear_unit, cache_quantized_input)


def _wrap_te_fused_forward(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        if kwargs.get("per_token_scale") is not None:
            raise ValueError(
                f"{type(self).__name__} got per_token_scale, which its Transformer Engine op "
                "sequence cannot apply (upstream dropped it silently). Use MLP or SequentialMLP "
                "for experts weighted per token."
            )
        return original(self, hidden_states, *args, **kwargs)

    return forward


def _te_activation_op_new(cls, config):
    from mcore_activations.te_lowering import TEActivationOp

    return TEActivationOp.__new__(TEActivationOp, config)


# ----------------------------------------------------------------------------- apply / revert

_lock = threading.Lock()
_state: dict[str, Any] = {"report": None, "undo": []}


def fusion_names(ours) -> list[str]:
    """Public names of one of this package's fusion modules that replace upstream's."""
    names = []
    for name, value in vars(ours).items():
        if name.startswith("_") or name in _IDENTITY_SENTINELS or inspect.ismodule(value):
            continue
        # bias_gelu_impl is GeLUFunction.apply, a bound method whose __module__ is torch's.
        if getattr(value, "__module__", None) == ours.__name__ or name == "bias_gelu_impl":
            names.append(name)
    return names


def _fusion_replacements() -> list[tuple[Any, str, Any]]:
    """(upstream module, name, ours) for every public fusion name both define."""
    out = []
    for short in FUSION_MODULES:
        upstream = importlib.import_module(f"{_CORE}.fusions.{short}")
        ours = importlib.import_module(f"mcore_activations.fusions.{short}")
        out += [(upstream, n, getattr(ours, n)) for n in fusion_names(ours) if hasattr(upstream, n)]
    return out


def _set(undo: list, owner, name: str, value) -> None:
    if isinstance(owner, type):
        undo.append((owner, name, owner.__dict__.get(name, _MISSING)))
    else:
        undo.append((owner, name, getattr(owner, name, _MISSING)))
    setattr(owner, name, value)


_MISSING = object()


def patch_megatron_core() -> PatchReport:
    """Patches the installed upstream megatron-core (idempotent); returns what it patched.

    Raises:
        UnsupportedUpstreamError: The installed megatron-core is unknown or modified; nothing
            was patched.
    """
    with _lock:
        if _state["report"] is not None:
            return _state["report"]
        key, description = installed_upstream()
        known = check_upstream(key)
        undo: list = []
        patched: list[PatchedObject] = []
        skipped: list[tuple[str, str]] = []

        def record(target: str, action: str, reason: str) -> None:
            patched.append(PatchedObject(target, action, reason))

        try:
            originals = {}
            for module, name, ours in _fusion_replacements():
                originals[id(getattr(module, name))] = ours
                _set(undo, module, name, ours)
                record(f"{module.__name__}:{name}", "replaced", "compile-safe fused activation")
            # Upstream modules that imported an entry point by name hold the old object.
            for mod_name, module in list(sys.modules.items()):
                if not mod_name.startswith("megatron.") or module is None:
                    continue
                for name, value in list(vars(module).items()):
                    if id(value) in originals and name not in _IDENTITY_SENTINELS:
                        if ".fusions." not in mod_name:
                            _set(undo, module, name, originals[id(value)])
                            record(f"{mod_name}:{name}", "replaced", "rebound to the fix")

            mlp_module = importlib.import_module(_MLP)
            mlp_cls = mlp_module.MLP
            _set(undo, mlp_cls, "__init__", _wrap_init(mlp_cls.__init__, _attach_mlp_activation))
            record(f"{_MLP}:MLP.__init__", "wrapped", "spec and path chosen at construction")
            _set(undo, mlp_cls, "forward", _make_mlp_forward(mlp_module))
            record(f"{_MLP}:MLP.forward", "replaced", "computes the spec on its path")

            shared = importlib.import_module(_SHARED)
            _set(
                undo,
                shared.SharedExpertMLP,
                "linear_fc1_forward_and_act",
                _make_shared_fc1_forward_and_act(shared),
            )
            record(
                f"{_SHARED}:SharedExpertMLP.linear_fc1_forward_and_act",
                "replaced",
                "the overlapped shared expert computes the spec",
            )
            fused_shared = getattr(shared, "FusedSharedExpertMLP", None)
            if fused_shared is not None:
                original = fused_shared._validate_fused_grouped_swiglu
                after = _check_fused_shared_expert(key)

                @functools.wraps(original)
                def validate(self, *args, _original=original, _after=after, **kwargs):
                    result = _original(self, *args, **kwargs)
                    _after(self)
                    return result

                _set(undo, fused_shared, "_validate_fused_grouped_swiglu", validate)
                record(
                    f"{_SHARED}:FusedSharedExpertMLP._validate_fused_grouped_swiglu",
                    "wrapped",
                    "refuses activations its hard-coded op does not compute",
                )

            experts = importlib.import_module(_EXPERTS)
            grouped = experts.TEGroupedMLP
            _set(undo, grouped, "__init__", _wrap_init(grouped.__init__, _check_grouped_mlp(key)))
            record(
                f"{_EXPERTS}:TEGroupedMLP.__init__",
                "wrapped",
                "refuses activations its fused paths would compute wrongly",
            )
            if key == "0.19.2":
                _set(undo, grouped, "forward", _wrap_grouped_forward(grouped.forward))
                record(
                    f"{_EXPERTS}:TEGroupedMLP.forward",
                    "wrapped",
                    "hands the layer's spec to its fused SwiGLU call (which drops the clamp)",
                )
                _set(
                    undo,
                    experts,
                    "weighted_bias_swiglu_impl",
                    _make_grouped_weighted_swiglu(experts.weighted_bias_swiglu_impl),
                )
                record(
                    f"{_EXPERTS}:weighted_bias_swiglu_impl",
                    "replaced",
                    "computes the running TEGroupedMLP's clamp",
                )

            te_module = importlib.import_module(_TE)
            te_fused = getattr(te_module, "TEFusedMLP", None)
            if te_fused is None:
                skipped.append((f"{_TE}:TEFusedMLP and TEActivationOp", "TE is not importable"))
            else:
                if key == "0.19.2":
                    _set(undo, te_fused, "_make_activation_op", _make_activation_op)
                    record(f"{_TE}:TEFusedMLP._make_activation_op", "replaced", "TE lowering")
                else:
                    _set(
                        undo,
                        te_fused,
                        "_make_fused_impl",
                        _wrap_make_fused_impl(te_fused._make_fused_impl),
                    )
                    _set(undo, te_module, "_make_te_ops_activation", _make_te_ops_activation)
                    record(f"{_TE}:_make_te_ops_activation", "replaced", "TE lowering")
                _set(undo, te_fused, "forward", _wrap_te_fused_forward(te_fused.forward))
                record(f"{_TE}:TEFusedMLP.forward", "wrapped", "refuses per_token_scale")
                op_cls = te_module.TEActivationOp
                _set(undo, op_cls, "__new__", _te_activation_op_new)
                record(f"{_TE}:TEActivationOp.__new__", "replaced", "TE lowering")
        except Exception:
            _undo(undo)
            raise

        report = PatchReport(
            upstream=f"{description} ({known['label']})",
            patched=tuple(patched),
            skipped=tuple(skipped),
        )
        _state.update(report=report, undo=undo)
        return report


def _undo(undo: list) -> None:
    for owner, name, old in reversed(undo):
        if old is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)
        else:
            setattr(owner, name, old)
    undo.clear()


def unpatch_megatron_core() -> None:
    """Restores every object :func:`patch_megatron_core` replaced (no-op when not patched).

    A layer built while patched then runs upstream's own forward again, computing what upstream
    computes for its config, until the next :func:`patch_megatron_core` gives it the fixed path
    back.
    """
    with _lock:
        _undo(_state["undo"])
        _state["report"] = None


def patch_report() -> Optional[PatchReport]:
    """The report of the patch in force, or None."""
    return _state["report"]
