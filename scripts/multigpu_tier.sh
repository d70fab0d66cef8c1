#!/usr/bin/env bash
# The multi-GPU tier (`-m multigpu`) in one go, on a machine with 2+ GPUs and CUDA torch (e.g. the
# 2xH200 machines of ../shared/gpu/README.md, with Transformer Engine from .te-bundle when
# present). The tests spawn their own NCCL ranks (one per GPU) from a plain pytest process, so no
# torchrun is needed. The log goes to $OUT/multigpu_tests.log (default ./gpu-out); the exit status
# is pytest's. Extra arguments are passed to pytest (e.g. -k expert, or -k tp2, to split the run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
# NVLink SHARP (NVLS) multicast is unavailable or unsafe on the shared machines: always off.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PYTHON=${PYTHON:-python3}
if [ -f .te-bundle/setup-te.sh ]; then
  # shellcheck disable=SC1091
  source .te-bundle/setup-te.sh > "$OUT/setup.log" 2>&1 || echo "TE setup failed: $OUT/setup.log"
fi
"$PYTHON" -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'x',
  torch.cuda.get_device_name())" 2>&1 | tee "$OUT/multigpu_env.txt"
"$PYTHON" -c "from megatron.core.extensions.te_import import have_te; import transformer_engine as t
print('TE', t.__version__ if have_te() else 'unavailable')" >> "$OUT/multigpu_env.txt" 2>&1 \
  || echo "TE unavailable" >> "$OUT/multigpu_env.txt"
tail -1 "$OUT/multigpu_env.txt"
# -p no:xdist: one pytest process; each test spawns its 2 ranks once for all its cases.
# -rP: each case's worst relative error (printed by the tests) goes into the log.
"$PYTHON" -m pytest -m multigpu tests/unit_tests -p no:xdist -p no:cacheprovider -rfEsP -v \
  "$@" > "$OUT/multigpu_tests.log" 2>&1
rc=$?
echo "cases ok: $(grep -c ': ok, max rel err' "$OUT/multigpu_tests.log")"
grep -E ": FAILED$|: skipped: " "$OUT/multigpu_tests.log" | head -20
tail -5 "$OUT/multigpu_tests.log"
echo "multigpu tests rc=$rc (log: $OUT/multigpu_tests.log)"
exit "$rc"
