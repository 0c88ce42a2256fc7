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
status=0
"$VENV/bin/python" -m pytest "$@" || status=$?
# The PaddleFormers generation the default install does not use (1.x: Llama, Phi3, ERNIE-4.5)
# gets the fallback's tests in a virtualenv of its own (~5 min to build once, ~1-2 min to run);
# it runs with the whole suite: when every argument is an option (-q, -x, ...), not when a
# test path or an option's value (-k EXPR) chooses tests. FD_SKIP_OTHER_PADDLEFORMERS=1 skips it.
whole_suite=1
for arg in "$@"; do
  case "$arg" in -*) ;; *) whole_suite=0 ;; esac
done
if [ "$whole_suite" = 1 ] && [ "${FD_SKIP_OTHER_PADDLEFORMERS:-0}" != "1" ]; then
  OTHER="${VENV}-paddleformers1"
  FD_VENV="$OTHER" FD_PADDLEFORMERS=1.2.0 bash scripts/setup_env.sh test
  "$OTHER/bin/python" -m pytest "$@" plugins/fd-paddleformers/tests || status=$?
fi
exit "$status"
