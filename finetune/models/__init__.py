"""What --model is and how it loads: catalog, GGUF import, loading (full / LoRA / QLoRA), skeleton."""
