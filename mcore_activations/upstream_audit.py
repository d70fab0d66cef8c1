"""Audit of an installed upstream megatron-core: does each MLP path compute its activation?

``mcore-activations-audit`` (or ``python -m mcore_activations.upstream_audit``) builds upstream's
own MLP classes for the upstream audit's entries of :mod:`mcore_activations.activation_catalogue`
(or the configurations of ``--config``), runs forward and backward on inputs large enough to hit
every clamp, and compares the output, the input gradient and every parameter gradient with the
float64 reference of :class:`ActivationSpec` (``fc2(reference(fc1(x)))`` on the layer's own
weights, probabilities included), through :mod:`mcore_activations.audit_runner`, the runner of the
fork's audit too. ``--before-after`` prints the table for upstream as installed, then again after
:func:`patch_megatron_core`; it also replays the stale-scalar call sequence of upstream issue #6918
on the compiled entry points (``exact`` or ``STALE``). The other cells use the words of
:mod:`mcore_activations.audit_cells`, which the legend under the tables explains.

Exit status: 0 when the last table has no ``MISMATCH``, ``error`` or ``STALE`` cell, else 1; 2 on
a usage error.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F

from mcore_activations import activation_catalogue, audit_runner
from mcore_activations.activation_spec import ActivationKind, ActivationSpec
from mcore_activations.audit_cells import LEGEND, MATCH, MISMATCH, UNAVAILABLE
from mcore_activations.audit_cli import (
    AuditArgumentParser,
    add_common_options,
    command_name,
    one_copy_of_each_warning,
    progress_printer,
)
from mcore_activations.audit_config import load_config_file
from mcore_activations.audit_runner import AuditPath, AuditSettings, Cell, PathUnavailable
from mcore_activations.reference_mlp import grouped_layer_reference, layer_reference

HIDDEN, FFN, TOKENS, EXPERTS = 32, 48, 24, 2

# Norm-relative error allowed per dtype. float32: its GEMMs and activation math against float64.
# bfloat16 keeps 8 significant bits (unit roundoff 2e-3); output and gradients pass through 5-7
# roundings, the bias add among them, and sums that cancel: correct layers measure 0.3-2.2 % on
# CPU (0.19.2 patched, clamp 7 with biases the worst), an activation computed wrongly > 10 %.
MATCH_RTOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


def _initialise(layer, generator):
    # Large weights: fc1 outputs of a few units, so every clamp is hit on many elements; every
    # parameter is drawn (biases and norms included), so a dropped one changes the result.
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (1.0 if p.dim() > 1 else 0.1))


def _probs(generator, device):
    # Away from zero, so every routed row's fc2 bias and activation carry weight.
    return torch.rand(TOKENS, generator=torch.Generator().manual_seed(3)).to(device) + 0.5


# This audit's inputs and judgement, for the runner both audits share; the fork's audit has its
# own (megatron.core.transformer.activation_audit_paths.SETTINGS). The published before/after
# tables (docs/using-with-megatron-lm.md) were measured with these.
SETTINGS = AuditSettings(
    tokens=TOKENS,
    hidden=HIDDEN,
    tokens_per_expert=(TOKENS // 2, TOKENS - TOKENS // 2),
    initialise=_initialise,
    probs=_probs,
    # ||error|| / ||reference||: MATCH_RTOL's bfloat16 bound was measured in this metric on
    # correct and wrong layers, and the recorded before/after tables are in it.
    metric=audit_runner.norm_relative,
    tolerance=MATCH_RTOL,
    # Upstream's own fused paths raise before the patch by design of the table (its "error"
    # cells); a traceback per cell would bury the table.
    print_tracebacks=False,
    # Reasons stand inside the table's cells.
    reason_limit=160,
)


def _quick_gelu():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return quick_gelu


def functions() -> dict:
    """``--config``'s activation names -> the installed megatron-core's own callables (upstream
    compares ``quick_gelu`` by identity, so the audit must pass upstream's object)."""
    from megatron.core import activations

    return {
        "silu": F.silu,
        "gelu": F.gelu,
        "fast_gelu": activations.fast_gelu,
        "quick_gelu": _quick_gelu(),
        "relu": F.relu,
        "squared_relu": activations.squared_relu,
    }


def builtin_activations() -> dict[str, dict]:
    """``{column: config fields}`` of the built-in set (the upstream audit's entries of
    :mod:`mcore_activations.activation_catalogue`), with the installed upstream's callables."""
    return activation_catalogue.columns(activation_catalogue.UPSTREAM_AUDIT, functions())


def _config(fields: dict, *, fused: bool, device, dtype=torch.float32):
    defaults = dict(
        moe_shared_expert_intermediate_size=FFN,
        bias_activation_fusion=fused,
        use_cpu_initialization=str(device) == "cpu",
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    return audit_runner.layer_config(
        fields, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, defaults=defaults
    )


# --------------------------------------------------------------------------------- the paths


def _local_submodules():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def _te_submodules():
    from megatron.core.extensions.transformer_engine import (
        TELayerNormColumnParallelLinear,
        TERowParallelLinear,
    )
    from megatron.core.transformer.mlp import MLPSubmodules

    return MLPSubmodules(linear_fc1=TELayerNormColumnParallelLinear, linear_fc2=TERowParallelLinear)


def _layer_dtype(layer) -> torch.dtype:
    return next(layer.parameters()).dtype


def _expert_reference(params, x, layer, probs=None, prefix=""):
    """The float64 reference MLP on ``layer``'s parameters (an expert's: ``prefix``)."""
    spec = ActivationSpec.from_config(layer.config)
    return layer_reference(params, x, spec, layer.config, prefix, probs, _layer_dtype(layer))


def _reference_mlp(params, x, layer, probs, tpe):
    # A dense layer takes no router probabilities.
    return _expert_reference(params, x, layer)


def _run_mlp(layer, x, probs, tpe):
    return audit_runner.with_bias(layer(x))


def _run_experts(layer, x, probs, tpe):
    return audit_runner.with_bias(layer(x, torch.tensor(tpe), probs))


def mlp_path(name: str, *, fused: bool, te: bool = False, cls_name=None) -> AuditPath:
    """Upstream's MLP (or a TE fused subclass), unfused or with ``bias_activation_fusion``."""

    def build(fields, device, dtype):
        from megatron.core.transformer.mlp import MLP

        cls = MLP
        if cls_name is not None:
            from megatron.core.extensions import transformer_engine

            cls = getattr(transformer_engine, cls_name, None)
            if cls is None:
                raise PathUnavailable(
                    f"{cls_name} is not defined (Transformer Engine missing or old)"
                )
        config = _config(fields, fused=fused, device=device, dtype=dtype)
        submodules = _te_submodules() if te else _local_submodules()
        return cls(config, submodules, ffn_hidden_size=FFN).to(device)

    return AuditPath(name, build, _run_mlp, _reference_mlp, needs_te=te)


def _pg_collection():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    return get_default_pg_collection()


def _shared_path(name: str) -> AuditPath:
    def build(fields, device, dtype):
        from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

        config = _config(fields, fused=True, device=device, dtype=dtype)
        layer = SharedExpertMLP(
            config, _local_submodules(), gate=False, pg_collection=_pg_collection()
        )
        return layer.to(device)

    return AuditPath(name, build, lambda layer, x, probs, tpe: layer(x), _reference_mlp)


def _reference_sequential(params, x, layer, probs, tpe):
    parts, start = [], 0
    for i, n in enumerate(tpe):
        rows = slice(start, start + n)
        expert = layer.local_experts[i]
        parts.append(_expert_reference(params, x[rows], expert, probs[rows], f"local_experts.{i}."))
        start += n
    return torch.cat(parts)


def _sequential_path(name: str, *, fused: bool) -> AuditPath:
    def build(fields, device, dtype):
        from megatron.core.transformer.moe.experts import SequentialMLP

        config = _config(fields, fused=fused, device=device, dtype=dtype)
        layer = SequentialMLP(EXPERTS, config, _local_submodules(), pg_collection=_pg_collection())
        return layer.to(device)

    return AuditPath(name, build, _run_experts, _reference_sequential)


def _reference_grouped(params, x, layer, probs, tpe):
    spec = ActivationSpec.from_config(layer.config)
    return grouped_layer_reference(params, x, spec, tpe, probs, _layer_dtype(layer))


def _te_grouped_path(name: str, *, fused: bool) -> AuditPath:
    """Upstream's TEGroupedMLP on TE grouped linears (its unfused activation closure)."""

    def build(fields, device, dtype):
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
        )
        from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

        config = _config(fields, fused=fused, device=device, dtype=dtype)
        submodules = GroupedMLPSubmodules(
            linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear
        )
        layer = TEGroupedMLP(EXPERTS, config, submodules, pg_collection=_pg_collection())
        return layer.to(device)

    return AuditPath(name, build, _run_experts, _reference_grouped, needs_te=True)


def all_paths() -> list[AuditPath]:
    """Every path this audit knows, in table order; the TE ones need CUDA and TE."""
    return [
        mlp_path("MLP (unfused)", fused=False),
        mlp_path("MLP (bias_activation_fusion)", fused=True),
        _shared_path("SharedExpertMLP (bias_activation_fusion)"),
        _sequential_path("SequentialMLP (unfused)", fused=False),
        _sequential_path("SequentialMLP (bias_activation_fusion)", fused=True),
        mlp_path("MLP (TE linears)", fused=False, te=True),
        mlp_path("TEFusedMLP", fused=False, te=True, cls_name="TEFusedMLP"),
        mlp_path(
            "TEFusedMLPWithGroupedLinear",
            fused=False,
            te=True,
            cls_name="TEFusedMLPWithGroupedLinear",
        ),
        _te_grouped_path("TEGroupedMLP (unfused)", fused=False),
        _te_grouped_path("TEGroupedMLP (bias_activation_fusion)", fused=True),
    ]


def paths(with_te: bool) -> list[AuditPath]:
    """The rows of this audit's table: without TE (CPU, or no TE installed) only the torch ones."""
    return [path for path in all_paths() if with_te or not path.needs_te]


# ---------------------------------------------------------------------------------- one cell


def cell_text(cell: Cell) -> str:
    """A cell as this audit's tables and JSON write it, e.g. ``match (2.1e-07)``."""
    if cell.status == MATCH:
        return f"{MATCH} ({cell.max_rel_error:.1e})"
    if cell.status == MISMATCH and cell.max_rel_error is not None:
        return f"{MISMATCH} ({cell.max_rel_error:.1e}, {cell.detail})"
    return f"{cell.status} ({cell.detail})" if cell.detail else cell.status


def audit_cell(path: AuditPath, fields: dict, device, dtype=torch.float32) -> str:
    """Runs one path on one activation through the audits' runner; returns the table cell."""
    cell = audit_runner.audit_cell(path, "", fields, device, dtype, SETTINGS)
    return cell_text(cell)


# --------------------------------------------------------------------- stale compiled scalars


def stale_scalar_row(device: str) -> dict[str, str]:
    """Upstream issue #6918's call sequence on the compiled clamped-SwiGLU entry points.

    Only this audit has the row: it shows what the patch replaces in an installed upstream. The
    fork's compiled entry points are this package's own, held to the same sequence (and more) by
    the compile-safety tests.

    Shapes (1, 2) without grad at clamp 1.0, then (1, 4) with grad at 0.5 and at 1.0, every
    element 0.75 (inside the clamp at 1.0, outside it at 0.5); forward, autograd backward and the
    explicit backward are compared with the float64 reference of each call's clamp.
    """
    from megatron.core.fusions import fused_bias_swiglu as f

    if not hasattr(f, "clamped_swiglu"):
        return {
            "compiled clamped_swiglu (#6918 sequence)": f"{UNAVAILABLE} (this upstream has none)"
        }
    worst = 0.0
    for shape, grad, clamp in (((1, 2), False, 1.0), ((1, 4), True, 0.5), ((1, 4), True, 1.0)):
        spec = ActivationSpec(ActivationKind.SILU, gated=True, clamp_value=clamp)
        x = torch.full(shape, 0.75, device=device, requires_grad=grad)
        x64 = torch.full(shape, 0.75, dtype=torch.float64, device=device, requires_grad=True)
        expected = spec.reference(x64)
        expected.sum().backward()
        out = f.clamped_swiglu(x, clamp)
        worst = max(worst, float((out.detach().double() - expected.detach()).abs().max()))
        if grad:
            out.sum().backward()
            worst = max(worst, float((x.grad.double() - x64.grad).abs().max()))
        back = f.clamped_swiglu_back(torch.ones_like(out), x.detach(), clamp)
        worst = max(worst, float((back.double() - x64.grad).abs().max()))
    cell = f"exact ({worst:.1e})" if worst <= 1e-6 else f"STALE (off by {worst:.4f})"
    return {"compiled clamped_swiglu (#6918 sequence)": cell}


# ------------------------------------------------------------------------------------ tables


def _init_parallel(device: str) -> None:
    from megatron.core import parallel_state, tensor_parallel

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        backend = "nccl" if device == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, world_size=1, rank=0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    else:
        # Upstream's inference RNG tracker needs no CUDA generator.
        tensor_parallel.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)


