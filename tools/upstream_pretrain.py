"""Upstream's own ``pretrain_gpt.py``, patched and unpatched, compared iteration by iteration.

The upstream training-loop tier (``scripts/gpu_pretrain_gpt.sh`` runs it on one GPU with
Transformer Engine). For each configuration below it trains upstream's tiny GPT-MoE (one dense
layer, one MoE layer, mock data) through upstream's unchanged ``pretrain_gpt.py`` several times:

- ``reference``: the activation fusion off (``--no-bias-*-fusion``), patched: the unfused path,
  whose math upstream and the patch share;
- ``patched`` / ``unpatched``: the path under test (fused kernels, a TE fused class, grouped
  experts), with and without ``MCORE_ACTIVATIONS_PATCH=1``;
- ``unpatched-reference``: the reference run without the patch (upstream's own unfused path);
- ``control``: the reference without the clamp. It sets the scale: the clamp moves the loss by
  ``|control - reference|``, and a run counts as equal to the reference only when it lies within
  :data:`EQUAL_FRACTION` of that;
- ``low-memory`` (asked for by ``--runs``, not run by default): ``patched`` with the memory
  options of :data:`LOW_MEMORY_ENV` (the in-place backward, fc2's input recomputed, fc2 on two
  row blocks).

Every run's log is parsed for upstream's own numbers: the lm loss of each iteration, the
"elapsed time per iteration" and ``forward-backward`` timer, and the memory report (max
allocated after the first iteration). Whether the patch was in force is read from the patch's
one-line report, never assumed. ``--size large`` trains a model whose MLPs dominate the step,
for step time and memory (patched against unpatched, one run at a time).

Usage (on the GPU machine; the script prepares the trees):

    python3 tools/upstream_pretrain.py --entry DIR --target release --out OUT [--configs ...]
    python3 tools/upstream_pretrain.py --dry-run --target main   # print the command lines
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

CLAMP = ["--activation-func-clamp-value", "0.5"]
# A run equals its reference when its largest loss difference is within this fraction of the
# clamp's own effect (the control run's largest difference): bf16 fused and unfused kernels round
# differently, and that noise grows over the iterations, but stays far below what a dropped clamp
# does.
EQUAL_FRACTION = 0.1
ITERATIONS = 20
LARGE_ITERATIONS = 12
WARMUP_ITERATIONS = 4  # left out of the step-time median
RUN_TIMEOUT_S = 900

TINY_MODEL = [
    "--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "512",
    "--num-attention-heads", "4", "--seq-length", "256", "--max-position-embeddings", "256",
    "--micro-batch-size", "4", "--global-batch-size", "4",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512",
    "--moe-layer-freq", "[0,1]",
]  # fmt: skip
LARGE_MODEL = [
    "--num-layers", "2", "--hidden-size", "2048", "--ffn-hidden-size", "8192",
    "--num-attention-heads", "16", "--seq-length", "4096", "--max-position-embeddings", "4096",
    "--micro-batch-size", "1", "--global-batch-size", "1",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "1408",
    "--moe-layer-freq", "[0,1]",
]  # fmt: skip
COMMON = [
    "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
    "--split", "100,0,0", "--bf16", "--transformer-impl", "transformer_engine",
    "--deterministic-mode", "--no-gradient-accumulation-fusion", "--init-method-std", "0.05",
    "--lr", "1e-4", "--lr-decay-style", "constant", "--weight-decay", "0.0", "--clip-grad", "1.0",
    "--seed", "1234", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000",
    "--timing-log-level", "0", "--distributed-backend", "nccl", "--num-workers", "0",
]  # fmt: skip
SPEC_MODULE = ["--spec", "pretrain_gpt_spec", "te_fused_dense_mlp_block"]


@dataclasses.dataclass(frozen=True)
class Config:
    """One model configuration of the tier.

    Attributes:
        name: Short name used in file names and tables.
        description: What it trains, in words.
        args: Flags of every run (activation, expert layout); the clamp is added separately.
        under_test: Flags that select the path under test (on top of ``args``).
        unfused: Flags of the reference: the same model with the activation fusion off.
        targets: The upstreams it runs on.
    """

    name: str
    description: str
    args: tuple[str, ...]
    under_test: tuple[str, ...]
    unfused: tuple[str, ...]
    targets: tuple[str, ...] = ("release", "main")


SWIGLU = ("--swiglu", "--disable-bias-linear")
GPT_OSS = ("--quick-geglu", "--glu-linear-offset", "1.0", "--no-bias-dropout-fusion")
NO_SWIGLU_FUSION = ("--no-bias-swiglu-fusion",)
NO_GELU_FUSION = ("--no-bias-gelu-fusion",)

CONFIGS = (
    Config(
        "dsv4",
        "DeepSeek-V4 clamped SwiGLU; dense MLP fused, SequentialMLP experts with token weights",
        SWIGLU,
        (),
        NO_SWIGLU_FUSION,
    ),
    Config(
        "dsv4-tefused",
        "DeepSeek-V4 clamp; dense layer TEFusedMLP (TE op fuser) through a user --spec",
        SWIGLU,
        (*SPEC_MODULE, "--use-transformer-engine-op-fuser"),
        NO_SWIGLU_FUSION,
    ),
    Config(
        "dsv4-grouped",
        "DeepSeek-V4 clamp; grouped-GEMM experts (TEGroupedMLP), fused",
        (*SWIGLU, "--moe-grouped-gemm"),
        (),
        NO_SWIGLU_FUSION,
    ),
    Config(
        "dsv4-shared",
        "DeepSeek-V4 clamp; SequentialMLP experts and a shared expert, fused",
        (*SWIGLU, "--moe-shared-expert-intermediate-size", "512"),
        (),
        NO_SWIGLU_FUSION,
    ),
    Config(
        "gpt-oss",
        "gpt-oss quick-GEGLU, offset 1, clamp, biases; SequentialMLP experts, fused",
        GPT_OSS,
        (),
        NO_GELU_FUSION,
    ),
    Config(
        "gpt-oss-grouped",
        "gpt-oss quick-GEGLU, offset 1, clamp, biases; grouped-GEMM experts (TEGroupedMLP), fused",
        (*GPT_OSS, "--moe-grouped-gemm"),
        (),
        NO_GELU_FUSION,
    ),
)
CONFIG_BY_NAME = {c.name: c for c in CONFIGS}
DEFAULT_RUNS = ("reference", "patched", "unpatched", "unpatched-reference", "control")
RUNS = (*DEFAULT_RUNS, "low-memory")
# The low-memory run's environment: every memory option of the package on.
LOW_MEMORY_ENV = {
    "MCORE_ACTIVATIONS_IN_PLACE_BACKWARD": "1",
    "MCORE_ACTIVATIONS_RECOMPUTE_OUTPUT": "1",
    "MCORE_ACTIVATIONS_FC2_CHUNKS": "2",
}
MEMORY_VARIABLES = tuple(LOW_MEMORY_ENV)


@dataclasses.dataclass
class Run:
    """One training run: its command line and, once run, what its log said."""

    config: str
    kind: str
    patch: bool
    argv: list[str]
    returncode: Optional[int] = None
    patched_report: Optional[str] = None
    losses: list[float] = dataclasses.field(default_factory=list)
    step_ms: list[float] = dataclasses.field(default_factory=list)
    forward_backward_ms: list[float] = dataclasses.field(default_factory=list)
    max_allocated_mb: Optional[float] = None
    error: Optional[str] = None
    seconds: Optional[float] = None

    @property
    def name(self) -> str:
        return f"{self.config}.{self.kind}"


def run_argv(config: Config, kind: str, *, size: str) -> list[str]:
    """The ``pretrain_gpt.py`` flags of one run."""
    model = TINY_MODEL if size == "tiny" else LARGE_MODEL
    iterations = ITERATIONS if size == "tiny" else LARGE_ITERATIONS
    argv = [*model, *COMMON, "--train-iters", str(iterations), *config.args]
    if kind in ("reference", "unpatched-reference", "control"):
        argv += config.unfused
    else:
        argv += config.under_test
    if kind != "control":
        argv += CLAMP
    return argv


def plan(configs: list[Config], kinds: list[str], target: str, size: str) -> list[Run]:
    """Every run of ``configs`` on ``target``."""
    runs = []
    for config in configs:
        if target not in config.targets:
            continue
        for kind in kinds:
            patch = kind in ("reference", "patched", "control", "low-memory")
            runs.append(Run(config.name, kind, patch, run_argv(config, kind, size=size)))
    return runs


# ------------------------------------------------------------------------------ parsing logs

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
_FIELD = re.compile(r"\s*([^:|]+):\s*([-+0-9.eE]+)\s*\|")
_TIMER = re.compile(r"^\s*forward-backward\s*\.+:\s*\(([0-9.]+),\s*([0-9.]+)\)")
_MEMORY = re.compile(r"memory \(MB\) \| allocated: ([0-9.]+) \| max allocated: ([0-9.]+)")
_PATCH_REPORT = re.compile(r"MCORE_ACTIVATIONS_PATCH: (patched .*)")
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?(\w+(?:\.\w+)*(?:Error|Exception)): (.*)$")


def parse_log(text: str, run: Run) -> None:
    """Fills ``run`` from its log: losses, step times, memory, the patch report, the error."""
    for line in text.splitlines():
        if match := _ITERATION.search(line):
            fields = {k.strip(): float(v) for k, v in _FIELD.findall(match.group(2))}
            if "lm loss" in fields:
                run.losses.append(fields["lm loss"])
            if "elapsed time per iteration (ms)" in fields:
                run.step_ms.append(fields["elapsed time per iteration (ms)"])
        elif match := _TIMER.search(line):
            run.forward_backward_ms.append(float(match.group(2)))
        elif (match := _MEMORY.search(line)) and run.max_allocated_mb is None:
            run.max_allocated_mb = float(match.group(2))
        elif match := _PATCH_REPORT.search(line):
            run.patched_report = match.group(1)
        elif (match := _ERROR_LINE.match(line.strip())) and run.error is None:
            run.error = f"{match.group(1)}: {match.group(2)}"[:400]


# ------------------------------------------------------------------------------ running


def _environment(run: Run, port: int, extra_path: list[str]) -> dict[str, str]:
    skip = ("MCORE_ACTIVATIONS_PATCH", *MEMORY_VARIABLES)
    env = {k: v for k, v in os.environ.items() if k not in skip}
    if run.patch:
        env["MCORE_ACTIVATIONS_PATCH"] = "1"
    if run.kind == "low-memory":
        env.update(LOW_MEMORY_ENV)
    env["PYTHONPATH"] = os.pathsep.join([*extra_path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        CUDA_DEVICE_MAX_CONNECTIONS="1",
        NCCL_NVLS_ENABLE="0",
        PYTHONUNBUFFERED="1",
        NO_VCS_VERSION="1",
        OMP_NUM_THREADS="2",
    )
    return env


def execute(run: Run, *, entry: Path, extra_path: list[str], port: int, logs: Path) -> Run:
    """Runs ``pretrain_gpt.py`` for ``run`` (one process, one GPU) and parses its log."""
    log = logs / f"{run.name}.log"
    started = time.monotonic()
    with open(log, "w") as out:
        try:
            done = subprocess.run(
                [sys.executable, str(entry / "pretrain_gpt.py"), *run.argv],
                cwd=entry,
                env=_environment(run, port, extra_path),
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=RUN_TIMEOUT_S,
            )
            returncode = done.returncode
        except subprocess.TimeoutExpired:
            # One hung run must not take the other runs' results with it.
            returncode = None
    run.seconds = round(time.monotonic() - started, 1)
    run.returncode = returncode
    parse_log(log.read_text(errors="replace"), run)
    if returncode is None:
        run.error = f"did not finish in {RUN_TIMEOUT_S} s"
    elif returncode != 0 and run.error is None:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:]
        run.error = f"exit {returncode}: {tail[0][:300] if tail else ''}"
    return run


# ------------------------------------------------------------------------------ comparing


def _max_diff(a: list[float], b: list[float]) -> Optional[float]:
    if not a or not b or len(a) != len(b):
        return None
    return max(abs(x - y) for x, y in zip(a, b))


def _first3(a: list[float], b: list[float]) -> Optional[float]:
    return _max_diff(a[:3], b[:3]) if len(a) >= 3 and len(a) == len(b) else None


def verdict(run: Run, reference: Run, control: Optional[Run]) -> dict:
    """How ``run`` compares with ``reference``, on the scale the clamp's control sets."""
    if not run.losses or run.returncode != 0:
        # A run that stopped early may never have reached the patch's report line.
        refused = run.error and "UnsupportedActivationError" in run.error
        label = "refused at build" if refused else "crashes"
        return {"cell": f"{label}: {run.error}", "equal": False, "crashed": not refused}
    if run.patch != (run.patched_report is not None):
        return {"cell": "INVALID: patch state not as requested", "equal": False}
    diff = _max_diff(run.losses, reference.losses)
    if diff is None:
        return {"cell": "reference did not train", "equal": False}
    scale = _max_diff(control.losses, reference.losses) if control else None
    ratio = diff / scale if scale else None
    equal = ratio is not None and ratio <= EQUAL_FRACTION
    first = _first3(run.losses, reference.losses)
    cell = f"{'= reference' if equal else 'DIFFERS'} ({first:.4f} / {diff:.4f}"
    cell += f", {ratio:.2f} of the clamp's effect)" if ratio is not None else ")"
    return {"cell": cell, "equal": equal, "max_diff": diff, "first3": first, "ratio": ratio}


