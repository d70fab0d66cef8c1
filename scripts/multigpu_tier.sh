#!/usr/bin/env bash
# The multi-GPU tier (`-m multigpu`) in one go, on a machine with 2, 4 or 8 GPUs and CUDA torch
# (e.g. the H200 machines of ../shared/gpu/README.md, with Transformer Engine from .te-bundle
# when present). The tests spawn their own NCCL ranks (one per GPU) from a plain pytest process,
# so no torchrun is needed. Each world size (2, 4, 8 ranks) is a test parameter (`[2ranks]`,
# `[4ranks]`, `[8ranks]`); the ones needing more GPUs than are visible skip, so by default the
# visible GPU count chooses the world sizes that run.
#
# Environment:
#   OUT           where the log goes ($OUT/multigpu_tests.log; default ./gpu-out)
#   WORLD_SIZES   run only these world sizes, e.g. "4 8" (the 4- and 8-GPU cases; this leaves
#                 out the other multigpu tests, which need 2 GPUs and have no world parameter)
#   SELECT        a pytest -k expression ANDed with WORLD_SIZES' (e.g. "expert", "not _te"),
#                 to split a run that does not fit one command's time limit
# Extra arguments go to pytest. The exit status is pytest's (2 with fewer than 2 GPUs).
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

GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$GPUS" -lt 2 ]; then
  echo "the multi-GPU tier needs at least 2 visible GPUs, found $GPUS" | tee -a "$OUT/multigpu_env.txt"
  exit 2
fi
runs="" skips=""
for n in ${WORLD_SIZES:-2 4 8}; do
  if [ "$n" -le "$GPUS" ]; then runs="$runs $n"; else skips="$skips $n"; fi
done
echo "visible GPUs: $GPUS; world sizes run:${runs:- none}; skipped (too few GPUs):${skips:- none}" \
  | tee -a "$OUT/multigpu_env.txt"

keyword=""
if [ -n "${WORLD_SIZES:-}" ]; then
  for n in $WORLD_SIZES; do keyword="${keyword:+$keyword or }${n}ranks"; done
  keyword="($keyword)"
fi
if [ -n "${SELECT:-}" ]; then keyword="${keyword:+$keyword and }($SELECT)"; fi
select_args=()
if [ -n "$keyword" ]; then select_args=(-k "$keyword"); fi

# -p no:xdist: one pytest process; each test spawns its world once for all its cases.
# -rP: each case's worst relative error (printed by the tests) goes into the log.
"$PYTHON" -m pytest -m multigpu tests/unit_tests -p no:xdist -p no:cacheprovider -rfEsP -v \
  ${select_args[@]+"${select_args[@]}"} "$@" > "$OUT/multigpu_tests.log" 2>&1
rc=$?
echo "cases ok: $(grep -c ': ok, max rel err' "$OUT/multigpu_tests.log")"
grep -E ": FAILED$|: skipped: " "$OUT/multigpu_tests.log" | head -20
grep -E "^SKIPPED" "$OUT/multigpu_tests.log" | head -20
tail -5 "$OUT/multigpu_tests.log"
echo "multigpu tests rc=$rc (log: $OUT/multigpu_tests.log)"
exit "$rc"
