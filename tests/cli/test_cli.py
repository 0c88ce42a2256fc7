"""``fastdeploy generate`` / ``chat`` / ``bench latency`` / ``bench throughput`` end to end."""

from __future__ import annotations

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest
from typer.testing import CliRunner

from fastdeploy_core.cli.bench import random_prompts
from fastdeploy_core.cli.generate import parse_engine_flags
from fastdeploy_core.errors import ConfigError

SMALL = ["--max-model-len", "256", "--num-gpu-blocks-override", "8"]


def test_engine_flags_parse_like_serve():
    flags = parse_engine_flags(
        ["--max-num-seqs", "8", "--no-enable-prefix-caching", "--block-size=32", "--enable-chunked-prefill"]
    )
    assert flags == {
        "max_num_seqs": "8",
        "enable_prefix_caching": "false",
        "block_size": "32",
        "enable_chunked_prefill": "true",
    }
    with pytest.raises(ConfigError, match="--bogus: unknown flag"):
        parse_engine_flags(["--bogus", "1"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_engine_flags(["stray"])


def test_random_prompts_are_reproducible():
    a = random_prompts(3, 5, 1000, seed=4)
    assert a == random_prompts(3, 5, 1000, seed=4) and a != random_prompts(3, 5, 1000, seed=5)
    assert all(100 <= t < 900 for row in a for t in row)


@pytest.fixture(scope="module")
def app():
    from fastdeploy_core.cli.main import build_app

    return build_app()


@pytest.mark.slow
def test_generate_and_chat_commands(app):
    runner = CliRunner()
    result = runner.invoke(app, ["generate", "What is the capital of France?", "--max-tokens", "16", *SMALL])
    assert result.exit_code == 0, result.output
    assert "The capital of France is Paris." in result.stdout
    result = runner.invoke(
        app, ["chat", "--max-tokens", "16", *SMALL], input="What is the capital of France?\n/reset\n/exit\n"
    )
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout and "(conversation cleared)" in result.stdout
    result = runner.invoke(app, ["generate", "hi", "--max-num-seqs", "zero"])
    assert result.exit_code == 2 and "max_num_seqs" in result.output


@pytest.mark.slow
def test_bench_commands_report_speeds(app, tmp_path):
    runner = CliRunner()
    out = tmp_path / "lat.json"
    args = [
        "bench",
        "latency",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--batch-size",
        "2",
        "--num-iters-warmup",
        "0",
        "--num-iters",
        "1",
    ]
    result = runner.invoke(app, [*args, *SMALL, "--output-json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["batch_size"] == 2 and data["prefill_tok_s"] > 0 and data["decode_tok_s"] > 0
    assert data["engine"]["num_gpu_blocks"] == 8
    result = runner.invoke(
        app, ["bench", "throughput", "--input-len", "8", "--output-len", "4", "--num-prompts", "3", *SMALL]
    )
    assert result.exit_code == 0, result.output
    assert "requests/s" in result.stdout


def test_serve_takes_the_graph_flags_of_fastdeploy_and_vllm(app, monkeypatch):
    import fastdeploy_core.entrypoints.openai.api_server as api_server

    seen = []
    monkeypatch.setattr(api_server, "run_server", lambda engine_args, server, log_level: seen.append(engine_args))
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "--graph-optimization-config", '{"cudagraph_capture_sizes": [1, 3]}'])
    assert result.exit_code == 0, result.output
    assert seen[-1].graph_opt.enabled and seen[-1].graph_opt.cudagraph_capture_sizes == [1, 3]
    assert runner.invoke(app, ["serve", "--enforce-eager"]).exit_code == 0
    assert not seen[-1].graph_opt.enabled
    assert runner.invoke(app, ["serve", "--no-use-cudagraph"]).exit_code == 0
    assert not seen[-1].graph_opt.enabled
    result = runner.invoke(app, ["serve", "--graph-optimization-config", "{bad"])
    assert result.exit_code == 2 and "graph_optimization_config" in result.output


def test_serve_takes_kv_cache_dtype_in_both_spellings(app, monkeypatch):
    import fastdeploy_core.entrypoints.openai.api_server as api_server

    seen = []
    monkeypatch.setattr(api_server, "run_server", lambda engine_args, server, log_level: seen.append(engine_args))
    runner = CliRunner()
    for spelling in ("bf16", "bfloat16", "BF16"):
        result = runner.invoke(app, ["serve", "--kv-cache-dtype", spelling])
        assert result.exit_code == 0, result.output
        assert seen[-1].cache.kv_cache_dtype == "bfloat16"
    assert runner.invoke(app, ["serve"]).exit_code == 0 and seen[-1].cache.kv_cache_dtype == "auto"
    result = runner.invoke(app, ["serve", "--kv-cache-dtype", "fp8"])
    assert result.exit_code == 2 and "kv_cache_dtype" in result.output
