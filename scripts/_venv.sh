# Sourced by scripts/main.sh and scripts/test.sh: create or reuse .venv and install the project.
#
# TORCH_SPEC picks the torch build. The default, torch==2.13.0, is the CPU build these CPU
# machines keep on local disk. Elsewhere, set e.g. TORCH_SPEC="torch==2.13.0" with
# PIP_INDEX_URL=https://download.pytorch.org/whl/cu130 for CUDA, or VENV_SYSTEM_SITE=1 to reuse
# a CUDA torch already installed in the system Python (the GPU machines do this).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  if [ "${VENV_SYSTEM_SITE:-0}" = 1 ]; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
STAMP="$VENV/.megatron-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  # pip runs quietly; say what is happening, since the first install takes a few minutes.
  echo "[setup] installing the project and its test tools into $VENV (first run: a few minutes)" >&2
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing $TORCH_SPEC" >&2
    "$PY" -m pip install -q "$TORCH_SPEC"
  fi
  "$PY" -m pip install -q -e "$ROOT[test,dev]"
  touch "$STAMP"
  echo "[setup] done" >&2
fi
