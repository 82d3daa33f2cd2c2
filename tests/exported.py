"""The model whose weights the memory-capped export writes (tests/cap_worker.py, tests/test_memory_cap.py)."""

from __future__ import annotations

import torch


def exported_model() -> torch.nn.Module:
    """A ``transformers`` Llama of 135 M parameters (517 MiB in float32), on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=16000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)
