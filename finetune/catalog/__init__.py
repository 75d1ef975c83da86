"""Static tables the planner and the loader share: model architectures and GPUs (no torch)."""
