"""Offline scripts run the way a user runs them: a fresh interpreter, exit status 0, and nothing
on stderr from teardown.

Captured decode steps hold the model's weights in the cpu kernels' registry; released during
the interpreter's teardown, after Paddle has dismantled its eager mode, the release failed in
C++ and every script ended in SIGABRT (status 134) after printing its answer. In-process tests
cannot see that, so each case here is a subprocess.
"""

from __future__ import annotations

import pytest

from tests.support.clean_exit import assert_clean_exit, run_script


@pytest.mark.slow
def test_readme_example_exits_cleanly_and_logs_its_kv_budget():
    """The README's example as written (default model, decode steps captured)."""
    proc = run_script(
        """
        from fastdeploy_core import LLM, SamplingParams

        llm = LLM()
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=32))
        print(out[0].outputs.text)
        print("graphs:", llm.engine.core.runner.graphs.captured_sizes)
        """
    )
    assert_clean_exit(proc)
    assert "The capital of France is Paris." in proc.stdout
    assert "graphs: [1]" in proc.stdout  # the decode step was captured, so its release ran at exit
    kv_lines = [line for line in proc.stderr.splitlines() if "KV cache:" in line]
    assert len(kv_lines) == 1, proc.stderr[-3000:]
    assert "cpu memory is the host's: the smaller of 25% of" in kv_lines[0]
    assert "64 sequences of max_model_len need 23040 MiB" in kv_lines[0]  # 8192 tokens x 45 KiB x 64


@pytest.mark.slow
def test_quantized_engine_and_two_engines_in_one_process_exit_cleanly():
    """A wint4 engine and a float one alive together, both with captured steps; the first is
    closed (refusing further use with a typed error), the second is left to the exit."""
    proc = run_script(
        """
        from fastdeploy_core import LLM, SamplingParams
        from fastdeploy_core.errors import EngineDeadError

        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        quantized = LLM(quantization="wint4", max_model_len=512, kv_cache_memory="64MiB")
        plain = LLM(max_model_len=512, max_num_seqs=4)
        a = quantized.generate(["The sky is", "Paris is"], greedy, use_tqdm=False)
        b = plain.generate("The sky is", greedy)
        print("tokens:", [len(o.outputs.token_ids) for o in a + b])
        print("graphs:", quantized.engine.core.runner.graphs.captured_sizes,
              plain.engine.core.runner.graphs.captured_sizes)
        print("blocks:", quantized.engine.core.runner.num_blocks, plain.engine.core.runner.num_blocks)
        with quantized:
            pass
        try:
            quantized.generate("again", greedy)
        except EngineDeadError as exc:
            print("closed:", exc)
        quantized.close()  # a second close is harmless
        """
    )
    assert_clean_exit(proc)
    assert "tokens: [8, 8, 8]" in proc.stdout
    assert "graphs: [2] [1]" in proc.stdout  # the two prompts decode together
    # 64 MiB of 64-token blocks of 45 KiB per token (int8 weights do not change the KV);
    # 4 sequences of 512 tokens: 32 blocks, under 25% of any RAM this test runs on.
    assert "blocks: 22 32" in proc.stdout
    assert "closed: this LLM was closed; create a new LLM(...) to generate again" in proc.stdout
