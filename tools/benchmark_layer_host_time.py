"""Host time per forward+backward of a small layer on the fused activation path.

Usage (CPU or GPU; this project's fork, or upstream megatron-core patched with ``--patch``)::

    MCORE_ACTIVATIONS_BACKEND=eager python tools/benchmark_layer_host_time.py \
        [--device cpu|cuda] [--iters 200] [--warmup 20] [--patch] [--json out.json]

Builds, on shapes so small that the kernels and GEMMs take next to nothing, a dense ``MLP``
(``[4, 2, 16]`` input, clamped SwiGLU, ``bias_activation_fusion``) and a ``SequentialMLP`` of
two experts with token weights, and times in one process, for each:

- ``layer``: the layer's forward and backward;
- ``activation``: the activation alone, forward and backward, as the layer calls it (the fork's
  ``MLP._activate``; for a patched upstream, the patch's ``mlp_activate``), with a bias and, for
  the experts, per-row probabilities.

Each row is the median over ``--iters`` steps of one step's wall time (on CUDA with a
synchronisation after each step, so a step's time is its host time only where the host paces
it: keep the shapes tiny). What changes between two trees at these shapes is host work per call.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# The checkout's megatron/ is the fork: put it first only when the fork is what is measured.
if "--patch" not in sys.argv:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The sibling tool's world-of-one setup (this folder is sys.path[0] when run as a script).
from benchmark_layer_memory import setup_single_rank  # noqa: E402

SHAPE = dict(seq=4, batch=2, hidden=16, ffn=24, tokens=16, experts=2)


def _config(device: str, experts: bool):
    import torch.nn.functional as F

    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=SHAPE["hidden"],
        ffn_hidden_size=SHAPE["ffn"],
        num_attention_heads=4,
        add_bias_linear=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=True,
        use_cpu_initialization=device == "cpu",
        # A clamp is legal only with MoE; the dense MLP of an MoE model may carry one.
        num_moe_experts=SHAPE["experts"],
        moe_ffn_hidden_size=SHAPE["ffn"],
        activation_func_clamp_value=7.0,
    )
    return TransformerConfig(**fields)


def _layers(device: str):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    try:  # upstream's experts need their process groups; the fork's default them
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        pg = get_default_pg_collection()
    except ImportError:
        pg = None
    local = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    dense = MLP(_config(device, False), local, ffn_hidden_size=SHAPE["ffn"]).to(device)
    experts = SequentialMLP(SHAPE["experts"], _config(device, True), local, pg_collection=pg)
    return dense, experts.to(device)


def _activation_call(mlp):
    """The activation as the layer calls it: ``f(x, bias, probs)``."""
    if hasattr(mlp, "_activate"):  # the fork
        return lambda x, bias, probs: mlp._activate(x, bias, probs)
    from mcore_activations.upstream_patch.mlp import mlp_activate

    return lambda x, bias, probs: mlp_activate(mlp, x, bias, probs)


def _steps(dense, experts, device: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE["seq"], SHAPE["batch"], SHAPE["hidden"], generator=gen)
    x = x.to(device).requires_grad_()
    tokens = torch.randn(SHAPE["tokens"], SHAPE["hidden"], generator=gen).to(device)
    tokens.requires_grad_()
    probs = torch.rand(SHAPE["tokens"], generator=gen).to(device)
    counts = torch.tensor([SHAPE["tokens"] // SHAPE["experts"]] * SHAPE["experts"])
    width = 2 * SHAPE["ffn"]
    h = torch.randn(SHAPE["tokens"], width, generator=gen).to(device).requires_grad_()
    bias = torch.randn(width, generator=gen).to(device).requires_grad_()
    row_probs = torch.rand(SHAPE["tokens"], generator=gen).to(device).requires_grad_()
    dense_act = _activation_call(dense)
    expert_act = _activation_call(experts.local_experts[0])

    def dense_layer():
        out, out_bias = dense(x)
        (out + out_bias).sum().backward()

    def experts_layer():
        out, _ = experts(tokens, counts, probs)
        out.sum().backward()

    def dense_activation():
        dense_act(h, bias, None).sum().backward()

    def expert_activation():
        expert_act(h, bias, row_probs).sum().backward()

    return {
        "MLP layer": dense_layer,
        "MLP activation": dense_activation,
        "SequentialMLP layer": experts_layer,
        "SequentialMLP expert activation": expert_activation,
    }


def _median_ms(step, iters: int, warmup: int, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--patch", action="store_true", help="patch an installed upstream first")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.patch:
        import mcore_activations

        mcore_activations.patch_megatron_core()
    setup_single_rank(args.device)
    torch.manual_seed(0)
    dense, experts = _layers(args.device)
    rows = {
        name: round(_median_ms(step, args.iters, args.warmup, args.device), 4)
        for name, step in _steps(dense, experts, args.device).items()
    }
    meta = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else _cpu_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": os.environ.get("MCORE_ACTIVATIONS_BACKEND", "default"),
        "iters": args.iters,
    }
    for name, ms in rows.items():
        print(f"{name:34s} {ms:8.4f} ms (median of {args.iters})")
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows_ms": rows}, indent=2) + "\n")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
