"""Tiny random-weight Llama checkpoints with SmolLM2's real tokenizer, for engine tests.

CPU attention in vLLM needs a supported head size, so heads are 32 wide. `sharpness` scales the output layer:
random weights give near-uniform next-token distributions, where drafts are almost never accepted at
temperature > 0; a sharper head makes some tokens likely, so speculative sampling has something to accept.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_model(target: Path, tokenizer_dir: Path, *, vocab_size: int, seed: int,
                     sharpness: float = 1.0, layers: int = 2) -> Path:
    """Writes config.json, model.safetensors and the tokenizer into `target` (created) and returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, target / name)
    return target
