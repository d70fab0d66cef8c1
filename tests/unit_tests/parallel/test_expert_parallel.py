"""Expert parallelism (EP) and expert tensor parallelism (ETP) of the routed-expert classes.

The token dispatcher is not part of this fork, so each case plays its part: every rank receives
the tokens of its own experts, already permuted (sorted by expert) with one router probability
per token, as the dispatcher delivers them; the outputs and gradients of all ranks are gathered
and compared with a float64 single-process model holding ALL experts
(``p * (fc2(act(fc1(x))) + b2)`` per expert, ``ActivationSpec.reference``).

Layouts (``parallel_test_utils.Layout``; every one has a single expert-data-parallel replica):

- EP only (EP=2, 4, 8): ``NUM_EXPERTS`` experts, disjoint blocks per rank (EP rank e holds
  experts ``e * L .. e * L + L - 1``); expert fc1/fc2 do no communication. Outputs and
  gradients are concatenated in expert order.
- ETP only (ETP=2; ETP=4 in the "tp4" layout): every rank holds every expert, split like a
  column/row-parallel pair (a gated fc1 as ``[gate_r; linear_r]``); each rank's output and input
  gradient are partial sums, which the dispatcher's combine (reduce-scatter) and its backward
  (all-gather) would sum; the test sums them.
- EP=2 x ETP=2 (4 ranks): both at once: partial sums over each EP rank's ETP group, then
  concatenated over EP.

Expert biases are refused with ETP > 1 (config rule), so those cases have none. The token
counts (:data:`TOKENS_PER_EXPERT`) are uneven and leave some experts, and at EP=4 and EP=8
whole ranks, without tokens.

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
    EP2,
    EP4,
    ETP2,
    LAYOUTS,
    NCCL_WORLDS,
    TP2XEP2,
    TP2XEP8,
    TP4,
    Checker,
    activation_kwargs,
    full_mlp_weights,
    gloo_world_params,
    load_,
    mlp_layout,
    nccl_world_params,
    quiet,
    real_parameters,
    reference_mlp,
    run_cases,
    seed_of,
    shard,
    unshard,
)
from tests.unit_tests.transformer.mlp_test_utils import COMPILED, FUSED, UNFUSED, kernel_mode

HIDDEN, EXPERT_FFN = 16, 16
NUM_EXPERTS = 8
# Uneven; experts 1, 4 and 5 get no tokens, which leaves whole ranks without tokens at EP=4
# (rank 2) and EP=8 (ranks 1, 4 and 5).
TOKENS_PER_EXPERT = [5, 0, 7, 3, 0, 0, 6, 4]
assert len(TOKENS_PER_EXPERT) == NUM_EXPERTS

LOCAL_KINDS = ("sequential",)
TE_KINDS = ("grouped_te",)
EXPERT_LAYOUTS = (EP2, ETP2, TP4, EP4, TP2XEP2, TP2XEP8)


def cases_of(world_size: int, kinds) -> list:
    """``(layout, kind, entry, path)`` tuples, grouped by layout."""
    return [
        (layout.name, kind, entry, path)
        for layout in EXPERT_LAYOUTS
        if layout.world == world_size
        for kind in kinds
        for entry in ENTRIES
        for path in (UNFUSED, FUSED)
    ]


def case_id(case) -> str:
    layout, kind, entry, path = case
    return "-".join((kind, entry, path, layout))


# ------------------------------------------------------------------------------ one case


def _config(case, device) -> TransformerConfig:
    layout, kind, entry, path = case
    layout = LAYOUTS[layout]
    kwargs = activation_kwargs(entry)
    kwargs.update(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=2 * EXPERT_FFN,  # differs from the experts' width on purpose
        num_moe_experts=NUM_EXPERTS,
        moe_ffn_hidden_size=EXPERT_FFN,
        moe_grouped_gemm=kind in TE_KINDS,
        tensor_model_parallel_size=layout.tp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        use_cpu_initialization=device == "cpu",
        params_dtype=DTYPE,
        add_bias_linear=layout.etp == 1,  # config rule: no expert bias with expert TP
        bias_activation_fusion=path != UNFUSED,
    )
    return quiet(TransformerConfig, **kwargs)


def _build(case, config, device):
    kind = case[1]
    pg = ProcessGroupCollection(
        ep=ps.get_expert_model_parallel_group(), expt_tp=ps.get_expert_tensor_parallel_group()
    )
    local = NUM_EXPERTS // LAYOUTS[case[0]].ep
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
    bias = LAYOUTS[case[0]].etp == 1
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


def compute(case, device: str) -> dict:
    """Runs ``case`` on this rank; returns its output and gradients, and where it sits."""
    layout, kind, _entry, path = case
    layout = LAYOUTS[layout]
    assert ps.get_expert_data_parallel_world_size() == 1, "one expert-data-parallel replica"
    ep_rank, etp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    config = _config(case, device)
    layer = _build(case, config, device)
    local = NUM_EXPERTS // layout.ep
    first = ep_rank * local
    weights, x_full, probs_full, grad_full = _inputs(case)

    params = real_parameters(layer)
    names = {name: _global_name(kind, name, first) for name in params}
    expected = {n for n in weights if int(n.split(".")[1]) in range(first, first + local)}
    assert set(names.values()) == expected, f"{sorted(names.values())} != {sorted(expected)}"
    for name, param in params.items():
        full = weights[names[name]]
        load_(param, shard(full, mlp_layout(name, gated=True), etp_rank, layout.etp))

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
    return {"tensors": tensors, "ep_rank": ep_rank, "etp_rank": etp_rank}


def check(case, per_rank: list) -> dict:
    """Every EP rank's results (summed over its ETP group) against the all-experts reference."""
    layout = LAYOUTS[case[0]]
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

    # groups[e][t]: the tensors of EP rank e, expert-TP rank t.
    groups = [[None] * layout.etp for _ in range(layout.ep)]
    for result in per_rank:
        assert groups[result["ep_rank"]][result["etp_rank"]] is None, "two ranks, one place"
        groups[result["ep_rank"]][result["etp_rank"]] = result["tensors"]

    checker = Checker(case_id(case))
    checker.clamps(spec, torch.cat(pres))
    how = {
        (True, False): "gathered over EP",
        (False, True): "partial sums over ETP",
        (True, True): "ETP partial sums, gathered over EP",
    }[layout.ep > 1, layout.etp > 1]
    for key, ref, name in (
        ("out", out_ref, "output"),
        ("dx", x64.grad, "input grad"),
        ("dprobs", probs64.grad, "probs grad"),
    ):
        # sum() of one tensor is that tensor (0 + t): no ETP, no sum.
        got = torch.cat([sum(tensors[key] for tensors in group) for group in groups])
        checker(f"{name} ({how})", got, ref)
    local = NUM_EXPERTS // layout.ep
    for name in weights:
        group = groups[int(name.split(".")[1]) // local]  # the EP rank holding this expert
        owners = [tensors[f"d{name}"] for tensors in group if f"d{name}" in tensors]
        assert len(owners) == layout.etp, f"{name} held by {len(owners)} ranks"
        checker(f"d{name}", unshard(owners, mlp_layout(name, gated=True)), reference[name].grad)
    return {"worst": checker.worst()}


# ------------------------------------------------------------------------------- the tests


def _run(world_size: int, kinds, backend: str) -> None:
    cases = cases_of(world_size, kinds)
    run_cases(cases, world_size, backend, case_id=case_id, compute=compute, check=check)


def test_every_world_builds_its_configs():
    """Every case's config is valid, also those of worlds this machine cannot spawn."""
    for world_size in NCCL_WORLDS:
        cases = cases_of(world_size, LOCAL_KINDS + TE_KINDS)
        assert cases, world_size
        for case in cases:
            config = _config(case, "cpu")
            layout = LAYOUTS[case[0]]
            assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (
                layout.ep,
                layout.etp,
            )
            assert NUM_EXPERTS % layout.ep == 0 and EXPERT_FFN % layout.etp == 0


@pytest.mark.parametrize("world_size", gloo_world_params())
def test_experts_match_all_experts_gloo(world_size):
    _run(world_size, LOCAL_KINDS, "gloo")


@pytest.mark.parametrize("world_size", nccl_world_params())
def test_experts_match_all_experts_nccl(world_size):
    _run(world_size, LOCAL_KINDS, "nccl")


@pytest.mark.te
@pytest.mark.parametrize("world_size", nccl_world_params())
def test_experts_match_all_experts_nccl_te(world_size):
    _run(world_size, TE_KINDS, "nccl")
