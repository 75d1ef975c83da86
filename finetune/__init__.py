"""finetune: know what fits, pick the strategy, and run one correct, resumable training loop."""

__version__ = "0.1.0"
