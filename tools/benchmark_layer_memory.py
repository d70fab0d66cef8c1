"""Forward+backward time and peak memory of whole MLP layers, upstream against patched.

Usage (GPU, with megatron-core 0.19.2 and this package installed; TE and Liger-Kernel optional)::

    python tools/benchmark_layer_memory.py [--json layers.json] [--layers dense experts]

Four layers, each built with upstream megatron-core's own classes and parallel linears:

- ``dense``: ``MLP`` (fc1 -> SwiGLU -> fc2, no biases) with upstream's local parallel linears,
  input ``[seq, batch, hidden]``; the weight gradients go to ``.grad`` through autograd (each
  linear's backward makes one, then adds it);
- ``dense_te``: the same ``MLP`` with Transformer Engine's linears and
  ``gradient_accumulation_fusion``, the weight gradients accumulated into each parameter's fp32
  ``main_grad`` as under Megatron's DDP (no weight-gradient tensor is made), where TE imports;
- ``experts``: routed experts with token weights (``TEGroupedMLP`` where Transformer Engine
  imports, else ``SequentialMLP``), input ``[tokens, hidden]`` split evenly over the experts,
  one router probability per token; the weight gradients through autograd;
- ``experts_te``: the same ``TEGroupedMLP`` with ``gradient_accumulation_fusion``, the weight
  gradients accumulated into fp32 ``main_grad`` as under Megatron's DDP, where TE imports.

Candidates, each in a process of its own (nothing of one, not even the allocator's cache or a
patch, reaches the next):

- ``upstream``: megatron-core as installed, unpatched;
- ``patched``: after ``mcore_activations.patch_megatron_core()``;
- ``patched_inplace``: patched, with ``MCORE_ACTIVATIONS_IN_PLACE_BACKWARD=1`` (the activation's
  backward writes its input gradient over fc1's output);
- ``patched_recompute`` / ``patched_inplace_recompute``: patched, with
  ``MCORE_ACTIVATIONS_RECOMPUTE_OUTPUT=1`` (fc2 saves a recipe of its input, recomputed in
  fc2's backward), without and with the in-place backward;
- ``patched_chunked``: patched, with both memory options and ``MCORE_ACTIVATIONS_FC2_CHUNKS``
  set to ``--fc2-chunks`` (the activation and fc2 run on row blocks of fc1's output);
- ``te_fused_mlp``: upstream's ``TEFusedMLP`` (Transformer Engine's op fuser), dense only, where TE
  imports;
- ``liger`` / ``liger_inplace``: Liger-Kernel's Megatron SwiGLU (``apply_liger_kernel_to_megatron(
  swiglu=True)``; with ``in_place=True`` its ``LigerMegatronSwiGLU`` bound as the MLP's fused
  SwiGLU), dense only (Liger patches neither the routed experts nor a clamp), where installed.

Each child times ``--iters`` forward+backward steps after ``--warmup`` (median, CUDA events) and
measures the peak memory of one step beyond what was allocated before it (parameters, their
gradients, the input and the output gradient): ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``; and ``held``, what the layer keeps between its forward and its
backward (allocated after the forward, output included), which a model holds once per layer
until the backward reaches it. The activations' memory is the difference between candidates. It
also reports a checksum of the output and the input gradient, so that a candidate computing
something else stands out (and of the weight gradients, zeroed before that step). One JSON
holds every row; a markdown table goes to stdout.

``--dry-run`` runs the same code on tiny shapes (one step, any device; on CPU no peak memory):
the CPU test tier runs it to keep the tool working, without judging its numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = (
    "upstream",
    "patched",
    "patched_inplace",
    "patched_recompute",
    "patched_inplace_recompute",
    "patched_chunked",
    "te_fused_mlp",
    "liger",
    "liger_inplace",
)
LAYERS = ("dense", "dense_te", "experts", "experts_te")
DENSE_ONLY = {"te_fused_mlp", "liger", "liger_inplace"}
NOT_DENSE_TE = {"te_fused_mlp"}  # upstream's TEFusedMLP is a layer of its own (the dense rows)
IN_PLACE_ENV = "MCORE_ACTIVATIONS_IN_PLACE_BACKWARD"
RECOMPUTE_ENV = "MCORE_ACTIVATIONS_RECOMPUTE_OUTPUT"
CHUNKS_ENV = "MCORE_ACTIVATIONS_FC2_CHUNKS"
MIB = 2**20

# Full size: a Llama-3-8B-like dense MLP (8192 tokens) and eight 2048-wide experts over 32768
# routed tokens; bf16. Dry run: the same code on shapes that run on a CPU in seconds.
FULL = dict(seq=4096, batch=2, hidden=4096, ffn=14336, tokens=32768, experts=8, moe_ffn=2048)
DRY = dict(seq=4, batch=2, hidden=16, ffn=24, tokens=16, experts=2, moe_ffn=8)


# ----------------------------------------------------------------------------- the child
def _skip(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def _have(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # noqa: BLE001 - TE raises RuntimeError on CPU-only torch
        return False
    return True


def setup_single_rank(device: str) -> None:
    """One process as a world of one rank, parallel state and RNG streams initialised."""
    import torch

    from megatron.core import parallel_state, tensor_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    backend = "nccl" if device == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, world_size=1, rank=0)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=device == "cpu")


def _config(layer: str, shape: dict, dtype, device: str, clamp):
    import torch.nn.functional as F

    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=shape["hidden"],
        ffn_hidden_size=shape["ffn"],
        num_attention_heads=4,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=True,
        params_dtype=dtype,
        bf16=str(dtype) == "torch.bfloat16",
        use_cpu_initialization=device == "cpu",
        gradient_accumulation_fusion=layer.endswith("_te"),
    )
    if layer.startswith("experts"):
        fields |= dict(
            num_moe_experts=shape["experts"],
            moe_ffn_hidden_size=shape["moe_ffn"],
            moe_grouped_gemm=_have("transformer_engine") and device == "cuda",
        )
        if clamp is not None:
            fields["activation_func_clamp_value"] = clamp
    return TransformerConfig(**fields)


def _build(candidate: str, layer: str, config, device: str):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    local = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    if layer == "dense_te":
        from megatron.core.extensions import transformer_engine as te_ext

        te_linears = MLPSubmodules(
            linear_fc1=te_ext.TEColumnParallelLinear, linear_fc2=te_ext.TERowParallelLinear
        )
        return MLP(config, te_linears).to(device)
    if layer == "dense":
        if candidate == "te_fused_mlp":
            from megatron.core.extensions import transformer_engine as te_ext

            # Upstream's TEFusedMLP takes fc1 only as a LayerNormLinear: its row carries one
            # layer norm more than the others.
            te_submodules = MLPSubmodules(
                linear_fc1=te_ext.TELayerNormColumnParallelLinear,
                linear_fc2=te_ext.TERowParallelLinear,
            )
            return te_ext.TEFusedMLP(config, te_submodules).to(device)
        return MLP(config, local).to(device)
    from megatron.core.transformer.moe import experts
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    pg = get_default_pg_collection()
    if config.moe_grouped_gemm:
        from megatron.core.extensions import transformer_engine as te_ext

        grouped = experts.GroupedMLPSubmodules(
            linear_fc1=te_ext.TEColumnParallelGroupedLinear,
            linear_fc2=te_ext.TERowParallelGroupedLinear,
        )
        return experts.TEGroupedMLP(config.num_moe_experts, config, grouped, pg_collection=pg)
    return experts.SequentialMLP(config.num_moe_experts, config, local, pg_collection=pg).to(device)


def _prepare(candidate: str, layer: str, device: str):
    """Patches or rebinds for ``candidate``; a skip reason when it cannot run here, else None."""
    if importlib.util.find_spec("megatron") is None:
        return (
            "megatron-core is not importable here; pass --python with the interpreter that has it"
        )
    needs_te = candidate == "te_fused_mlp" or layer.endswith("_te")
    if needs_te and not (device == "cuda" and _have("transformer_engine")):
        return "Transformer Engine is not importable here"
    if candidate.startswith("liger") and not (device == "cuda" and _have("liger_kernel")):
        return "liger_kernel is not importable here (or no GPU)"
    import mcore_activations.megatron_patch as patch

    if patch.is_standalone_fork():
        return "megatron.core is this project's standalone fork, not upstream megatron-core"
    if candidate.startswith("patched"):
        patch.patch_megatron_core()
    elif candidate == "liger":
        from liger_kernel.megatron import apply_liger_kernel_to_megatron

        apply_liger_kernel_to_megatron(swiglu=True)
    elif candidate == "liger_inplace":
        from liger_kernel.megatron import LigerMegatronSwiGLU

        import megatron.core.transformer.mlp as mlp_module

        original = mlp_module.bias_swiglu_impl
        mlp_module.bias_swiglu_impl = LigerMegatronSwiGLU(fallback_impl=original, in_place=True)
    return None


def _fill_parameters(module) -> None:
    # The same weights in every candidate's process (by name, in order; all candidates share
    # upstream's parameter names), so that the checksums compare like with like.
    import torch

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            scale = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.0
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def _step_fn(layer: str, module, shape: dict, dtype, device: str):
    """``(forward, step, reset, x, grad)``: the forward, one forward+backward, what clears the
    input's gradient, the input and the output gradient."""
    import torch

    gen = torch.Generator().manual_seed(0)
    if not layer.startswith("experts"):
        x = torch.randn(shape["seq"], shape["batch"], shape["hidden"], generator=gen)
    else:
        x = torch.randn(shape["tokens"], shape["hidden"], generator=gen)
    x = x.to(device, dtype).requires_grad_()
    grad = torch.randn(x.shape, generator=gen).to(device, dtype)
    probs = None
    counts = None
    if layer.startswith("experts"):
        probs = torch.rand(shape["tokens"], generator=gen).to(device)
        share, rest = divmod(shape["tokens"], shape["experts"])
        counts = torch.tensor([share + (i < rest) for i in range(shape["experts"])])

    def forward():
        out, _ = module(x, counts, probs) if counts is not None else module(x)
        return out

    def step():
        out = forward()
        out.backward(grad)
        return out

    def reset():
        x.grad = None

    return forward, step, reset, x, grad


