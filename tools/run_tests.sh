#!/usr/bin/env bash
# Install (into .venv, reused if present; MM_DEPS=latest: .venv-latest, see setup_env.sh) and run the whole test suite: every package's tests plus the
# cross-package tests. Extra arguments go to pytest. Exit status 5 (no tests collected) is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
source tools/_env_name.sh
set +e
OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "run_tests: pytest collected no tests; treating that as a failure" >&2
  exit 1
fi
exit $rc
