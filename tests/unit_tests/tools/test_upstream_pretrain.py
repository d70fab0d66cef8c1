"""The upstream training-loop tier's planning, log parsing and verdicts (the runs need a GPU)."""

import pytest

from tools import upstream_pretrain as tier

# Lines as upstream's training loop prints them (training_log, Timers.log, report_memory).
LOG = """\
MCORE_ACTIVATIONS_PATCH: patched megatron-core 0.19.2 (release): 23 objects
 [2026-12-07 06:30:01.000001] iteration        1/       3 | consumed samples:            4 | \
elapsed time per iteration (ms): 2345.6 | learning rate: 1.000000E-04 | global batch size:     4 \
| lm loss: 6.934512E+00 | load_balancing_loss: 1.001234E+00 | loss scale: 1.0 | grad norm: 3.210 \
| number of skipped iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 1 iterations) memory (MB) | allocated: 120.50 | max allocated: 345.25 | \
reserved: 400.00 | max reserved: 400.00
(min, max) time across ranks (ms):
    forward-backward ...............................: (20.10, 20.50)
    optimizer ......................................: (1.00, 1.10)
 [2026-12-07 06:30:02.000001] iteration        2/       3 | consumed samples:            8 | \
elapsed time per iteration (ms): 30.5 | learning rate: 1.000000E-04 | global batch size:     4 \
| lm loss: 6.900000E+00 | loss scale: 1.0 |
 [2026-12-07 06:30:03.000001] iteration        3/       3 | consumed samples:           12 | \
elapsed time per iteration (ms): 31.5 | learning rate: 1.000000E-04 | global batch size:     4 \
| lm loss: 6.800000E+00 | loss scale: 1.0 |
[Rank 0] (after 3 iterations) memory (MB) | allocated: 1.00 | max allocated: 999.00 | \
reserved: 1.00 | max reserved: 1.00
"""


def _run(kind="patched", patch=True, losses=(), report="patched x", rc=0, error=None):
    run = tier.Run("dsv4", kind, patch, [])
    run.losses, run.patched_report, run.returncode, run.error = list(losses), report, rc, error
    return run


def test_log_parsing_reads_upstreams_own_numbers():
    run = tier.Run("dsv4", "patched", True, [])
    tier.parse_log(LOG, run)
    assert run.losses == [6.934512, 6.9, 6.8]
    assert run.step_ms == [2345.6, 30.5, 31.5]
    assert run.forward_backward_ms == [20.5]  # the slower rank
    assert run.max_allocated_mb == 345.25  # the first report: peak of the first iteration
    assert run.patched_report == "patched megatron-core 0.19.2 (release): 23 objects"
    assert run.error is None


def test_log_parsing_keeps_the_first_error_line():
    run = tier.Run("gpt-oss", "unpatched", False, [])
    tier.parse_log(
        "Traceback (most recent call last):\n"
        "RuntimeError: Output 0 of _LinearBackward is a view and is being modified inplace.\n"
        "torch.distributed.DistBackendError: later noise\n",
        run,
    )
    assert run.error.startswith("RuntimeError: Output 0 of _LinearBackward is a view")


def test_log_parsing_reads_the_error_of_a_run_without_torchrun():
    # Without torchrun, torch prefixes the rank to the traceback lines; NCCL's exit warning
    # comes last and must not stand in for the error.
    run = tier.Run("gpt-oss", "unpatched", False, [])
    tier.parse_log(
        "[rank0]:     raise ValueError(...)\n"
        "[rank0]: ValueError: Only support fusion of gelu and swiglu\n"
        "[rank0]:[W1207 08:25:38.6 ProcessGroupNCCL.cpp:1575] Warning: destroy_process_group()\n",
        run,
    )
    assert run.error == "ValueError: Only support fusion of gelu and swiglu"


