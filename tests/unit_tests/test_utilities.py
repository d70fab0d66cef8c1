"""Test helpers: the ``Utils`` distributed setup and a multi-process runner.

``Utils`` works in three settings:

- under ``torchrun`` (``WORLD_SIZE`` / ``RANK`` set): a TCP rendezvous at ``MASTER_ADDR`` /
  ``MASTER_PORT``, NCCL with CUDA, gloo without;
- a plain ``pytest`` on a CPU-only machine: a one-process gloo world on an in-process store (no
  port, so parallel pytest workers cannot collide);
- a plain ``pytest`` on a GPU machine: the same one-process world on NCCL.

``run_distributed`` starts a small world from inside a test and returns rank 0's result: gloo
processes on the CPU, or one NCCL process per GPU (see its docstring).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch

import megatron.core.parallel_state as ps
from megatron.core import jit

# As conftest.py does for the pytest process, and for the same reason (no Inductor compile of
# every activation on a 2-core CI machine): ranks spawned by run_distributed import this module
# before the worker's module, so the decorator is a no-op for everything they import later.
if os.environ.get("MEGATRON_TEST_JIT", "0") != "1":
    jit.disable_jit_fuser()

_NVTE_ATTENTION_ENV_VARS = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def _barrier():
    # Naming the device avoids NCCL guessing it (and warning). Binding it at init instead
    # (device_id=) would make NCCL create every later group's communicator eagerly: slow.
    if torch.distributed.get_backend() == "nccl":
        torch.distributed.barrier(device_ids=[torch.cuda.current_device()])
    else:
        torch.distributed.barrier()


class TestModel(torch.nn.Module):
    """A stack of ``torch.nn.Linear`` layers for data-parallel and checkpoint tests."""

    __test__ = False  # a helper, not a pytest test class

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        num_layers: int,
        bias: bool,
        shared_embedding: bool = False,
    ):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(input_dim, output_dim, bias) for _ in range(num_layers)]
        )
        if shared_embedding:
            self.layers[0].weight.shared_embedding = True
            self.layers[-1].weight.shared_embedding = True


def _live_groups() -> set:
    if not torch.distributed.is_initialized():
        return set()
    return set(torch.distributed.distributed_c10d._world.pg_map)


def _parallel_state_groups() -> set:
    """The groups ``parallel_state`` made (its group table and the groups of create_group)."""
    from megatron.core import parallel_state_groups, parallel_state_store

    return set(parallel_state_store.GROUPS.values()) | set(parallel_state_groups._CREATED_GROUPS)


def _destroy_gloo_groups_since(before, made) -> None:
    """Destroys the gloo groups in ``made`` created since ``before`` (a :func:`_live_groups`
    snapshot).

    ``parallel_state.destroy_model_parallel`` only forgets its groups, as upstream's does; torch
    keeps them, and each gloo group keeps its threads (about 20 per one-rank set-up), which
    spin. Tests that set up and tear down hundreds of times would pile up thousands. Only the
    groups parallel_state made go (a test's own groups stay), and NCCL groups are left alone:
    destroying them is the ranks' joint business.
    """
    if before is None or not torch.distributed.is_initialized():
        return
    for group in (_live_groups() - before) & made:
        if torch.distributed.get_backend(group) == "gloo":
            torch.distributed.destroy_process_group(group)


class Utils:
    """Process-wide distributed setup shared by the tests."""

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    inited = False
    store = None
    _groups_before = None  # the process groups alive before initialize_model_parallel

    @staticmethod
    def clear_nvte_env_vars():
        """Removes the TE attention-backend selectors a test may have set."""
        for name in _NVTE_ATTENTION_ENV_VARS:
            os.environ.pop(name, None)

    @staticmethod
    def initialize_distributed():
        """Starts the default process group, unless it runs or this rank sits out (rank < 0)."""
        if torch.distributed.is_initialized() or Utils.rank < 0:
            return
        Utils.clear_nvte_env_vars()
        print(f"Initializing torch.distributed: rank {Utils.rank}, world_size {Utils.world_size}")

        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(Utils.local_rank % torch.cuda.device_count())

        launched = "WORLD_SIZE" in os.environ or "RANK" in os.environ
        if launched or Utils.world_size > 1:
            if Utils.store is None:
                # torchrun's agent already serves a store at MASTER_PORT; join it as a client.
                agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                Utils.store = torch.distributed.TCPStore(
                    host_name=os.environ.get("MASTER_ADDR", "localhost"),
                    port=int(os.environ.get("MASTER_PORT", "29500")),
                    world_size=Utils.world_size,
                    is_master=Utils.rank == 0 and not agent_store,
                    timeout=timedelta(minutes=1),
                )
            store = torch.distributed.PrefixStore("default_pg", Utils.store)
        else:
            # One process needs no rendezvous; an in-process store avoids picking a port.
            Utils.store = torch.distributed.HashStore()
            store = Utils.store

        torch.distributed.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            world_size=Utils.world_size,
            rank=Utils.rank,
            store=store,
        )
        _barrier()
        Utils.inited = True

    @staticmethod
    def set_world_size(world_size: Optional[int] = None, rank: Optional[int] = None):
        """Changes the world the next ``initialize_distributed`` creates.

        Ranks at or beyond ``world_size`` get rank -1 and sit out. The default world size is the
        launcher's ``WORLD_SIZE`` (1 without a launcher).
        """
        Utils.world_size = (
            int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        )
        if (
            torch.distributed.is_initialized()
            and Utils.world_size != torch.distributed.get_world_size()
        ):
            torch.distributed.destroy_process_group()
        if rank is None:
            Utils.rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
            if Utils.rank >= Utils.world_size:
                Utils.rank = -1
        else:
            Utils.rank = rank

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: Optional[int] = None,
        **kwargs,
    ):
        """(Re)initializes ``parallel_state`` on a fresh or running default group."""
        Utils.clear_nvte_env_vars()
        Utils.destroy_model_parallel()
        ps.destroy_model_parallel()  # also what a test set up through parallel_state directly
        Utils.initialize_distributed()
        Utils._groups_before = _live_groups()
        ps.initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size,
            **kwargs,
        )
        Utils.inited = True

    @staticmethod
    def fake_initialize_model_parallel(
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: Optional[int] = None,
        expert_model_parallel_size: int = 1,
    ):
        """Sets sizes and ranks through ``parallel_state``'s overrides, creating no groups.

        Ranks follow the default ``tp-cp-ep-dp-pp`` layout for this process's ``Utils.rank``.
        """
        rank = max(Utils.rank, 0)
        tp, pp, ep = (
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            expert_model_parallel_size,
        )
        ranks_per_stage = max(Utils.world_size // pp, 1)
        ps.set_tensor_model_parallel_world_size(tp)
        ps.set_tensor_model_parallel_rank(rank % tp)
        ps.set_pipeline_model_parallel_world_size(pp)
        ps.set_pipeline_model_parallel_rank(rank // ranks_per_stage)
        ps.set_virtual_pipeline_model_parallel_world_size(virtual_pipeline_model_parallel_size)
        ps.set_expert_model_parallel_world_size(ep)
        ps.set_expert_model_parallel_rank((rank // tp) % ep)
        ps.set_expert_tensor_parallel_world_size(tp)
        ps.set_expert_tensor_parallel_rank(rank % tp)
        Utils.inited = True

    @staticmethod
    def destroy_model_parallel():
        """Forgets ``parallel_state``'s groups; the default process group stays up."""
        Utils.clear_nvte_env_vars()
        if not Utils.inited:
            return
        if torch.distributed.is_initialized():
            try:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                _barrier()
            except Exception:  # noqa: BLE001 - a broken group must not block the reset below
                pass
        # Local bookkeeping only, so it is safe even when the barrier failed.
        made = _parallel_state_groups()
        ps.destroy_model_parallel()
        _destroy_gloo_groups_since(Utils._groups_before, made)
        Utils._groups_before = None
        Utils.inited = False
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------- multi-process runs

_RESULT_FILE = "rank0_result.pt"


def _distributed_entry(rank: int, worker: Callable, world_size: int, backend: str, tmp: str, args):
    # One intra-op thread per process: the ranks share the machine's cores.
    torch.set_num_threads(1)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        backend,
        init_method=f"file://{os.path.join(tmp, 'rendezvous')}",
        rank=rank,
        world_size=world_size,
    )
    try:
        result = worker(rank, world_size, *args)
        # No rank tears its groups down while another may still be using or connecting them: a
        # fast rank leaving new_group() early and destroying the world made a slow peer's gloo
        # connect fail ("Connection closed by peer") on the 2-core CI machine.
        torch.distributed.barrier()
        if rank == 0:
            # torch.save pickles: any picklable result comes back, tensors moved to the CPU.
            torch.save(to_cpu(result), os.path.join(tmp, _RESULT_FILE))
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def to_cpu(value):
    """``value`` with every tensor in it (also in dicts, lists, tuples) detached onto the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_cpu(item) for item in value)
    return value


def _launched_world_size() -> Optional[int]:
    """The world size of a ``torchrun`` launch around this process, else None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["WORLD_SIZE"])


