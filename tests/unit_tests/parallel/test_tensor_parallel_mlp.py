"""Tensor parallelism of the MLP classes against a float64 model on the full weights.

Each case builds one layer on one parallel layout (``parallel_test_utils.Layout``: TP=2 on 2
ranks; TP=4, and TP=2 in 2 data-parallel replicas next to EP=2, on 4; TP=2 in 4 replicas next
to EP=8 on 8), loads every rank's shard of one set of full weights, runs forward and backward
(input and output split along the sequence under sequence parallelism), gathers output, input
gradient and every parameter gradient from all ranks, and compares each replica's with
``fc2(ActivationSpec.reference(fc1(x)))`` on its own input, in float64 (see
``parallel_test_utils``). The replicas share the weights and get different inputs, so a
collective that reached into another TP group would show.

Classes and routes covered:

- ``mlp``: :class:`MLP` with the fork's Column/RowParallelLinear (all-reduce, or all-gather +
  reduce-scatter under sequence parallelism), activation unfused or on the fused kernels;
- ``shared``: :class:`SharedExpertMLP` with the sigmoid gate, plain, and with
  ``moe_shared_expert_overlap`` (its own communication, the linears' switched off; on CPU the
  overlapped steps run synchronously);
- GPU only, with Transformer Engine: ``mlp_te`` (MLP with TE linears), ``te_fused``
  (:class:`TEFusedMLP`: one TE op chain with AllReduce / ReduceScatter ops), ``shared_te``.

All cases of one world size run in one spawned world (spawning costs seconds; a case costs
milliseconds); the test lists every failed case with its traceback and prints each case's worst
error. CPU tier: gloo, 2 ranks (4 ranks with ``-m ranks4``). Multi-GPU tier (``-m multigpu``):
NCCL on 2, 4 and 8 GPUs (each skipped with fewer), fused kernels compiled (Triton); the TE
cases are a separate test (``te``).
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
    LAYOUTS,
    NCCL_WORLDS,
    REPLICATED,
    TP2,
    TP2XEP2,
    TP2XEP8,
    TP4,
    Checker,
    SkipCase,
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

HIDDEN, FFN, SEQ, BATCH = 16, 32, 8, 2

LOCAL_KINDS = ("mlp", "shared")
TE_KINDS = ("mlp_te", "te_fused", "shared_te")
# The layouts whose dense TP is > 1 (EP-only layouts leave these classes unsplit).
DENSE_LAYOUTS = (TP2, TP4, TP2XEP2, TP2XEP8)


def cases_of(world_size: int, kinds) -> list:
    """``(layout, kind, entry, path, sequence_parallel, overlap)`` tuples, grouped by layout."""
    cases = []
    for layout in DENSE_LAYOUTS:
        if layout.world != world_size:
            continue
        for kind in kinds:
            paths = (UNFUSED,) if kind == "te_fused" else (UNFUSED, FUSED)
            overlaps = (False, True) if kind.startswith("shared") else (False,)
            for entry in ENTRIES:
                for path in paths:
                    for sequence_parallel in (False, True):
                        for overlap in overlaps:
                            cases.append(
                                (layout.name, kind, entry, path, sequence_parallel, overlap)
                            )
    return cases


def case_id(case) -> str:
    layout, kind, entry, path, sequence_parallel, overlap = case
    parts = [layout, kind, entry, path, "sp" if sequence_parallel else "nosp"]
    if kind.startswith("shared"):
        parts.append("overlap" if overlap else "nooverlap")
    return "-".join(parts)


# ------------------------------------------------------------------------------ one case


def _config(case, device) -> TransformerConfig:
    layout, kind, entry, path, sequence_parallel, overlap = case
    shared = kind.startswith("shared")
    kwargs = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=FFN,
        tensor_model_parallel_size=LAYOUTS[layout].tp,
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
    kind = case[1]
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
            raise SkipCase(f"TEFusedMLP refuses {case[2]} here: {error}") from error
    else:
        layer = MLP(config, submodules, ffn_hidden_size=FFN, tp_group=tp_group)
    return layer.to(device)


def _weights(case) -> dict:
    """The full float64 weights of ``case`` (the same on every rank and replica)."""
    generator = torch.Generator().manual_seed(seed_of(case_id(case)))
    shared = case[1].startswith("shared")
    return full_mlp_weights(
        generator, hidden=HIDDEN, ffn=FFN, gated=True, bias=not shared, gate=shared
    )


def _data(case, replica: int):
    """Input and output gradient of data-parallel ``replica`` (each replica its own)."""
    generator = torch.Generator().manual_seed(seed_of(f"{case_id(case)}/replica{replica}"))
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=torch.float64)
    grad = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=torch.float64)
    return x, grad


def _local_part(full: torch.Tensor, case, tp_rank: int) -> torch.Tensor:
    if not case[4]:
        return full
    return full.chunk(LAYOUTS[case[0]].tp, dim=0)[tp_rank]  # sequence parallel: split dim 0


def compute(case, device: str) -> dict:
    """Runs ``case`` on this rank; returns its output and gradients, and where it sits."""
    tp = LAYOUTS[case[0]].tp
    tp_rank, replica = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    assert ps.get_tensor_model_parallel_world_size() == tp
    config = _config(case, device)
    layer = _build(case, config, device)
    weights = _weights(case)
    x_full, grad_full = _data(case, replica)
    params = real_parameters(layer)
    assert set(params) == set(weights), f"parameters {sorted(params)} != {sorted(weights)}"
    for name, param in params.items():
        load_(param, shard(weights[name], mlp_layout(name, gated=True), tp_rank, tp))

    x = _local_part(x_full, case, tp_rank).to(device, DTYPE).requires_grad_()
    grad = _local_part(grad_full, case, tp_rank).to(device, DTYPE)
    path = case[3]
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
    return {"tensors": tensors, "tp_rank": tp_rank, "replica": replica}


def check(case, per_rank: list) -> dict:
    """Compares every replica's gathered results of ``case`` with its float64 reference."""
    layout = LAYOUTS[case[0]]
    replicas = layout.world // layout.tp
    spec = ActivationSpec.from_config(_config(case, "cpu"))
    checker = Checker(case_id(case))
    for replica in range(replicas):
        ranks = sorted((r for r in per_rank if r["replica"] == replica), key=lambda r: r["tp_rank"])
        assert [r["tp_rank"] for r in ranks] == list(range(layout.tp)), (replica, "TP ranks")
        prefix = f"replica {replica}: " if replicas > 1 else ""
        _check_replica(case, replica, [r["tensors"] for r in ranks], spec, checker, prefix)
    return {"worst": checker.worst()}


