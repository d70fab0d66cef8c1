"""Helpers of the tensor- and expert-parallel tests: full weights, sharding, gathering, checking.

Every parallel test follows one recipe:

1. draw the FULL weights of the layer (float64, same seed on every rank);
2. give each rank its shard (:func:`shard`) and run forward and backward on the parallel layer;
3. gather the outputs, input gradients and parameter gradients of all ranks
   (:func:`gather_objects`; every rank sees every rank's tensors) and rebuild full tensors
   (:func:`unshard`);
4. compare them with a float64 single-process model on the full weights, written out with
   ``ActivationSpec.reference`` (fc1 -> activation -> fc2), by the dtype's tolerance from
   ``tests.unit_tests.tolerances``.

Shard layouts (the ones the fork's linears use):

- ``ROWS_GLU``: a gated fc1 (column parallel, ``stride=2``) holds ``[gate; linear]``; rank ``r``
  keeps ``[gate_r; linear_r]``, the r-th slice of each half (weight rows and bias alike);
- ``ROWS``: a non-gated column-parallel weight, rank ``r`` keeps rows slice ``r``;
- ``COLS``: a row-parallel fc2 weight, rank ``r`` keeps columns slice ``r``;
- ``REPLICATED``: every rank holds the whole tensor (fc2 bias, the shared-expert gate).

Layouts (:class:`Layout`) name a world's TP / EP / expert-TP split; a test's cases carry their
layout's name first, and :func:`run_cases` spawns one world per world size (2 and 4 gloo ranks
on CPU, 2, 4 and 8 NCCL ranks on GPUs) and rebuilds ``parallel_state`` once per layout. The
world sizes become pytest parameters (:func:`gloo_world_params`, :func:`nccl_world_params`):
an NCCL world skips with fewer GPUs than ranks, the 4-rank gloo world is opt-in (``ranks4``).

Each case runs inside ``case_result``, which turns an exception into a traceback string, so one
broken case does not hide the others of the same spawned world: :func:`report_all` lists every
failed case with its rank's traceback.
"""

from __future__ import annotations

import functools
import traceback
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import megatron.core.parallel_state as ps
from mcore_activations.reference_mlp import reference_mlp as mlp_reference
from tests.unit_tests.activation_catalog import CONFIGS, NEEDS_MOE
from tests.unit_tests.test_utilities import _launched_world_size, run_distributed, to_cpu
from tests.unit_tests.tolerances import assert_close_to_reference, max_rel_error
from tests.unit_tests.transformer.mlp_test_utils import PRE_ACTIVATION_STD, assert_clamps_active

# The activations of issue 14: SwiGLU, DeepSeek-V4 clamped SwiGLU, Kimi-K3 SiTU-GLU (both
# scales) and gpt-oss quick-GEGLU (clamp and linear offset).
ENTRIES = ["swiglu", "swiglu_clamp", "situ_glu", "quick_geglu_gpt_oss"]

DTYPE = torch.float32  # layers run in fp32; the reference in float64

ROWS_GLU, ROWS, COLS, REPLICATED = "rows_glu", "rows", "cols", "replicated"

_FC1_BIAS_STD = 0.5
_FC2_BIAS_STD = 0.5
_GATE_STD = 0.5


def seed_of(case_id: str) -> int:
    """A stable per-case seed (Python's ``hash`` of a str differs between processes)."""
    return zlib.crc32(case_id.encode())


def activation_kwargs(entry: str) -> dict:
    """TransformerConfig kwargs of catalogue ``entry`` (plus ``num_moe_experts`` if it needs it)."""
    kwargs = dict(CONFIGS[entry])
    if entry in NEEDS_MOE:
        kwargs["num_moe_experts"] = 4  # config rule: the SwiGLU clamp is MoE-only
    return kwargs


