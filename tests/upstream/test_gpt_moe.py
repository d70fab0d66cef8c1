"""End-to-end checks of ``mcore_activations``' patch on upstream megatron-core's own GPT+MoE.

Part of the upstream tier (tests/upstream/conftest.py): run by scripts/test.sh inside
``.venv-upstream``, against upstream 0.19.2 (installed) and upstream main (``upstream-main/``), with
the repository root off ``sys.path`` (the fork's ``megatron/`` would shadow upstream's). The module
skips itself with that reason if ``megatron`` resolves to the fork.

Every training run is a subprocess of ``tools/upstream_gpt_moe.py`` (a clamped SwiGLU, dense + MoE
layers, 3 Adam steps, ``--json``), so the patch state, torch.distributed process groups and
compiled kernels never leak between runs. The runs of one comparison (unfused and fused) start
together: two torch processes at a time, and this pytest process never imports torch.

What is asserted, and why:

* With the patch, fused (``bias_activation_fusion=True``) and unfused losses agree within 1e-5
  relative at every step, and every MLP's fc2 input matches the float64 reference of
  ``ActivationSpec`` within 1e-5 (fp32). This is the patch's promise, on any upstream it accepts.
* Without the patch, whether fused and unfused differ is *recorded*, not asserted: it describes
  upstream (0.19.2's fused SwiGLU ignores the clamp; main computes it), detected from the runs
  themselves rather than from a version check.
* Before and after: on 0.19.2 the fused losses differ from unfused before patching and agree
  after; main already computes the fused clamp, so they agree before and after. The patch never
  moves the unfused losses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import TARGETS, target_env

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL_PATH = REPO_ROOT / "tools" / "upstream_gpt_moe.py"

CLAMP = 7.0
INIT_STD = 0.5  # about 6% of the first step's fc1 outputs lie beyond the clamp (asserted below)
STEPS = 3
LOSS_RTOL = 1e-5
ACT_RTOL = 1e-5
# A bug that ignores the clamp moves the losses by far more than this (about 1e-2 relative).
CHANGED_RTOL = 1e-4
MIN_CLAMPED_FRACTION = 0.01
RUN_TIMEOUT_S = 600


def _load_tool():
    """Imports tools/upstream_gpt_moe.py by file path (the repository root stays off sys.path)."""
    spec = importlib.util.spec_from_file_location("upstream_gpt_moe", TOOL_PATH)
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolves string annotations through sys.modules[cls.__module__].
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _skip_reason():
    """Why this environment cannot run the tests, or None."""
    if importlib.util.find_spec("mcore_activations") is None:
        return "mcore_activations is not importable (add a directory linking it to PYTHONPATH)"
    megatron = importlib.util.find_spec("megatron")
    if megatron is None:
        return "no upstream megatron-core installed in this environment"
    for location in megatron.submodule_search_locations or []:
        if Path(location).resolve() == (REPO_ROOT / "megatron").resolve():
            return (
                "`megatron` resolves to this repository's fork; these tests need upstream "
                "megatron-core (keep the repository root off PYTHONPATH)"
            )
    return None


_reason = _skip_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

tool = _load_tool()


def _run_one(tmp_dir: Path, tag: str, flags: list[str], env: dict) -> dict:
    """Runs the tool once in a fresh interpreter and returns its result dict."""
    out = tmp_dir / f"{tag}.json"
    cmd = [
        sys.executable,
        str(TOOL_PATH),
        "--clamp",
        str(CLAMP),
        "--init-std",
        str(INIT_STD),
        "--steps",
        str(STEPS),
        "--quiet",
        "--json",
        str(out),
        *flags,
    ]
    # cwd is the temporary directory so that nothing of the repository lands on sys.path
    # besides the tool's own directory; the environment selects the upstream target.
    proc = subprocess.run(
        cmd,
        cwd=tmp_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed (rc={proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(out.read_text())


def _run_pair(tmp_dir: Path, tag: str, flags: list[str], target: str) -> dict:
    """Unfused and fused runs of one configuration, side by side (two processes at most)."""
    env = target_env(target)
    with ThreadPoolExecutor(max_workers=2) as pool:
        unfused = pool.submit(_run_one, tmp_dir, f"{tag}_unfused", flags, env)
        fused = pool.submit(_run_one, tmp_dir, f"{tag}_fused", [*flags, "--fused"], env)
        return {"unfused": unfused.result(), "fused": fused.result()}


@pytest.fixture(scope="module", params=TARGETS)
def upstream(request):
    return request.param


@pytest.fixture(scope="module")
def patched(tmp_path_factory, upstream):
    return _run_pair(tmp_path_factory.mktemp("patched"), "patched", ["--patch"], upstream)


@pytest.fixture(scope="module")
def unpatched(tmp_path_factory, upstream):
    return _run_pair(tmp_path_factory.mktemp("unpatched"), "unpatched", [], upstream)


@pytest.fixture(scope="module")
def shared_patched(tmp_path_factory, upstream):
    flags = ["--patch", "--shared-expert"]
    return _run_pair(tmp_path_factory.mktemp("shared_patched"), "shared_patched", flags, upstream)


@pytest.fixture(scope="module")
def shared_unpatched(tmp_path_factory, upstream):
    flags = ["--shared-expert"]
    return _run_pair(
        tmp_path_factory.mktemp("shared_unpatched"), "shared_unpatched", flags, upstream
    )


def _max_loss_rel_diff(a: dict, b: dict) -> float:
    assert len(a["losses"]) == len(b["losses"]) == STEPS
    return max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))


def _loss_table(pair: dict) -> str:
    return "\n".join(
        f"  {kind:8s} " + " ".join(f"{x:.6f}" for x in pair[kind]["losses"])
        for kind in ("unfused", "fused")
    )


def _assert_patched_pair(pair: dict, expect_shared: bool) -> None:
    """The patch's promise: fused == unfused losses, and every activation == the reference."""
    for kind, result in pair.items():
        assert result["patched"] and result["patch_report"], kind
        assert result["build_error"] is None, result["build_error"]
        classes = result["model_classes"]
        # One dense MLP layer and SequentialMLP experts (plus the shared expert when asked).
        assert classes.get("decoder.layers.0.mlp") == "MLP", classes
        assert any(".local_experts." in name for name in classes), classes
        assert any(name.endswith("shared_experts") for name in classes) == expect_shared
        # The clamp is actually exercised, otherwise nothing here would test it.
        fraction = result["clamp_stats"]["fraction_beyond_clamp"]
        assert fraction >= MIN_CLAMPED_FRACTION, f"{kind}: clamp hit by only {fraction:.4f}"
        checked = {n: e for n, e in result["max_rel_error"].items() if e is not None}
        assert "decoder.layers.0.mlp" in checked
        assert any(".local_experts." in n for n in checked)
        bad = {n: e for n, e in checked.items() if e > ACT_RTOL}
        assert not bad, f"{kind}: fc2 inputs differ from the float64 reference: {bad}"
    diff = _max_loss_rel_diff(pair["fused"], pair["unfused"])
    assert diff <= LOSS_RTOL, f"fused and unfused losses differ ({diff:.2e}):\n{_loss_table(pair)}"


