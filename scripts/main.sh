#!/usr/bin/env bash
# The project's main job: creates/reuses .venv, installs the project, then runs the activation
# audit, which builds every MLP path this machine can run for each configured activation and
# checks forward and backward against the float64 reference. Extra arguments go to the audit
# (see `scripts/main.sh --help`).
#
# The audit runs from the clone's root, where `megatron` is this project's fork; file arguments
# (--config FILE, --json FILE) are resolved against the caller's directory first.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
absolute() {
  case "$1" in
    /* | -) printf '%s' "$1" ;;
    *) printf '%s/%s' "$PWD" "$1" ;;
  esac
}
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --config | --json)
      args+=("$1")
      [ $# -gt 1 ] && args+=("$(absolute "$2")") && shift
      ;;
    --config=* | --json=*) args+=("${1%%=*}=$(absolute "${1#*=}")") ;;
    --) args+=("$@") && break ;;
    *) args+=("$1") ;;
  esac
  shift
done
cd "$ROOT"
# The audit's --help and errors name the command the user typed.
MCORE_ACTIVATIONS_AUDIT_PROG=$0 exec "$PY" -m megatron.core.transformer.activation_audit \
  ${args[@]+"${args[@]}"}
