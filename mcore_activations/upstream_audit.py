"""Audit of an installed upstream megatron-core: does each MLP path compute its activation?

``mcore-activations-audit`` (or ``python -m mcore_activations.upstream_audit``) builds upstream's
own MLP classes for a set of activations, runs forward and backward on inputs large enough to hit
every clamp, and compares the output and the input gradient with the float64 reference of
:class:`ActivationSpec` (``fc2(reference(fc1(x)))`` on the layer's own weights, probabilities
included). ``--before-after`` prints the table for upstream as installed, then again after
:func:`patch_megatron_core`; it also replays the stale-scalar call sequence of upstream issue #6918
on the compiled entry points. A cell is ``match``, ``MISMATCH`` (a silent wrong result),
``refused`` (the layer raised :class:`UnsupportedActivationError` at construction, naming why and
what to configure instead), ``config rejected by upstream`` (upstream's own config rules),
``n/a on this GPU`` (a hardware limit, e.g. MXFP8 on a GPU before SM100), ``error`` (an exception
at run time) or ``n/a``.

Exit status: 0 when the last table has no ``MISMATCH`` and no ``error``, else 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from mcore_activations.activation_spec import (
    ActivationKind,
    ActivationSpec,
    UnsupportedActivationError,
)
from mcore_activations.audit_cells import (
    ERROR,
    LEGEND,
    MATCH,
    MISMATCH,
    REFUSED,
    UNAVAILABLE,
    UPSTREAM_RULE,
    reason,
)
from mcore_activations.audit_cli import (
    AuditArgumentParser,
    command_name,
    one_copy_of_each_warning,
)
from mcore_activations.audit_config import CONFIG_FILE_FIELDS, load_config_file
from mcore_activations.reference_mlp import grouped_layer_reference, layer_reference

# Norm-relative error allowed per dtype. float32: its GEMMs and activation math against float64.
# bfloat16 keeps 8 significant bits (unit roundoff 2e-3); output and gradients pass through 5-7
# roundings, the bias add among them, and sums that cancel: correct layers measure 0.3-2.2 % on
# CPU (0.19.2 patched, clamp 7 with biases the worst), an activation computed wrongly > 10 %.
MATCH_RTOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}
# Run-time errors that mean "this GPU cannot run the path" (e.g. MXFP8 needs SM100), not a bug.
_HARDWARE_LIMITS = ("compute capability", "requires SM100", "not supported on this device")


@dataclass(frozen=True)
class AuditActivation:
    """One column of the table: a name and the config fields that select it."""

    name: str
    fields: Callable[[], dict]


def _quick_gelu():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return quick_gelu


def _squared_relu():
    from megatron.core.activations import squared_relu

    return squared_relu


ACTIVATIONS = (
    AuditActivation("SwiGLU", lambda: dict(activation_func=F.silu, gated_linear_unit=True)),
    AuditActivation(
        "DeepSeek-V4 SwiGLU(clamp=0.5)",
        lambda: dict(
            activation_func=F.silu, gated_linear_unit=True, activation_func_clamp_value=0.5
        ),
    ),
    AuditActivation(
        "gpt-oss quick-GEGLU(clamp=1.5, offset=1)",
        lambda: dict(
            activation_func=_quick_gelu(),
            gated_linear_unit=True,
            activation_func_clamp_value=1.5,
            glu_linear_offset=1.0,
        ),
    ),
    AuditActivation("GEGLU (erf)", lambda: dict(activation_func=F.gelu, gated_linear_unit=True)),
    AuditActivation(
        "squared-ReLU", lambda: dict(activation_func=_squared_relu(), gated_linear_unit=False)
    ),
)


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
        "squared_relu": _squared_relu(),
    }


HIDDEN, FFN, TOKENS, EXPERTS = 32, 48, 24, 2


def _config(fields: dict, *, fused: bool, device: str):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=4,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=FFN,
        moe_shared_expert_intermediate_size=FFN,
        add_bias_linear=False,
        bias_activation_fusion=fused,
        use_cpu_initialization=device == "cpu",
        params_dtype=torch.float32,
    )
    return TransformerConfig(**{**base, **fields})


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


def _with_bias(result):
    # MLP-like layers return ``(output, output_bias)`` and leave adding fc2's bias to the caller
    # (upstream fuses it with dropout); the reference includes it, so the audit adds it too.
    output, bias = result
    return output if bias is None else output + bias


def _mlp_reference(layer, prefix=""):
    """``(params64, x64) -> output``: the float64 reference MLP on ``layer``'s parameters."""

    def reference(params, x, probs=None):
        spec = ActivationSpec.from_config(layer.config)
        dtype = next(layer.parameters()).dtype
        return layer_reference(params, x, spec, layer.config, prefix, probs, dtype)

    return reference


