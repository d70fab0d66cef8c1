#!/usr/bin/env bash
# The whole single-GPU tier in one go, for machines that already have CUDA torch (e.g. the H200
# machines of ../shared/gpu/README.md, with Transformer Engine from .te-bundle when present):
# GPU tests, the activation audit and the kernel benchmark. Logs and JSON go to $OUT (default
# ./gpu-out); the exit status is non-zero if the tests or the audit failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ -f .te-bundle/setup-te.sh ]; then
  # shellcheck disable=SC1091
  source .te-bundle/setup-te.sh > "$OUT/setup.log" 2>&1 || echo "TE setup failed: $OUT/setup.log"
fi
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -m "gpu and not multigpu" tests/unit_tests -n "${GPU_TEST_WORKERS:-8}" \
  -p no:cacheprovider -rfs > "$OUT/gpu_tests.log" 2>&1
tests_rc=$?
tail -5 "$OUT/gpu_tests.log"
# The compile contracts also run unmarked on the CPU tier; here they meet the GPU machine's torch,
# usually another release than CI's, whose Dynamo traces the entry points differently.
python3 -m pytest tests/unit_tests/mcore_activations/fusions/test_entry_point_contracts.py \
  tests/unit_tests/mcore_activations/fusions/test_entry_point_properties.py \
  tests/unit_tests/mcore_activations/fusions/test_compile_safety.py \
  -n "${GPU_TEST_WORKERS:-8}" -p no:cacheprovider -rfs > "$OUT/compile_contracts.log" 2>&1 || tests_rc=1
tail -3 "$OUT/compile_contracts.log"
python3 -m megatron.core.transformer.activation_audit --json "$OUT/audit.json" > "$OUT/audit.txt" 2>&1
audit_rc=$?
grep -v "^ \|Traceback\|Warning" "$OUT/audit.txt" | head -40
python3 tools/benchmark_activations.py --suite full --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
tail -8 "$OUT/bench.txt"
echo "tests rc=$tests_rc audit rc=$audit_rc"
[ "$tests_rc" -eq 0 ] && [ "$audit_rc" -eq 0 ]