def _weight_grads(module) -> list:
    grads = [getattr(p, "main_grad", None) for p in module.parameters()]
    grads += [p.grad for p in module.parameters()]
    return [g for g in grads if g is not None]


def _checksums(out, x, module) -> dict:
    wgrad = sum(float(g.float().square().sum()) for g in _weight_grads(module)) ** 0.5
    return {
        "out_sum": float(out.detach().float().sum()),
        "dx_norm": float(x.grad.float().norm()) if x.grad is not None else None,
        "wgrad_norm": wgrad,
    }


def run_child(candidate: str, layer: str, shape: dict, args) -> dict:
    """One candidate on one layer in this process; the row of the JSON."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype) if device == "cuda" else torch.float32
    reason = _prepare(candidate, layer, device)
    if reason is not None:
        return _skip(reason)
    setup_single_rank(device)
    config = _config(layer, shape, dtype, device, args.clamp)
    module = _build(candidate, layer, config, device)
    _fill_parameters(module)
    if config.gradient_accumulation_fusion:
        # What Megatron's DDP gives each parameter: an fp32 buffer the linears add their weight
        # gradient to (allocated before the measured step, like ``.grad`` in the other layers).
        for p in module.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    forward, step, reset, x, grad = _step_fn(layer, module, shape, dtype, device)
    for _ in range(args.warmup):
        reset()
        step()
    # Parameter gradients stay allocated: the peak is the step's activations and temporaries.
    # Zeroed in place, so that the checksum is this step's gradient.
    for g in _weight_grads(module):
        g.zero_()
    row = {"status": "ok", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    reset()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = forward()
        torch.cuda.synchronize()
        row["held_mib"] = (torch.cuda.memory_allocated() - base) / MIB
        out.backward(grad)
        torch.cuda.synchronize()
        row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
    else:
        out = step()
        row["peak_mib"] = row["held_mib"] = None
    row |= _checksums(out, x, module)
    del out
    times = []
    for _ in range(args.iters):
        reset()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
    row["ms"] = statistics.median(times)
    from mcore_activations.fusions import fc2_chunks, in_place, output_recompute

    row["in_place_backward"] = in_place.in_place_backward_enabled()
    row["recompute_output"] = output_recompute.recompute_output_enabled()
    row["fc2_chunks"] = fc2_chunks.fc2_chunks()
    return row


# ----------------------------------------------------------------------------- the parent
def _child_env(candidate: str, fc2_chunks: int) -> dict:
    env = dict(os.environ)
    # The checkout's mcore_activations, without its megatron/ (the fork) shadowing upstream's:
    # a folder holding only a link to the package goes first on the child's path.
    link_dir = Path(tempfile.mkdtemp(prefix="layer-bench-"))
    (link_dir / "mcore_activations").symlink_to(ROOT / "mcore_activations")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(link_dir), env.get("PYTHONPATH")]))
    env[IN_PLACE_ENV] = "1" if candidate.startswith("patched_inplace") else "0"
    env[RECOMPUTE_ENV] = "1" if candidate.endswith("_recompute") else "0"
    env[CHUNKS_ENV] = "1"
    if candidate == "patched_chunked":
        env[IN_PLACE_ENV] = env[RECOMPUTE_ENV] = "1"
        env[CHUNKS_ENV] = str(fc2_chunks)
    env.pop("MCORE_ACTIVATIONS_PATCH", None)  # each candidate patches (or not) itself
    return env


def run_candidate(python: str, candidate: str, layer: str, args) -> dict:
    """Runs one candidate in a fresh interpreter; its row (an error row if the child failed)."""
    command = [python, str(Path(__file__).resolve()), "--child", candidate, "--layer", layer]
    command += _forwarded(args)
    done = subprocess.run(
        command, env=_child_env(candidate, args.fc2_chunks), capture_output=True, text=True
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        row = {"status": "error", "reason": " | ".join(tail), "returncode": done.returncode}
    else:
        row = json.loads(lines[-1])
    return {"candidate": candidate, "layer": layer} | row


def _forwarded(args) -> list[str]:
    out = ["--dtype", args.dtype, "--iters", str(args.iters), "--warmup", str(args.warmup)]
    out += ["--fc2-chunks", str(args.fc2_chunks)]
    out += ["--shape", json.dumps(args.shape)]
    if args.clamp is not None:
        out += ["--clamp", str(args.clamp)]
    return out


def markdown(rows: list[dict]) -> str:
    """The rows as a table: time, peak and their ratio to the unpatched upstream layer."""
    lines = [
        "| layer | candidate | f+b ms | held MiB | peak MiB | vs upstream (time / held / peak) "
        "| note |",
        "|---|---|---|---|---|---|---|",
    ]
    base = {r["layer"]: r for r in rows if r["candidate"] == "upstream" and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['layer']} | {r['candidate']} | - | - | - | - | {r['reason']} |")
            continue
        held = "-" if r.get("held_mib") is None else f"{r['held_mib']:.0f}"
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        ref, ratio = base.get(r["layer"]), "-"
        if ref is not None:
            ratio = f"{r['ms'] / ref['ms']:.3f}"
            for key in ("held_mib", "peak_mib"):
                if r.get(key) and ref.get(key):
                    ratio += f" / {r[key] / ref[key]:.3f}"
        cells = f"{r['ms']:.3f} | {held} | {peak} | {ratio}"
        lines.append(f"| {r['layer']} | {r['candidate']} | {cells} | |")
    return "\n".join(lines)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", choices=LAYERS, default=list(LAYERS))
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=20, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--clamp", type=float, help="the experts' DeepSeek-V4 SwiGLU clamp (none by default)"
    )
    parser.add_argument(
        "--fc2-chunks", type=int, default=2, help="row blocks of the patched_chunked candidate"
    )
    parser.add_argument("--shape", type=json.loads, help="JSON overriding the default shapes")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, one step")
    parser.add_argument(
        "--python", default=sys.executable, help="the interpreter the candidates run in"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=CANDIDATES, help=argparse.SUPPRESS)
    parser.add_argument("--layer", choices=LAYERS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fc2_chunks < 1:
        parser.error(f"--fc2-chunks must be >= 1, got {args.fc2_chunks}")
    if args.iters < 1 or args.warmup < 0:
        parser.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters}, {args.warmup}")
    defaults = DRY if args.dry_run else FULL
    unknown = set(args.shape or {}) - set(defaults)
    if unknown:
        parser.error(f"--shape has unknown keys {sorted(unknown)}; known: {sorted(defaults)}")
    args.shape = defaults | (args.shape or {})
    if args.dry_run:
        args.iters, args.warmup = 1, 0
    return args


def main(argv=None):
    """Runs every candidate on every layer, each in its own process; prints and saves them."""
    args = parse(argv)
    if args.child:
        print(json.dumps(run_child(args.child, args.layer, args.shape, args)), flush=True)
        return
    rows = []
    for layer in args.layers:
        for candidate in args.candidates:
            row = {"candidate": candidate, "layer": layer}
            if layer.startswith("experts") and candidate in DENSE_ONLY:
                rows.append(row | _skip("dense only (it does not cover routed experts)"))
            elif layer == "dense_te" and candidate in NOT_DENSE_TE:
                rows.append(row | _skip("a layer of its own (see the dense rows)"))
            else:
                rows.append(run_candidate(args.python, candidate, layer, args))
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print(markdown(rows))
    if args.json:
        setup = {"shape": args.shape, "dtype": args.dtype, "iters": args.iters}
        setup |= {"clamp": args.clamp, "python": args.python, "dry_run": args.dry_run}
        setup |= {"fc2_chunks": args.fc2_chunks}
        args.json.write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
