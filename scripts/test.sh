#!/usr/bin/env bash
# Runs the CPU test tiers: creates/reuses .venv, installs the project with its test extras, runs
# pytest over tests/unit_tests (GPU / multi-GPU / real-TE tests skip themselves without the
# hardware), then the upstream tier: tests/upstream inside the upstream environment (Python 3.12,
# upstream megatron-core 0.19.2 and upstream main, with this package installed next to them;
# built, or reused from the user's cache, by scripts/upstream_env.sh). Extra arguments go to the first pytest, e.g. `scripts/test.sh -m gpu`
# on a GPU machine; UPSTREAM_TIER=0 skips the upstream tier.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
set +e
"$PY" -m pytest -n "${PYTEST_WORKERS:-auto}" -p no:cacheprovider "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && rc=0  # "no tests collected" (e.g. a marker with nothing to run) is not a failure
if [ "${UPSTREAM_TIER:-1}" = 1 ]; then
  source "$ROOT/scripts/upstream_env.sh"
  set +e
  # The pytest launcher, not `python -m pytest`: the repository root must not be on sys.path,
  # or its megatron/ would shadow the upstream megatron-core under test.
  # Every test is a handful of fresh interpreters; --dist loadfile keeps each file's shared
  # training-run fixtures on one worker, so that no run happens twice. The `alone` tests
  # uninstall this package for a moment, so they run afterwards, by themselves.
  "$UVENV/bin/pytest" -c tests/upstream/pytest.ini --rootdir tests/upstream -p no:cacheprovider \
    -n "${PYTEST_WORKERS:-auto}" --dist loadfile -m "not alone" tests/upstream
  urc=$?
  "$UVENV/bin/pytest" -c tests/upstream/pytest.ini --rootdir tests/upstream -p no:cacheprovider \
    -m alone tests/upstream
  arc=$?
  [ "$urc" -eq 0 ] && urc=$arc
  set -e
  [ "$rc" -eq 0 ] && rc=$urc
fi
exit "$rc"
