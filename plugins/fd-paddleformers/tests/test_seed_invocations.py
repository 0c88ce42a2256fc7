"""FastDeploy's PaddleFormers-backend examples, run as written on a local tiny Qwen3 directory.

The online example is ``fastdeploy serve --model Qwen/Qwen3-4B --model-impl paddleformers
--max-model-len 32768 --max-num-seqs 256 --kv-cache-ratio 0.75 --tensor-parallel-size 1
--gpu-memory-utilization 0.9 --engine-worker-queue-port P --metrics-port M``; the offline one
``LLM(model=..., model_impl="paddleformers", max_model_len=32768)`` then
``llm.chat(messages, SamplingParams(max_tokens=4096, temperature=0.7))`` and
``output.outputs.text``. The directory (a random Qwen3 with 32k positions, a word-level
tokenizer and a ChatML template) is written by transformers in a subprocess
(``hf_reference.py --chat``). Qwen3 is built by PaddleFormers 0.4 only (1.x needs paddlefleet).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest

_MISSING = [name for name in ("paddleformers", "torch", "transformers") if importlib.util.find_spec(name) is None]
if _MISSING:
    pytest.skip(f"{', '.join(_MISSING)} not installed (plugins/fd-paddleformers/README.md)", allow_module_level=True)

from importlib import metadata

if not metadata.version("paddleformers").startswith("0.4"):
    pytest.skip("Qwen3 through the fallback needs PaddleFormers 0.4 (1.x imports paddlefleet)", allow_module_level=True)

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
MESSAGES = [{"role": "user", "content": "Hello how are you ?"}]
STARTUP_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("seed") / "tiny-qwen3")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "hf_reference.py"), "--chat", path],
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


@pytest.fixture(scope="module")
def offline_text(qwen3_dir) -> str:
    from fastdeploy_core import LLM, SamplingParams

    llm = LLM(model=qwen3_dir, model_impl="paddleformers", max_model_len=32768)
    assert type(llm.engine.core.runner.model).__name__ == "PaddleFormersForCausalLM"
    outputs = llm.chat(MESSAGES, SamplingParams(max_tokens=4096, temperature=0.7))
    output = outputs[0]
    text = output.outputs.text
    del llm
    return text


def test_offline_example_chats_through_the_fallback(offline_text):
    words = offline_text.split()
    assert words and all(word.startswith("w") or word in "?!." or word.isalpha() for word in words)


def test_serve_example_flags_serve_chat_and_metrics_through_the_fallback(qwen3_dir, offline_text, tmp_path):
    port, metrics_port, queue_port = free_port(), free_port(), free_port()
    script = os.path.join(os.path.dirname(sys.executable), "fastdeploy")
    command = [script] if os.path.exists(script) else [sys.executable, "-m", "fastdeploy_core.cli"]
    # the example's flags as written, plus --port so the test does not need 8000
    args = [
        *command, "serve", "--model", qwen3_dir, "--model-impl", "paddleformers", "--max-model-len", "32768",
        "--max-num-seqs", "256", "--kv-cache-ratio", "0.75", "--tensor-parallel-size", "1",
        "--gpu-memory-utilization", "0.9", "--engine-worker-queue-port", str(queue_port),
        "--metrics-port", str(metrics_port), "--port", str(port),
    ]  # fmt: skip
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not healthy in {STARTUP_TIMEOUT} s:\n{log_path.read_text()[-4000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        body = {"model": qwen3_dir, "messages": MESSAGES, "max_tokens": 4096, "temperature": 0.7}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
        # same default seed, same engine: the server's sample is the offline one
        assert choice["message"]["content"] == offline_text
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
        assert metrics.status_code == 200 and "fastdeploy:request_success_total" in metrics.text
        log = log_path.read_text()
        assert "served by the paddleformers implementation" in log
        assert "deprecated" not in log  # 0.4's MLP would warn on every step through paddle.incubate's swiglu
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
