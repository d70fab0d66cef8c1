"""The one runner of both activation audits: build a layer, run it, compare, classify the cell.

``megatron.core.transformer.activation_audit`` (the fork) and ``mcore_activations.upstream_audit``
(an installed upstream megatron-core) each describe their MLP code paths as :class:`AuditPath`
values and their inputs as :class:`AuditSettings`; :func:`run_audit` builds every (path,
activation) layer, runs forward and backward, compares the output, the input gradient and every
parameter gradient with the float64 reference on the layer's own weights (or, for a fused class
with an unfused parent, with the parent on the same weights), and returns one :class:`Cell` each,
in the words of :mod:`mcore_activations.audit_cells`. The command lines only render the cells.

How a build or run failure is classified (the legend's words):

- :class:`PathUnavailable` while building: ``unavailable`` (the path does not exist here);
- :class:`UnsupportedActivationError` while building: ``refused`` (this package's refusal);
- another ``ValueError`` or an ``AssertionError`` while building: ``upstream config rule``;
- an exception naming a hardware limit while running: ``unavailable`` (this GPU);
- any other exception: ``error``;
- a non-finite result, or a nonzero gradient that only one side (layer or reference) has:
  ``MISMATCH`` without a number.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Optional

import torch

from mcore_activations.activation_spec import UnsupportedActivationError
from mcore_activations.audit_cells import (
    ERROR,
    MATCH,
    MISMATCH,
    REFUSED,
    UNAVAILABLE,
    UPSTREAM_RULE,
    reason,
)

# Why a compared quantity has no finite error; the cell names it instead of a number.
NON_FINITE = "non-finite values (NaN or inf) in the layer's result"
NO_GRADIENT = "the layer gives no gradient where the reference has one"
EXTRA_GRADIENT = "the layer gives a gradient where the reference has none"

# Run-time errors that mean "this GPU cannot run the path" (e.g. MXFP8 needs SM100), not a bug.
HARDWARE_LIMITS = ("compute capability", "requires SM100", "not supported on this device")


class PathUnavailable(Exception):
    """Raised by a path's ``build`` when the audited megatron-core does not define the path."""


@dataclasses.dataclass(frozen=True)
class AuditPath:
    """How to build, run and model one MLP code path.

    Attributes:
        name: The row label.
        build: ``(config fields, device, dtype) -> layer``, the layer in ``dtype``.
        run: ``(layer, x, probs, tokens_per_expert) -> output`` (fc2's returned bias added).
        reference: ``(params64, x64, layer, probs64, tokens_per_expert) -> output``, the float64
            model on the layer's parameters (keyed as ``layer.named_parameters()``).
        needs_te: Runs only where Transformer Engine runs (CUDA with TE importable).
        parent: Builds the unfused class to compare with on the same weights, like ``build``;
            None compares with ``reference``.
    """

    name: str
    build: Callable
    run: Callable
    reference: Callable
    needs_te: bool = False
    parent: Optional[Callable] = None


@dataclasses.dataclass(frozen=True)
class Cell:
    """One (path, activation) result.

    Attributes:
        path: The row.
        activation: The column.
        status: A word of :mod:`mcore_activations.audit_cells`.
        max_rel_error: The worst relative error over output, input gradient and parameter
            gradients (the audit's metric); None where no number describes the cell.
        detail: Why: the refusal, the rule or the error; for a comparison ``worst: <quantity>``
            or the quantities without a finite error.
        against: What a compared cell was compared with; empty for the other cells.
    """

    path: str
    activation: str
    status: str
    max_rel_error: Optional[float] = None
    detail: str = ""
    against: str = ""

    def explanation(self) -> str:
        """``detail``, after what the layer was compared with where it was compared."""
        return f"{self.against}; {self.detail}" if self.against else self.detail

    def to_json(self) -> dict:
        """The cell as the fork's ``--json`` writes it (finite numbers only)."""
        return dict(
            path=self.path,
            activation=self.activation,
            status=self.status,
            max_rel_error=self.max_rel_error,
            detail=self.explanation(),
        )


