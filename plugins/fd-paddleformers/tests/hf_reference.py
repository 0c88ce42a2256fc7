"""Build tiny random checkpoints with transformers and record its greedy tokens (run as a script).

``python hf_reference.py OUT_DIR [NAME ...]`` writes one HF directory per entry of :data:`CHECKPOINTS`
(or the named ones)
under ``OUT_DIR`` and ``OUT_DIR/reference.json`` with transformers' greedy tokens for
:data:`PROMPTS` (and its logits after :data:`LOGITS_PROMPT`). It runs in its own process because importing PaddleFormers (as the fallback
does) hides torch from transformers in that process.
"""

from __future__ import annotations

import json
import os
import sys

MAX_NEW = 32
#: the prompt whose last-token logits are recorded (compared to 1e-4)
LOGITS_PROMPT = 1
PROMPTS = [
    [5, 9, 17, 33, 2, 7, 100, 64, 3],
    [5, 9, 17, 33, 2, 7, 100, 64, 3, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],  # shares 9 tokens
    [1],
    [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110],
    [12, 12, 12, 12, 30],
]
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.3,  # peaky logits: no near-ties between float32 stacks
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
ROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=1000.0))  # not any family's default
#: name -> (transformers config class, model class, extra config). Llama, Qwen2/3(-MoE) and
#: ERNIE-4.5 have native classes too; Phi3 has none; Mistral and (on PaddleFormers 1.x) the
#: Qwen families are architectures PaddleFormers cannot build here. A non-default rope_theta
#: and hidden dims that differ from each other catch config keys read from the wrong place.
CHECKPOINTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, **ROPE)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=None, tie_word_embeddings=False)),
    "ernie4_5": (
        "Ernie4_5Config",
        "Ernie4_5ForCausalLM",
        dict(head_dim=16, tie_word_embeddings=True, use_bias=False, **ROPE),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False, **ROPE)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False, **ROPE)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            **ROPE,
        ),
    ),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            head_dim=16,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=32,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=1,
            moe_layer_interval=1,
            use_bias=False,
            tie_word_embeddings=True,
            **ROPE,
        ),
    ),
    # MLA (q through a low-rank pair, V narrower than Q/K), YaRN with distinct mscales (the
    # softmax scale differs from qk_head_dim**-0.5), interleaved rotary pairs, 4 experts in 2
    # groups (the best 1 group), sigmoid routing with random correction biases, a dense first layer
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=0.7,
            ),
        ),
    ),
}
# DeepSeek-V3 with q from one projection (q_lora_rank null: PaddleFormers builds an unused q norm)
CHECKPOINTS["deepseek_v3_q_proj"] = (
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    dict(CHECKPOINTS["deepseek_v3"][2], q_lora_rank=None, num_experts_per_tok=3, topk_group=2, norm_topk_prob=False),
)
#: checkpoint -> routers whose correction biases start at zero in transformers: made random so they choose
RANDOM_CORRECTION_BIAS = {name: "mlp.gate.e_score_correction_bias" for name in ("deepseek_v3", "deepseek_v3_q_proj")}


def main(out_dir: str, names: list[str]) -> None:
    # PaddleFormers' dependency paddlecodec installs a module named torchcodec without its
    # package metadata, which transformers' audio utilities trip over; nothing here needs it.
    sys.modules.setdefault("torchcodec", None)
    import torch
    import transformers

    reference = {
        "prompts": PROMPTS,
        "max_new": MAX_NEW,
        "logits_prompt": LOGITS_PROMPT,
        "tokens": {},
        "logits": {},
        "paths": {},
    }
    for name, (config_cls, model_cls, extra) in CHECKPOINTS.items():
        if names and name not in names:
            continue
        config = getattr(transformers, config_cls)(**{**COMMON, **extra})
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config).eval()
        if name in RANDOM_CORRECTION_BIAS:
            with torch.no_grad():
                for key, tensor in model.state_dict().items():
                    if key.endswith(RANDOM_CORRECTION_BIAS[name]):
                        tensor.copy_(0.3 * torch.randn(tensor.shape))
        path = os.path.join(out_dir, name)
        model.save_pretrained(path)
        runs = []
        with torch.no_grad():
            for prompt in PROMPTS:
                out = model.generate(
                    torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
                )
                runs.append(out[0, len(prompt) :].tolist())
            logits = model(torch.tensor([PROMPTS[LOGITS_PROMPT]])).logits[0, -1]
        reference["tokens"][name] = runs
        reference["logits"][name] = logits.tolist()
        reference["paths"][name] = path
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(reference, f)


#: the words of the chat checkpoint's tokenizer (ids 3..127 after [UNK], <|im_start|>, <|im_end|>)
CHAT_WORDS = ["user", "assistant", "system", "Hello", "how", "are", "you", "?", "!", "."] + [
    f"w{i}" for i in range(115)
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def write_chat_checkpoint(path: str) -> None:
    """A tiny random Qwen3 directory a chat request can run on: 32k positions, a word-level
    tokenizer with ChatML special tokens, eos = ``<|im_end|>``."""
    sys.modules.setdefault("torchcodec", None)
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.Qwen3Config(
        **dict(COMMON, max_position_embeddings=32768, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        head_dim=32,
        tie_word_embeddings=False,
        **ROPE,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(path)
    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({word: 3 + i for i, word in enumerate(CHAT_WORDS)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "[UNK]", "chat_template": CHATML}, f
        )


if __name__ == "__main__":
    if sys.argv[1] == "--chat":
        write_chat_checkpoint(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2:])