def summarize(runs: list[Run]) -> dict:
    """Per configuration: the clamp's effect and each run's verdict against the reference."""
    by = {(r.config, r.kind): r for r in runs}
    table = {}
    for config in dict.fromkeys(r.config for r in runs):
        reference = by.get((config, "reference"))
        control = by.get((config, "control"))
        row = {}
        if reference is None or not reference.losses:
            error = reference.error if reference else "not run"
            row["reference"] = {"cell": f"reference failed: {error}", "equal": False}
        else:
            if control is not None and control.losses:
                effect = _max_diff(control.losses, reference.losses)
                first = _first3(control.losses, reference.losses)
                row["clamp effect"] = {"cell": f"{first:.4f} / {effect:.4f}", "max_diff": effect}
            for kind in ("patched", "unpatched", "unpatched-reference", "low-memory"):
                if (config, kind) in by:
                    row[kind] = verdict(by[(config, kind)], reference, control)
        table[config] = row
    return table


def perf_summary(runs: list[Run]) -> dict:
    """Median step time, forward-backward time and peak memory of each run."""
    out = {}
    for run in runs:
        steps = run.step_ms[WARMUP_ITERATIONS:]
        fwd_bwd = run.forward_backward_ms[WARMUP_ITERATIONS:]
        out[run.name + (".patched" if run.patch else ".unpatched")] = {
            "step_ms": statistics.median(steps) if steps else None,
            "forward_backward_ms": statistics.median(fwd_bwd) if fwd_bwd else None,
            "max_allocated_mb": run.max_allocated_mb,
            "error": run.error,
        }
    return out


