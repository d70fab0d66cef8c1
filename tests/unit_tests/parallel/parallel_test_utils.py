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

Each case runs inside ``case_result``, which turns an exception into a traceback string, so one
broken case does not hide the others of the same spawned world: :func:`report_all` lists every
failed case with its rank's traceback.
"""

from __future__ import annotations

import traceback
import warnings
import zlib
from collections.abc import Callable
from typing import Optional

import torch

from tests.unit_tests.activation_catalog import CONFIGS, NEEDS_MOE
from tests.unit_tests.test_utilities import run_distributed, to_cpu
from tests.unit_tests.tolerances import assert_close_to_reference, max_rel_error
from tests.unit_tests.transformer.mlp_test_utils import PRE_ACTIVATION_STD, assert_clamps_active

# The activations of issue 14: SwiGLU, DeepSeek-V4 clamped SwiGLU, Kimi-K3 SiTU-GLU (both
# scales) and gpt-oss quick-GEGLU (clamp and linear offset).
ENTRIES = ["swiglu", "swiglu_clamp", "situ_glu", "quick_geglu_gpt_oss"]

DTYPE = torch.float32  # layers run in fp32; the reference in float64
TP = 2

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
    pre = x @ w1.T
    act = spec.reference(pre, bias=b1, probs=probs)
    out = act @ w2.T
    if b2 is not None:
        out = out + (b2 * probs.unsqueeze(-1) if probs is not None else b2)
    gate_weight = params.get(f"{prefix}gate_weight")
    if gate_weight is not None:
        out = out * torch.sigmoid(x @ gate_weight.T)
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
    import pytest

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


def run_cases(worker: Callable, world_size: int, cases: list, case_ids: list, backend: str):
    """Runs ``worker(rank, world_size, cases, device)`` on a spawned world; reports every case.

    gloo runs on the CPU; nccl on one GPU per rank, with more time (the first fused case of each
    world compiles its kernels).
    """
    device = "cpu" if backend == "gloo" else "cuda"
    results = run_distributed(
        worker,
        world_size=world_size,
        args=(cases, device),
        timeout_s=240 if backend == "gloo" else 500,
        backend=backend,
    )
    report_all(results, case_ids)
