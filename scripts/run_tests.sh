#!/usr/bin/env bash
# Set up everything on a fresh machine (virtualenv, core, plugins, test dependencies and the
# services tests need), then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
# The global scheduler's tests start their own redis-server (Debian's package).
if ! command -v redis-server >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq redis-server
fi
VENV="${FD_VENV:-.venv}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest "$@"
