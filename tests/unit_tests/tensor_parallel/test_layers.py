"""ColumnParallelLinear / RowParallelLinear: TP=2 on two gloo ranks equals one device.

Each rank builds the TP=2 pair and, over a one-rank group, the same pair unsplit from the same
seed. Forward outputs, the input gradient and every parameter gradient of the split pair must
equal the matching slices of the unsplit pair's (float64, so only summation order differs).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import megatron.core.parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    get_cuda_rng_tracker,
    initialize_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from tests.unit_tests.test_utilities import run_distributed

HIDDEN, FFN, SEQ, BATCH = 6, 8, 4, 3
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _init(weight):
    return torch.nn.init.normal_(weight, std=0.5)


def _config(tp, sequence_parallel=False, **kwargs):
    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=torch.float64,
        **kwargs,
    )


def _build_pair(
    config, group, *, seed, skip_bias_add, gather_output=False, bias=True, device="cpu"
):
    torch.manual_seed(seed)
    fc1 = ColumnParallelLinear(
        HIDDEN,
        FFN,
        config=config,
        init_method=_init,
        bias=bias,
        gather_output=gather_output,
        skip_bias_add=skip_bias_add,
        tp_group=group,
    )
    fc2 = RowParallelLinear(
        FFN,
        HIDDEN,
        config=config,
        init_method=_init,
        bias=bias,
        input_is_parallel=not gather_output,
        skip_bias_add=skip_bias_add,
        tp_group=group,
    )
    if bias:
        # Random biases (sliced from one full bias, as the weights are), so that a bias added
        # twice or dropped cannot go unnoticed.
        generator = torch.Generator().manual_seed(seed + 1)
        full1, full2 = (
            torch.randn(n, dtype=torch.float64, generator=generator) for n in (FFN, HIDDEN)
        )
        with torch.no_grad():
            fc1.bias.copy_(full1.chunk(fc1.tp_size)[fc1.tp_rank])
            fc2.bias.copy_(full2)
    return fc1.to(device), fc2.to(device)


def _run_pair(fc1, fc2, x, grad_output):
    hidden, bias1 = fc1(x)
    if bias1 is not None:
        hidden = hidden + bias1
    hidden = F.gelu(hidden)
    out, bias2 = fc2(hidden)
    if bias2 is not None:
        out = out + bias2
    out.backward(grad_output)
    return out


def _check_variant(
    rank,
    tp_group,
    solo_group,
    *,
    sequence_parallel,
    skip_bias_add,
    gather_output,
    device="cpu",
):
    label = (
        f"rank {rank}, sequence_parallel={sequence_parallel}, skip_bias_add={skip_bias_add}, "
        f"gather_output={gather_output}"
    )
    fc1, fc2 = _build_pair(
        _config(2, sequence_parallel),
        tp_group,
        seed=1234,
        skip_bias_add=skip_bias_add,
        gather_output=gather_output,
        device=device,
    )
    ref1, ref2 = _build_pair(
        _config(1), solo_group, seed=1234, skip_bias_add=skip_bias_add, device=device
    )

    # Same master weights: each rank holds its slice of the single-device weight.
    torch.testing.assert_close(fc1.weight, ref1.weight.chunk(2, dim=0)[rank], rtol=0, atol=0)
    torch.testing.assert_close(fc2.weight, ref2.weight.chunk(2, dim=1)[rank], rtol=0, atol=0)

    generator = torch.Generator().manual_seed(99)
    x_full = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64, generator=generator)
    grad_full = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64, generator=generator)
    x_full, grad_full = x_full.to(device), grad_full.to(device)
    if sequence_parallel:
        x_local = x_full.chunk(2, dim=0)[rank].clone()
        grad_local = grad_full.chunk(2, dim=0)[rank]
    else:
        x_local, grad_local = x_full.clone(), grad_full
    x_local.requires_grad_()
    x_ref = x_full.clone().requires_grad_()

    out = _run_pair(fc1, fc2, x_local, grad_local)
    out_ref = _run_pair(ref1, ref2, x_ref, grad_full)

    def local(full):
        return full.chunk(2, dim=0)[rank] if sequence_parallel else full

    torch.testing.assert_close(out, local(out_ref), **TOL, msg=lambda m: f"{label}: output: {m}")
    torch.testing.assert_close(
        x_local.grad, local(x_ref.grad), **TOL, msg=lambda m: f"{label}: input grad: {m}"
    )
    torch.testing.assert_close(
        fc1.weight.grad,
        ref1.weight.grad.chunk(2, dim=0)[rank],
        **TOL,
        msg=lambda m: f"{label}: fc1 weight grad: {m}",
    )
    torch.testing.assert_close(
        fc1.bias.grad,
        ref1.bias.grad.chunk(2, dim=0)[rank],
        **TOL,
        msg=lambda m: f"{label}: fc1 bias grad: {m}",
    )
    torch.testing.assert_close(
        fc2.weight.grad,
        ref2.weight.grad.chunk(2, dim=1)[rank],
        **TOL,
        msg=lambda m: f"{label}: fc2 weight grad: {m}",
    )
    fc2_bias_grad = fc2.bias.grad.clone()
    if sequence_parallel:
        # Each rank saw only its part of the sequence; the sequence_parallel attribute tells
        # the gradient reduction to sum these partial bias gradients over the TP group.
        assert fc2.bias.sequence_parallel
        torch.distributed.all_reduce(fc2_bias_grad, group=tp_group)
    torch.testing.assert_close(
        fc2_bias_grad, ref2.bias.grad, **TOL, msg=lambda m: f"{label}: fc2 bias grad: {m}"
    )


def _check_attributes(rank, tp_group):
    fc1, fc2 = _build_pair(_config(2, sequence_parallel=True), tp_group, seed=1, skip_bias_add=True)
    assert (fc1.weight.tensor_model_parallel, fc1.weight.partition_dim) == (True, 0)
    assert (fc1.bias.tensor_model_parallel, fc1.bias.partition_dim) == (True, 0)
    assert (fc2.weight.tensor_model_parallel, fc2.weight.partition_dim) == (True, 1)
    assert not hasattr(fc2.bias, "tensor_model_parallel")  # replicated on every rank
    assert fc1.weight.partition_stride == 1 and fc2.weight.partition_stride == 1
    assert all(p.allreduce for p in (fc1.weight, fc1.bias, fc2.weight, fc2.bias))
    assert fc2.bias.sequence_parallel
    assert fc1.weight.shape == (FFN // 2, HIDDEN) and fc1.bias.shape == (FFN // 2,)
    assert fc2.weight.shape == (HIDDEN, FFN // 2) and fc2.bias.shape == (HIDDEN,)
    fc1.backward_dw()
    fc2.backward_dw()


def _check_stride(rank, tp_group, solo_group):
    # A gated fc1 stores [gate; linear]; with stride 2 each rank keeps [gate_i; linear_i].
    def build(group, tp):
        torch.manual_seed(7)
        return ColumnParallelLinear(
            HIDDEN,
            2 * FFN,
            config=_config(tp),
            init_method=_init,
            stride=2,
            keep_master_weight_for_test=True,
            tp_group=group,
        )

    split, full = build(tp_group, 2), build(solo_group, 1)
    gate, linear = full.weight.chunk(2, dim=0)
    expected = torch.cat([gate.chunk(2, dim=0)[rank], linear.chunk(2, dim=0)[rank]])
    torch.testing.assert_close(split.weight, expected, rtol=0, atol=0)
    torch.testing.assert_close(split.master_weight, full.weight, rtol=0, atol=0)
    assert split.weight.partition_stride == 2


def _check_group_resolution(rank):
    # TP=2 dense, experts ETP=1 x EP=2: the expert layers take the one-rank expert-TP group.
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    )
    config = _config(2, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    collection = ProcessGroupCollection.use_mpu_process_groups()

    dense = ColumnParallelLinear(
        HIDDEN, FFN, config=config, init_method=_init, pg_collection=collection
    )
    assert dense.tp_group is collection.tp and dense.weight.shape == (FFN // 2, HIDDEN)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # parallel_state fallback
        expert = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=_init, is_expert=True)
    assert expert.tp_group is ps.get_expert_tensor_parallel_group()
    assert expert.weight.shape == (FFN, HIDDEN)
    # Expert weights are distinct per EP rank, so data-parallel grad all-reduce must skip them.
    assert expert.weight.allreduce is False
    # The token dispatcher communicates for experts: the layer itself is a plain linear.
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    out, _ = expert(x)
    torch.testing.assert_close(out, F.linear(x, expert.weight, expert.bias))

    with pytest.raises(ValueError, match="skip_bias_add=True"):
        RowParallelLinear(
            FFN,
            HIDDEN,
            config=config,
            init_method=_init,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            is_expert=True,
            pg_collection=collection,
        )
    with pytest.raises(ValueError, match="pg_collection.expt_tp"):
        ColumnParallelLinear(
            HIDDEN,
            FFN,
            config=config,
            init_method=_init,
            is_expert=True,
            pg_collection=ProcessGroupCollection(tp=collection.tp),
        )
    ps.destroy_model_parallel()


def _tensor_parallel_worker(rank, world_size):
    tp_group = torch.distributed.new_group([0, 1])
    # new_group is collective: every rank creates both one-rank groups and keeps its own.
    solo_group = [torch.distributed.new_group([r]) for r in range(world_size)][rank]

    for sequence_parallel in (False, True):
        for skip_bias_add in (False, True):
            _check_variant(
                rank,
                tp_group,
                solo_group,
                sequence_parallel=sequence_parallel,
                skip_bias_add=skip_bias_add,
                gather_output=False,
            )
    # fc1 gathers its output, fc2 splits it again.
    _check_variant(
        rank, tp_group, solo_group, sequence_parallel=False, skip_bias_add=False, gather_output=True
    )
    _check_attributes(rank, tp_group)
    _check_stride(rank, tp_group, solo_group)
    _check_group_resolution(rank)


def test_tensor_parallel_pair_matches_single_device():
    run_distributed(_tensor_parallel_worker, world_size=2, timeout_s=120)


# ------------------------------------------------------------------------ single process


def test_single_device_without_distributed(monkeypatch):
    # Outside a distributed job the layers are plain linears.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    config = _config(1)
    fc1 = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=_init, skip_bias_add=True)
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    out, bias = fc1(x)
    assert fc1.tp_group is None and fc1.tp_size == 1
    assert bias is fc1.bias
    torch.testing.assert_close(out, F.linear(x, fc1.weight))


def test_cpu_init_is_seeded_by_the_default_generator(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    builds = []
    for _ in range(2):
        torch.manual_seed(5)
        builds.append(
            ColumnParallelLinear(
                HIDDEN, FFN, config=_config(1), init_method=_init, keep_master_weight_for_test=True
            )
        )
    torch.testing.assert_close(builds[0].weight, builds[1].weight, rtol=0, atol=0)
    torch.testing.assert_close(builds[0].master_weight, builds[0].weight, rtol=0, atol=0)
    assert torch.count_nonzero(builds[0].bias) == 0


def test_skip_weight_param_allocation(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    fc1 = ColumnParallelLinear(
        HIDDEN, FFN, config=_config(1), init_method=_init, skip_weight_param_allocation=True
    )
    assert fc1.weight is None
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="pass weight="):
        fc1(x)
    with pytest.raises(RuntimeError, match="expected"):
        fc1(x, weight=torch.zeros(FFN, HIDDEN + 1, dtype=torch.float64))
    weight = torch.randn(FFN, HIDDEN, dtype=torch.float64)
    out, _ = fc1(x, weight=weight)
    torch.testing.assert_close(out, F.linear(x, weight, fc1.bias))


def test_configuration_errors(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="gradient_accumulation_fusion=False"):
        ColumnParallelLinear(
            HIDDEN, FFN, config=_config(1, gradient_accumulation_fusion=True), init_method=_init
        )
    with pytest.raises(ValueError, match=r"output_size \(7\) must be divisible .* stride \(2\)"):
        ColumnParallelLinear(HIDDEN, 7, config=_config(1), init_method=_init, stride=2)


@pytest.mark.gpu
def test_gpu_init_needs_the_model_parallel_rng_stream(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    config = ModelParallelConfig(params_dtype=torch.float32)
    initialize_rng_tracker(force_reset=True)
    with pytest.raises(Exception, match="cuda rng state model-parallel-rng is not added"):
        ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=_init)
    model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    layer = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=_init)
    assert layer.weight.is_cuda
    # The weight came from the model-parallel stream (seed + 2718 for TP rank 0).
    model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    expected = torch.empty(FFN, HIDDEN, device="cuda")
    with get_cuda_rng_tracker().fork():
        _init(expected)
    torch.testing.assert_close(layer.weight, expected, rtol=0, atol=0)


def _two_gpu_worker(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_group = ps.get_tensor_model_parallel_group()
    solo_group = [torch.distributed.new_group([r]) for r in range(world_size)][rank]
    for sequence_parallel in (False, True):
        _check_variant(
            rank,
            tp_group,
            solo_group,
            sequence_parallel=sequence_parallel,
            skip_bias_add=sequence_parallel,
            gather_output=False,
            device="cuda",
        )
    _check_variant(
        rank,
        tp_group,
        solo_group,
        sequence_parallel=False,
        skip_bias_add=False,
        gather_output=True,
        device="cuda",
    )


@pytest.mark.multigpu
def test_tensor_parallel_pair_on_two_gpus():
    """The TP=2 pair on NCCL equals one device.

    Under plain pytest it spawns one rank per GPU; under ``torchrun --nproc-per-node 2`` it runs
    on the launched ranks.
    """
    run_distributed(_two_gpu_worker, world_size=2, timeout_s=300, backend="nccl")
