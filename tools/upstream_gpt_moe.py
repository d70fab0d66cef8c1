#!/usr/bin/env python
"""Train upstream megatron-core's tiny GPT with MoE layers and check every MLP's activation.

This tool runs against an *installed upstream* megatron-core (e.g. 0.19.2, or upstream main on
``PYTHONPATH``), never against this repository's ``megatron/`` fork. It builds upstream's
``GPTModel`` from upstream's own layer-spec builders, with one dense layer and one MoE layer
(``moe_layer_freq=[0, 1]``), a DeepSeek-V4 style clamped SwiGLU (``activation_func=F.silu``,
``gated_linear_unit=True``, ``activation_func_clamp_value=C``, no linear biases), trains it for a
few Adam steps on fixed token batches and, on the first step, checks what each MLP-like module
actually feeds to its ``linear_fc2`` against the float64 reference
``ActivationSpec.from_config(module.config).reference(...)`` of ``mcore_activations``.

With ``--patch`` it calls ``mcore_activations.megatron_patch.patch_megatron_core()`` before the
model is built (layers built before the patch keep upstream's behaviour).

Modes:
    * default: upstream's local (non-Transformer-Engine) specs on CPU, torch.distributed with gloo
      and world size 1. Upstream MoE code calls a few ``torch.cuda`` functions unconditionally, so
      a scoped context manager (:func:`cpu_cuda_stand_ins`) replaces exactly those while the model
      is built and trained, and restores them afterwards.
    * ``--te``: upstream's Transformer Engine specs on a CUDA GPU (NCCL, world size 1).
      ``--op-fuser`` sets ``use_transformer_engine_op_fuser=True`` and builds the dense MLP as
      ``TEFusedMLP``; ``--grouped-gemm`` selects ``TEGroupedMLP`` routed experts.

Examples:
    python tools/upstream_gpt_moe.py --clamp 7 --init-std 1.0 --steps 3 --json /tmp/unfused.json
    python tools/upstream_gpt_moe.py --clamp 7 --init-std 1.0 --steps 3 --fused --patch

Programmatic use: ``run(parse_args([...]))`` or ``run(Options(...))`` returns the result dict.

The exit code is non-zero only when the run crashes; errors above any tolerance are reported in
the output, not turned into failures (tests decide what to assert). A construction-time
``UnsupportedActivationError`` (the patch refusing a configuration it cannot compute) is recorded
as ``build_error`` and is not a crash either.

One file on purpose (about 760 lines): tests/upstream imports it by file path and runs it as a
script with the repository root kept off ``sys.path`` (or the fork's ``megatron/`` would shadow
the upstream megatron-core under test), so it cannot import helpers from sibling modules.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import sys
from typing import Any, Optional

# torch and megatron are imported inside the functions that need them: a test process can import
# this module (for its defaults and argument parser) without loading torch, so the number of
# torch processes on a small machine stays the number of runs actually started.

# Tiny model; the sizes are what the project's brief fixes.
NUM_LAYERS = 2
HIDDEN = 64
HEADS = 4
VOCAB = 128
SEQ = 16
MICRO_BATCH = 2
NUM_EXPERTS = 4
TOPK = 2
MOE_FFN = 64
DENSE_FFN = 128
SHARED_FFN = 64
MOE_LAYER_FREQ = [0, 1]  # layer 1 dense, layer 2 MoE

DEFAULT_CLAMP = 7.0
# Upstream's default init_method_std (0.02) keeps every fc1 output below 1, so a clamp of 7 is
# never reached and a clamp bug is invisible. 0.5 puts about 6% of fc1 outputs beyond 7.
DEFAULT_INIT_STD = 0.5


@dataclasses.dataclass
class Options:
    """Options of one run (the CLI flags, see :func:`parse_args`).

    Attributes:
        clamp: ``activation_func_clamp_value``; None for plain SwiGLU.
        init_std: ``init_method_std``.
        fused: ``bias_activation_fusion``.
        patch: Patch upstream with ``mcore_activations`` before building the model.
        shared_expert: Add a shared expert (``moe_shared_expert_intermediate_size``).
        te: Use upstream's Transformer Engine specs on a CUDA GPU.
        op_fuser: ``use_transformer_engine_op_fuser`` (needs ``te``).
        grouped_gemm: ``moe_grouped_gemm`` (grouped experts with ``te``).
        dispatcher: ``moe_token_dispatcher_type``.
        steps: Number of Adam steps.
        seed: Seed of the weights and the token batches.
        lr: Adam learning rate.
        json: Where to write the result dict (None: do not write).
        quiet: Print only the summary.
    """

    clamp: Optional[float] = DEFAULT_CLAMP
    init_std: float = DEFAULT_INIT_STD
    fused: bool = False
    patch: bool = False
    shared_expert: bool = False
    te: bool = False
    op_fuser: bool = False
    grouped_gemm: bool = False
    dispatcher: str = "alltoall"
    steps: int = 3
    seed: int = 1234
    lr: float = 1e-3
    json: Optional[str] = None
    quiet: bool = False


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; its flags map one to one onto :class:`Options`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument(
        "--clamp",
        type=float,
        default=DEFAULT_CLAMP,
        help="activation_func_clamp_value C (DeepSeek-V4 SwiGLU clamp); "
        "a value <= 0 disables the clamp",
    )
    p.add_argument(
        "--init-std",
        type=float,
        default=DEFAULT_INIT_STD,
        help="init_method_std; large enough that fc1 outputs exceed the clamp",
    )
    p.add_argument("--fused", action="store_true", help="bias_activation_fusion=True")
    p.add_argument(
        "--patch",
        action="store_true",
        help="call mcore_activations.megatron_patch.patch_megatron_core() first",
    )
    p.add_argument(
        "--shared-expert",
        action="store_true",
        help=f"moe_shared_expert_intermediate_size={SHARED_FFN}",
    )
    p.add_argument(
        "--te", action="store_true", help="upstream's Transformer Engine layer specs on a CUDA GPU"
    )
    p.add_argument(
        "--op-fuser",
        action="store_true",
        help="use_transformer_engine_op_fuser=True (TEFusedMLP dense MLP; needs --te)",
    )
    p.add_argument(
        "--grouped-gemm",
        action="store_true",
        help="moe_grouped_gemm=True (TEGroupedMLP experts with --te)",
    )
    p.add_argument("--dispatcher", default="alltoall", choices=["alltoall", "allgather"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--json", default=None, help="write the result dict to this path")
    p.add_argument("--quiet", action="store_true")
    return p


def parse_args(argv: Optional[list[str]] = None) -> Options:
    """Parses CLI arguments into :class:`Options`."""
    ns = build_parser().parse_args(argv)
    values = vars(ns)
    if values["clamp"] is not None and values["clamp"] <= 0:
        values["clamp"] = None
    return Options(**values)


# --------------------------------------------------------------------------- CPU stand-ins


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: CPU work is synchronous, so every wait is a no-op."""

    def synchronize(self) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU.

    One shared instance answers both ``Stream()`` and ``current_stream()``, so upstream code that
    compares a side stream with the current one sees "same stream" and takes its simple path.
    """

    _instance: Optional[_CpuStream] = None

    def __new__(cls, *args, **kwargs):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def record_event(self, *args, **kwargs) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def cpu_cuda_stand_ins():
    """Replaces the few ``torch.cuda`` functions upstream MoE calls unconditionally, then restores.

    Why each one is needed (the same in 0.19.2 and main d98e8a64):

    * ``current_device``: ``GlobalMemoryBuffer.get_tensor`` (attention) and
      ``TopKRouter.gating`` ("move weights to GPU") call it whatever the device of the model.
    * ``Stream`` / ``current_stream``: the alltoall dispatcher creates a device-to-host stream in
      its constructor and synchronises on it every step.

    Nothing else is replaced. On a machine with CUDA the context does nothing.

    Yields:
        The list of replaced names (empty with CUDA).
    """
    import torch

    if torch.cuda.is_available():
        yield []
        return
    replacements = {
        "current_device": lambda: torch.device("cpu"),
        "Stream": _CpuStream,
        "current_stream": lambda *args, **kwargs: _CpuStream(),
    }
    saved = {name: getattr(torch.cuda, name) for name in replacements}
    try:
        for name, value in replacements.items():
            setattr(torch.cuda, name, value)
        yield [f"torch.cuda.{name}" for name in replacements]
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


# --------------------------------------------------------------------------- distributed setup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def single_process_group(backend: str):
    """A world-size-1 process group for the duration of the context (torch.distributed)."""
    import torch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    torch.distributed.init_process_group(
        backend=backend, init_method="env://", world_size=1, rank=0
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _check_not_the_fork(megatron_core) -> None:
    """Refuses to run when ``megatron.core`` is this repository's fork instead of upstream."""
    from mcore_activations.megatron_patch import is_standalone_fork

    if is_standalone_fork():
        raise RuntimeError(
            f"megatron.core ({megatron_core.__file__}) is this repository's standalone fork; "
            "this tool needs an installed upstream megatron-core. Keep the repository root off "
            "PYTHONPATH."
        )