def format_table(target: str, table: dict) -> str:
    lines = [
        f"### {target}",
        "",
        "| configuration | clamp effect | unpatched | patched | unpatched unfused "
        "| patched, low-memory |",
        "|---|---|---|---|---|---|",
    ]
    kinds = ("clamp effect", "unpatched", "patched", "unpatched-reference", "low-memory")
    for config, row in table.items():
        cells = [row.get(k, {}).get("cell", "-") for k in kinds]
        if "reference" in row:
            cells = [row["reference"]["cell"], "-", "-", "-", "-"]
        lines.append(f"| {config} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="upstream_pretrain.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", required=True, choices=("release", "main"))
    parser.add_argument("--entry", type=Path, help="folder holding upstream's pretrain_gpt.py")
    parser.add_argument("--path", action="append", default=[], help="prepended to PYTHONPATH")
    parser.add_argument("--out", type=Path, help="folder for logs and the JSON result")
    parser.add_argument("--configs", nargs="*", default=[c.name for c in CONFIGS])
    parser.add_argument("--runs", nargs="*", default=list(DEFAULT_RUNS), choices=RUNS)
    parser.add_argument("--size", default="tiny", choices=("tiny", "large"))
    parser.add_argument("--parallel", type=int, default=6, help="runs at a time (tiny size)")
    parser.add_argument("--repeat", type=int, default=1, help="large size: runs of each")
    parser.add_argument("--dry-run", action="store_true", help="print the command lines only")
    args = parser.parse_args(argv)
    unknown = [c for c in args.configs if c not in CONFIG_BY_NAME]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {list(CONFIG_BY_NAME)}")
    configs = [CONFIG_BY_NAME[c] for c in args.configs]
    if args.size == "large":
        runs = []
        for i in range(args.repeat):
            for patch in (False, True):  # alternating, so that drift hits both alike
                kind = "patched" if patch else "unpatched"
                for config in configs:
                    r = Run(config.name, f"{kind}{i}", patch, run_argv(config, kind, size="large"))
                    runs.append(r)
        parallel = 1
    else:
        runs = plan(configs, args.runs, args.target, args.size)
        parallel = args.parallel
    if args.dry_run:
        for run in runs:
            patch = "MCORE_ACTIVATIONS_PATCH=1 " if run.patch else ""
            if run.kind == "low-memory":
                patch += "".join(f"{k}={v} " for k, v in LOW_MEMORY_ENV.items())
            print(f"# {run.name}\n{patch}python3 pretrain_gpt.py {' '.join(run.argv)}")
        return 0
    if args.entry is None or args.out is None:
        parser.error("--entry and --out are needed unless --dry-run")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / f"logs-{args.target}-{args.size}"
    logs.mkdir(exist_ok=True)
    base_port = (
        31000 + (0 if args.target == "release" else 500) + (200 if args.size == "large" else 0)
    )
    with ThreadPoolExecutor(parallel) as pool:
        futures = [
            pool.submit(
                execute, run, entry=args.entry, extra_path=args.path, port=base_port + i, logs=logs
            )
            for i, run in enumerate(runs)
        ]
        for future in futures:
            run = future.result()
            print(
                f"{args.target} {run.name:32s} patch={run.patch!s:5s} rc={run.returncode} "
                f"{run.seconds}s losses={len(run.losses)} "
                f"{run.patched_report or ''} {run.error or ''}",
                flush=True,
            )
    result = {
        "target": args.target,
        "size": args.size,
        "runs": [dataclasses.asdict(r) for r in runs],
    }
    if args.size == "tiny":
        result["table"] = summarize(runs)
        print(format_table(args.target, result["table"]))
    else:
        result["perf"] = perf_summary(runs)
        print(json.dumps(result["perf"], indent=1))
    (args.out / f"pretrain-{args.target}-{args.size}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
