#!/usr/bin/env bash
# The upstream GPU tier, on one CUDA GPU with Transformer Engine (e.g. the H200 machines of
# ../shared/gpu/README.md): for upstream megatron-core 0.19.2 and upstream main, the audit before
# and after patch_megatron_core() (TE fused classes included) and upstream's own tiny GPT-MoE with
# its TE layer specs, trained a few steps with and without the patch. Logs and JSON go to $OUT.
#
# Needs, inside the repository (ignored by git, sent with the working tree): .te-bundle/ (TE) and
# .upstream-wheels/ holding the megatron-core 0.19.2 wheel and the upstream main archive (the GPU
# machines have no package index): `scripts/gpu_upstream.sh --prepare` fills it on a CPU machine.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
WHEELS=$ROOT/.upstream-wheels
if [ "${1:-}" = "--prepare" ]; then
  mkdir -p "$WHEELS"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    -d "$WHEELS" megatron-core==0.19.2
  cp ../shared/upstream/megatron-lm-main-*.tar.gz "$WHEELS/"
  exit 0
fi
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVIDIA_TF32_OVERRIDE=0 NO_VCS_VERSION=1
if [ -f .te-bundle/setup-te.sh ]; then
  # shellcheck disable=SC1091
  source .te-bundle/setup-te.sh > "$OUT/setup.log" 2>&1 || echo "TE setup failed: $OUT/setup.log"
fi
STAGE=$(mktemp -d)
python3 -m pip install -q --no-deps --target "$STAGE/release" "$WHEELS"/megatron_core-0.19.2-*.whl
mkdir -p "$STAGE/main" "$STAGE/acts"
tar -xzf "$WHEELS"/megatron-lm-main-*.tar.gz -C "$STAGE/main" --strip-components=1
ln -s "$ROOT/mcore_activations" "$STAGE/acts/mcore_activations"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
cd "$STAGE"  # never the repository root: its megatron/ would shadow upstream's
status=0
BASE_PYTHONPATH=${PYTHONPATH:-}  # Transformer Engine's, from setup-te.sh
for target in release main; do
  export PYTHONPATH="$STAGE/$target:$STAGE/acts${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}"
  python3 -m mcore_activations.upstream_audit --before-after --device cuda \
    --json "$OUT/audit-$target.json" > "$OUT/audit-$target.txt" 2>&1 || status=1
  grep "^|\|^#\|^patched" "$OUT/audit-$target.txt"
  runs=(
    "grouped:--te --grouped-gemm"
    "grouped-fused:--te --grouped-gemm --fused"
    "grouped-patch:--te --grouped-gemm --patch"
    "grouped-fused-patch:--te --grouped-gemm --fused --patch"
    "opfuser:--te --op-fuser"
    "opfuser-patch:--te --op-fuser --patch"
  )
  for run in "${runs[@]}"; do
    name=${run%%:*}
    # shellcheck disable=SC2086
    python3 "$ROOT/tools/upstream_gpt_moe.py" ${run#*:} --steps 3 --quiet \
      --json "$OUT/e2e-$target-$name.json" > "$OUT/e2e-$target-$name.log" 2>&1 &
  done
  wait
  python3 - "$OUT" "$target" <<'PY'
import json, pathlib, sys
out, target = pathlib.Path(sys.argv[1]), sys.argv[2]
for path in sorted(out.glob(f"e2e-{target}-*.json")):
    r = json.loads(path.read_text())
    errs = [e for e in (r.get("max_rel_error") or {}).values() if e is not None]
    worst = f"{max(errs):.1e}" if errs else "-"
    losses = " ".join(f"{x:.6f}" for x in r.get("losses") or [])
    print(f"{path.stem:40s} losses {losses or r.get('build_error')}  worst act err {worst}")
PY
  for log in "$OUT"/e2e-"$target"-*.log; do
    [ -f "${log%.log}.json" ] || { echo "== $log (no result)"; tail -n 15 "$log"; status=1; }
  done
done
# One archive of the runs: the device tool returns a limited number of files.
tar -czf "$OUT/upstream-gpu-runs.tgz" -C "$OUT" $(cd "$OUT" && ls e2e-* setup.log)
rm -f "$OUT"/e2e-* "$OUT/setup.log"
exit "$status"