# --------------------------------------------------------------------------- model


def build_config(opts: Options):
    """Upstream ``TransformerConfig`` of the tiny dense+MoE GPT."""
    import torch
    import torch.nn.functional as F

    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = opts.te
    return TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=DENSE_FFN,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=MOE_FFN,
        moe_layer_freq=list(MOE_LAYER_FREQ),
        moe_token_dispatcher_type=opts.dispatcher,
        moe_grouped_gemm=opts.grouped_gemm,
        moe_shared_expert_intermediate_size=SHARED_FFN if opts.shared_expert else None,
        # The loss is the language-model loss alone, so fused and unfused runs compare directly.
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        # Kernels that exist only on GPU, and that are not what this tool checks.
        moe_permute_fusion=False,
        moe_router_fusion=False,
        # DeepSeek-V4 clamped SwiGLU.
        activation_func=F.silu,
        gated_linear_unit=True,
        add_bias_linear=False,
        activation_func_clamp_value=opts.clamp,
        bias_activation_fusion=opts.fused,
        use_transformer_engine_op_fuser=opts.op_fuser,
        init_method_std=opts.init_std,
        # fp32 and no dropout: runs are deterministic and comparable to the float64 reference.
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        fp16=False,
        bf16=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # On CPU the weights must be created on CPU (the default allocates on the current device).
        use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=False,
    )