def quiet(factory: Callable, *args, **kwargs):
    """Calls ``factory`` with warnings (parallel_state fallbacks, config defaults) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return factory(*args, **kwargs)


# ------------------------------------------------------------------------- parallel layouts


@dataclass(frozen=True)
class Layout:
    """One way of splitting a world: dense TP size, expert EP and expert-TP sizes.

    The dense layers are data parallel over ``world / tp`` replicas (each replica gets its own
    input, the weights are the same); every layout here has one expert-data-parallel replica
    (``ep * etp == world``), so the experts of one world hold one model.
    """

    name: str
    world: int
    tp: int
    ep: int
    etp: int

    def __post_init__(self):
        assert self.world % self.tp == 0 and self.ep * self.etp == self.world, self


# World size 2 (the CPU tier and the 2-GPU tier).
TP2 = Layout("tp2", world=2, tp=2, ep=1, etp=2)
EP2 = Layout("ep2", world=2, tp=1, ep=2, etp=1)
ETP2 = Layout("etp2", world=2, tp=1, ep=1, etp=2)
# World size 4. "tp4": the experts take the dense split too (ETP=4, upstream's default).
TP4 = Layout("tp4", world=4, tp=4, ep=1, etp=4)
EP4 = Layout("ep4", world=4, tp=1, ep=4, etp=1)
TP2XEP2 = Layout("tp2xep2", world=4, tp=2, ep=2, etp=2)  # 2 dense replicas; experts 2 x 2
# World size 8: EP=8 with expert-TP=1; the dense layers at TP=2 in 4 replicas (MoE "parallel
# folding": the experts' split is independent of the dense one).
TP2XEP8 = Layout("tp2xep8", world=8, tp=2, ep=8, etp=1)

LAYOUTS = {layout.name: layout for layout in (TP2, EP2, ETP2, TP4, EP4, TP2XEP2, TP2XEP8)}

# World sizes of the spawned tests. gloo (CPU) stops at 4 ranks: 8 CPU processes are too many
# for the CI machines; 4 are opt-in (marker ``ranks4``, see conftest.py).
GLOO_WORLDS = (2, 4)
NCCL_WORLDS = (2, 4, 8)


def world_id(world_size: int) -> str:
    """The pytest id of a world size (``-k 4ranks`` selects the 4-rank worlds)."""
    return f"{world_size}ranks"


def gloo_world_params() -> list:
    """``world_size`` parameters of a gloo test: 2 ranks by default, 4 behind ``ranks4``."""
    return [
        pytest.param(n, id=world_id(n), marks=[pytest.mark.ranks4] if n > 2 else [])
        for n in GLOO_WORLDS
    ]


def nccl_world_params() -> list:
    """``world_size`` parameters of an NCCL test, each skipped below ``n`` visible GPUs."""
    return [
        pytest.param(n, id=world_id(n), marks=pytest.mark.multigpu(num_gpus=n)) for n in NCCL_WORLDS
    ]


def init_layout(layout: Layout, device: str) -> None:
    """(Re)builds ``parallel_state``'s groups for ``layout`` on the running world."""
    assert torch.distributed.get_world_size() == layout.world, (layout, "world size")
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    if device == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)


# ------------------------------------------------------------------------------ full weights


def full_mlp_weights(
    generator: torch.Generator,
    *,
    hidden: int,
    ffn: int,
    gated: bool,
    bias: bool,
    gate: bool = False,
    prefix: str = "",
) -> dict:
    """Float64 full weights of one MLP, named as the layer names them (after ``prefix``).

    fc1 is scaled so that unit-variance inputs give pre-activations of std
    ``PRE_ACTIVATION_STD``: far beyond the catalogue's clamps, so every clamp is hit.
    """
    rows = 2 * ffn if gated else ffn
    weights = {
        f"{prefix}linear_fc1.weight": torch.randn(
            rows, hidden, generator=generator, dtype=torch.float64
        )
        * (PRE_ACTIVATION_STD / hidden**0.5),
        f"{prefix}linear_fc2.weight": torch.randn(
            hidden, ffn, generator=generator, dtype=torch.float64
        )
        / ffn**0.5,
    }
    if bias:
        weights[f"{prefix}linear_fc1.bias"] = (
            torch.randn(rows, generator=generator, dtype=torch.float64) * _FC1_BIAS_STD
        )
        weights[f"{prefix}linear_fc2.bias"] = (
            torch.randn(hidden, generator=generator, dtype=torch.float64) * _FC2_BIAS_STD
        )
    if gate:
        weights[f"{prefix}gate_weight"] = torch.randn(
            1, hidden, generator=generator, dtype=torch.float64
        ) * (_GATE_STD / hidden**0.5)
    return weights


