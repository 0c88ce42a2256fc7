"""``fastdeploy chat`` tells how to leave, ends its line on Ctrl-D and marks an answer cut at
``--max-tokens``."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

SMALL = ["--max-model-len", "256", "--num-gpu-blocks-override", "8"]


@pytest.mark.slow
def test_chat_hint_ctrl_d_newline_and_cut_marker(monkeypatch):
    import typer.testing

    from fastdeploy_core.cli.generate import CHAT_HINT
    from fastdeploy_core.cli.main import build_app

    app = build_app()
    runner = CliRunner()
    question = "What is the capital of France?\n"
    with monkeypatch.context() as typed:  # input from a terminal: prompts, and its end is Ctrl-D
        typed.setattr(typer.testing._NamedTextIOWrapper, "isatty", lambda self: True, raising=False)
        result = runner.invoke(app, ["chat", "--max-tokens", "3", *SMALL], input=question)
    assert result.exit_code == 0, result.output
    assert CHAT_HINT in result.stderr and "/exit or Ctrl-D quits" in CHAT_HINT
    # the answer, cut after 3 tokens and marked; then the prompt again, and Ctrl-D ends its line
    assert result.stdout == ">>> The capital of [cut at --max-tokens 3]\n>>> \n"
    result = runner.invoke(app, ["chat", "--max-tokens", "32", *SMALL], input=question)
    assert result.exit_code == 0, result.output
    assert result.stdout == "The capital of France is Paris.\n"  # finished on its own: no marker
