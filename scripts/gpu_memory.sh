#!/usr/bin/env bash
# The memory benchmarks on one GPU: the activations' in-place and out-of-place peaks against
# Transformer Engine's op and Liger-Kernel's Megatron SwiGLU (tools/benchmark_activations.py
# --suite memory), and whole layers, upstream megatron-core 0.19.2 unpatched and patched with each
# memory option, TEFusedMLP and Liger (tools/benchmark_layer_memory.py). The tables of
# docs/performance.md, "Low-memory backward", come from here.
#
#   scripts/gpu_memory.sh --prepare     # once, on a machine with a package index
#   scripts/gpu_memory.sh [layer-benchmark options, e.g. --candidates upstream patched]
#
# --prepare downloads the megatron-core 0.19.2 wheel and Liger-Kernel 0.8.5 into .upstream-wheels/
# and .liger-wheel/ (ignored by git, sent with the working tree: the GPU machine has no network).
# Transformer Engine comes from .te-bundle/ (../shared/gpu/README.md). It installs into the
# running Python: use a throw-away machine or environment. Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
if [ "${1:-}" = "--prepare" ]; then
  mkdir -p .upstream-wheels .liger-wheel
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    -d .upstream-wheels megatron-core==0.19.2
  python3 -m pip download -q --no-deps -d .liger-wheel liger-kernel==0.8.5
  exit 0
fi
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NO_VCS_VERSION=1
if [ -f .te-bundle/setup-te.sh ]; then
  # shellcheck disable=SC1091
  source .te-bundle/setup-te.sh > "$OUT/setup-te.log" 2>&1 || { cat "$OUT/setup-te.log"; exit 2; }
fi
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# Transformer Engine's unpacked bundle joins the interpreter's path for every process.
[ -n "${PYTHONPATH:-}" ] && tr ':' '\n' <<< "$PYTHONPATH" > "$SITE/zz-te-bundle.pth"
unset PYTHONPATH
python3 -m pip install -q --no-deps --no-index .upstream-wheels/megatron_core-0.19.2-*.whl || exit 2
if ls .liger-wheel/liger_kernel-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index .liger-wheel/liger_kernel-*.whl || exit 2
fi
python3 -m pip install -q --no-deps --no-index --no-build-isolation "$ROOT" || exit 2
# Outside the checkout: its megatron/ (the fork) must not shadow the installed upstream.
(cd /tmp && python3 -c "import torch, triton, megatron.core as mc, sys; \
print('torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', mc.__version__, \
'python', sys.version.split()[0], torch.cuda.get_device_name())")
status=0
(cd /tmp && python3 "$ROOT/tools/benchmark_layer_memory.py" --json "$OUT/layers.json" "$@" \
  > "$OUT/layers.txt" 2>&1) || status=1
grep "^|" "$OUT/layers.txt"
python3 tools/benchmark_activations.py --suite memory --no-eager \
  --json "$OUT/activations-memory.json" > "$OUT/activations-memory.txt" 2>&1 || status=1
tail -20 "$OUT/activations-memory.txt"
exit $status