def max_relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / max |ref|`` in float64; inf where ``got`` is not finite."""
    got, ref = got.detach().double(), ref.detach().double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def norm_relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``||got - ref|| / ||ref||`` in float64; inf where ``got`` is not finite."""
    got, ref = got.detach().double(), ref.detach().double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()


@dataclasses.dataclass(frozen=True)
class AuditSettings:
    """What one audit feeds its layers and how it judges them.

    Attributes:
        tokens: Rows of the input.
        hidden: Columns of the input (the layers' hidden size).
        tokens_per_expert: Rows of each expert, for expert layers.
        initialise: ``(layer, generator)``: the layer's weights before it runs.
        probs: ``(generator, device) -> probs``: the router probabilities of expert layers.
        metric: ``(got, reference) -> error`` against the float64 reference. A comparison with
            a parent class always uses :func:`norm_relative` (the grouped GEMMs accumulate in
            another order than the parent's, which moves single elements by ~1e-5).
        tolerance: dtype -> the largest error of a ``match``.
        print_tracebacks: Print an ``error`` cell's traceback to stderr.
        reason_limit: The longest reason a cell carries (cut between words): a reason listed
            under the table can name the path, the activation and what to do instead; one inside
            a table cell must stay short.
    """

    tokens: int
    hidden: int
    tokens_per_expert: Sequence[int]
    initialise: Callable
    probs: Callable
    metric: Callable
    tolerance: dict
    print_tracebacks: bool = True
    reason_limit: int = 400


def _forward_backward(path, layer, x, probs, tpe, grad=None, generator=None):
    x_in = x.clone().requires_grad_()
    out = path.run(layer, x_in, probs, tpe)
    if grad is None:
        grad = torch.randn(out.shape, generator=generator).to(device=x.device, dtype=out.dtype)
    out.backward(grad)
    return out, x_in.grad, {name: p.grad for name, p in layer.named_parameters()}, grad


def grads_in_checkpoint_layout(module) -> dict:
    """Parameter gradients, laid out as ``module.state_dict()`` lays out the parameters.

    A fused class may hold a weight in another memory layout than its unfused parent and convert
    in its state-dict hooks (FusedSharedExpertMLP keeps fc1 block-interleaved for the grouped op
    and saves [gate; linear] halves). Reading the state dict with every parameter's data swapped
    for its gradient runs those same hooks on the gradients, so a fused class's gradients compare
    element by element with its parent's; for every other module this is the identity.

    Raises:
        ValueError: a parameter is a tensor subclass (e.g. a quantized Transformer Engine
            weight, whose ``.data`` setter quantizes or copies in place, so swapping is unsafe),
            or a state-dict hook renamed a parameter's key.
    """
    params = dict(module.named_parameters())
    for name, p in params.items():
        if type(p) is not torch.nn.Parameter:
            raise ValueError(
                f"activation audit: parameter {name!r} of {type(module).__name__} is a "
                f"{type(p).__name__}; the audit compares unquantized parameters only. Build the "
                "layer without quantized primary weights (e.g. te_fused_recipe='none')."
            )
    saved = {name: p.data for name, p in params.items()}
    try:
        with torch.no_grad():
            for p in params.values():
                if p.grad is not None:
                    p.data = p.grad
            state = module.state_dict()
    finally:
        with torch.no_grad():
            for name, p in params.items():
                p.data = saved[name]
    missing = [name for name, p in params.items() if p.grad is not None and name not in state]
    if missing:
        raise ValueError(
            f"activation audit: the state_dict of {type(module).__name__} has no entries for "
            f"parameters {missing}; its hooks rename keys, so gradients cannot be matched by name."
        )
    return {
        name: None if p.grad is None else state[name].detach().clone() for name, p in params.items()
    }


