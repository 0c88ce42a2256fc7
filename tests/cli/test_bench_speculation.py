"""``fastdeploy bench latency`` with speculative decoding reports what speculation did."""

from __future__ import annotations

import json

import pytest

from fastdeploy_core.cli.bench import speculation_line
from tests.support.clean_exit import assert_clean_exit, run_cli


def test_speculation_line_reads_the_engines_counters():
    stats = {
        "spec_decode_method": "ngram",
        "spec_decode_num_draft_tokens_total": 40,
        "spec_decode_num_accepted_tokens_total": 10,
        "spec_decode_num_emitted_tokens_total": 30,
        "spec_decode_draft_acceptance_rate": 0.25,
        "spec_decode_mean_accepted_length": 1.5,
    }
    line = speculation_line(stats)
    assert line == (
        "Speculative decoding (ngram): 40 draft tokens proposed, 10 accepted (acceptance rate 25.0%); "
        "mean accepted length 1.50 tokens per speculating step"
    )
    assert speculation_line({}) is None


@pytest.mark.slow
def test_bench_latency_prints_and_saves_the_speculation_counters(tmp_path):
    out = tmp_path / "latency.json"
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "max_ngram_size": 3, "min_ngram_size": 1})
    proc = run_cli(
        "bench", "latency", "--input-len", "16", "--output-len", "24", "--batch-size", "2",
        "--num-iters-warmup", "0", "--num-iters", "1", "--output-json", str(out),
        "--max-model-len", "256", "--max-num-seqs", "4", "--speculative-config", spec,
    )
    assert_clean_exit(proc)
    stats = json.loads(out.read_text())["speculative_decoding"]
    assert stats["spec_decode_method"] == "ngram"
    assert stats["spec_decode_num_draft_tokens_total"] >= stats["spec_decode_num_accepted_tokens_total"] >= 0
    assert speculation_line(stats) in proc.stdout, proc.stdout
    plain = run_cli(
        "bench", "latency", "--input-len", "8", "--output-len", "4", "--batch-size", "1",
        "--num-iters-warmup", "0", "--num-iters", "1", "--max-model-len", "256", "--max-num-seqs", "4",
    )
    assert_clean_exit(plain)
    assert "Speculative decoding" not in plain.stdout