def _build_mlp(config, submodules, cls=None):
    from megatron.core.transformer.mlp import MLP

    return (cls or MLP)(config, submodules, ffn_hidden_size=FFN)


def path_mlp(fields, *, fused, device, te=False, cls_name=None):
    """(layer, run, reference) for upstream's MLP (or a TE fused subclass)."""
    config = _config(fields, fused=fused, device=device)
    cls = None
    if cls_name is not None:
        from megatron.core.extensions import transformer_engine

        cls = getattr(transformer_engine, cls_name, None)
        if cls is None:
            raise _NotAvailable(f"{cls_name} is not defined (Transformer Engine missing or old)")
    layer = _build_mlp(config, _te_submodules() if te else _local_submodules(), cls).to(device)
    return layer, lambda x: _with_bias(layer(x)), _mlp_reference(layer)


def _pg_collection():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    return get_default_pg_collection()


def path_shared(fields, *, fused, device):
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    config = _config(fields, fused=fused, device=device)
    layer = SharedExpertMLP(
        config, _local_submodules(), gate=False, pg_collection=_pg_collection()
    ).to(device)
    return layer, layer, _mlp_reference(layer)


def path_sequential(fields, *, fused, device):
    from megatron.core.transformer.moe.experts import SequentialMLP

    config = _config(fields, fused=fused, device=device)
    layer = SequentialMLP(EXPERTS, config, _local_submodules(), pg_collection=_pg_collection()).to(
        device
    )
    split = torch.tensor([TOKENS // 2, TOKENS - TOKENS // 2])
    probs = torch.rand(TOKENS, generator=torch.Generator().manual_seed(3)).to(device) + 0.5

    def run(x):
        return _with_bias(layer(x, split, probs))

    def reference(params, x):
        parts, start = [], 0
        for i, n in enumerate(split.tolist()):
            rows = slice(start, start + n)
            expert = _mlp_reference(layer.local_experts[i], f"local_experts.{i}.")
            parts.append(expert(params, x[rows], probs[rows].double()))
            start += n
        return torch.cat(parts)

    return layer, run, reference


def path_te_grouped(fields, *, fused, device):
    """Upstream's TEGroupedMLP on TE grouped linears (its unfused activation closure)."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelGroupedLinear,
        TERowParallelGroupedLinear,
    )
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    config = _config(fields, fused=fused, device=device)
    submodules = GroupedMLPSubmodules(
        linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear
    )
    layer = TEGroupedMLP(EXPERTS, config, submodules, pg_collection=_pg_collection()).to(device)
    split = torch.tensor([TOKENS // 2, TOKENS - TOKENS // 2])
    probs = torch.rand(TOKENS, generator=torch.Generator().manual_seed(3)).to(device) + 0.5
    spec = ActivationSpec.from_config(config)

    def run(x):
        return _with_bias(layer(x, split, probs))

    def reference(params, x):
        dtype = next(layer.parameters()).dtype
        return grouped_layer_reference(params, x, spec, split.tolist(), probs.double(), dtype)

    return layer, run, reference


class _NotAvailable(Exception):
    pass


def _paths(device: str, with_te: bool) -> dict[str, Callable]:
    paths = {
        "MLP (unfused)": lambda f: path_mlp(f, fused=False, device=device),
        "MLP (bias_activation_fusion)": lambda f: path_mlp(f, fused=True, device=device),
        "SharedExpertMLP (bias_activation_fusion)": lambda f: path_shared(
            f, fused=True, device=device
        ),
        "SequentialMLP (unfused)": lambda f: path_sequential(f, fused=False, device=device),
        "SequentialMLP (bias_activation_fusion)": lambda f: path_sequential(
            f, fused=True, device=device
        ),
    }
    if with_te:
        paths["MLP (TE linears)"] = lambda f: path_mlp(f, fused=False, device=device, te=True)
        paths["TEFusedMLP"] = lambda f: path_mlp(
            f, fused=False, device=device, te=True, cls_name="TEFusedMLP"
        )
        paths["TEFusedMLPWithGroupedLinear"] = lambda f: path_mlp(
            f, fused=False, device=device, te=True, cls_name="TEFusedMLPWithGroupedLinear"
        )
        paths["TEGroupedMLP (unfused)"] = lambda f: path_te_grouped(f, fused=False, device=device)
        paths["TEGroupedMLP (bias_activation_fusion)"] = lambda f: path_te_grouped(
            f, fused=True, device=device
        )
    return paths


# ---------------------------------------------------------------------------------- one cell


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def audit_cell(build: Callable, fields: dict, device: str) -> str:
    """Runs one path on one activation; returns the table cell."""
    try:
        layer, run, reference = build(fields)
    except _NotAvailable as err:
        return f"{UNAVAILABLE} ({reason(err)})"
    except UnsupportedActivationError as err:
        return f"{REFUSED} ({reason(err)})"
    except (ValueError, AssertionError) as err:
        # Upstream states its config rules as ValueError (TransformerConfig) or assert (layers).
        return f"{UPSTREAM_RULE} ({reason(err)})"
    except Exception as err:  # noqa: BLE001 - the audit reports every failure as a cell
        return f"{ERROR} at build ({type(err).__name__}: {reason(err)})"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            # Large weights: fc1 outputs of a few units, so every clamp is hit on many elements.
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if p.dim() > 1 else 0.1))
    dtype = next(layer.parameters()).dtype
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(device, dtype).requires_grad_(True)
    try:
        out = run(x)
        grad_out = torch.randn(out.shape, generator=gen).to(device, out.dtype)
        out.backward(grad_out)
    except Exception as err:  # noqa: BLE001
        message = reason(err)
        if any(marker in str(err) for marker in _HARDWARE_LIMITS):
            return f"{UNAVAILABLE} on this GPU ({message})"
        return f"{ERROR} ({type(err).__name__}: {message})"
    params = dict(layer.named_parameters())
    params64 = {name: p.detach().double().requires_grad_(True) for name, p in params.items()}
    x64 = x.detach().double().requires_grad_(True)
    ref = reference(params64, x64)
    ref.backward(grad_out.double())
    return _verdict(
        {"output": (out.detach(), ref.detach()), "dx": (x.grad, x64.grad)},
        {name: (p.grad, params64[name].grad) for name, p in params.items()},
        MATCH_RTOL[dtype],
    )


def _verdict(results: dict, gradients: dict, tolerance: float) -> str:
    """The cell for ``{quantity: (layer's, reference's)}`` and the parameter gradients.

    A parameter the reference gives a gradient must get one from the layer (a dropped bias
    does not); one the reference does not read (e.g. an unused norm) is not judged.
    """
    problems, errors = [], {}
    for name, (got, expected) in gradients.items():
        if expected is None:
            continue
        if got is None:
            problems.append(f"d{name}: the layer gives no gradient where the reference has one")
        else:
            results[f"d{name}"] = (got, expected)
    for name, (got, expected) in results.items():
        if not torch.isfinite(got).all():
            problems.append(f"{name}: non-finite values (NaN or inf) in the layer's result")
        else:
            errors[name] = _rel(got, expected)
    if problems:
        return f"{MISMATCH} ({'; '.join(problems)})"
    worst = max(errors, key=errors.get)
    if errors[worst] <= tolerance:
        return f"{MATCH} ({errors[worst]:.1e})"
    return f"{MISMATCH} ({errors[worst]:.1e}, worst: {worst})"


# --------------------------------------------------------------------- stale compiled scalars


def stale_scalar_row(device: str) -> dict[str, str]:
    """Upstream issue #6918's call sequence on the compiled clamped-SwiGLU entry points.

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


def builtin_activations() -> dict[str, dict]:
    """``{column: config fields}`` of the built-in set, with the installed upstream's callables."""
    return {a.name: a.fields() for a in ACTIVATIONS}


def audit_table(
    device: str,
    with_te: bool,
    activations: Optional[dict] = None,
    dtype: torch.dtype = torch.float32,
    progress: Optional[Callable[[str, str, str], None]] = None,
) -> dict[str, dict[str, str]]:
    """``{path: {activation: cell}}`` for the installed megatron-core as it is now.

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        with_te: Also the Transformer Engine paths.
        activations: ``{column: TransformerConfig fields}``; default the built-in set.
        dtype: The layers' parameter dtype.
        progress: Called with ``(path, activation, cell)`` after each cell.
    """
    activations = builtin_activations() if activations is None else activations
    extra = {"params_dtype": dtype, "bf16": dtype == torch.bfloat16}
    # The #6918 sequence first: staleness needs the compile caches as a fresh process has them.
    table = {"compiled entry points": stale_scalar_row(device)}
    for path_name, build in _paths(device, with_te).items():
        row = table[path_name] = {}
        for name, fields in activations.items():
            row[name] = audit_cell(build, {**fields, **extra}, device)
            if progress is not None:
                progress(path_name, name, row[name])
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
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="audit the configurations in this JSON file instead of the built-in set: one object "
        "or a list, each with an optional 'name' and any of: "
        f"{', '.join(CONFIG_FILE_FIELDS)} (activation_func by name: fast_gelu, gelu, quick_gelu, "
        "relu, silu, squared_relu)",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=["cpu", "cuda"],
        help="default: cuda where a GPU is usable; the Transformer Engine classes need cuda",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the layers' parameter dtype (default: float32)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the tables as JSON to FILE")
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
    total = passes * len(_paths(args.device, with_te)) * len(columns)
    done = 0

    def progress(path, activation, cell):
        nonlocal done
        done += 1
        status = cell.split(" (")[0]
        print(f"[{done}/{total}] {path} / {activation}: {status}", file=sys.stderr)

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
