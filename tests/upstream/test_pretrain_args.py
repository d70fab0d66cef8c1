"""The training-loop tier's command lines, as upstream's own ``pretrain_gpt.py`` reads them.

tools/upstream_pretrain.py trains through upstream's unchanged ``pretrain_gpt.py`` on a GPU. Here,
on the CPU, every command line it plans goes through upstream's own argument parser, validation
and ``core_transformer_config_from_args``, and the config that comes out must be the one the run
is meant to test: the activation, the clamp (absent in the control), fusion on exactly where the
path under test is fused, biases for gpt-oss. A flag upstream renames or drops fails here, not
after a GPU machine has started. Runs whose config needs CUDA to validate (grouped GEMM, which
asks Transformer Engine about the device) are checked up to the parser.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest
from conftest import run_json

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAINING_NAME = "megatron-lm-d98e8a64-training.tar.gz"


def _training_archive() -> Path:
    """Upstream main's training tree: UPSTREAM_TRAINING_ARCHIVE, else beside the main archive
    (UPSTREAM_MAIN_ARCHIVE, as scripts/upstream_env.sh finds it), else in ../shared/upstream."""
    if os.environ.get("UPSTREAM_TRAINING_ARCHIVE"):
        return Path(os.environ["UPSTREAM_TRAINING_ARCHIVE"])
    if os.environ.get("UPSTREAM_MAIN_ARCHIVE"):
        return Path(os.environ["UPSTREAM_MAIN_ARCHIVE"]).parent / TRAINING_NAME
    return REPO_ROOT.parent / "shared" / "upstream" / TRAINING_NAME


CHECK = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("upstream_pretrain", TOOL)
tool = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = tool
spec.loader.exec_module(tool)
from megatron.training.arguments import parse_args, validate_args
from megatron.training.argument_utils import core_transformer_config_from_args

out = {}
for size in ("tiny", "large"):
    for run in tool.plan(list(tool.CONFIGS), list(tool.RUNS), TARGET, size):
        argv = list(run.argv)
        if "--spec" in argv:  # the spec module imports megatron.training's global args
            i = argv.index("--spec")
            del argv[i : i + 3]
        sys.argv = ["pretrain_gpt.py", *argv]
        args = parse_args()
        if args.moe_grouped_gemm:
            out[f"{size}.{run.name}"] = {"parsed": True}
            continue
        validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
        c = core_transformer_config_from_args(args)
        out[f"{size}.{run.name}"] = {
            "parsed": True,
            "activation": c.activation_func.__name__,
            "gated": c.gated_linear_unit,
            "clamp": c.activation_func_clamp_value,
            "offset": c.glu_linear_offset,
            "fused": c.bias_activation_fusion,
            "bias": c.add_bias_linear,
            "op_fuser": c.use_transformer_engine_op_fuser,
            "shared": c.moe_shared_expert_intermediate_size,
        }
print(json.dumps(out))
"""


def _training_tree(target: str, tmp_path: Path) -> dict:
    """Extra environment of a subprocess that can import ``target``'s megatron.training."""
    if target == "release":
        return {}  # the 0.19.2 wheel ships megatron.training
    archive_path = _training_archive()
    if not archive_path.is_file():
        pytest.skip(f"upstream main's training tree is not at {archive_path}")
    with tarfile.open(archive_path) as archive:
        archive.extractall(tmp_path, filter="data")
    return {"PYTHONPATH": str(tmp_path / "megatron-lm")}


def test_every_planned_run_is_the_config_it_means_to_test(target, tmp_path):
    code = CHECK.replace("TOOL", repr(str(REPO_ROOT / "tools" / "upstream_pretrain.py")))
    code = code.replace("TARGET", repr(target))
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
    configs = run_json(code, target, env={**env, **_training_tree(target, tmp_path)})
    assert configs and all(c["parsed"] for c in configs.values())
    for name, c in configs.items():
        if "activation" not in c:
            continue
        size, config, kind = name.split(".")
        assert c["gated"], name
        assert c["clamp"] == (None if kind == "control" else 0.5), name
        unfused = kind in ("reference", "unpatched-reference", "control")
        assert c["fused"] is (not unfused), name
        assert c["op_fuser"] is (config == "dsv4-tefused" and not unfused), name
        if config.startswith("gpt-oss"):
            assert (c["activation"], c["offset"], c["bias"]) == ("quick_gelu", 1.0, True), name
        else:
            assert (c["activation"], c["offset"], c["bias"]) == ("silu", 0.0, False), name
        assert bool(c["shared"]) is (config == "dsv4-shared"), name


SPEC_CHECK = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("upstream_pretrain", TOOL)
tool = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = tool
spec.loader.exec_module(tool)
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import set_args
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.mlp import MLP
from megatron.core import parallel_state

# Transformer Engine's spec provider and TEFusedMLP are absent on the CPU: local stand-ins let the
# spec module run its own logic (which layers it replaces) exactly as it does with TE.
gpt_layer_specs.TESpecProvider = LocalSpecProvider
gpt_layer_specs.TEFusedMLP = type("TEFusedMLP", (MLP,), {})
config = next(c for c in tool.CONFIGS if c.name == "dsv4-tefused")
run = tool.plan([config], ["patched"], TARGET, "tiny")[0]
argv = list(run.argv)
i = argv.index("--spec")
sys.path.insert(0, SPECS)
sys.argv = ["pretrain_gpt.py", *argv]
args = parse_args()
validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
set_args(args)
assert not parallel_state.model_parallel_is_initialized()  # as when pretrain_gpt imports it
module = __import__(argv[i + 1], fromlist=[argv[i + 2]])
block = getattr(module, argv[i + 2])
built = []
for layer in block.layer_specs:
    mlp = layer.submodules.mlp
    builder = getattr(getattr(mlp, "module", mlp), "func", mlp)
    built.append(getattr(builder, "__self__", builder).__name__)
print(json.dumps(built))
"""


def test_user_spec_builds_before_parallel_groups_and_replaces_dense_mlps_only(target, tmp_path):
    """``--spec pretrain_gpt_spec ...`` is imported while upstream parses its arguments, before any
    parallel group exists; it must build there, with the dense layer as TEFusedMLP and the MoE
    layer as upstream's."""
    code = SPEC_CHECK.replace("TOOL", repr(str(REPO_ROOT / "tools" / "upstream_pretrain.py")))
    code = code.replace("TARGET", repr(target)).replace("SPECS", repr(str(REPO_ROOT / "tools")))
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
    built = run_json(code, target, env={**env, **_training_tree(target, tmp_path)})
    assert built == ["TEFusedMLP", "MoELayer"]
