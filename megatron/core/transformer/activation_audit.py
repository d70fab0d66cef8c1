"""Activation audit: proves every MLP path this machine runs computes the configured activation.

For each activation and each path (unfused ``MLP``, ``MLP`` with fused kernels, ``SharedExpertMLP``,
``SequentialMLP``, and with Transformer Engine on a GPU ``TEFusedMLP``,
``TEFusedMLPWithGroupedLinear``, ``FusedSharedExpertMLP`` and ``TEGroupedMLP``) it builds the
layer from a ``TransformerConfig``, scales the fc1 weights so pre-activations hit the clamps, runs
forward and backward, and compares the output, the input gradient and every parameter gradient
with a float64 evaluation of ``ActivationSpec.reference`` on the same weights (max |error| over
max |reference|). The TE fused classes are compared with their unfused parent class on the same
weights instead (||error|| / ||parent||), which isolates the activation from TE's GEMMs. The
cells use the words of :mod:`mcore_activations.audit_cells`; the exit status is 1 if any cell is
a mismatch or an error and 2 on a usage error (checked before anything runs). Progress goes to
stderr, one line per cell. ``--help`` shows examples (:data:`EXAMPLES`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import traceback

import torch

from mcore_activations import audit_config
from mcore_activations.activation_spec import ActivationSpec
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
from mcore_activations.audit_config import ACTIVATION_OPTIONS as _ACTIVATION_OPTIONS
from mcore_activations.audit_config import CONFIG_FILE_FIELDS
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

    torch.manual_seed(1234)
    try:
        module = path.build(kwargs, device)
    except (UnsupportedActivationError, RuntimeError, NotImplementedError) as err:
        return Cell(path.name, act_name, REFUSED, detail=reason(err, limit=400))
    except (ValueError, AssertionError) as err:
        # The config rules upstream states as ValueError (TransformerConfig) or assert (layers),
        # which the fork keeps.
        return Cell(path.name, act_name, UPSTREAM_RULE, detail=reason(err, limit=400))
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
        return Cell(path.name, act_name, MISMATCH, None, f"{against}; {why}")
    worst_name = max(errors, key=errors.get)
    worst = errors[worst_name]
    status = MATCH if worst <= TOLERANCE[dtype] else MISMATCH
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
    from mcore_activations.te_import import TE_INSTALL_HINT, have_te

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
                cells.append(Cell(path.name, act_name, UNAVAILABLE, detail=no_te))
            else:
                try:
                    cells.append(audit_cell(path, act_name, kwargs, device, dtype))
                except Exception as err:  # noqa: BLE001 - report, never hide, unexpected failures
                    detail = f"{type(err).__name__}: {reason(err, limit=400)}"
                    cells.append(Cell(path.name, act_name, ERROR, detail=detail))
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
            if c.status == MATCH:
                row.append(f"{MATCH} ({c.max_rel_error:.1e})")
            elif c.status == MISMATCH:
                err = "" if c.max_rel_error is None else f" {c.max_rel_error:.2e}"
                row.append(f"**{MISMATCH}**{err}")
            else:
                row.append(c.status)
        lines.append(f"| {path} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def legend(dtype: torch.dtype) -> str:
    """What a cell of the table means, for ``dtype``."""
    lines = [
        f"Each cell: forward and backward of one layer. {LEGEND}",
        f"`{MATCH} (e)`: e is the worst, over the output, the input gradient and every parameter "
        "gradient, of max|error| / max|reference| against the float64 reference on the layer's "
        "weights (TE fused classes: ||error|| / ||parent|| against their unfused parent class); "
        f"{MATCH} when e <= {TOLERANCE[dtype]:g}. The reasons are listed below the table.",
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


def _check(kwargs) -> str:
    return ActivationSpec.from_config(_config(kwargs)).name


def load_config_file(path: str) -> dict:
    """``{column name: TransformerConfig kwargs}`` from a JSON file of one object or a list.

    The format is :func:`mcore_activations.audit_config.load_config_file`'s, with the functions
    of :data:`FUNCTIONS`.

    Raises:
        ValueError: unreadable JSON, an unknown field or function, or a configuration that
            ``TransformerConfig`` / ``ActivationSpec`` refuses; the message says which.
    """
    return audit_config.load_config_file(path, FUNCTIONS, _check)


MODULE = "megatron.core.transformer.activation_audit"
DESCRIPTION = """\
Builds every MLP path this machine can run (unfused MLP, fused kernels, SharedExpertMLP,
SequentialMLP; with Transformer Engine on a GPU the TE fused and grouped classes) for each
activation, runs forward and backward, and compares the output and every gradient with the
float64 reference. A legend under the table says what each cell means."""

EXAMPLES = """\
examples:
  the built-in activation set:
    {prog}
  your own configurations (one JSON object or a list), e.g. my-model.json holding
  [{{"name": "my-moe", "activation_func": "silu", "gated_linear_unit": true,
    "activation_func_clamp_value": 7, "add_bias_linear": true}}]:
    {prog} --config my-model.json
  one activation, from the command line:
    {prog} --activation-func silu --gated-linear-unit --activation-func-clamp-value 7
  in bfloat16, also writing the cells as JSON:
    {prog} --dtype bfloat16 --json audit.json
  JSON alone on stdout (the table goes to stderr):
    {prog} --json - > audit.json

