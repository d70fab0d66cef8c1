"""``MCORE_ACTIVATIONS_PATCH``: strict parsing, and never a silent no-op for any install kind."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from mcore_activations.patch_env import ENV_VAR, PTH_LINE, PTH_NAME, patch_mode

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", " On "])
def test_values_that_patch(value):
    assert patch_mode({ENV_VAR: value}) == "on"


@pytest.mark.parametrize("value", ["0", "false", "False", "no", "off", "", "  "])
def test_values_that_do_not_patch(value):
    assert patch_mode({ENV_VAR: value}) == "off"


def test_unset_does_not_patch_and_quiet_patches_without_the_report():
    assert patch_mode({}) == "off"
    assert patch_mode({ENV_VAR: "quiet"}) == "quiet"


@pytest.mark.parametrize("value", ["2", "enable", "ture", "patch"])
def test_any_other_value_is_an_error_naming_the_variable(value):
    with pytest.raises(ValueError, match=f"{ENV_VAR}='{value}' is not understood") as err:
        patch_mode({ENV_VAR: value})
    assert "1, true, yes, on" in str(err.value) and "quiet" in str(err.value)


def _python(code: str, env_value, tmp_path, pth: bool):
    """Runs ``code`` with the source tree importable; with ``pth``, also a site dir holding the
    autopatch .pth file as an install writes it (processed by site.addsitedir, as at start-up)."""
    prelude, code = "", textwrap.dedent(code)
    if pth:
        site_dir = tmp_path / "site"
        site_dir.mkdir(exist_ok=True)
        (site_dir / PTH_NAME).write_text(PTH_LINE)
        prelude = f"import site; site.addsitedir({str(site_dir)!r})\n"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    if env_value is not None:
        env[ENV_VAR] = env_value
    return subprocess.run(
        # Without the file: -S keeps the interpreter from reading the .pth files of this
        # environment's own install (regular and editable installs have one).
        [sys.executable, *([] if pth else ["-S"]), "-W", "default", "-c", prelude + code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


HOOK_STATE = """
import sys
hooked = "mcore_activations.autopatch" in sys.modules
if hooked:
    from mcore_activations import autopatch
    hooked = autopatch.installed()
print("HOOKED" if hooked else "NOT HOOKED")
"""


@pytest.mark.parametrize(
    "value, expected",
    [("1", "HOOKED"), ("yes", "HOOKED"), ("false", "NOT HOOKED"), ("", "NOT HOOKED")],
)
def test_the_pth_file_installs_the_hook_only_when_asked(tmp_path, value, expected):
    done = _python(HOOK_STATE, value, tmp_path, pth=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == expected
    assert "did not run" not in done.stderr


def test_a_bad_value_in_the_pth_case_stops_the_import_of_megatron_core(tmp_path):
    done = _python("import megatron.core\nprint('IMPORTED')", "maybe", tmp_path, pth=True)
    assert done.returncode != 0 and "IMPORTED" not in done.stdout
    assert f"{ENV_VAR}='maybe' is not understood" in done.stderr
    # Said at start-up too, before anything else runs.
    assert done.stderr.startswith(f"mcore_activations: {ENV_VAR}='maybe'")


def test_without_the_pth_file_importing_the_package_installs_the_hook_and_says_so(tmp_path):
    done = _python("import mcore_activations\n" + HOOK_STATE, "1", tmp_path, pth=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "HOOKED"
    assert f"{ENV_VAR} is set, but this interpreter did not run" in done.stderr
    assert "mcore_activations_autopatch.pth" in done.stderr


def test_without_the_pth_file_a_bad_value_fails_the_package_import(tmp_path):
    done = _python("import mcore_activations", "ture", tmp_path, pth=False)
    assert done.returncode != 0
    assert f"ValueError: {ENV_VAR}='ture' is not understood" in done.stderr


def test_without_the_variable_importing_the_package_is_silent(tmp_path):
    done = _python("import mcore_activations\n" + HOOK_STATE, None, tmp_path, pth=False)
    assert done.returncode == 0 and done.stdout.strip() == "NOT HOOKED" and not done.stderr


def test_an_editable_install_gets_the_pth_file_too(tmp_path):
    """``pip install -e``: setuptools' editable wheel carries the autopatch .pth file."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(REPO / name, project / name)
    shutil.copytree(
        REPO / "mcore_activations",
        project / "mcore_activations",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    out = tmp_path / "dist"
    out.mkdir()
    code = f"import setuptools.build_meta as b, sys; print(b.build_editable({str(out)!r}))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=project, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mcore_activations_autopatch.pth" in names, names
    pths = sorted(n for n in names if n.endswith(".pth"))
    # The editable finder's .pth sorts (and so runs) first: the package is importable by then.
    assert pths[-1] == "mcore_activations_autopatch.pth", pths
