"""Tiny randomly initialised causal LMs, saved as model directories the engine can load.

They borrow the default model's tokenizer (so text round-trips) and use a larger weight scale
than usual so their logits are peaked: greedy decoding then has no near-ties that float
rounding could flip, and token-for-token comparisons stay meaningful.
"""

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def make_tiny_model(arch: str, out_dir: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    elif arch == "llama":
        config = LlamaConfig(**common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":
        # Qwen2's q/k/v projections carry a bias; make it nonzero so the test exercises it.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out_dir / name)
    return out_dir
