#!/usr/bin/env bash
# Set up everything on a fresh machine, then serve the embedded default model
# (SmolLM2-135M-Instruct) on http://0.0.0.0:8000 with the OpenAI-compatible API.
# Extra arguments go to `fastdeploy serve` (e.g. --port 9000 --model /path/to/model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV="${FD_VENV:-.venv}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
exec "$VENV/bin/fastdeploy" serve "$@"
