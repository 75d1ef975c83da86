"""Shared test fixtures: offline environment, tiny models built from catalog shapes, fresh Accelerate state."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; each test builds its own Accelerator from scratch."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def tiny_llama(seed: int = 0, vocab_size: int = 64, layers: int = 2, hidden: int = 32):
    """A 2-layer Llama shrunk from the catalog's `tiny` entry (same class, same module names)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.catalog.models import get

    config = get("tiny").to_hf_config_dict() | {
        "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4, "vocab_size": vocab_size,
    }
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="sdpa")
