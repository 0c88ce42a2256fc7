"""The README's offline example, run as written: it prints the answer its comment promises and
the process exits cleanly (it used to abort with 134 while freeing a captured step at exit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_readme_python_example_prints_paris_and_exits_cleanly(tmp_path):
    text = README.read_text(encoding="utf-8")
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert "print(out[0].outputs.text)" in code and "# The capital of France is Paris." in code
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "The capital of France is Paris.\n"
