#!/usr/bin/env bash
# Build llama.cpp's native `llama-server` into benchmarks/.peers/llamacpp-native/ (the llama.cpp
# peer of serve_vs_llamacpp.py), from the llama.cpp source vendored in llama-cpp-python's sdist
# (fetched from the package index: no other download). ggml is built for this CPU
# (GGML_NATIVE). On CPUs with AMX, ggml's AMX Q4_1 kernel died with SIGILL at `tilezero` on an
# earlier machine of this project, so there ggml-cpu is built with -mno-amx-tile -mno-amx-int8
# -mno-amx-bf16 (its AVX-512 kernels run); build/variant.txt says which was built.
#
#   benchmarks/build_llama_server.sh [VERSION]     # default 0.3.36; a few minutes on 2 cores
set -euo pipefail
cd "$(dirname "$0")"
VERSION="${1:-0.3.36}"
OUT=.peers/llamacpp-native
SRC=.peers/llamacpp-src
mkdir -p "$OUT" "$SRC"
if [ ! -d "$SRC/llama_cpp_python-$VERSION" ]; then
  python3 - "$VERSION" "$SRC" <<'PY'
import json, subprocess, sys, tarfile, urllib.parse, urllib.request
version, dest = sys.argv[1], sys.argv[2]
index = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                       capture_output=True, text=True).stdout.strip() or "https://pypi.org/simple"
api = urllib.parse.urljoin(index.rstrip("/") + "/", "../pypi/llama-cpp-python/json")
meta = json.load(urllib.request.urlopen(api, timeout=60))
files = meta.get("releases", {}).get(version) or (meta["urls"] if meta["info"]["version"] == version else [])
sdists = [u for u in files if u["packagetype"] == "sdist"]
if not sdists:
    raise SystemExit(f"no sdist of llama-cpp-python {version} on {api}")
sdist = sdists[0]
url = urllib.parse.urljoin(api, sdist["url"])
path = f"{dest}/llama_cpp_python-{version}.tar.gz"
urllib.request.urlretrieve(url, path)
with tarfile.open(path) as tar:
    tar.extractall(dest, filter="data")
PY
fi
LLAMA="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"
flags=""
variant="GGML_NATIVE"
if grep -qw amx_tile /proc/cpuinfo; then
  flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  variant="GGML_NATIVE with $flags (this CPU has AMX)"
fi
cmake -S "$LLAMA" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" >"$SRC/cmake.log" 2>&1
cmake --build "$SRC/build" --target llama-server -j 2 >"$SRC/build.log" 2>&1
cp "$SRC/build/bin/llama-server" "$OUT/llama-server"
cp "$SRC/build/bin/"*.so "$OUT/" 2>/dev/null || true
echo "llama.cpp from llama-cpp-python $VERSION, $variant, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)" \
  >"$OUT/variant.txt"
cat "$OUT/variant.txt"