def _errors(out, dx, grads, ref_out, ref_dx, ref_grads, metric) -> tuple[dict, dict]:
    """``({quantity: error}, {quantity: why it has no finite error})`` of one layer run.

    A gradient one side lacks counts as zero: only a nonzero gradient on the other side is a
    problem (a dropped bias is; a parameter neither side moves is not).
    """
    errors = {"output": metric(out, ref_out), "dx": metric(dx, ref_dx)}
    problems = {}
    for name, got in grads.items():
        expected = ref_grads.get(name)
        if got is None and expected is None:
            continue
        if got is None or expected is None:
            present = expected if got is None else got
            if bool(present.detach().ne(0).any()):
                problems[f"d{name}"] = NO_GRADIENT if got is None else EXTRA_GRADIENT
            continue
        errors[f"d{name}"] = metric(got, expected)
    for name, error in errors.items():
        if not math.isfinite(error):
            problems[name] = NON_FINITE
    return {k: v for k, v in errors.items() if k not in problems}, problems


def _build(path: AuditPath, label: str, fields: dict, device, dtype, limit: int):
    """``(layer, None)``, or ``(None, cell)`` when the build says why the path cannot run."""
    try:
        return path.build(fields, device, dtype), None
    except PathUnavailable as err:
        return None, Cell(path.name, label, UNAVAILABLE, detail=reason(err, limit))
    except UnsupportedActivationError as err:
        return None, Cell(path.name, label, REFUSED, detail=reason(err, limit))
    except (ValueError, AssertionError) as err:
        # Upstream states its config rules as ValueError (TransformerConfig) or assert (layers),
        # which the fork keeps.
        return None, Cell(path.name, label, UPSTREAM_RULE, detail=reason(err, limit))


def _failure(path: AuditPath, label: str, err: Exception, settings: AuditSettings, when: str):
    message = reason(err, settings.reason_limit)
    if when == "run" and any(marker in str(err) for marker in HARDWARE_LIMITS):
        return Cell(path.name, label, UNAVAILABLE, detail=f"this GPU cannot run it: {message}")
    if settings.print_tracebacks:
        traceback.print_exception(err, file=sys.stderr)
    at = " at build" if when == "build" else ""
    return Cell(path.name, label, ERROR, detail=f"{type(err).__name__}{at}: {message}")


def audit_cell(
    path: AuditPath, label: str, fields: dict, device, dtype, settings: AuditSettings
) -> Cell:
    """Builds one path for one activation, runs it, and judges what it computes.

    Args:
        path: The code path.
        label: The activation's column label.
        fields: The ``TransformerConfig`` fields of the activation (and options such as
            ``add_bias_linear``).
        device: Where the layer runs.
        dtype: The layer's parameter and compute dtype.
        settings: The audit's inputs, metric and tolerance.

    Returns:
        The cell; an exception of the layer becomes an ``error`` cell, never escapes.
    """
    torch.manual_seed(1234)
    try:
        layer, cell = _build(path, label, fields, device, dtype, settings.reason_limit)
    except Exception as err:  # noqa: BLE001 - the audit reports every failure as a cell
        return _failure(path, label, err, settings, "build")
    if cell is not None:
        return cell
    try:
        return _compare(path, label, fields, layer, device, dtype, settings)
    except Exception as err:  # noqa: BLE001
        return _failure(path, label, err, settings, "run")