def audit_table(
    device: str,
    with_te: bool,
    activations: Optional[dict] = None,
    dtype: torch.dtype = torch.float32,
    progress: Optional[Callable[[Cell], None]] = None,
) -> dict[str, dict[str, str]]:
    """``{path: {activation: cell}}`` for the installed megatron-core as it is now.

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        with_te: Also the Transformer Engine paths.
        activations: ``{column: TransformerConfig fields}``; default the built-in set.
        dtype: The layers' parameter dtype.
        progress: Called with each cell as soon as it is done.
    """
    activations = builtin_activations() if activations is None else activations
    # The #6918 sequence first: staleness needs the compile caches as a fresh process has them.
    table = {"compiled entry points": stale_scalar_row(device)}
    cells = audit_runner.run_audit(
        paths(with_te), activations, device, dtype, SETTINGS, progress=progress
    )
    for cell in cells:
        table.setdefault(cell.path, {})[cell.activation] = cell_text(cell)
    return table


def format_table(title: str, table: dict[str, dict[str, str]], columns=None) -> str:
    """A markdown table under ``title``: one row per path, one column per activation."""
    columns = list(columns or builtin_activations())
    lines = [f"### {title}", "", "| path | " + " | ".join(columns) + " |"]
    lines.append("|---" * (len(columns) + 1) + "|")
    for path_name, row in table.items():
        if path_name == "compiled entry points":
            for name, cell in row.items():
                lines.append(f"| {name} | {cell} |" + " |" * (len(columns) - 1))
            continue
        lines.append(f"| {path_name} | " + " | ".join(row.get(c, "") for c in columns) + " |")
    return "\n".join(lines)


