"""Shared pytest setup: NCCL defaults, hardware-based skips and process-group cleanup."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter (on CPU tensors), so the CPU tier
# tests the same kernel code the GPU runs. Must be set before the kernels are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megatron.core import jit  # noqa: E402

# Tests run megatron's @jit_fuser functions eagerly unless MEGATRON_TEST_JIT=1: on a 2-core CI
# machine, compiling every activation for every dtype and shape would dominate the run. Compiled
# code is still tested, explicitly: the use_compile axes (`use_compiled_kernels(True)`) and the
# compile-safety scenarios, which start fresh interpreters with the default (compiling) jit_fuser.
# This runs before any test module imports the decorated functions.
if os.environ.get("MEGATRON_TEST_JIT", "0") != "1":
    jit.disable_jit_fuser()


def pytest_configure(config):
    # One NCCL channel keeps small test collectives cheap; NVLink SHARP (NVLS) multicast is
    # unavailable or unsafe on the shared test machines. Users can still override both.
    os.environ.setdefault("NCCL_MAX_NCHANNELS", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def pytest_collection_modifyitems(config, items):
    """Skips tests whose hardware or Transformer Engine is missing.

    - ``gpu``: needs CUDA.
    - ``multigpu``: needs at least two GPUs, or ``@pytest.mark.multigpu(num_gpus=N)``.
    - ``te``: needs Transformer Engine's PyTorch API to import.
    """
    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    have_te = None  # importing TE is slow: only check when some test asks for it

    for item in items:
        if item.get_closest_marker("gpu") is not None and gpu_count == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        multigpu = item.get_closest_marker("multigpu")
        if multigpu is not None:
            needed = multigpu.kwargs.get("num_gpus", 2)
            if gpu_count < needed:
                item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPUs"))
        if item.get_closest_marker("te") is not None:
            if have_te is None:
                from megatron.core.extensions.te_import import have_te as _have_te

                have_te = _have_te()
            if not have_te:
                item.add_marker(pytest.mark.skip(reason="needs Transformer Engine"))


def pytest_sessionfinish(session, exitstatus):
    # A tier with no matching tests (e.g. `-m gpu` on a CPU machine) is not a failure.
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK


@pytest.fixture(scope="session", autouse=True)
def cleanup():
    """Tears down the default process group once every test has run."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture
def single_rank_model_parallel():
    """A one-rank model-parallel world (tensor, pipeline, expert sizes 1) for the test's duration.

    Tests that call code reading the global groups use it instead of relying on the state
    earlier tests left behind: the default process group outlives ``destroy_model_parallel``, and
    with it initialized, a getter without groups raises as upstream's does.
    """
    from tests.unit_tests.test_utilities import Utils

    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()