# ----------------------------------------------------------------------------- (a) patched


def test_patched_fused_matches_unfused_and_reference(patched):
    _assert_patched_pair(patched, expect_shared=False)


# ----------------------------------------------------------------------------- (b) unpatched


def test_unpatched_fused_vs_unfused_is_recorded(unpatched, record_property):
    """Records (never asserts) whether upstream's own fused path differs from its unfused one."""
    diff = _max_loss_rel_diff(unpatched["fused"], unpatched["unfused"])
    worst_fused = max(e for e in unpatched["fused"]["max_rel_error"].values() if e is not None)
    version = unpatched["unfused"]["upstream_version"]
    record_property("upstream_version", version)
    record_property("unpatched_fused_vs_unfused_max_rel_loss_diff", diff)
    record_property("unpatched_fused_max_rel_activation_error", worst_fused)
    print(
        f"\nmegatron-core {version} unpatched: fused vs unfused losses differ by {diff:.2e} "
        f"(fused activation error vs reference {worst_fused:.2e}; "
        f"{'DIFFERENT' if diff > LOSS_RTOL else 'same'})\n{_loss_table(unpatched)}"
    )
    # The unfused path is upstream's reference behaviour in every version; it must compute the
    # clamp (otherwise the comparisons above would say nothing).
    unfused_errors = [e for e in unpatched["unfused"]["max_rel_error"].values() if e is not None]
    assert max(unfused_errors) <= ACT_RTOL


def _assert_patch_fixes_fused(unpatched_pair: dict, patched_pair: dict) -> None:
    """0.19.2: the fused losses move from wrong to right. Main: they are right before and after."""
    version = unpatched_pair["unfused"]["upstream_version"]
    before = _max_loss_rel_diff(unpatched_pair["fused"], unpatched_pair["unfused"])
    after = _max_loss_rel_diff(patched_pair["fused"], patched_pair["unfused"])
    if version.startswith("0.19.2"):
        assert before > CHANGED_RTOL, (
            f"0.19.2's fused SwiGLU should ignore the clamp, but fused and unfused agree "
            f"({before:.2e}):\n{_loss_table(unpatched_pair)}"
        )
    else:
        # Upstream main computes the fused clamp (#5940): the patch has nothing to fix here.
        assert before <= LOSS_RTOL, (
            f"megatron-core {version}: fused != unfused before the patch ({before:.2e})"
        )
    assert after <= LOSS_RTOL, (
        f"patched fused != unfused ({after:.2e}):\n{_loss_table(patched_pair)}"
    )
    # The patch must not move the unfused path, which was already right.
    unfused_shift = _max_loss_rel_diff(patched_pair["unfused"], unpatched_pair["unfused"])
    assert unfused_shift <= LOSS_RTOL, unfused_shift


def test_patch_fixes_the_fused_clamp(unpatched, patched):
    _assert_patch_fixes_fused(unpatched, patched)


# ----------------------------------------------------------------------------- (c) shared expert


def test_shared_expert_patched_fused_matches_unfused_and_reference(shared_patched):
    _assert_patched_pair(shared_patched, expect_shared=True)


def test_shared_expert_patch_fixes_the_fused_clamp(shared_unpatched, shared_patched):
    _assert_patch_fixes_fused(shared_unpatched, shared_patched)


# ----------------------------------------------------------------------------- the tool itself


def test_tool_parses_options_without_torch():
    """The tool's module and parser load without torch (so this process stays torch-free)."""
    assert tool.parse_args(["--clamp", "0"]).clamp is None  # a clamp <= 0 means no clamp
    opts = tool.parse_args(["--clamp", str(CLAMP), "--init-std", str(INIT_STD)])
    assert (opts.clamp, opts.init_std, opts.patch, opts.fused) == (CLAMP, INIT_STD, False, False)
    code = (
        "import importlib.util, sys; "
        f"s = importlib.util.spec_from_file_location('t', {str(TOOL_PATH)!r}); "
        "m = importlib.util.module_from_spec(s); sys.modules['t'] = m; "
        "s.loader.exec_module(m); "
        "m.parse_args([]); assert 'torch' not in sys.modules, 'tool imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ), timeout=60)