def build_layer_spec(config, opts: Options):
    """The decoder spec from upstream's own builders.

    The local path uses ``get_gpt_decoder_block_spec``, which reads ``moe_layer_freq``. Upstream's
    block builder does not pass ``use_te_op_fuser`` to the dense layer, so with ``--op-fuser`` the
    two layer specs come from ``get_gpt_layer_with_transformer_engine_spec`` directly, in the
    order of ``MOE_LAYER_FREQ``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if not (opts.te and opts.op_fuser):
        return get_gpt_decoder_block_spec(config, use_transformer_engine=opts.te)
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    dense = get_gpt_layer_with_transformer_engine_spec(num_experts=None, use_te_op_fuser=True)
    moe = get_gpt_layer_with_transformer_engine_spec(
        num_experts=NUM_EXPERTS, moe_grouped_gemm=opts.grouped_gemm, use_te_op_fuser=True
    )
    layers = [moe if is_moe else dense for is_moe in MOE_LAYER_FREQ]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=TENorm)


def fixed_batches(steps: int, seed: int, device):
    """One token batch per step from a seeded generator (the same batches in every run)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, -1).contiguous()
    # Megatron's convention: True marks a masked (future) position.
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
        batches.append(
            tuple(
                t.to(device)
                for t in (tokens[:, :-1].contiguous(), positions, mask, tokens[:, 1:].contiguous())
            )
        )
    return batches


# --------------------------------------------------------------------------- activation probe


@dataclasses.dataclass
class _Calls:
    """What one MLP-like module saw on the first step, one entry per call."""

    cls: str
    config: Any
    glu_interleave: Optional[int]
    fc1_out: list = dataclasses.field(default_factory=list)
    fc1_bias: list = dataclasses.field(default_factory=list)
    fc2_in: list = dataclasses.field(default_factory=list)
    probs: list = dataclasses.field(default_factory=list)
    # Modules whose fused op sequence bypasses linear_fc1/linear_fc2 (TEFusedMLP, op-fuser
    # TEGroupedMLP): their whole output is checked instead of the fc2 input.
    module_errors: list = dataclasses.field(default_factory=list)
    fc1_calls_before: int = 0  # len(fc1_out) when the current module call started


