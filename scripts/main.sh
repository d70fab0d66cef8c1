#!/usr/bin/env bash
# The project's main job: creates/reuses .venv, installs the project, then runs the activation
# audit, which builds every MLP path this machine can run for each configured activation and
# checks forward and backward against the float64 reference. Extra arguments go to the audit
# (see `scripts/main.sh --help`).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
exec "$PY" -m megatron.core.transformer.activation_audit "$@"
