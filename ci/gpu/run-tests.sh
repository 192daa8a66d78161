#!/usr/bin/env bash
# Step 4 (GPU machine, repo root): the GPU-marked tests, through nox when it is installed, else the same pytest
# selection. Arguments go to pytest. See ci/gpu/README.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source ci/gpu/env.sh
WAIT_BUILD=1 ci/gpu/setup.sh
if ! python3 -c "import vllm" 2>/dev/null; then
  echo "run-tests.sh: vLLM is not unpacked yet (all bundle parts must have travelled: see ci/gpu/README.md)" >&2
  exit 2
fi
if PYTHONPATH=/tmp/nox-site:$PYTHONPATH python3 -c "import nox" 2>/dev/null; then
  # the session drops QUANTPACK_NOX_SITE from the tests' PYTHONPATH again (see noxfile.py)
  export QUANTPACK_NOX_SITE=/tmp/nox-site
  PYTHONPATH=/tmp/nox-site:$PYTHONPATH exec python3 -m nox -s gpu-tests -- "$@"
fi
# as the nox session: test files among the arguments narrow the selection, otherwise every GPU test
paths=(packages/quantpack-core/tests packages/quantpack-exl3/tests packages/quantpack-escha-rocm/tests)
for a in "$@"; do case "$a" in *.py | *.py::*) paths=() ;; esac; done
# the same report as the nox session's (ci/gpu/matrix_table.py)
PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} $(gpu_card_opt)" exec python3 -m pytest -ra -p no:cacheprovider --durations=15 --junitxml="$(gpu_report)" -m gpu "${paths[@]}" "$@"