def _compare(path, label, fields, layer, device, dtype, settings: AuditSettings) -> Cell:
    gen = torch.Generator().manual_seed(0)
    settings.initialise(layer, gen)
    x = torch.randn(settings.tokens, settings.hidden, generator=gen).to(device=device, dtype=dtype)
    probs = settings.probs(gen, device)
    tpe = list(settings.tokens_per_expert)
    out, dx, grads, grad = _forward_backward(path, layer, x, probs, tpe, generator=gen)
    if path.parent is not None:
        parent = path.parent(fields, device, dtype)
        parent.load_state_dict(layer.state_dict())
        p_out, p_dx, _, _ = _forward_backward(path, parent, x, probs, tpe, grad=grad)
        # Gradients in the checkpoint layout on both sides: the state dicts are what match.
        errors, problems = _errors(
            out,
            dx,
            grads_in_checkpoint_layout(layer),
            p_out,
            p_dx,
            grads_in_checkpoint_layout(parent),
            norm_relative,
        )
        against = f"vs {type(parent).__name__} on the same weights"
    else:
        # The reference reads the parameters as the layer holds them in memory, so the
        # gradients are compared in that layout too.
        params64 = {
            name: p.detach().double().requires_grad_() for name, p in layer.named_parameters()
        }
        x64 = x.double().requires_grad_()
        ref = path.reference(params64, x64, layer, probs.double(), tpe)
        ref.backward(grad.double())
        ref_grads = {name: p.grad for name, p in params64.items()}
        errors, problems = _errors(out, dx, grads, ref, x64.grad, ref_grads, settings.metric)
        against = "vs the float64 reference"
    if problems:
        # No number describes these; the cell carries no error value (JSON stays strict).
        why = "; ".join(f"{name}: {text}" for name, text in problems.items())
        return Cell(path.name, label, MISMATCH, None, why, against)
    worst_name = max(errors, key=errors.get)
    worst = errors[worst_name]
    status = MATCH if worst <= settings.tolerance[dtype] else MISMATCH
    return Cell(path.name, label, status, worst, f"worst: {worst_name}", against)


def run_audit(
    paths: Sequence[AuditPath],
    activations: dict,
    device,
    dtype,
    settings: AuditSettings,
    no_te: Optional[str] = None,
    progress: Optional[Callable[[Cell], None]] = None,
) -> list[Cell]:
    """Every (path, activation) cell, path by path.

    Args:
        paths: The rows, in table order.
        activations: ``{label: TransformerConfig fields}``, the columns in table order.
        device: Where the layers run.
        dtype: The layers' dtype.
        settings: The audit's inputs, metric and tolerance.
        no_te: Why Transformer Engine paths cannot run here (each becomes ``unavailable``);
            None runs them.
        progress: Called with each cell as soon as it is done.
    """
    cells = []
    for path in paths:
        for label, fields in activations.items():
            if path.needs_te and no_te:
                cell = Cell(path.name, label, UNAVAILABLE, detail=no_te)
            else:
                cell = audit_cell(path, label, fields, device, dtype, settings)
            cells.append(cell)
            if progress is not None:
                progress(cell)
    return cells


def layer_config(
    fields: dict,
    *,
    hidden: int,
    ffn: int,
    experts: int,
    defaults: Optional[dict] = None,
    forced: Optional[dict] = None,
):
    """The ``TransformerConfig`` of an audited layer, from the audited megatron-core.

    Args:
        fields: The activation's fields and what a ``--config`` file sets.
        hidden: ``hidden_size``.
        ffn: ``ffn_hidden_size`` and the experts' ``moe_ffn_hidden_size``.
        experts: ``num_moe_experts``.
        defaults: The audit's other settings; ``fields`` override them.
        forced: The path's own settings (e.g. its fusion); they override ``fields``.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=1,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=4,
        num_moe_experts=experts,
        moe_ffn_hidden_size=ffn,
        add_bias_linear=False,
    )
    return TransformerConfig(**{**base, **(defaults or {}), **fields, **(forced or {})})


def with_bias(result):
    """An MLP-like layer's ``(output, output_bias)`` as its caller adds them.

    Megatron's MLP classes leave fc2's bias to the caller (upstream fuses it with dropout). The
    reference includes it, so the audit adds it as the caller would: dropping it would leave the
    bias without a gradient.
    """
    output, bias = result
    return output if bias is None else output + bias
