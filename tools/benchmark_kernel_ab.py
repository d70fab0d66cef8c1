"""The raw Triton kernels of this tree against those of another commit, in turns, on one GPU.

Usage (GPU)::

    python tools/benchmark_kernel_ab.py --baseline REV [--backward] [--bias] [--probs]
        [--shapes 65536x1536,16384x8192] [--cases SwiGLU "SwiGLU(clamp=7), fp32" ...]
        [--candidate NAME=VALUE[,NAME=VALUE...]] [--variant LABEL=REV ...] [--json out.json]

``REV``'s kernels are loaded from git as modules of their own, next to this tree's, so both
kernel families run in one process: ``mcore_activations/fusions/triton_kernels.py`` alone for a
revision from before the kernels were split in three, else that file with ``triton_jit.py`` and
``triton_plans.py`` as a package of their own. ``REV`` may also be the path of a copy (the GPU
machine gets a snapshot of the tree, without git): a copy of the single file, or a directory
holding copies of the three.
``--variant`` adds more kernel sources the same way, each timed in the same turns under its
label, so several formulations of a kernel compare in one run. For each case and shape
the script checks that the two agree (the output or input gradient to the rounding of the dtype,
or 16 float32 units of the largest value; the bias and probability gradients, sums whose order
follows the plan, to 1e-4 of their largest value or two units of the dtype's rounding, whichever
is larger), then times, in turns (``time_interleaved``): a copy of the same bytes (the floor),
this tree's call without the bias and probabilities (what the variant adds), when both are on
this tree's call with the bias alone (``bias only``: the reference a weighted call with a bias
is held to), the baseline's call, this tree's, this tree's with each ``--candidate`` set of
``triton_plans.LaunchOptions`` fields (with a bias and probabilities, also that candidate's own
bias-only call), and each ``--variant``'s. It prints time / floor, the ratio of this tree to the
baseline and, for weighted calls with a bias, each call's ratio to its bias-only one.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mcore_activations.activation_spec import ActivationKind, ActivationSpec  # noqa: E402
from mcore_activations.fusions import activation_kernels as ak  # noqa: E402
from mcore_activations.fusions import triton_kernels as tk  # noqa: E402
from mcore_activations.fusions.triton_plans import LaunchOptions  # noqa: E402
from tools.benchmark_activations import copy_fn, time_interleaved  # noqa: E402
from tools.kernel_variants.common import GLU_CASES, check_formulation, with_options  # noqa: E402

FUSIONS = "mcore_activations/fusions"
KERNELS = f"{FUSIONS}/triton_kernels.py"
# The kernels' modules since the split, in import order; each imports the ones before it.
SPLIT = ("triton_jit", "triton_plans", "triton_kernels")
CASES = GLU_CASES | {
    "squared-ReLU": (ActivationSpec(ActivationKind.SQUARED_RELU), torch.bfloat16),
}


def load_baseline(rev: str, directory: str, name: str = "baseline_triton_kernels"):
    """``triton_kernels`` as of git revision ``rev`` (or of the copy at path ``rev``: a file, or
    a directory of the split modules), imported under ``name`` from copies in ``directory``.

    A split revision's three modules import one another by their absolute names: the copies'
    imports are rewritten to the copies' package, so nothing of this tree's kernels is mixed in.
    """
    sources = _baseline_sources(rev)
    if list(sources) == ["triton_kernels"]:
        path = Path(directory) / f"{name}.py"
        path.write_text(sources["triton_kernels"])
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    package = Path(directory) / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module_name, source in sources.items():
        for other in SPLIT:
            source = source.replace(f"mcore_activations.fusions.{other}", f"{name}.{other}")
            source = source.replace(
                f"from mcore_activations.fusions import {other}", f"from {name} import {other}"
            )
        (package / f"{module_name}.py").write_text(source)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    importlib.invalidate_caches()
    module = importlib.import_module(f"{name}.triton_kernels")
    module.__name__ = name  # the label tools print
    return module


def _baseline_sources(rev: str) -> dict:
    """``{module: source}`` of ``rev``'s kernels: ``triton_kernels`` alone (the single file of
    the revisions before the split) or the three split modules."""
    path = Path(rev)
    if path.is_file():
        return {"triton_kernels": path.read_text()}
    if path.is_dir():
        return {m: (path / f"{m}.py").read_text() for m in SPLIT}

    def show(file: str):
        done = subprocess.run(
            ["git", "show", f"{rev}:{file}"], cwd=ROOT, capture_output=True, text=True
        )
        return done.stdout if done.returncode == 0 else None

    if show(f"{FUSIONS}/triton_plans.py") is None:
        source = show(KERNELS)
        if source is None:
            raise ValueError(f"{rev}: no {KERNELS} there")
        return {"triton_kernels": source}
    return {m: show(f"{FUSIONS}/{m}.py") for m in SPLIT}


def parse_variant(text: str) -> tuple[str, str]:
    """``"LABEL=REV"`` -> ``("LABEL", "REV")``; ``REV`` is a git revision or a file's path."""
    label, sep, rev = text.partition("=")
    if not sep or not label.strip() or not rev.strip():
        raise argparse.ArgumentTypeError(f"--variant wants LABEL=REV, got {text!r}")
    return label.strip(), rev.strip()