def _bad(table) -> bool:
    cells = [c for row in table.values() for c in row.values()]
    return any(c.startswith(("MISMATCH", "error", "STALE")) for c in cells)


MODULE = "mcore_activations.upstream_audit"
DESCRIPTION = """\
Audits the installed upstream megatron-core: builds its own MLP classes for each activation, runs
forward and backward on inputs that hit every clamp, and compares the output and every gradient
with the float64 reference. --before-after also patches (patch_megatron_core()) and audits again,
and replays the stale-clamp sequence of upstream issue #6918 on the compiled entry points. A
legend under the tables says what each cell means."""

EXAMPLES = """\
examples:
  upstream as installed, then patched (the check docs/using-with-megatron-lm.md describes):
    {prog} --before-after
  your own configurations (one JSON object or a list), e.g. my-model.json holding
  [{{"name": "my-moe", "activation_func": "silu", "gated_linear_unit": true,
    "activation_func_clamp_value": 7, "add_bias_linear": true}}]:
    {prog} --before-after --config my-model.json
  on a GPU, Transformer Engine classes included, in bfloat16, tables also as JSON:
    {prog} --before-after --device cuda --dtype bfloat16 --json audit.json

exit status: 0 the last table has no MISMATCH, error or STALE cell, 1 it has, 2 a usage error
(reported before anything runs).
"""