exit status: 0 every cell matches or is refused with a reason, 1 a MISMATCH or an error,
2 a usage error (reported before anything runs).
"""


def build_parser() -> AuditArgumentParser:
    """The command line of the audit (``scripts/main.sh``)."""
    parser = AuditArgumentParser(
        prog=command_name(MODULE),
        description=DESCRIPTION,
        epilog=EXAMPLES.format(prog=command_name(MODULE)),
    )
    one = parser.add_argument_group(
        "one activation (instead of the built-in set; the fields of TransformerConfig)"
    )
    one.add_argument(
        "--activation-func", choices=sorted(FUNCTIONS), help="the activation function, by name"
    )
    one.add_argument(
        "--gated-linear-unit", action="store_true", help="gated: act(gate) * linear (GLU)"
    )
    one.add_argument(
        "--activation-func-clamp-value",
        type=float,
        metavar="C",
        help="DeepSeek-V4 / gpt-oss clamp: gate at most C, linear half within [-C, C]",
    )
    one.add_argument(
        "--activation-func-tanh-clamp-scale",
        type=float,
        metavar="S",
        help="SiTU tanh clamp of the gate: S * tanh(gate / S)",
    )
    one.add_argument(
        "--activation-func-tanh-clamp-scale-linear",
        type=float,
        metavar="S",
        help="SiTU tanh clamp of the linear half: S * tanh(linear / S)",
    )
    one.add_argument(
        "--glu-linear-offset", type=float, metavar="B", help="added to the linear half (gpt-oss: 1)"
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="audit the configurations in this JSON file instead of the built-in set: one object "
        "or a list, each with an optional 'name' and any of: "
        f"{', '.join(CONFIG_FILE_FIELDS)} (activation_func by name: "
        f"{', '.join(sorted(FUNCTIONS))})",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda (default: cuda where a GPU is usable; the TE paths need cuda)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the layers' parameter and compute dtype (default: float32)",
    )
    parser.add_argument(
        "--json",
        metavar="FILE",
        help="also write the cells as JSON to FILE ('-': JSON alone on "
        "stdout, the table on stderr)",
    )
    return parser


def main(argv=None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = build_parser()
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

    with one_copy_of_each_warning():
        cells = run_audit(to_run, device, dtype, progress=progress)
    print(
        f"activation audit: device={device} dtype={args.dtype} torch={torch.__version__}",
        file=report,
    )
    print(format_table(cells, list(to_run)), file=report)
    print(legend(dtype), file=report)
    for c in cells:
        if c.status in (REFUSED, UPSTREAM_RULE, MISMATCH, ERROR) and c.detail:
            print(f"- {c.path} / {c.activation}: {c.status}: {c.detail}", file=report)
    unavailable = {}  # reason -> paths, in table order
    for c in cells:
        if c.status == UNAVAILABLE:
            unavailable.setdefault(c.detail, {})[c.path] = None
    for why, paths in unavailable.items():
        print(f"- {', '.join(paths)}: {UNAVAILABLE}: {why}", file=report)
    if args.json:
        # Strict JSON: a non-finite number would be written as the non-JSON token Infinity.
        payload = json.dumps([dataclasses.asdict(c) for c in cells], indent=1, allow_nan=False)
        if json_file is None:
            print(payload)
        else:
            with json_file:
                json_file.write(payload)
    wrong = [c for c in cells if c.status in (MISMATCH, ERROR)]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
