"""The upstream tier: this package installed next to upstream megatron-core, patching it.

It runs inside ``.venv-upstream`` (scripts/upstream_env.sh): Python 3.12, upstream megatron-core
0.19.2 installed from the package index, this repository installed as megatron-core-activations,
and upstream main unpacked in ``upstream-main/``. Every check runs in a fresh interpreter
(:func:`run_python`), so a patch, a compile cache or a process group never leaks between tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MAIN_TREE = Path(sys.prefix) / "upstream-main"
TARGETS = ("release", "main")


# The head of a script that builds upstream's MLP from its local linears in a world of one rank
# (gloo, CPU): the imports and the parallel state every such script needs.
LOCAL_MLP_PRELUDE = """
import json, os
import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mcore_activations import megatron_patch as mp

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
torch.distributed.init_process_group("gloo", world_size=1, rank=0)
parallel_state.initialize_model_parallel(1, 1)
tensor_parallel.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
"""


def main_tree() -> Path:
    """Upstream main's unpacked tree; skips the test where no archive was there to unpack."""
    if not (MAIN_TREE / "megatron" / "core").is_dir():
        pytest.skip(f"upstream main is not unpacked at {MAIN_TREE} (scripts/upstream_env.sh)")
    return MAIN_TREE


def target_env(target: str) -> dict[str, str]:
    """The environment of a subprocess that imports ``target``'s megatron.core."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_ACTIVATIONS_PATCH")}
    env.pop("PYTHONPATH", None)
    if target == "main":
        # megatron is a namespace package: main's tree, first on the path, provides megatron.core.
        env["PYTHONPATH"] = str(main_tree())
    env["OMP_NUM_THREADS"] = "1"
    env["NO_VCS_VERSION"] = "1"  # upstream main would append the enclosing git sha
    return env


def run_python(code: str, target: str, *, env: dict | None = None, timeout: int = 600):
    """Runs ``code`` in a fresh interpreter against ``target``; returns the CompletedProcess."""
    full_env = target_env(target)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).parent,
    )


def run_json(code: str, target: str, **kwargs):
    """Runs ``code``, which must print one JSON document as its last line; returns it parsed."""
    done = run_python(code, target, **kwargs)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(params=TARGETS)
def target(request) -> str:
    return request.param
