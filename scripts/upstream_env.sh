# Sourced by scripts/test.sh (and usable alone): builds or reuses the upstream environment, a
# Python 3.12 environment laid out as a user's would be: torch, upstream megatron-core from the
# package index (MCORE_SPEC, default 0.19.2) and, next to it, this repository installed as
# megatron-core-activations (non-editable, exactly as `pip install <repo>` does). The pip output of
# that install is kept in install-activations.log for the packaging test. Upstream main (the
# ../shared/upstream archive, when present) is unpacked into upstream-main/ for the tests that
# target it; elsewhere, set UPSTREAM_MAIN_ARCHIVE.
#
# PyPI has no CPU-only torch build for Python 3.12; its default (CUDA) build runs on the CPU, and
# with its libraries it is about 5 GB. Nothing in that environment but this package depends on the
# checkout, so it lives in the user's cache (one per Python/torch/megatron-core combination) and a
# fresh clone reuses it: building it takes minutes, reinstalling this package seconds. Set
# UPSTREAM_VENV to put it elsewhere.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MCORE_SPEC=${MCORE_SPEC:-megatron-core==0.19.2}
UTORCH_SPEC=${UPSTREAM_TORCH_SPEC:-torch==2.13.0}
if [ -z "${PYTHON312:-}" ]; then
  # A pyenv shim may exist without a usable interpreter behind it: take the first that runs.
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python "$(command -v python3.12)"; do
    if [ -x "$candidate" ] && "$candidate" -c "import sys" >/dev/null 2>&1; then
      PYTHON312=$candidate
      break
    fi
  done
fi
if [ -z "${PYTHON312:-}" ]; then
  echo "upstream_env.sh: megatron-core >= 0.17 needs Python 3.12; set PYTHON312=/path/to/python3.12" >&2
  return 1 2>/dev/null || exit 1
fi
UKEY=$(printf '%s' "$("$PYTHON312" -V 2>&1) $UTORCH_SPEC $MCORE_SPEC" | tr -c 'A-Za-z0-9.=\n' '_')
UVENV=${UPSTREAM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-core-activations/venv-upstream-$UKEY}
UPY="$UVENV/bin/python"
# The stamp names the recipe: change the package list below, and bump it.
USTAMP="$UVENV/.upstream-installed-v2"
if [ ! -f "$USTAMP" ]; then
  echo "[setup] building $UVENV: $UTORCH_SPEC and $MCORE_SPEC (first run: a few minutes)" >&2
  rm -rf "$UVENV"
  "$PYTHON312" -m venv "$UVENV"
  "$UPY" -m pip install -q "$UTORCH_SPEC" numpy packaging "pytest>=8" pytest-xdist setuptools wheel
  "$UPY" -m pip install -q "$MCORE_SPEC"
  touch "$USTAMP"
fi
# Always reinstall this repository's package, so the tests see the current source; the old copy is
# removed first, so that the log shows exactly what a first installation next to upstream does.
"$UPY" -m pip uninstall -q -y megatron-core-activations >/dev/null 2>&1 || true
"$UPY" -m pip install --no-deps --no-build-isolation "$ROOT" \
  > "$UVENV/install-activations.log" 2>&1 || { cat "$UVENV/install-activations.log" >&2; exit 1; }
ARCHIVE=${UPSTREAM_MAIN_ARCHIVE:-$(ls "$ROOT"/../shared/upstream/megatron-lm-main-*.tar.gz 2>/dev/null | head -n 1 || true)}
if [ -n "$ARCHIVE" ]; then
  # The environment outlives checkouts: unpack again whenever the archive is another one.
  ARCHIVE_ID="$(basename "$ARCHIVE") $(stat -c %s "$ARCHIVE")"
  if [ "$(cat "$UVENV/upstream-main.id" 2>/dev/null)" != "$ARCHIVE_ID" ]; then
    rm -rf "$UVENV/upstream-main"
    mkdir -p "$UVENV/upstream-main"
    tar -xzf "$ARCHIVE" -C "$UVENV/upstream-main" --strip-components=1
    printf '%s' "$ARCHIVE_ID" > "$UVENV/upstream-main.id"
  fi
fi
export MCORE_ACTIVATIONS_SOURCE="$ROOT"
