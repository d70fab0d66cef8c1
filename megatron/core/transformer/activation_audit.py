"""Activation audit: proves every MLP path this machine runs computes the configured activation.

Usage::

    python -m megatron.core.transformer.activation_audit            # the built-in activation set
    python -m megatron.core.transformer.activation_audit --activation-func silu \\
        --gated-linear-unit --activation-func-clamp-value 7
    python -m megatron.core.transformer.activation_audit --json audit.json
    python -m megatron.core.transformer.activation_audit --json - > audit.json  # JSON alone

For each activation and each path (unfused ``MLP``, ``MLP`` with fused kernels, ``SharedExpertMLP``,
``SequentialMLP``, and with Transformer Engine on a GPU ``TEFusedMLP``,
``TEFusedMLPWithGroupedLinear``, ``FusedSharedExpertMLP`` and ``TEGroupedMLP``) it builds the
layer from a ``TransformerConfig``, scales the fc1 weights so pre-activations hit the clamps, runs
forward and backward, and compares the output, the input gradient and every parameter gradient
with a float64 evaluation of ``ActivationSpec.reference`` on the same weights (max |error| over
max |reference|). The TE fused classes are compared with their unfused parent class on the same
weights instead (||error|| / ||parent||), which isolates the activation from TE's GEMMs. Each
cell of the printed table is ``match`` (worst error), ``refuses`` (the construction-time error),
or ``MISMATCH``; the exit status is 1 if any cell is a mismatch and 2 on a usage error (checked
before anything runs). Progress goes to stderr, one line per cell.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import traceback

import torch

from mcore_activations.activation_spec import ActivationSpec
from megatron.core.transformer.activation_audit_paths import (  # noqa: F401 - the audit's names
    BUILT_IN,
    EXPERTS,
    FFN,
    FUNCTIONS,
    HIDDEN,
    TOKENS,
    TOLERANCE,
    Cell,
    Path,
    _config,
    _grouped_reference,
    _layer_dtype,
    _mlp_reference,
    all_paths,
)


# ----------------------------------------------------------------------------- running
def _scale_fc1(module, std=8.0):
    """Scales fc1 weights so pre-activations have std ~``std``: clamps and tanh scales bite.

    Biases (zero after Megatron's init) get random values too, so a path that drops or misplaces
    a bias changes the output, not only a gradient.
    """
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "linear_fc1.weight" in name and param.dim() == 2:
                param.normal_(0.0, std / math.sqrt(param.shape[1]))
            elif ".bias" in name and "layer_norm" not in name:
                param.normal_(0.0, 1.0)


def _max_rel(got, ref):
    got, ref = got.detach().double(), ref.detach().double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


# Why a compared quantity has no finite error; the cell names it instead of a number.
NON_FINITE = "non-finite values (NaN or inf) in the layer's result"
NO_GRADIENT = "the layer gives no gradient where the reference has one"
EXTRA_GRADIENT = "the layer gives a gradient where the reference has none"


def _run(path, module, x, probs, tpe, grad=None, generator=None):
    x_in = x.clone().requires_grad_()
    out = path.run(module, x_in, probs, tpe)
    if grad is None:
        grad = torch.randn(out.shape, generator=generator).to(device=x.device, dtype=out.dtype)
    out.backward(grad)
    return out, x_in.grad, {name: p.grad for name, p in module.named_parameters()}, grad


def _grads_in_checkpoint_layout(module) -> dict:
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


def _norm_rel(got, ref):
    got, ref = got.detach().double(), ref.detach().double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _errors(out, dx, grads, ref_out, ref_dx, ref_grads, metric=_max_rel) -> tuple[dict, dict]:
    """``({quantity: error}, {quantity: why it has no finite error})`` of one layer run."""
    errors = {"output": metric(out, ref_out), "dx": metric(dx, ref_dx)}
    problems = {}
    for name, got in grads.items():
        expected = ref_grads.get(name)
        if got is None or expected is None:
            if (got is None) != (expected is None):
                problems[f"d{name}"] = NO_GRADIENT if got is None else EXTRA_GRADIENT
            continue
        errors[f"d{name}"] = metric(got, expected)
    for name, error in errors.items():
        if not math.isfinite(error):
            problems[name] = NON_FINITE
    return {k: v for k, v in errors.items() if k not in problems}, problems


def audit_cell(path: Path, act_name: str, kwargs: dict, device, dtype) -> Cell:
    """Builds one path for one activation and checks what it computes.

    Paths with an unfused parent (the TE fused classes) are compared with that parent on the
    same weights, loaded through ``state_dict``: both run the same linears, so any difference is
    the activation (or the weight layout). Every other path is compared with the float64
    reference evaluated on the layer's weights.
    """
    from mcore_activations.activation_spec import UnsupportedActivationError

    refusals = (ValueError, RuntimeError, NotImplementedError, AssertionError)
    torch.manual_seed(1234)
    try:
        module = path.build(kwargs, device)
    except (*refusals, UnsupportedActivationError) as err:
        return Cell(path.name, act_name, "refuses", detail=str(err).splitlines()[0])
    module = module.to(dtype)
    _scale_fc1(module)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(device=device, dtype=dtype)
    probs = torch.rand(TOKENS, 1, generator=gen).to(device=device, dtype=torch.float32)
    tpe = [TOKENS // 2, 0, TOKENS // 4, TOKENS - TOKENS // 2 - TOKENS // 4]
    out, dx, grads, grad = _run(path, module, x, probs, tpe, generator=gen)

    if path.parent is not None:
        parent = path.parent(kwargs, device).to(dtype)
        parent.load_state_dict(module.state_dict())
        p_out, p_dx, _, _ = _run(path, parent, x, probs, tpe, grad=grad)
        # Gradients in the checkpoint layout both sides: the state dicts are what match.
        grads = _grads_in_checkpoint_layout(module)
        p_grads = _grads_in_checkpoint_layout(parent)
        # ||a - b|| / ||b||, the fused-MLP PR's metric: the grouped GEMMs accumulate in another
        # order than the parent's, which moves single elements by ~1e-5 of the largest.
        errors, problems = _errors(out, dx, grads, p_out, p_dx, p_grads, metric=_norm_rel)
        against = f"vs {type(parent).__name__} on the same weights"
    else:
        # The reference reads the parameters as the module holds them in memory, so the
        # gradients are compared in that layout too (``grads`` as ``_run`` returned them).
        params64 = {
            name: p.detach().double().requires_grad_() for name, p in module.named_parameters()
        }
        x64 = x.double().requires_grad_()
        ref = path.reference(params64, x64, module, probs.double(), tpe)
        ref.backward(grad.double())
        ref_grads = {name: p.grad for name, p in params64.items()}
        errors, problems = _errors(out, dx, grads, ref, x64.grad, ref_grads)
        against = "vs the float64 reference"
    if problems:
        # No number describes these; the cell carries no error value (JSON stays strict).
        why = "; ".join(f"{name}: {reason}" for name, reason in problems.items())
        return Cell(path.name, act_name, "MISMATCH", None, f"{against}; {why}")
    worst_name = max(errors, key=errors.get)
    worst = errors[worst_name]
    status = "match" if worst <= TOLERANCE[dtype] else "MISMATCH"
    return Cell(path.name, act_name, status, worst, f"{against}; worst: {worst_name}")


def _init_single_process_world(device):
    """A one-process world (gloo on CPU, nccl on GPU) with TP = EP = 1."""
    import os

    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        store = dist.HashStore()
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def run_audit(activations_to_run: dict, device, dtype, paths=None, progress=None) -> list[Cell]:
    """Runs every (path, activation) cell this machine can run.

    ``progress``, if given, is called with ``(done, total, cell)`` after each cell.
    """
    from mcore_activations.te_import import have_te
    from mcore_activations.te_lowering import TE_INSTALL_HINT

    _init_single_process_world(device)
    if not have_te():
        no_te = f"Transformer Engine is not importable ({TE_INSTALL_HINT})"
    elif device.type != "cuda":
        no_te = "Transformer Engine runs on CUDA only (--device cuda)"
    else:
        no_te = None
    cells = []
    paths = list(paths or all_paths())
    total = len(paths) * len(activations_to_run)
    for path in paths:
        for act_name, kwargs in activations_to_run.items():
            if path.needs_te and no_te:
                cells.append(Cell(path.name, act_name, "unavailable", detail=no_te))
            else:
                try:
                    cells.append(audit_cell(path, act_name, kwargs, device, dtype))
                except Exception as err:  # noqa: BLE001 - report, never hide, unexpected failures
                    detail = f"{type(err).__name__}: {err}".splitlines()[0]
                    crashed = Cell(path.name, act_name, "MISMATCH", detail=f"crashed: {detail}")
                    cells.append(crashed)
                    traceback.print_exc(file=sys.stderr)
            if progress is not None:
                progress(len(cells), total, cells[-1])
    return cells


def format_table(cells: list[Cell], activation_names: list[str]) -> str:
    """Markdown table: one row per path, one column per activation."""
    paths = list(dict.fromkeys(c.path for c in cells))
    lines = [
        "| path | " + " | ".join(activation_names) + " |",
        "|---|" + "---|" * len(activation_names),
    ]
    by_key = {(c.path, c.activation): c for c in cells}
    for path in paths:
        row = []
        for act in activation_names:
            c = by_key[(path, act)]
            if c.status == "match":
                row.append(f"match ({c.max_rel_error:.1e})")
            elif c.status == "MISMATCH":
                err = "" if c.max_rel_error is None else f" {c.max_rel_error:.2e}"
                row.append(f"**MISMATCH**{err}")
            else:
                row.append(c.status)
        lines.append(f"| {path} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def legend(dtype: torch.dtype) -> str:
    """What a cell of the table means, for ``dtype``."""
    lines = [
        "Each cell: forward and backward of one layer. `match (e)`: e is the worst, over the "
        "output, the input gradient and every parameter gradient, of max|error| / max|reference| "
        "against the float64 reference on the layer's weights (TE fused classes: "
        f"||error|| / ||parent|| against their unfused parent class); match when e <= "
        f"{TOLERANCE[dtype]:g}. `refuses`: the layer refused the config at construction (reason "
        "below). `unavailable`: this machine cannot run the path (reason below)."
    ]
    if dtype != torch.float32:
        lines.append(
            f"In {str(dtype).replace('torch.', '')} the reference applies the activation to fc1's "
            "output rounded as the layer rounds it, so elements at a clamp edge are judged on the "
            "side the layer saw."
        )
    return "\n".join(lines)


def _activation_from_args(args) -> dict:
    kwargs = dict(activation_func=FUNCTIONS[args.activation_func])
    if args.gated_linear_unit:
        kwargs["gated_linear_unit"] = True
    for field in (
        "activation_func_clamp_value",
        "activation_func_tanh_clamp_scale",
        "activation_func_tanh_clamp_scale_linear",
        "glu_linear_offset",
    ):
        value = getattr(args, field)
        if value is not None:
            kwargs[field] = value
    return kwargs


_ACTIVATION_OPTIONS = (
    "gated_linear_unit",
    "activation_func_clamp_value",
    "activation_func_tanh_clamp_scale",
    "activation_func_tanh_clamp_scale_linear",
    "glu_linear_offset",
)


# What a --config file may set: the activation fields, and the options that change what the
# activation path sees (fc1's bias, the saved-input precision, the experts' GLU layout).
CONFIG_FILE_FIELDS = (
    "activation_func",
    *_ACTIVATION_OPTIONS,
    "activation_func_fp8_input_store",
    "add_bias_linear",
    "moe_mlp_glu_interleave_size",
)


def load_config_file(path: str) -> dict:
    """``{column name: TransformerConfig kwargs}`` from a JSON file of one object or a list.

    Each object sets ``activation_func`` (one of :data:`FUNCTIONS`) and any of
    :data:`CONFIG_FILE_FIELDS`, plus an optional ``"name"`` for its column, e.g.
    ``{"name": "my-moe", "activation_func": "silu", "gated_linear_unit": true,
    "activation_func_clamp_value": 7}``.

    Raises:
        ValueError: unreadable JSON, an unknown field or function, or a configuration that
            ``TransformerConfig`` / ``ActivationSpec`` refuses; the message says which.
    """
    try:
        with open(path) as fh:
            entries = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    entries = entries if isinstance(entries, list) else [entries]
    to_run = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: entry {i} is not a JSON object")
        entry = dict(entry)
        name = entry.pop("name", None)
        unknown = sorted(set(entry) - set(CONFIG_FILE_FIELDS))
        if unknown:
            raise ValueError(
                f"{path}: entry {i} sets {', '.join(unknown)}; the audit takes "
                f"{', '.join(CONFIG_FILE_FIELDS)}"
            )
        func = entry.get("activation_func")
        if func not in FUNCTIONS:
            raise ValueError(
                f"{path}: entry {i} needs activation_func, one of {', '.join(sorted(FUNCTIONS))}; "
                f"got {func!r}"
            )
        kwargs = {**entry, "activation_func": FUNCTIONS[func]}
        try:
            spec = ActivationSpec.from_config(_config(kwargs))
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}: entry {i} is not a valid configuration: {err}") from err
        to_run[name or spec.name] = kwargs
    return to_run


def main(argv=None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron.core.transformer.activation_audit", description=__doc__
    )
    parser.add_argument("--activation-func", choices=sorted(FUNCTIONS))
    parser.add_argument("--gated-linear-unit", action="store_true")
    parser.add_argument("--activation-func-clamp-value", type=float)
    parser.add_argument("--activation-func-tanh-clamp-scale", type=float)
    parser.add_argument("--activation-func-tanh-clamp-scale-linear", type=float)
    parser.add_argument("--glu-linear-offset", type=float)
    parser.add_argument(
        "--config",
        help="audit the configurations in this JSON file instead of the built-in set: one object "
        "or a list, each with an optional 'name' and any of: "
        f"{', '.join(CONFIG_FILE_FIELDS)} (activation_func by name: "
        f"{', '.join(sorted(FUNCTIONS))})",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", help="also write the cells as JSON to this file ('-': stdout)")
    args = parser.parse_args(argv)

    if args.config is not None:
        given = [f"--{f.replace('_', '-')}" for f in _ACTIVATION_OPTIONS if getattr(args, f)]
        if args.activation_func is not None or given:
            parser.error(
                "--config names what to audit; put the activation options in the file instead "
                f"of {', '.join(given) or '--activation-func'}."
            )
        try:
            to_run = load_config_file(args.config)
        except ValueError as err:
            parser.error(f"--config {err}")
    elif args.activation_func is None:
        given = [f"--{f.replace('_', '-')}" for f in _ACTIVATION_OPTIONS if getattr(args, f)]
        if given:
            parser.error(
                f"{', '.join(given)} describe one activation and need --activation-func; without "
                "it the built-in set is audited."
            )
        to_run = BUILT_IN
    else:
        kwargs = _activation_from_args(args)
        try:
            name = ActivationSpec.from_config(_config(kwargs)).name
        except ValueError as err:
            parser.error(f"invalid activation configuration: {err}")
        to_run = {name: kwargs}

    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError) as err:
        parser.error(f"--device {args.device!r} is not a device: {err}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device} but this machine has no usable CUDA GPU; use cpu.")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: the audit runs on cpu or cuda.")
    json_file = None
    if args.json and args.json != "-":
        try:  # fail now, not after the whole audit
            json_file = open(args.json, "w")
        except OSError as err:
            parser.error(f"--json {args.json}: cannot write there ({err.strerror}).")
    # With the JSON on stdout, everything else goes to stderr so stdout stays parseable.
    report = sys.stderr if args.json == "-" else sys.stdout

    # Full-precision float32 GEMMs in every NVIDIA library (cuBLAS inside TE would otherwise
    # use TF32), so float32 comparisons measure the activation, not the matmul precision. Set
    # before any CUDA work; an explicit setting in the environment wins.
    os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
    dtype = getattr(torch, args.dtype)

    def progress(done, total, cell):
        print(f"[{done}/{total}] {cell.path} / {cell.activation}: {cell.status}", file=sys.stderr)

    cells = run_audit(to_run, device, dtype, progress=progress)
    print(
        f"activation audit: device={device} dtype={args.dtype} torch={torch.__version__}",
        file=report,
    )
    print(format_table(cells, list(to_run)), file=report)
    print(legend(dtype), file=report)
    for c in cells:
        if c.status in ("refuses", "MISMATCH") and c.detail:
            print(f"- {c.path} / {c.activation}: {c.status}: {c.detail}", file=report)
    unavailable = {}  # reason -> paths, in table order
    for c in cells:
        if c.status == "unavailable":
            unavailable.setdefault(c.detail, {})[c.path] = None
    for reason, paths in unavailable.items():
        print(f"- {', '.join(paths)}: unavailable: {reason}", file=report)
    if args.json:
        # Strict JSON: a non-finite number would be written as the non-JSON token Infinity.
        payload = json.dumps([dataclasses.asdict(c) for c in cells], indent=1, allow_nan=False)
        if json_file is None:
            print(payload)
        else:
            with json_file:
                json_file.write(payload)
    mismatches = [c for c in cells if c.status == "MISMATCH"]
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
