#!/usr/bin/env bash
# The upstream training-loop tier: upstream Megatron-LM's own, unchanged pretrain_gpt.py on one
# GPU with Transformer Engine, for megatron-core 0.19.2 (its megatron.training, the core_r0.19.0
# entry scripts) and upstream main d98e8a64, patched (MCORE_ACTIVATIONS_PATCH=1) and not, each run
# compared iteration by iteration with its unfused reference and a no-clamp control
# (tools/upstream_pretrain.py; the table in docs/using-with-megatron-lm.md).
#
#   scripts/gpu_pretrain_gpt.sh --prepare        # once, on a machine with a package index
#   scripts/gpu_pretrain_gpt.sh [--size tiny|large] [--targets "release main"] [tool options]
#
# Everything is installed the way a user installs it: megatron-core 0.19.2 from its wheel and this
# package with `pip install` (its .pth file makes MCORE_ACTIVATIONS_PATCH=1 work in every process,
# no sitecustomize), Transformer Engine from .te-bundle/ (../shared/gpu/README.md). The machine
# needs no network: --prepare puts the wheel and upstream's source archives into .upstream-wheels/
# (ignored by git, sent with the working tree). It installs into the running Python: use a
# throw-away machine or environment. Logs, JSON and tables go to $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
WHEELS=$ROOT/.upstream-wheels
SHARED=${UPSTREAM_ARCHIVES:-$ROOT/../shared/upstream}
if [ "${1:-}" = "--prepare" ]; then
  mkdir -p "$WHEELS"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    -d "$WHEELS" megatron-core==0.19.2
  cp "$SHARED"/megatron-lm-d98e8a64-training.tar.gz "$SHARED"/megatron-lm-core_r0.19.0-entry.tar.gz \
    "$WHEELS/"
  exit 0
fi
SIZE=tiny
TARGETS="release main"
TOOL_ARGS=()
while [ $# -gt 0 ]; do
  case $1 in
    --size) SIZE=$2; shift 2 ;;
    --targets) TARGETS=$2; shift 2 ;;
    *) TOOL_ARGS+=("$1"); shift ;;
  esac
done
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NO_VCS_VERSION=1
for f in megatron_core-0.19.2-*.whl megatron-lm-d98e8a64-training.tar.gz \
  megatron-lm-core_r0.19.0-entry.tar.gz; do
  ls "$WHEELS"/$f >/dev/null 2>&1 || { echo "missing $WHEELS/$f: run $0 --prepare"; exit 2; }
done
if [ -f .te-bundle/setup-te.sh ]; then
  # shellcheck disable=SC1091
  source .te-bundle/setup-te.sh > "$OUT/setup-te.log" 2>&1 || { cat "$OUT/setup-te.log"; exit 2; }
  tail -n 1 "$OUT/setup-te.log"
fi
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# Transformer Engine's unpacked bundle joins the interpreter's path for every process.
[ -n "${PYTHONPATH:-}" ] && tr ':' '\n' <<< "$PYTHONPATH" > "$SITE/zz-te-bundle.pth"
unset PYTHONPATH
python3 -m pip install -q --no-deps --no-index "$WHEELS"/megatron_core-0.19.2-*.whl || exit 2
python3 -m pip install -q --no-deps --no-index --no-build-isolation "$ROOT" || exit 2
STAGE=$(mktemp -d)
tar -xzf "$WHEELS"/megatron-lm-d98e8a64-training.tar.gz -C "$STAGE"      # -> megatron-lm/
tar -xzf "$WHEELS"/megatron-lm-core_r0.19.0-entry.tar.gz -C "$STAGE"    # -> megatron-lm-r019/
# The 0.19.2 wheel lacks the Makefile that megatron.training's dataset-helper build runs; the
# entry archive carries it. The entry folder keeps only the scripts, so that its partial
# megatron/ never meets the installed package.
cp "$STAGE"/megatron-lm-r019/megatron/core/datasets/Makefile "$SITE/megatron/core/datasets/"
rm -rf "$STAGE"/megatron-lm-r019/megatron
mkdir -p "$STAGE/specs"
cp tools/pretrain_gpt_spec.py "$STAGE/specs/"
# tests/upstream finds upstream main where scripts/upstream_env.sh unpacks it.
ln -sfn "$STAGE/megatron-lm" "$(python3 -c 'import sys; print(sys.prefix)')/upstream-main"
python3 -c "import torch, transformer_engine as te; print('torch', torch.__version__, \
torch.cuda.get_device_name(), 'TE', te.__version__)"
# The tiny runs of both targets share the GPU (each is a small fraction of it); the large runs
# time steps, so they run one at a time.
status=0
pids=()
for target in $TARGETS; do
  if [ "$target" = release ]; then entry=$STAGE/megatron-lm-r019; else entry=$STAGE/megatron-lm; fi
  python3 tools/upstream_pretrain.py --target "$target" --entry "$entry" --path "$STAGE/specs" \
    --out "$OUT" --size "$SIZE" "${TOOL_ARGS[@]}" &
  if [ "$SIZE" = large ]; then wait $! || status=1; else pids+=($!); fi
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
# One archive of the logs: the device tool returns a limited number of files.
(cd "$OUT" && tar -czf "pretrain-logs-$SIZE.tgz" logs-* && rm -rf logs-*)
exit "$status"