def parse_candidate(text: str) -> dict:
    """``"A=1,B=None"`` -> ``{"A": 1, "B": None}`` (values are Python literals); raises
    ``argparse.ArgumentTypeError``, whose message argparse prints, on anything else."""
    import ast

    constants = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if not name.strip() or not value.strip():
            raise argparse.ArgumentTypeError(
                f"--candidate wants NAME=VALUE[,NAME=VALUE...], got {text!r}"
            )
        if name.strip() not in {f.name for f in dataclasses.fields(LaunchOptions)}:
            raise argparse.ArgumentTypeError(
                f"--candidate: LaunchOptions has no field {name.strip()!r}"
            )
        try:
            constants[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(
                f"--candidate: {value.strip()!r} is not a Python literal (e.g. 4096, None)"
            ) from None
    return constants


# Labels of a case's timing group that bench_case sets itself; a variant must not replace one.
RESERVED_LABELS = (
    "floor",
    "plain",
    "bias only",
    "baseline",
    "this tree",
    "this tree / baseline",
    "this tree / bias only",
)


def candidate_label(constants: dict) -> str:
    """The label a ``--candidate`` set of constants is timed and printed under."""
    return ", ".join(f"{k}={v}" for k, v in constants.items())


def bias_only_label(constants: dict) -> str:
    """The label of a ``--candidate``'s own bias-only call (weighted calls with a bias)."""
    return f"bias only, {candidate_label(constants)}"


def check_variant_labels(variants, candidates) -> str | None:
    """An error message if a ``--variant`` label would overwrite another timing, else None."""
    taken = set(RESERVED_LABELS) | {candidate_label(c) for c in candidates}
    taken |= {bias_only_label(c) for c in candidates}
    for label, _ in variants:
        if label in taken:
            return (
                f"--variant label {label!r} is already a column of the table (reserved: "
                f"{', '.join(RESERVED_LABELS)}, the candidates' labels, earlier variants); "
                "pick another"
            )
        taken.add(label)
    return None


def parse_shape(text: str) -> tuple[int, int]:
    """``"65536x1536"`` -> ``(65536, 1536)`` (rows, output width)."""
    rows, sep, ffn = text.lower().partition("x")
    if not sep or not rows.isdigit() or not ffn.isdigit():
        raise argparse.ArgumentTypeError(
            f"--shapes wants ROWSxWIDTH items such as 65536x1536, got {text!r}"
        )
    return int(rows), int(ffn)


def bench_case(
    baseline, spec, dtype, rows, ffn, backward, has_bias, has_probs, candidates, variants=()
):
    """``{label: time / floor}`` of one case, every candidate in the same turns (``variants``:
    ``(label, module)`` pairs of other kernel sources)."""
    width = 2 * ffn if spec.gated else ffn
    x = torch.randn(rows, width, device="cuda", dtype=dtype) * 4  # large enough for the clamps
    grad = torch.randn(rows, ffn, device="cuda", dtype=dtype)
    bias = torch.randn(width, device="cuda", dtype=dtype) if has_bias else None
    probs = torch.rand(rows, 1, device="cuda") if has_probs else None
    params = ak.params_tensor(ak.spec_params(spec), x.device)
    variant = ak.KernelVariant.of(spec, has_bias=has_bias, has_probs=has_probs)
    plain = ak.KernelVariant.of(spec, has_bias=False, has_probs=False)
    bias_only = ak.KernelVariant.of(spec, has_bias=True, has_probs=False)

    def call(module, v=variant, b=bias, p=probs):
        if backward:
            return lambda: module.triton_backward(v, grad, x, b, p, params)
        return lambda: module.triton_forward(v, x, b, p, params)

    def candidate(fields, v=variant, b=bias, p=probs):
        # This tree's call under production's launch options with ``fields`` replaced.
        if backward:
            return with_options(
                fields, lambda o: tk.triton_backward(v, grad, x, b, p, params, options=o)
            )
        return with_options(fields, lambda o: tk.triton_forward(v, x, b, p, params, options=o))

    theirs = call(baseline)()
    for label, module in [("this tree", tk), *variants]:
        ours = call(module)()
        pairs = zip(ours, theirs) if backward else [(ours, theirs)]
        for i, (mine, base) in enumerate(pairs):
            if i == 0:
                # 16 float32 units of the largest value (at least the default 2 of the dtype): a
                # source that evaluates a formula another way (a tanh from another identity)
                # rounds differently, most where 1 - tanh**2 cancels.
                eps = torch.finfo(base.dtype).eps
                units = max(2, math.ceil(16 * torch.finfo(torch.float32).eps / eps))
                check_formulation(f"{label} against the baseline", mine, base, units=units)
            elif mine is not None:
                # The bias and probability gradients are float32 sums whose order follows the
                # plan, rounded to the bias's or probabilities' dtype.
                tol = max(1e-4, 2 * torch.finfo(mine.dtype).eps)
                scale = base.float().abs().max().item()
                torch.testing.assert_close(mine, base, rtol=tol, atol=tol * scale)
    # Forward: read the input, write the output; backward: also read the output gradient and
    # write the input gradient in the input's layout.
    elements = rows * (width + ffn + (width if backward else 0))
    group = {"floor": copy_fn(elements * dtype.itemsize)}
    if has_bias or has_probs:
        group["plain"] = call(tk, plain, None, None)
    if has_bias and has_probs:
        # The reference the weighted call with a bias is held to: the same call unweighted.
        group["bias only"] = call(tk, bias_only, bias, None)
    group["baseline"] = call(baseline)
    group["this tree"] = call(tk)
    for constants in candidates:
        group[candidate_label(constants)] = candidate(constants)
        if has_bias and has_probs:
            # A candidate may move the bias-only call too (plans shared with it): its own
            # reference, so the 5 % target reads within the candidate.
            group[bias_only_label(constants)] = candidate(constants, bias_only, bias, None)
    for label, module in variants:
        group[label] = call(module)
    with torch.no_grad():
        times = time_interleaved(group, repeats=9)
    floor = times.pop("floor")
    row = {label: t / floor for label, t in times.items()}
    row["this tree / baseline"] = times["this tree"] / times["baseline"]
    if has_bias and has_probs:
        row["this tree / bias only"] = times["this tree"] / times["bias only"]
        for constants in candidates:
            label = candidate_label(constants)
            row[f"{label} / its bias only"] = times[label] / times[bias_only_label(constants)]
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline", required=True, help="a git revision, e.g. HEAD~3, or a copy's path"
    )
    parser.add_argument("--backward", action="store_true", help="time the backward kernels")
    parser.add_argument("--bias", action="store_true")
    parser.add_argument("--probs", action="store_true")
    parser.add_argument("--shapes", default="65536x1536,16384x8192")
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["SwiGLU", "SwiGLU(clamp=7)", "quick-GEGLU(gpt-oss)"],
        help="names from CASES (some contain commas: quote each name)",
    )
    parser.add_argument("--candidate", action="append", default=[], type=parse_candidate)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=parse_variant,
        help="LABEL=REV: another kernel source (a git revision or a file's path) to time",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",")]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    names = args.cases
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    clash = check_variant_labels(args.variant, args.candidate)
    if clash:
        parser.error(clash)
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_kernel_ab needs a CUDA GPU")
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    env |= {"baseline": args.baseline, "backward": args.backward}
    env |= {"bias": args.bias, "probs": args.probs}
    env |= {"variants": dict(args.variant)}
    print(json.dumps(env), flush=True)
    results = {"env": env}
    with tempfile.TemporaryDirectory() as tmp:
        baseline = load_baseline(args.baseline, tmp)
        variants = [
            (label, load_baseline(rev, tmp, f"variant_{i}_triton_kernels"))
            for i, (label, rev) in enumerate(args.variant)
        ]
        for rows, ffn in shapes:
            for name in names:
                spec, dtype = CASES[name]
                row = bench_case(
                    baseline,
                    spec,
                    dtype,
                    rows,
                    ffn,
                    args.backward,
                    args.bias,
                    args.probs,
                    args.candidate,
                    variants,
                )
                key = f"{name} {rows} x {ffn}"
                results[key] = row
                cells = " | ".join(f"{label} {value:.3f}" for label, value in row.items())
                print(f"| {key} | {cells} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
