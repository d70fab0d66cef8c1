"""Expert parallelism (EP=2) and expert tensor parallelism (ETP=2) of the routed-expert classes.

The token dispatcher is not part of this fork, so each case plays its part: every rank receives
the tokens of its own experts, already permuted (sorted by expert) with one router probability
per token, as the dispatcher delivers them; the outputs and gradients of both ranks are gathered
and compared with a float64 single-process model holding ALL experts
(``p * (fc2(act(fc1(x))) + b2)`` per expert, ``ActivationSpec.reference``).

- EP=2: ``NUM_EXPERTS`` experts, disjoint halves per rank (rank r holds experts
  ``r * L .. r * L + L - 1``); expert fc1/fc2 do no communication.
- ETP=2 (EP=1): every rank holds every expert, split like a column/row-parallel pair (a gated
  fc1 as ``[gate_r; linear_r]``); each rank's output and input gradient are partial sums, which
  the dispatcher's combine (reduce-scatter) and its backward (all-gather) would sum; the test
  sums them. Expert biases are refused with ETP > 1 (config rule), so ETP cases have none.

Classes: :class:`SequentialMLP` (fork linears; CPU tier on gloo and multi-GPU tier on NCCL) and
:class:`TEGroupedMLP` with TE's grouped linears (multi-GPU tier, ``te``), activation unfused or
on the fused kernels. The TE op-fuser route of TEGroupedMLP refuses expert TP by design and needs
the SM100 CuTe DSL grouped kernel for GLUs, so it is not run here.
"""

from __future__ import annotations

import pytest
import torch