class ActivationProbe:
    """Records fc1 outputs and fc2 inputs of every MLP-like module on the first step.

    A module is MLP-like when it has ``linear_fc1`` and ``linear_fc2`` (upstream's MLP,
    SharedExpertMLP, the experts of SequentialMLP, TEGroupedMLP, TEFusedMLP).

    Hooks:
        * ``linear_fc1`` forward hook: its output ``(y, bias)``, the activation's input.
        * ``linear_fc2`` forward pre-hook: its input, the activation's output. It is registered
          without kwargs and tolerates ``args=None`` because upstream's fused implementations
          call submodule pre-hooks as ``hook(module, None)`` and refuse one that returns a value.
        * module forward pre-hook with kwargs: the per-token probabilities (``per_token_scale`` of
          an expert MLP, ``permuted_probs`` of TEGroupedMLP), positional or keyword.
        * module forward hook, only for fused op-sequence modules: recomputes the module through
          its unfused ``linear_fc1``/``linear_fc2`` with the float64 reference activation and
          compares outputs.
    """

    def __init__(self, model):
        self.active = True
        self._busy = False  # set while the probe itself calls a module, to not record that call
        self.calls: dict[str, _Calls] = {}
        self.handles = []
        for name, module in model.named_modules():
            if hasattr(module, "linear_fc1") and hasattr(module, "linear_fc2"):
                self._attach(name, module)

    def _attach(self, name: str, module) -> None:
        cfg = module.config
        interleave = None
        if type(module).__name__ == "TEGroupedMLP":
            # Only grouped experts lay their fc1 output out in interleaved GLU blocks.
            interleave = getattr(cfg, "moe_mlp_glu_interleave_size", None)
        rec = _Calls(type(module).__name__, cfg, interleave)
        # Only routed experts get per-token probabilities positionally; other MLPs' extra
        # positional arguments (if any) are not probabilities.
        probs_index = 2 if rec.cls == "TEGroupedMLP" else 1 if ".local_experts." in name else None
        self.calls[name] = rec
        opaque = bool(getattr(module, "_with_fused_impl", False)) or type(module).__name__ in (
            "TEFusedMLP",
            "TEFusedMLPWithGroupedLinear",
        )

        def fc1_hook(_mod, _args, output):
            if self.active and not self._busy and output is not None:
                out, bias = output if isinstance(output, tuple) else (output, None)
                rec.fc1_out.append(out.detach().clone())
                rec.fc1_bias.append(None if bias is None else bias.detach().clone())

        def fc2_pre_hook(_mod, args):
            if self.active and not self._busy and args:
                rec.fc2_in.append(args[0].detach().clone())

        def module_pre_hook(_mod, args, kwargs):
            if not self.active or self._busy:
                return
            rec.fc1_calls_before = len(rec.fc1_out)
            probs = kwargs.get("per_token_scale", kwargs.get("permuted_probs"))
            if probs is None:
                # SequentialMLP calls expert(tokens, probs); TEGroupedMLP(x, tokens_per_expert,
                # permuted_probs).
                ok = probs_index is not None and len(args) > probs_index
                probs = args[probs_index] if ok else None
            rec.probs.append(None if probs is None else probs.detach().clone())

        if not opaque:
            # A fused op sequence never calls its linears; upstream replays hooks registered on
            # them with placeholder arguments instead, so they are not registered there.
            self.handles.append(module.linear_fc1.register_forward_hook(fc1_hook))
            self.handles.append(module.linear_fc2.register_forward_pre_hook(fc2_pre_hook))
        self.handles.append(module.register_forward_pre_hook(module_pre_hook, with_kwargs=True))
        if opaque:
            self.handles.append(
                module.register_forward_hook(self._opaque_hook(module, rec), with_kwargs=True)
            )

    def _opaque_hook(self, module, rec: _Calls):
        """Checks a fused op-sequence module by recomputing it with the reference activation."""
        import torch

        from mcore_activations.activation_spec import ActivationSpec

        def hook(_mod, args, kwargs, output):
            if not self.active or self._busy or output is None:
                return
            if not args and "hidden_states" not in (kwargs or {}):
                return  # a replay with placeholder arguments, not a real call
            x = args[0] if args else kwargs["hidden_states"]
            extra = []
            if rec.cls == "TEGroupedMLP":
                tokens = args[1] if len(args) > 1 else kwargs["tokens_per_expert"]
                extra = [tokens.tolist() if torch.is_tensor(tokens) else list(tokens)]
            probs = rec.probs[-1] if rec.probs else None
            spec = ActivationSpec.from_config(rec.config, glu_interleave_size=rec.glu_interleave)
            self._busy = True
            try:
                with torch.no_grad():
                    y, bias = module.linear_fc1(x, *extra)
                    act = spec.reference(y, bias, probs)
                    ref, _ = module.linear_fc2(act.to(y.dtype), *extra)
            finally:
                self._busy = False
            # A fused sequence bypasses linear_fc1, so the fc1 hook saw nothing: keep the
            # recomputed fc1 output (same weights, same input) for the clamp statistics.
            if len(rec.fc1_out) == rec.fc1_calls_before:
                rec.fc1_out.append(y.detach().clone())
                rec.fc1_bias.append(None if bias is None else bias.detach().clone())
            out = output[0] if isinstance(output, tuple) else output
            rec.module_errors.append(_rel_error(out, ref))

        return hook

    def stop(self) -> None:
        """Stops recording (called after the first step) and removes the hooks."""
        self.active = False
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def results(self, clamp: Optional[float]) -> dict:
        """Per-module max relative error vs the reference and the clamp statistics."""
        import torch

        from mcore_activations.activation_spec import ActivationSpec

        errors: dict[str, Optional[float]] = {}
        details: dict[str, dict] = {}
        beyond = total = 0
        max_abs = 0.0
        for name, rec in self.calls.items():
            spec = ActivationSpec.from_config(rec.config, glu_interleave_size=rec.glu_interleave)
            worst: Optional[float] = None
            rows = 0
            checked = "fc2_input"
            for y in rec.fc1_out:
                if y.numel() == 0:
                    continue
                # The clamp applies to the gate half (from above) and the linear half (both sides).
                gate, lin = (
                    torch.chunk(y.float(), 2, dim=-1)
                    if spec.glu_interleave_size is None
                    else _deinterleave(y.float(), spec.glu_interleave_size)
                )
                total += y.numel()
                max_abs = max(max_abs, y.abs().max().item())
                if clamp is not None:
                    beyond += int((gate > clamp).sum().item() + (lin.abs() > clamp).sum().item())
            if rec.module_errors:
                checked = "module_output"
                worst = max(rec.module_errors)
                rows = sum(y.reshape(-1, y.shape[-1]).shape[0] for y in rec.fc1_out)
            else:
                pairs = list(zip(rec.fc1_out, rec.fc1_bias, rec.fc2_in))
                for i, (y, bias, got) in enumerate(pairs):
                    if y.numel() == 0:
                        continue
                    probs = rec.probs[i] if i < len(rec.probs) else None
                    ref = spec.reference(y, bias, probs)
                    err = _rel_error(got, ref)
                    worst = err if worst is None else max(worst, err)
                    rows += y.reshape(-1, y.shape[-1]).shape[0]
                if len(rec.fc1_out) != len(rec.fc2_in):
                    checked = (
                        f"fc2_input (fc1 calls {len(rec.fc1_out)} != fc2 calls {len(rec.fc2_in)})"
                    )
            errors[name] = worst
            details[name] = {
                "class": rec.cls,
                "activation": spec.name,
                "calls": len(rec.fc1_out),
                "rows": rows,
                "checked": checked,
                "max_rel_error": worst,
            }
        return {
            "max_rel_error": errors,
            "modules": details,
            "clamp_stats": {
                "clamp": clamp,
                "elements": total,
                "beyond_clamp": beyond,
                "fraction_beyond_clamp": (beyond / total) if total else 0.0,
                "max_abs_fc1_out": max_abs,
            },
        }


