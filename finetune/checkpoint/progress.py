"""Where a run is, in the units resume needs: updates, epoch, micro-batches into the epoch, tokens."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Progress:
    """Where the run is; saved with every checkpoint (`accelerator.register_for_checkpointing`)."""

    step: int = 0  # optimizer updates done
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of `epoch` already consumed on each rank
    tokens_seen: int = 0  # target tokens trained on, all ranks

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, int(value))
