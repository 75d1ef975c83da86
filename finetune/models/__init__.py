"""What --model is, torch-free: the catalog (architectures), families (one entry per model family), source
(one answer to what --model names) and GGUF import. Loading the weights belongs to train/ (loading.py)."""