def _check_replica(case, replica: int, per_rank: list, spec, check: Checker, prefix: str):
    """One TP group's results (in TP-rank order) against the reference on its input."""
    weights = _weights(case)
    x_full, grad_full = _data(case, replica)
    reference = {name: w.clone().requires_grad_() for name, w in weights.items()}
    x64 = x_full.clone().requires_grad_()
    out_ref, pre = reference_mlp(reference, x64, spec)
    out_ref.backward(grad_full)

    check.clamps(spec, pre)
    sequence_parallel = case[4]
    for key, ref in (("out", out_ref), ("dx", x64.grad)):
        parts = [tensors[key] for tensors in per_rank]
        name = prefix + {"out": "output", "dx": "input grad"}[key]
        if sequence_parallel:
            check(f"{name} (gathered along the sequence)", torch.cat(parts), ref)
        else:
            check.replicas(name, parts, ref)
    for name in weights:
        parts = [tensors[f"d{name}"] for tensors in per_rank]
        layout = mlp_layout(name, gated=True)
        what = f"{prefix}d{name}"
        if layout != REPLICATED:
            check(f"{what} (gathered)", unshard(parts, layout), reference[name].grad)
        elif sequence_parallel:
            # Each rank saw part of the sequence: the gradient reduction sums over TP (the
            # parameter is tagged sequence_parallel for it).
            check(f"{what} (summed over TP)", sum(parts), reference[name].grad)
        else:
            check.replicas(what, parts, reference[name].grad)


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
            assert config.tensor_model_parallel_size == LAYOUTS[case[0]].tp
            assert FFN % config.tensor_model_parallel_size == 0
            if case[4]:
                assert SEQ % config.tensor_model_parallel_size == 0


def test_nccl_world_of_another_size_than_torchrun_skips(monkeypatch):
    """Under a torchrun launch of another size, a world is not spawned once per launched rank."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(pytest.skip.Exception, match="needs a 4-rank world; .* one of 8 torchrun"):
        _run(4, LOCAL_KINDS, "nccl")


@pytest.mark.parametrize("world_size", gloo_world_params())
def test_tp_matches_full_weights_gloo(world_size):
    _run(world_size, LOCAL_KINDS, "gloo")


@pytest.mark.parametrize("world_size", nccl_world_params())
def test_tp_matches_full_weights_nccl(world_size):
    _run(world_size, LOCAL_KINDS, "nccl")


@pytest.mark.te
@pytest.mark.parametrize("world_size", nccl_world_params())
def test_tp_matches_full_weights_nccl_te(world_size):
    _run(world_size, TE_KINDS, "nccl")
