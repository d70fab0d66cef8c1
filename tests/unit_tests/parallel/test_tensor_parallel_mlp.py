"""Tensor parallelism (TP=2) of the MLP classes against a float64 model on the full weights.

Each case builds one layer at TP=2, loads every rank's shard of one set of full weights, runs
forward and backward (input and output split along the sequence under sequence parallelism),
gathers output, input gradient and every parameter gradient from both ranks, and compares them
with ``fc2(ActivationSpec.reference(fc1(x)))`` in float64 (see ``parallel_test_utils``).

Classes and routes covered:

- ``mlp``: :class:`MLP` with the fork's Column/RowParallelLinear (all-reduce, or all-gather +
  reduce-scatter under sequence parallelism), activation unfused or on the fused kernels;
- ``shared``: :class:`SharedExpertMLP` with the sigmoid gate, plain, and with
  ``moe_shared_expert_overlap`` (its own communication, the linears' switched off; on CPU the
  overlapped steps run synchronously);
- GPU only, with Transformer Engine: ``mlp_te`` (MLP with TE linears), ``te_fused``
  (:class:`TEFusedMLP`: one TE op chain with AllReduce / ReduceScatter ops), ``shared_te``.

All cases of a test run in one spawned 2-rank world (spawning costs seconds; a case costs
milliseconds); the test lists every failed case with its traceback and prints each case's worst
error. CPU tier: gloo. Multi-GPU tier (``-m multigpu``): NCCL on two GPUs, fused kernels
compiled (Triton); the TE cases are a separate test (``te``).
"""

from __future__ import annotations

import pytest
import torch

import megatron.core.parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.activation_spec import ActivationSpec, UnsupportedActivationError
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.parallel.parallel_test_utils import (
    DTYPE,
    ENTRIES,
    REPLICATED,
    TP,
    Checker,
    SkipCase,
    activation_kwargs,
    case_result,
    full_mlp_weights,
    gather_objects,
    load_,
    merge_rank_results,
    mlp_layout,
    quiet,
    real_parameters,
    reference_mlp,
    run_cases,
    seed_of,
    shard,
    unshard,
)
from tests.unit_tests.transformer.mlp_test_utils import COMPILED, FUSED, UNFUSED, kernel_mode

HIDDEN, FFN, SEQ, BATCH = 16, 32, 8, 2

LOCAL_KINDS = ("mlp", "shared")
TE_KINDS = ("mlp_te", "te_fused", "shared_te")


def _cases(kinds) -> list:
    """``(kind, entry, path, sequence_parallel, overlap)`` tuples."""
    cases = []
    for kind in kinds:
        paths = (UNFUSED,) if kind == "te_fused" else (UNFUSED, FUSED)
        overlaps = (False, True) if kind.startswith("shared") else (False,)
        for entry in ENTRIES:
            for path in paths:
                for sequence_parallel in (False, True):
                    for overlap in overlaps:
                        cases.append((kind, entry, path, sequence_parallel, overlap))
    return cases


def case_id(case) -> str:
    kind, entry, path, sequence_parallel, overlap = case
    parts = [kind, entry, path, "sp" if sequence_parallel else "nosp"]
    if kind.startswith("shared"):
        parts.append("overlap" if overlap else "nooverlap")
    return "-".join(parts)


CPU_CASES = _cases(LOCAL_KINDS)
GPU_CASES = _cases(LOCAL_KINDS + TE_KINDS)


# ------------------------------------------------------------------------------ one case


def _config(case, device) -> TransformerConfig:
    kind, entry, path, sequence_parallel, overlap = case
    shared = kind.startswith("shared")
    kwargs = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=FFN,
        tensor_model_parallel_size=TP,
        # The dense MLP's fc1/fc2 biases; MoE configs allow biases only without expert TP.
        expert_tensor_parallel_size=1,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=device == "cpu",
        params_dtype=DTYPE,
        add_bias_linear=not shared,  # shared experts have no bias
        bias_activation_fusion=path != UNFUSED,
        **activation_kwargs(entry),
    )
    if shared:
        kwargs.update(
            num_moe_experts=4,
            moe_shared_expert_intermediate_size=FFN,
            moe_shared_expert_overlap=overlap,
            moe_token_dispatcher_type="alltoall",
        )
    return quiet(TransformerConfig, **kwargs)


def _submodules(kind) -> MLPSubmodules:
    if kind in TE_KINDS:
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TERowParallelLinear,
        )

        return MLPSubmodules(linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear)
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def _build(case, config, device):
    kind = case[0]
    submodules = _submodules(kind)
    tp_group = ps.get_tensor_model_parallel_group()
    if kind.startswith("shared"):
        pg = ProcessGroupCollection(tp=tp_group)
        layer = SharedExpertMLP(config, submodules, gate=True, pg_collection=pg)
    elif kind == "te_fused":
        from megatron.core.extensions.transformer_engine import TEFusedMLP

        try:
            layer = TEFusedMLP(config, submodules, ffn_hidden_size=FFN, tp_group=tp_group)
        except UnsupportedActivationError as error:
            # A refusal at construction is the designed outcome where TE has no exact op.
            raise SkipCase(f"TEFusedMLP refuses {case[1]} here: {error}") from error
    else:
        layer = MLP(config, submodules, ffn_hidden_size=FFN, tp_group=tp_group)
    return layer.to(device)