def _deinterleave(y, block: int):
    from mcore_activations.activation_spec import deinterleave_glu

    return deinterleave_glu(y, block)


def _rel_error(got, ref) -> float:
    """max |got - ref| / max |ref| in float64 (norm-wise: no blow-up on near-zero entries)."""
    import torch

    ref = ref.to(torch.float64)
    diff = (got.to(torch.float64) - ref).abs().max().item()
    scale = ref.abs().max().item()
    return diff / scale if scale > 0 else diff


# --------------------------------------------------------------------------- run


def run(options: Options) -> dict:
    """Builds, trains and probes the model once.

    Args:
        options: The run's options.

    Returns:
        A JSON-serialisable dict: ``upstream_version``, ``upstream_path``, ``torch_version``,
        ``options``, ``patched``, ``patch_report`` (text or None), ``cuda_stand_ins``,
        ``model_classes`` (MLP-like module name -> class), ``losses`` (per step),
        ``max_rel_error`` (module name -> max relative error of its fc2 input vs the float64
        reference; None for a module that got no tokens), ``modules`` (details), ``clamp_stats``
        (``fraction_beyond_clamp`` of first-step fc1 outputs, ...), ``build_error`` (None, or
        the message of an ``UnsupportedActivationError`` raised while building).
    """
    import torch

    if options.op_fuser and not options.te:
        raise ValueError("--op-fuser needs --te (the op fuser is Transformer Engine's).")
    if options.te and not torch.cuda.is_available():
        raise RuntimeError("--te needs a CUDA GPU (upstream's TE specs run on CUDA only).")
    torch.manual_seed(options.seed)
    if not options.te:
        torch.set_num_threads(1)  # small shared machines; results do not depend on it

    import megatron.core

    _check_not_the_fork(megatron.core)
    result: dict[str, Any] = {
        "upstream_version": getattr(megatron.core, "__version__", "?"),
        "upstream_path": os.path.dirname(megatron.core.__file__),
        "torch_version": torch.__version__,
        "options": dataclasses.asdict(options),
        "patched": False,
        "patch_report": None,
        "build_error": None,
        "losses": [],
        "max_rel_error": {},
    }
    if options.patch:
        # Before any upstream layer is built: layers built earlier keep upstream's behaviour.
        from mcore_activations.megatron_patch import patch_megatron_core

        report = patch_megatron_core()
        result["patched"] = True
        result["patch_report"] = report.details()
        if not options.quiet:
            print(report, flush=True)

    from mcore_activations.activation_spec import UnsupportedActivationError
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel

    device = (
        torch.device("cuda", torch.cuda.current_device()) if options.te else torch.device("cpu")
    )
    stand_ins = contextlib.nullcontext([]) if options.te else cpu_cuda_stand_ins()
    with single_process_group("nccl" if options.te else "gloo"), stand_ins as replaced:
        result["cuda_stand_ins"] = replaced
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=1,
        )
        try:
            # On CPU the default tracker's add() reads the CUDA RNG state; upstream's inference
            # tracker is a no-op, which is fine with dropout 0 and weights made by the CPU RNG.
            tensor_parallel.model_parallel_cuda_manual_seed(
                options.seed, inference_rng_tracker=not options.te
            )
            config = build_config(options)
            try:
                model = GPTModel(
                    config=config,
                    transformer_layer_spec=build_layer_spec(config, options),
                    vocab_size=VOCAB,
                    max_sequence_length=SEQ,
                    position_embedding_type="learned_absolute",
                    share_embeddings_and_output_weights=True,
                ).to(device)
            except UnsupportedActivationError as err:
                result["build_error"] = f"{type(err).__name__}: {err}"
                if not options.quiet:
                    print("build refused:", result["build_error"], flush=True)
                return _finish(result, options)
            probe = ActivationProbe(model)
            result["model_classes"] = {n: c.cls for n, c in probe.calls.items()}
            optimizer = torch.optim.Adam(model.parameters(), lr=options.lr)
            model.train()
            for step, (ids, pos, mask, labels) in enumerate(
                fixed_batches(options.steps, options.seed, device)
            ):
                optimizer.zero_grad(set_to_none=True)
                loss = model(ids, pos, mask, labels=labels).float().mean()
                loss.backward()
                optimizer.step()
                result["losses"].append(loss.item())
                if step == 0:
                    probe.stop()
                if not options.quiet:
                    print(f"step {step} loss {loss.item():.6f}", flush=True)
            if options.steps == 0:
                probe.stop()
            result.update(probe.results(options.clamp))
        finally:
            parallel_state.destroy_model_parallel()
    return _finish(result, options)


