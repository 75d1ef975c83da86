"""What each objective computes from a micro-batch: the loss the loop backpropagates, and its rewards.

The loop (train/loop.py) asks an objective three things: how many units a micro-batch holds
(`count`), what to do before a window's first forward (`start_window`), and the micro-batch's loss as
a sum over its units divided by the window's units on all ranks (`loss`). Supervised fine-tuning's
unit is a target token and its loss is the model's own forward, exactly as before objectives
existed. A preference objective's unit is an example (a pair, or a labelled row): every example of
an optimizer step weighs the same, whichever micro-batch or rank it sits on, so micro 4 × accum 1 ≡
micro 1 × accum 4 ≡ 2 ranks × micro 2 for these too. Its loss reads one log-probability per
sequence: the sum of its answer tokens' log-probabilities (train/log_probs.py), or their mean for
the objectives that normalise by length (config/objectives.py says which).

KTO compares each reward with a KL estimate: the mean, over the window's examples on every rank, of
the policy's log-ratio to the reference on mismatched sequences (data/preference.py), without
gradients and clamped at 0 (as TRL's KTOTrainer estimates it per micro-batch; per window here, so
the split into micro-batches and ranks changes nothing for KTO either).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from finetune.config.names import IGNORE_INDEX
from finetune.config.objectives import OBJECTIVES, Objective, beta_of
from finetune.train.log_probs import sequence_log_probs

if TYPE_CHECKING:
    from finetune.config.options import TrainConfig
    from finetune.train.parallel import LossRanks
    from finetune.train.reference import Reference


def count_target_tokens(batch: dict) -> torch.Tensor:
    """Tokens that contribute to the loss: labels shifted by one (as the model's loss does), not ignored."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


class Supervised:
    """Cross-entropy on the answer tokens through the model's own forward (or the chunked loss / Liger
    that replace it): one unit per target token."""

    objective = OBJECTIVES["sft"]

    def count(self, batch: dict) -> torch.Tensor:
        return count_target_tokens(batch)

    def start_window(self, model: torch.nn.Module, window: list[dict], ranks: LossRanks) -> None:
        pass

    def loss(self, model: torch.nn.Module, batch: dict, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(sum of the batch's token losses / total, the model's load-balancing loss or None)."""
        out = model(**batch, num_items_in_batch=total)
        return out.loss, getattr(out, "aux_loss", None)


@dataclass(frozen=True)
class Settings:
    """A preference objective's knobs, resolved from the flags."""

    beta: float
    dpo_loss: str = "sigmoid"
    simpo_gamma: float = 0.5

    @classmethod
    def of(cls, config: TrainConfig) -> Settings:
        return cls(beta=beta_of(config.objective, config.beta), dpo_loss=config.dpo_loss, simpo_gamma=config.simpo_gamma)


@dataclass
class Scores:
    """Per-example results of a preference loss: the loss, and the rewards it compares (chosen and
    rejected for pairs; for labelled rows the row's reward as `chosen`, `rejected` unused)."""

    loss: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor


def _split(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pair batch's values: chosen rows first, rejected rows second (data/collate.PreferenceCollator)."""
    half = values.size(0) // 2
    return values[:half], values[half:]


def dpo_scores(s: Settings, policy: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor) -> Scores:
    """DPO with h = (chosen − rejected) log-ratio to the reference: sigmoid −log σ(βh), IPO (h − 1/2β)²
    on mean log-probabilities (the IPO paper's length normalisation, as TRL), hinge max(0, 1 − βh)."""
    if s.dpo_loss == "ipo":
        policy, reference = policy / tokens, reference / tokens
    chosen, rejected = _split(policy - reference)
    h = chosen - rejected
    loss = {"sigmoid": lambda: -F.logsigmoid(s.beta * h), "ipo": lambda: (h - 1 / (2 * s.beta)) ** 2,
            "hinge": lambda: torch.relu(1 - s.beta * h)}[s.dpo_loss]()
    return Scores(loss, s.beta * chosen.detach(), s.beta * rejected.detach())


def simpo_scores(s: Settings, policy: torch.Tensor, tokens: torch.Tensor) -> Scores:
    """SimPO: −log σ(β·(chosen − rejected mean log-probability) − γ)."""
    chosen, rejected = _split(policy / tokens)
    loss = -F.logsigmoid(s.beta * (chosen - rejected) - s.simpo_gamma)
    return Scores(loss, s.beta * chosen.detach(), s.beta * rejected.detach())


def orpo_scores(s: Settings, policy: torch.Tensor, tokens: torch.Tensor) -> Scores:
    """ORPO: the chosen answer's mean token cross-entropy, plus β × −log σ(log odds(chosen) − log
    odds(rejected)), the odds of a mean log-probability m being e^m / (1 − e^m)."""
    chosen, rejected = _split(policy / tokens)
    log_odds = (chosen - rejected) - (_log_one_minus_exp(chosen) - _log_one_minus_exp(rejected))
    loss = -chosen - s.beta * F.logsigmoid(log_odds)
    return Scores(loss, s.beta * chosen.detach(), s.beta * rejected.detach())


def _log_one_minus_exp(m: torch.Tensor) -> torch.Tensor:
    """log(1 − eᵐ) for a mean log-probability m < 0, accurate near 0 (expm1), finite at m = 0 (a certain
    answer: its odds are capped rather than infinite)."""
    return torch.log(-torch.expm1(m.clamp(max=-1e-6)))


def kto_scores(s: Settings, policy: torch.Tensor, reference: torch.Tensor, desirable: torch.Tensor,
               kl: torch.Tensor) -> Scores:
    """KTO: 1 − σ(β(r − z)) for a desirable row, 1 − σ(β(z − r)) for another, r its log-ratio to the
    reference and z the KL estimate (`kl`, no gradient)."""
    ratio = policy - reference
    loss = torch.where(desirable, 1 - torch.sigmoid(s.beta * (ratio - kl)), 1 - torch.sigmoid(s.beta * (kl - ratio)))
    return Scores(loss, s.beta * ratio.detach(), torch.zeros_like(ratio))


class Preference:
    """A preference objective in the loop: the reference's log-probabilities (train/reference.py), the
    policy's, and the objective's loss over them; one unit per example."""

    def __init__(self, objective: Objective, settings: Settings, reference: Reference | None):
        self.objective, self.settings, self.reference = objective, settings, reference
        self.kl = torch.zeros(())

    def count(self, batch: dict) -> torch.Tensor:
        rows = batch["input_ids"].size(0)
        return torch.tensor(rows // self.objective.sequences, device=batch["input_ids"].device)

    def start_window(self, model: torch.nn.Module, window: list[dict], ranks: LossRanks) -> None:
        """KTO: the window's KL estimate, from its mismatched sequences on every rank."""
        if self.objective.policy_no_grad_sequences == 0:
            return
        with torch.no_grad():
            ratios = [sequence_log_probs(model, b, "kl_")[0] - self.reference.log_probs(model, b, "kl_") for b in window]
        ratios = torch.cat(ratios).double()
        total = ranks.sum_over_rows(torch.stack([ratios.sum(), torch.tensor(float(ratios.numel()), device=ratios.device,
                                                                             dtype=torch.float64)]))
        self.kl = (total[0] / total[1]).clamp(min=0).float()

    def scores(self, model: torch.nn.Module, batch: dict) -> Scores:
        """The micro-batch's per-example loss and rewards."""
        policy, tokens = sequence_log_probs(model, batch)
        reference = self.reference.log_probs(model, batch) if self.reference is not None else None
        return score(self.objective, self.settings, policy, tokens, reference, batch.get("desirable"), self.kl)

    def loss(self, model: torch.nn.Module, batch: dict, total: torch.Tensor) -> tuple[torch.Tensor, None]:
        """(sum of the micro-batch's example losses / total, None: no load-balancing loss is added)."""
        return self.scores(model, batch).loss.sum() / total, None


def _kto(s: Settings, policy, tokens, reference, desirable, kl) -> Scores:
    return kto_scores(s, policy, reference, desirable, kl.to(policy.device, policy.dtype))


# objective name → its per-example loss and rewards from (settings, policy log-probability sums, answer
# tokens, reference sums, desirable, KL estimate); config/objectives.OBJECTIVES holds what each reads
SCORES = {
    "dpo": lambda s, policy, tokens, reference, desirable, kl: dpo_scores(s, policy, reference, tokens),
    "simpo": lambda s, policy, tokens, reference, desirable, kl: simpo_scores(s, policy, tokens),
    "orpo": lambda s, policy, tokens, reference, desirable, kl: orpo_scores(s, policy, tokens),
    "kto": _kto,
}


def score(objective: Objective, s: Settings, policy: torch.Tensor, tokens: torch.Tensor, reference: torch.Tensor | None,
          desirable: torch.Tensor | None = None, kl: torch.Tensor | None = None) -> Scores:
    """`objective`'s per-example loss and rewards from per-sequence log-probability sums."""
    reference = reference.to(policy.dtype) if reference is not None else None
    return SCORES[objective.name](s, policy, tokens.to(policy.dtype), reference, desirable, kl)


def build_objective(config: TrainConfig, reference: Reference | None) -> Supervised | Preference:
    """The loop's objective for `config.objective`."""
    objective = OBJECTIVES[config.objective]
    if not objective.preference:
        return Supervised()
    return Preference(objective, Settings.of(config), reference)