def _check_config(kwargs) -> str:
    return ActivationSpec.from_config(_config(kwargs, fused=False, device="cpu")).name


def build_parser() -> AuditArgumentParser:
    """The command line of ``mcore-activations-audit``."""
    parser = AuditArgumentParser(
        prog=command_name(MODULE),
        description=DESCRIPTION,
        epilog=EXAMPLES.format(prog=command_name(MODULE)),
    )
    when = parser.add_mutually_exclusive_group()
    when.add_argument(
        "--before-after",
        action="store_true",
        help="audit upstream as installed, patch it, and audit again",
    )
    when.add_argument(
        "--patch", action="store_true", help="patch first, then audit (the patched table only)"
    )
    add_common_options(
        parser,
        cuda_available=torch.cuda.is_available(),
        json_help="also write the tables as JSON to FILE",
        device_choices=("cpu", "cuda"),
    )
    return parser


def main(argv=None) -> int:
    """Command-line entry point (``mcore-activations-audit``); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but this machine has no usable CUDA GPU; use --device cpu.")
    with one_copy_of_each_warning():
        return _main(parser, args)


def _main(parser, args) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False  # the comparison is with float64
    torch.backends.cudnn.allow_tf32 = False
    from mcore_activations import megatron_patch
    from mcore_activations.te_import import have_te

    try:
        _, description = megatron_patch.installed_upstream()
    except megatron_patch.UnsupportedUpstreamError as err:
        parser.error(str(err))
    activations = None
    if args.config is not None:
        try:
            activations = load_config_file(args.config, functions(), _check_config)
        except ValueError as err:
            parser.error(f"--config {err}")
    json_file = None
    if args.json:
        try:  # fail now, not after the whole audit
            json_file = open(args.json, "w")
        except OSError as err:
            parser.error(f"--json {args.json}: cannot write there ({err.strerror}).")
    dtype = getattr(torch, args.dtype)
    with_te = args.device == "cuda" and have_te()
    columns = list(activations or builtin_activations())
    passes = 2 if args.before_after else 1
    progress = progress_printer(passes * len(paths(with_te)) * len(columns))

    def table():
        return audit_table(args.device, with_te, activations, dtype, progress)

    _init_parallel(args.device)
    tables = {}
    if args.before_after:
        tables["before"] = table()
        print(format_table(f"{description}, as installed", tables["before"], columns) + "\n")
    if args.before_after or args.patch:
        report = megatron_patch.patch_megatron_core()
        print(report.summary() + "\n")
    title = "after" if (args.before_after or args.patch) else "as installed"
    tables[title] = table()
    when = "after patch_megatron_core()" if title == "after" else "as installed"
    print(format_table(f"{description}, {when}", tables[title], columns))
    print(f"\ndevice={args.device} dtype={args.dtype} torch={torch.__version__}")
    print(LEGEND)
    if json_file is not None:
        payload = {"upstream": description, "device": args.device, "dtype": args.dtype}
        with json_file:
            json.dump({**payload, "tables": tables}, json_file, indent=1, allow_nan=False)
    return 1 if _bad(tables[title]) else 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        try:
            sys.exit(main())
        except Exception:
            traceback.print_exc()
            sys.exit(2)