def _finish(result: dict, options: Options) -> dict:
    if options.json:
        with open(options.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=str)
    print(summary(result), flush=True)
    return result


def summary(result: dict) -> str:
    """A short human-readable summary of a result dict."""
    o = result["options"]
    flags = [
        k for k in ("fused", "patch", "shared_expert", "te", "op_fuser", "grouped_gemm") if o.get(k)
    ]
    lines = [
        f"megatron-core {result['upstream_version']} ({result['upstream_path']}); "
        f"clamp={o['clamp']} init_std={o['init_std']} {' '.join(flags) or 'unfused'}"
    ]
    if result.get("build_error"):
        lines.append(f"build refused: {result['build_error']}")
        return "\n".join(lines)
    stats = result.get("clamp_stats", {})
    if stats:
        lines.append(
            f"fc1 outputs beyond the clamp: {stats['beyond_clamp']}/{stats['elements']}"
            f" = {stats['fraction_beyond_clamp']:.4f} (max |fc1| "
            f"{stats['max_abs_fc1_out']:.2f})"
        )
    for name, err in result.get("max_rel_error", {}).items():
        cls = result["modules"][name]["class"]
        lines.append(
            f"  {name} [{cls}]: max rel error "
            + ("n/a (no tokens)" if err is None else f"{err:.3e}")
        )
    lines.append("LOSSES " + " ".join(f"{x:.6f}" for x in result["losses"]))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point; returns 0 unless the run raises."""
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
