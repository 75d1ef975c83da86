"""A trained run to one model: safetensors, GGUF, model card, Hub."""