import megatron.core.parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.activation_spec import ActivationSpec
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import (
    GroupedMLPSubmodules,
    SequentialMLP,
    TEGroupedMLP,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.parallel.parallel_test_utils import (
    DTYPE,
    ENTRIES,
    Checker,
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

WORLD = 2
HIDDEN, EXPERT_FFN = 16, 16
NUM_EXPERTS = 4
TOKENS_PER_EXPERT = [5, 0, 7, 3]  # uneven, one expert without tokens
EP, ETP = "ep2", "etp2"

LOCAL_KINDS = ("sequential",)
TE_KINDS = ("grouped_te",)


def _cases(kinds) -> list:
    """``(kind, entry, path, layout)`` tuples."""
    return [
        (kind, entry, path, layout)
        for kind in kinds
        for layout in (EP, ETP)
        for entry in ENTRIES
        for path in (UNFUSED, FUSED)
    ]


def case_id(case) -> str:
    return "-".join(case)


CPU_CASES = _cases(LOCAL_KINDS)
GPU_CASES = _cases(LOCAL_KINDS + TE_KINDS)


def _sizes(layout: str) -> tuple[int, int]:
    """``(expert_model_parallel_size, expert_tensor_parallel_size)``."""
    return (WORLD, 1) if layout == EP else (1, WORLD)


# ------------------------------------------------------------------------------ one case


def _config(case, device) -> TransformerConfig:
    kind, entry, path, layout = case
    ep, etp = _sizes(layout)
    kwargs = activation_kwargs(entry)
    kwargs.update(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=2 * EXPERT_FFN,  # differs from the experts' width on purpose
        num_moe_experts=NUM_EXPERTS,
        moe_ffn_hidden_size=EXPERT_FFN,
        moe_grouped_gemm=kind in TE_KINDS,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        use_cpu_initialization=device == "cpu",
        params_dtype=DTYPE,
        add_bias_linear=etp == 1,  # config rule: no expert bias with expert TP
        bias_activation_fusion=path != UNFUSED,
    )
    return quiet(TransformerConfig, **kwargs)


def _build(case, config, device):
    kind, _entry, _path, layout = case
    ep, _etp = _sizes(layout)
    pg = ProcessGroupCollection(
        ep=ps.get_expert_model_parallel_group(), expt_tp=ps.get_expert_tensor_parallel_group()
    )
    local = NUM_EXPERTS // ep
    if kind in TE_KINDS:
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
        )

        submodules = GroupedMLPSubmodules(
            linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear
        )
        layer = TEGroupedMLP(local, config, submodules, pg_collection=pg)
    else:
        submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        layer = SequentialMLP(local, config, submodules, pg_collection=pg)
    return layer.to(device)


def _global_name(kind: str, name: str, first_expert: int) -> str:
    """The reference's name ``experts.<global index>.linear_fcN.<weight|bias>`` of a parameter."""
    if kind in TE_KINDS:  # linear_fc1.weight3
        linear, attr = name.split(".")
        base = attr.rstrip("0123456789")
        index = int(attr[len(base) :])
        return f"experts.{first_expert + index}.{linear}.{base}"
    _, index, rest = name.split(".", 2)  # local_experts.3.linear_fc1.weight
    return f"experts.{first_expert + int(index)}.{rest}"


def _inputs(case):
    """Full float64 weights of all experts, tokens, probabilities, output gradient."""
    generator = torch.Generator().manual_seed(seed_of(case_id(case)))
    bias = _sizes(case[3])[1] == 1
    weights = {}
    for expert in range(NUM_EXPERTS):
        weights.update(
            full_mlp_weights(
                generator,
                hidden=HIDDEN,
                ffn=EXPERT_FFN,
                gated=True,
                bias=bias,
                prefix=f"experts.{expert}.",
            )
        )
    tokens = sum(TOKENS_PER_EXPERT)
    x = torch.randn(tokens, HIDDEN, generator=generator, dtype=torch.float64)
    probs = torch.rand(tokens, generator=generator, dtype=torch.float64) * 0.9 + 0.1
    grad = torch.randn(tokens, HIDDEN, generator=generator, dtype=torch.float64)
    return weights, x, probs, grad


def _expert_rows(first: int, count: int) -> slice:
    start = sum(TOKENS_PER_EXPERT[:first])
    return slice(start, start + sum(TOKENS_PER_EXPERT[first : first + count]))


def _compute(case, device: str) -> dict:
    kind, _entry, path, layout = case
    ep, etp = _sizes(layout)
    config = _config(case, device)
    layer = _build(case, config, device)
    local = NUM_EXPERTS // ep
    first = ps.get_expert_model_parallel_rank() * local
    etp_rank = ps.get_expert_tensor_parallel_rank()
    weights, x_full, probs_full, grad_full = _inputs(case)

    params = real_parameters(layer)
    names = {name: _global_name(kind, name, first) for name in params}
    expected = {n for n in weights if int(n.split(".")[1]) in range(first, first + local)}
    assert set(names.values()) == expected, f"{sorted(names.values())} != {sorted(expected)}"
    for name, param in params.items():
        full = weights[names[name]]
        load_(param, shard(full, mlp_layout(name, gated=True), etp_rank, etp))

    rows = _expert_rows(first, local)
    x = x_full[rows].to(device, DTYPE).requires_grad_()
    probs = probs_full[rows].to(device, torch.float32).requires_grad_()
    # Under ETP the combine's backward hands every rank the whole output gradient.
    grad = grad_full[rows].to(device, DTYPE)
    tokens_per_expert = torch.tensor(TOKENS_PER_EXPERT[first : first + local])
    if path == FUSED and device != "cpu":
        path = COMPILED  # Triton on GPU, as in training
    with kernel_mode(path):
        out, bias = layer(x, tokens_per_expert, probs)
        assert bias is None
        out.backward(grad)
    tensors = {"out": out, "dx": x.grad, "dprobs": probs.grad}
    tensors.update({f"d{names[name]}": param.grad for name, param in params.items()})
    return {"tensors": tensors}


def _check(case, per_rank: list) -> dict:
    layout = case[3]
    weights, x_full, probs_full, grad_full = _inputs(case)
    spec = ActivationSpec.from_config(_config(case, "cpu"))
    reference = {name: w.clone().requires_grad_() for name, w in weights.items()}
    x64, probs64 = x_full.clone().requires_grad_(), probs_full.clone().requires_grad_()
    pieces, pres = [], []
    for expert in range(NUM_EXPERTS):
        rows = _expert_rows(expert, 1)
        out, pre = reference_mlp(
            reference, x64[rows], spec, probs=probs64[rows], prefix=f"experts.{expert}."
        )
        pieces.append(out)
        pres.append(pre)
    out_ref = torch.cat(pieces)
    out_ref.backward(grad_full)

    check = Checker(case_id(case))
    check.clamps(spec, torch.cat(pres))
    for key, ref, name in (
        ("out", out_ref, "output"),
        ("dx", x64.grad, "input grad"),
        ("dprobs", probs64.grad, "probs grad"),
    ):
        parts = [tensors[key] for tensors in per_rank]
        if layout == EP:
            check(f"{name} (gathered over EP)", torch.cat(parts), ref)
        else:
            check(f"{name} (partial sums over ETP)", sum(parts), ref)
    for name in weights:
        owners = [tensors[f"d{name}"] for tensors in per_rank if f"d{name}" in tensors]
        if layout == EP:
            assert len(owners) == 1, f"{name} held by {len(owners)} EP ranks, expected 1"
            got = owners[0]
        else:
            got = unshard(owners, mlp_layout(name, gated=True))
        check(f"d{name}", got, reference[name].grad)
    return {"worst": check.worst()}


def _run_case(case, device: str) -> dict:
    ep, etp = _sizes(case[3])
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=1,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    if device == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    local = case_result(lambda: _compute(case, device))
    per_rank = gather_objects(local)  # always, so the ranks stay in step
    failed = [r for r in per_rank if r["error"] is not None or r["skip"]]
    if failed:
        return failed[0]
    return case_result(lambda: _check(case, [r["tensors"] for r in per_rank]))


def _expert_parallel_worker(rank: int, world_size: int, cases: list, device: str) -> dict:
    assert world_size == WORLD
    # Cases grouped by layout: parallel_state is rebuilt per case, which is cheap.
    results = {case_id(case): _run_case(case, device) for case in cases}
    return merge_rank_results(gather_objects(results))


# ------------------------------------------------------------------------------- the tests


def _run(cases: list, backend: str) -> None:
    run_cases(_expert_parallel_worker, WORLD, cases, [case_id(case) for case in cases], backend)


def test_experts_match_all_experts_gloo():
    _run(CPU_CASES, "gloo")


@pytest.mark.multigpu
def test_experts_match_all_experts_nccl():
    _run([case for case in GPU_CASES if case[0] not in TE_KINDS], "nccl")


@pytest.mark.multigpu
@pytest.mark.te
def test_experts_match_all_experts_nccl_te():
    _run([case for case in GPU_CASES if case[0] in TE_KINDS], "nccl")
