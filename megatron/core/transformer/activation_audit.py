"""Activation audit: proves every MLP path this machine runs computes the configured activation.

For each activation and each path (unfused ``MLP``, ``MLP`` with fused kernels, ``SharedExpertMLP``,
``SequentialMLP``, and with Transformer Engine on a GPU ``TEFusedMLP``,
``TEFusedMLPWithGroupedLinear``, ``FusedSharedExpertMLP`` and ``TEGroupedMLP``) it builds the
layer from a ``TransformerConfig``, scales the fc1 weights so pre-activations hit the clamps, runs
forward and backward, and compares the output, the input gradient and every parameter gradient
with a float64 evaluation of ``ActivationSpec.reference`` on the same weights (max |error| over
max |reference|). The TE fused classes are compared with their unfused parent class on the same
weights instead (||error|| / ||parent||), which isolates the activation from TE's GEMMs. The
cells come from :mod:`mcore_activations.audit_runner`, the runner ``mcore-activations-audit``
uses too, in the words of :mod:`mcore_activations.audit_cells`; the columns are the fork audit's
entries of :mod:`mcore_activations.activation_catalogue`. The exit status is 1 if any cell is a
mismatch or an error and 2 on a usage error (checked before anything runs). Progress goes to
stderr, one line per cell. ``--help`` shows examples (:data:`EXAMPLES`).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from mcore_activations import audit_config, audit_runner
from mcore_activations.activation_spec import ActivationSpec
from mcore_activations.audit_cells import (
    ERROR,
    LEGEND,
    MATCH,
    MISMATCH,
    REFUSED,
    UNAVAILABLE,
    UPSTREAM_RULE,
)
from mcore_activations.audit_cli import (
    AuditArgumentParser,
    add_common_options,
    command_name,
    one_copy_of_each_warning,
    progress_printer,
)
from mcore_activations.audit_config import ACTIVATION_OPTIONS as _ACTIVATION_OPTIONS
from mcore_activations.audit_runner import Cell
from megatron.core.transformer.activation_audit_paths import (  # noqa: F401 - the audit's names
    BUILT_IN,
    EXPERTS,
    FFN,
    FUNCTIONS,
    HIDDEN,
    SETTINGS,
    TOKENS,
    TOLERANCE,
    Path,
    _config,
    _grouped_reference,
    _layer_dtype,
    _mlp_reference,
    all_paths,
)


def audit_cell(path: Path, act_name: str, kwargs: dict, device, dtype) -> Cell:
    """One cell of this audit: :func:`mcore_activations.audit_runner.audit_cell` with its
    :data:`SETTINGS`."""
    return audit_runner.audit_cell(path, act_name, kwargs, device, dtype, SETTINGS)


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
    """Runs every (path, activation) cell this machine can run, through the one audit runner.

    ``progress``, if given, is called with each cell as soon as it is done.
    """
    from mcore_activations.te_import import TE_INSTALL_HINT, have_te

    _init_single_process_world(device)
    if not have_te():
        no_te = f"Transformer Engine is not importable ({TE_INSTALL_HINT})"
    elif device.type != "cuda":
        no_te = "Transformer Engine runs on CUDA only (--device cuda)"
    else:
        no_te = None
    paths = list(paths or all_paths())
    return audit_runner.run_audit(
        paths, activations_to_run, device, dtype, SETTINGS, no_te=no_te, progress=progress
    )


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
    add_common_options(
        parser,
        cuda_available=torch.cuda.is_available(),
        json_help="also write the cells as JSON to FILE ('-': JSON alone on stdout, the table "
        "on stderr)",
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

    progress = progress_printer(len(all_paths()) * len(to_run))
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
            print(f"- {c.path} / {c.activation}: {c.status}: {c.explanation()}", file=report)
    unavailable = {}  # reason -> paths, in table order
    for c in cells:
        if c.status == UNAVAILABLE:
            unavailable.setdefault(c.detail, {})[c.path] = None
    for why, paths in unavailable.items():
        print(f"- {', '.join(paths)}: {UNAVAILABLE}: {why}", file=report)
    if args.json:
        # Strict JSON: a non-finite number would be written as the non-JSON token Infinity.
        payload = json.dumps([c.to_json() for c in cells], indent=1, allow_nan=False)
        if json_file is None:
            print(payload)
        else:
            with json_file:
                json_file.write(payload)
    wrong = [c for c in cells if c.status in (MISMATCH, ERROR)]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