def mlp_layout(name: str, gated: bool) -> str:
    """Shard layout of an MLP parameter (a name ending in ``linear_fc1.weight`` etc.)."""
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return ROWS_GLU if gated else ROWS
    if name.endswith("linear_fc2.weight"):
        return COLS
    if name.endswith(("linear_fc2.bias", "gate_weight")):
        return REPLICATED
    raise KeyError(f"no shard layout for parameter {name!r}")


def shard(full: torch.Tensor, layout: str, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` under ``layout`` (see the module docstring)."""
    if size == 1 or layout == REPLICATED:
        return full
    if layout == ROWS_GLU:
        return torch.cat([half.chunk(size, dim=0)[rank] for half in full.chunk(2, dim=0)])
    if layout == ROWS:
        return full.chunk(size, dim=0)[rank]
    if layout == COLS:
        return full.chunk(size, dim=1)[rank]
    raise ValueError(layout)


def unshard(parts: list, layout: str) -> torch.Tensor:
    """The full tensor from every rank's part (inverse of :func:`shard`).

    ``REPLICATED`` parts must all be equal (checked by the caller); the first is returned.
    """
    if len(parts) == 1 or layout == REPLICATED:
        return parts[0]
    if layout == ROWS_GLU:
        halves = [part.chunk(2, dim=0) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if layout == ROWS:
        return torch.cat(parts, dim=0)
    if layout == COLS:
        return torch.cat(parts, dim=1)
    raise ValueError(layout)


def load_(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copies ``value`` into ``param`` (shape-checked, in the parameter's dtype and device)."""
    assert param.shape == value.shape, f"shape {tuple(param.shape)} != {tuple(value.shape)}"
    with torch.no_grad():
        param.copy_(value.to(device=param.device, dtype=param.dtype))


def real_parameters(module: torch.nn.Module) -> dict:
    """``name -> parameter``, without the empty tensors TE registers for a disabled bias."""
    return {name: p for name, p in module.named_parameters() if p.numel() > 0}


# -------------------------------------------------------------------------- gather and check


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (tensors moved to the CPU first), in rank order, on every rank."""
    obj = to_cpu(obj)
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def reference_mlp(
    params: dict,
    x: torch.Tensor,
    spec,
    *,
    probs: Optional[torch.Tensor] = None,
    prefix: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``[gate *] (fc2(act(fc1(x))) [+ b2]) [* probs]`` on full weights.

    Returns ``(output, fc1 pre-activation incl. bias)``.
    """
    w1, w2 = params[f"{prefix}linear_fc1.weight"], params[f"{prefix}linear_fc2.weight"]
    b1, b2 = params.get(f"{prefix}linear_fc1.bias"), params.get(f"{prefix}linear_fc2.bias")
    out = mlp_reference(x, w1, w2, spec, fc1_bias=b1, fc2_bias=b2, probs=probs)
    gate_weight = params.get(f"{prefix}gate_weight")
    if gate_weight is not None:
        out = out * torch.sigmoid(x @ gate_weight.T)
    pre = x @ w1.T
    return out, (pre + b1 if b1 is not None else pre)


class Checker:
    """Compares gathered results with float64 references; records the worst relative errors."""

    def __init__(self, label: str):
        self.label = label
        self.errors: dict = {}

    def __call__(self, name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        what = f"{self.label}: {name}"
        assert_close_to_reference(got, ref, DTYPE, what)
        self.errors[name] = max(self.errors.get(name, 0.0), max_rel_error(got, ref))

    def replicas(self, name: str, copies: list, ref: torch.Tensor) -> None:
        """Every rank's copy of a replicated result must match the reference."""
        for rank, copy in enumerate(copies):
            self(f"{name} (rank {rank})", copy, ref)

    def clamps(self, spec, pre: torch.Tensor) -> None:
        try:
            assert_clamps_active(spec, pre)
        except AssertionError as error:
            raise AssertionError(f"{self.label}: {error}") from None

    def worst(self) -> float:
        return max(self.errors.values(), default=0.0)


def case_result(run: Callable[[], Optional[dict]]) -> dict:
    """``{"error": traceback or None, "skip": reason or None, ...}`` of one case's ``run``.

    ``run`` returns a dict of extra fields (e.g. the worst error) or raises; a
    ``SkipCase`` exception marks a configuration the layer refuses by design.
    """
    try:
        fields = run() or {}
    except SkipCase as skip:
        return {"error": None, "skip": str(skip)}
    except Exception:  # noqa: BLE001 - reported through the test of this case
        return {"error": traceback.format_exc(), "skip": None}
    return {"error": None, "skip": None, **fields}


def merge_rank_results(per_rank: list) -> dict:
    """One ``case -> result`` dict from every rank's: a case fails if it failed on any rank."""
    merged = {}
    for rank, results in enumerate(per_rank):
        for case, result in results.items():
            current = merged.setdefault(case, dict(result))
            if result["error"] is not None and current.get("error_rank") is None:
                current["error"] = f"rank {rank}:\n{result['error']}"
                current["error_rank"] = rank
    return merged


class SkipCase(Exception):
    """A case the layer refuses by design on this installation (e.g. a TE version gate)."""


def report_all(results: Optional[dict], case_ids: list) -> None:
    """Prints every case's worst error; fails listing every failed case (skips if all skipped).

    One pytest test covers all cases of a spawned world: under pytest-xdist a module-scoped
    fixture would spawn the world once per xdist worker, so the cases are not separate tests.
    """
    assert results is not None, "the distributed run returned no results"
    missing = [case for case in case_ids if case not in results]
    assert not missing, f"cases that did not run: {missing}"
    failed, skipped = [], []
    for case in case_ids:
        result = results[case]
        if result["error"] is not None:
            failed.append(f"--- {case}\n{result['error']}")
            status = "FAILED"
        elif result.get("skip"):
            skipped.append(case)
            status = f"skipped: {result['skip']}"
        else:
            status = f"ok, max rel err {result['worst']:.2e}"
        print(f"{case}: {status}")
    if failed:
        pytest.fail(
            f"{len(failed)} of {len(case_ids)} cases failed:\n" + "\n".join(failed), pytrace=False
        )
    if len(skipped) == len(case_ids):
        pytest.skip(f"every case skipped: {results[case_ids[0]]['skip']}")


def _run_world(
    rank: int,
    world_size: int,
    cases: list,
    device: str,
    case_id: Callable,
    compute: Callable,
    check: Callable,
) -> dict:
    """One rank's part of :func:`run_cases`: every case, its layout's groups built first.

    ``compute(case, device)`` returns this rank's fields (``tensors`` and its coordinates);
    ``check(case, per_rank)`` compares every rank's fields with the reference. Each case's
    check runs on every rank; the merged result reports a failure on any rank.
    """
    results, current = {}, None
    for case in cases:
        layout = LAYOUTS[case[0]]
        if layout != current:  # cases come grouped by layout: one set of groups per layout
            init_layout(layout, device)
            current = layout
        local = case_result(functools.partial(compute, case, device))
        # Always gathered, also after an error on this rank, so the ranks stay in step.
        per_rank = gather_objects(local)
        failed = [r for r in per_rank if r["error"] is not None or r["skip"]]
        if failed:
            results[case_id(case)] = failed[0]
        else:
            results[case_id(case)] = case_result(functools.partial(check, case, per_rank))
    return merge_rank_results(gather_objects(results))


def run_cases(
    cases: list,
    world_size: int,
    backend: str,
    *,
    case_id: Callable,
    compute: Callable,
    check: Callable,
) -> None:
    """Runs ``cases`` (layout name first) on a spawned ``world_size`` world; reports each.

    gloo runs on the CPU; nccl on one GPU per rank, with more time (the first fused case of each
    world compiles its kernels). ``compute`` and ``check`` must be module-level functions (they
    are pickled into the spawned ranks); see :func:`_run_world`.
    """
    assert cases and all(LAYOUTS[case[0]].world == world_size for case in cases), world_size
    launched = _launched_world_size()
    if backend == "nccl" and launched is not None and launched != world_size:
        # Every launched rank would spawn its own world on the same GPUs.
        pytest.skip(
            f"needs a {world_size}-rank world; this process is one of {launched} torchrun "
            f"ranks: run it without torchrun (it spawns one rank per GPU) or with "
            f"--nproc-per-node {world_size}"
        )
    device = "cpu" if backend == "gloo" else "cuda"
    results = run_distributed(
        _run_world,
        world_size=world_size,
        args=(cases, device, case_id, compute, check),
        # gloo: the ranks share the CPU cores, so a larger world takes longer.
        timeout_s=240 * world_size // 2 if backend == "gloo" else 500,
        backend=backend,
    )
    report_all(results, [case_id(case) for case in cases])