def _inputs(case):
    """Full float64 weights, input and output gradient of ``case`` (same on every rank)."""
    generator = torch.Generator().manual_seed(seed_of(case_id(case)))
    shared = case[0].startswith("shared")
    weights = full_mlp_weights(
        generator, hidden=HIDDEN, ffn=FFN, gated=True, bias=not shared, gate=shared
    )
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=torch.float64)
    grad = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=torch.float64)
    return weights, x, grad


def _local_part(full: torch.Tensor, case, rank: int) -> torch.Tensor:
    return full.chunk(TP, dim=0)[rank] if case[3] else full  # sequence parallel: split dim 0


def _compute(case, rank: int, device: str) -> dict:
    """Runs ``case`` on this rank; returns this rank's output and gradients."""
    config = _config(case, device)
    layer = _build(case, config, device)
    weights, x_full, grad_full = _inputs(case)
    params = real_parameters(layer)
    assert set(params) == set(weights), f"parameters {sorted(params)} != {sorted(weights)}"
    for name, param in params.items():
        load_(param, shard(weights[name], mlp_layout(name, gated=True), rank, TP))

    x = _local_part(x_full, case, rank).to(device, DTYPE).requires_grad_()
    grad = _local_part(grad_full, case, rank).to(device, DTYPE)
    path = case[2]
    if path == FUSED and device != "cpu":
        path = COMPILED  # on GPU the fused kernels run compiled (Triton), as in training
    with kernel_mode(path):
        out = layer(x)
        if isinstance(out, tuple):  # MLP returns (output, bias to add)
            out, bias = out
            if bias is not None:
                out = out + bias
        out.backward(grad)
    tensors = {"out": out, "dx": x.grad}
    tensors.update({f"d{name}": param.grad for name, param in params.items()})
    return {"tensors": tensors}


def _check(case, per_rank: list) -> dict:
    """Compares every rank's results of ``case`` with the float64 reference."""
    weights, x_full, grad_full = _inputs(case)
    spec = ActivationSpec.from_config(_config(case, "cpu"))
    reference = {name: w.clone().requires_grad_() for name, w in weights.items()}
    x64 = x_full.clone().requires_grad_()
    out_ref, pre = reference_mlp(reference, x64, spec)
    out_ref.backward(grad_full)

    check = Checker(case_id(case))
    check.clamps(spec, pre)
    sequence_parallel = case[3]
    for key, ref in (("out", out_ref), ("dx", x64.grad)):
        parts = [tensors[key] for tensors in per_rank]
        name = {"out": "output", "dx": "input grad"}[key]
        if sequence_parallel:
            check(f"{name} (gathered along the sequence)", torch.cat(parts), ref)
        else:
            check.replicas(name, parts, ref)
    for name in weights:
        parts = [tensors[f"d{name}"] for tensors in per_rank]
        layout = mlp_layout(name, gated=True)
        if layout != REPLICATED:
            check(f"d{name} (gathered)", unshard(parts, layout), reference[name].grad)
        elif sequence_parallel:
            # Each rank saw part of the sequence: the gradient reduction sums over TP (the
            # parameter is tagged sequence_parallel for it).
            check(f"d{name} (summed over TP)", sum(parts), reference[name].grad)
        else:
            check.replicas(f"d{name}", parts, reference[name].grad)
    return {"worst": check.worst()}


def _run_case(case, rank: int, device: str) -> dict:
    local = case_result(lambda: _compute(case, rank, device))
    # Always gathered, also after an error on this rank, so the ranks stay in step.
    per_rank = gather_objects(local)
    failed = [r for r in per_rank if r["error"] is not None or r["skip"]]
    if failed:
        return failed[0]
    return case_result(lambda: _check(case, [r["tensors"] for r in per_rank]))


def _tensor_parallel_worker(rank: int, world_size: int, cases: list, device: str) -> dict:
    assert world_size == TP
    ps.initialize_model_parallel(tensor_model_parallel_size=TP)
    if device == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    results = {case_id(case): _run_case(case, rank, device) for case in cases}
    # A result computed on every rank; merge so that a failure on any rank is reported.
    return merge_rank_results(gather_objects(results))


# ------------------------------------------------------------------------------- the tests


def _run(cases: list, backend: str) -> None:
    run_cases(_tensor_parallel_worker, TP, cases, [case_id(case) for case in cases], backend)


def test_tp2_matches_full_weights_gloo():
    _run(CPU_CASES, "gloo")


@pytest.mark.multigpu
def test_tp2_matches_full_weights_nccl():
    _run([case for case in GPU_CASES if case[0] not in TE_KINDS], "nccl")


@pytest.mark.multigpu
@pytest.mark.te
def test_tp2_matches_full_weights_nccl_te():
    _run([case for case in GPU_CASES if case[0] in TE_KINDS], "nccl")