def test_the_control_sets_the_scale_of_equal():
    reference = _run("reference", losses=[7.0, 6.5, 6.0])
    control = _run("control", losses=[7.0, 6.0, 5.0])  # the clamp moves the loss by up to 1.0
    close = _run(losses=[7.0, 6.52, 6.05])  # 0.05: within a tenth of the clamp's effect
    far = _run(losses=[7.0, 6.2, 5.4])  # 0.6: most of the clamp's effect is missing
    assert tier.verdict(close, reference, control)["equal"] is True
    assert tier.verdict(close, reference, control)["cell"].startswith("= reference")
    assert tier.verdict(far, reference, control)["equal"] is False
    assert tier.verdict(far, reference, control)["cell"].startswith("DIFFERS (0.6000 / 0.6000")
    # Without a control there is no scale: nothing is called equal.
    assert tier.verdict(close, reference, None)["equal"] is False


def test_crashes_refusals_and_a_wrong_patch_state_are_never_equal():
    reference = _run("reference", losses=[7.0, 6.5, 6.0])
    control = _run("control", losses=[7.0, 6.0, 5.0])
    crash = _run(rc=1, error="RuntimeError: view modified inplace")
    assert tier.verdict(crash, reference, control)["cell"].startswith("crashes: RuntimeError")
    refused = _run(rc=1, error="mcore_activations.UnsupportedActivationError: no")
    assert tier.verdict(refused, reference, control)["cell"].startswith("refused at build")
    # A run asked to be patched whose log has no patch report did not test the patch.
    silent = _run(losses=[7.0, 6.5, 6.0], report=None)
    assert tier.verdict(silent, reference, control)["cell"].startswith("INVALID")
    leaked = _run("unpatched", patch=False, losses=[7.0, 6.5, 6.0], report="patched x")
    assert tier.verdict(leaked, reference, control)["cell"].startswith("INVALID")


@pytest.mark.parametrize("target", ["release", "main"])
def test_every_run_differs_from_its_reference_only_where_meant(target):
    runs = {r.name: r for r in tier.plan(list(tier.CONFIGS), list(tier.RUNS), target, "tiny")}
    for config in tier.CONFIGS:
        reference = runs[f"{config.name}.reference"].argv
        control = runs[f"{config.name}.control"].argv
        patched = runs[f"{config.name}.patched"].argv
        assert runs[f"{config.name}.unpatched"].argv == patched
        assert runs[f"{config.name}.unpatched-reference"].argv == reference
        assert control == [a for a in reference if a not in tier.CLAMP]
        assert set(reference) - set(patched) == set(config.unfused)
        assert runs[f"{config.name}.reference"].patch and runs[f"{config.name}.patched"].patch
        assert not runs[f"{config.name}.unpatched"].patch
        assert runs[f"{config.name}.low-memory"].argv == patched
        assert runs[f"{config.name}.low-memory"].patch


def test_only_the_low_memory_run_gets_the_memory_options(monkeypatch):
    # A variable of the caller's shell reaches no run: each run's options are its own.
    monkeypatch.setenv("MCORE_ACTIVATIONS_FC2_CHUNKS", "4")
    (low, patched) = tier.plan([tier.CONFIGS[0]], ["low-memory", "patched"], "release", "tiny")
    low_env = tier._environment(low, 0, [])
    patched_env = tier._environment(patched, 0, [])
    assert {k: low_env[k] for k in tier.LOW_MEMORY_ENV} == tier.LOW_MEMORY_ENV
    assert not set(tier.LOW_MEMORY_ENV) & set(patched_env)
    assert low_env["MCORE_ACTIVATIONS_PATCH"] == patched_env["MCORE_ACTIVATIONS_PATCH"] == "1"
    # Not a default run: the tier's table stays what it was unless asked.
    assert "low-memory" not in tier.DEFAULT_RUNS and "low-memory" in tier.RUNS


def test_a_run_that_hangs_is_recorded_and_does_not_stop_the_others(tmp_path, monkeypatch):
    (tmp_path / "pretrain_gpt.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(tier, "RUN_TIMEOUT_S", 1)
    run = tier.execute(
        tier.Run("dsv4", "patched", True, []), entry=tmp_path, extra_path=[], port=0, logs=tmp_path
    )
    assert run.returncode is None and run.error == "did not finish in 1 s"
    assert tier.verdict(run, _run("reference", losses=[1.0]), None)["cell"].startswith("crashes")