def run_distributed(
    worker: Callable,
    world_size: int = 2,
    args: Sequence = (),
    timeout_s: float = 120.0,
    backend: str = "gloo",
) -> Any:
    """Runs ``worker(rank, world_size, *args)`` on ``world_size`` ranks; returns rank 0's result.

    ``backend="gloo"`` spawns ``world_size`` fresh CPU processes. ``backend="nccl"`` spawns one
    process per GPU (rank i on ``cuda:i``); under a ``torchrun`` launch of exactly
    ``world_size`` ranks it instead runs ``worker`` in this process, on the launched world, and
    returns this rank's result. ``NCCL_NVLS_ENABLE=0`` is always set (NVLink SHARP multicast is
    unavailable or unsafe on the test machines).

    The default process group is up when ``worker`` starts; ``parallel_state`` is not. The
    worker must be a module-level function (it is pickled into spawned processes), and its
    result must be picklable (``torch.save``; tensors come back on the CPU). An exception in
    any rank fails the caller with that rank's traceback; a run longer than ``timeout_s``
    kills every rank and raises ``TimeoutError``, so a hung collective fails instead of
    blocking CI.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited by the spawned ranks
    if backend == "nccl":
        if _launched_world_size() == world_size:
            return _run_in_launched_world(worker, world_size, args)
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available < world_size:
            raise RuntimeError(f"backend='nccl' needs {world_size} GPUs, found {available}")
    with tempfile.TemporaryDirectory() as tmp:
        context = torch.multiprocessing.start_processes(
            _distributed_entry,
            args=(worker, world_size, backend, tmp, tuple(args)),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{getattr(worker, '__name__', worker)} did not finish within "
                        f"{timeout_s} s on {world_size} ranks"
                    )
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        result_file = os.path.join(tmp, _RESULT_FILE)
        if not os.path.exists(result_file):
            return None
        return torch.load(result_file, weights_only=False)


def _run_in_launched_world(worker: Callable, world_size: int, args: Sequence) -> Any:
    # Under torchrun every rank runs the same test; they meet in the launched default group.
    Utils.set_world_size(world_size)
    Utils.initialize_distributed()
    ps.destroy_model_parallel()
    try:
        return worker(torch.distributed.get_rank(), world_size, *args)
    finally:
        ps.destroy_model_parallel()
        _barrier()


def _has_sm100() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)


# TE's grouped-MLP op-fuser kernels (CuTe DSL), MXFP8 and NVFP4 exist only on SM100 (B200/B300):
# on an H100/H200 those paths are checked for structure on CPU and for their refusal, not run.
needs_sm100 = pytest.mark.skipif(
    not _has_sm100(), reason="needs an SM100 GPU (B200/B300) for TE's grouped op-fuser kernels"
)
