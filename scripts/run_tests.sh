#!/usr/bin/env bash
# Set up everything on a fresh machine (virtualenv, core, plugins, test dependencies and the
# services tests need), then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
VENV="${FD_VENV:-.venv}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest "$@"
