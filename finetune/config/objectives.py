"""The training objectives, one table: what each reads, what it needs beside the policy, what it holds.

`--objective` names a row of OBJECTIVES. Everything that depends on the objective reads the row
instead of comparing names: the data layer (which rows it prepares: single, paired or labelled),
the loop (train/objectives.py holds each row's loss, by `name`), the reference (train/reference.py:
whether one is needed and how many sequences it reads), and the planner (plan/memory.py and
plan/speed.py: sequences per example forward and backward, sequences read without gradients). So a
new objective is a row here, its loss in train/objectives.py, and, if it reads rows of a new shape,
their format in data/preference.py.

Supervised fine-tuning has three forms, which hold its token log-probabilities differently
(LOSS_FORMS, named as config/switches.py resolves them). A preference objective reads one log-
probability per sequence instead, and computes it through the LM head in chunks wherever the
supervised run would not hold the full-vocabulary logits (`log_prob_form`).

Torch-free like the rest of config/.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Objective:
    """One training objective. Sequences are counted per example: a supervised row, a preference pair
    (prompt, chosen, rejected), or a labelled row (prompt, completion, desirable or not)."""

    name: str
    summary: str  # one line: --help, the docs' table
    rows: str  # what an example is: "single", "paired" or "labelled" (data/preference.py reads them)
    sequences: int  # sequences per example that run forward and backward: a pair's two answers
    reference_sequences: int  # sequences per example the reference model reads (0: no reference)
    policy_no_grad_sequences: int  # sequences per example the policy reads without gradients (KTO's mismatched rows)
    log_probs: str  # what its loss reads per sequence: "tokens" (every token's loss), "sum" or "mean" of log-probs
    default_beta: float | None  # the strength of the preference (TRL's defaults); None: no such knob
    loss_count: str  # what every example of an optimizer step weighs the same as: "token" or "example"

    @property
    def preference(self) -> bool:
        return self.rows != "single"

    @property
    def reference(self) -> bool:
        """Whether the loss compares the policy with the reference model (the weights before training)."""
        return self.reference_sequences > 0

    def rows_per_example(self) -> int:
        """Sequences one example puts through the policy per forward, with and without gradients."""
        return self.sequences + self.policy_no_grad_sequences


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective("sft", "supervised fine-tuning: cross-entropy on the answer's tokens", rows="single", sequences=1,
              reference_sequences=0, policy_no_grad_sequences=0, log_probs="tokens", default_beta=None, loss_count="token"),
    Objective("dpo", "Direct Preference Optimization: the chosen answer's log-likelihood ratio to the reference above "
              "the rejected one's (--dpo-loss sigmoid, ipo or hinge)", rows="paired", sequences=2, reference_sequences=2,
              policy_no_grad_sequences=0, log_probs="sum", default_beta=0.1, loss_count="example"),
    Objective("simpo", "SimPO: the chosen answer's mean token log-probability above the rejected one's by a margin "
              "(--simpo-gamma); no reference", rows="paired", sequences=2, reference_sequences=0,
              policy_no_grad_sequences=0, log_probs="mean", default_beta=2.0, loss_count="example"),
    Objective("orpo", "ORPO: cross-entropy on the chosen answer plus its odds ratio over the rejected one; no reference",
              rows="paired", sequences=2, reference_sequences=0, policy_no_grad_sequences=0, log_probs="mean",
              default_beta=0.1, loss_count="example"),
    Objective("kto", "KTO: each answer labelled desirable or not, its log-likelihood ratio to the reference against the "
              "batch's KL estimate (paired rows count as one of each)", rows="labelled", sequences=1,
              reference_sequences=2, policy_no_grad_sequences=1, log_probs="sum", default_beta=0.1, loss_count="example"),
)}

# --dpo-loss: what DPO does with h = (chosen − rejected log-ratio to the reference)
DPO_LOSSES = ("sigmoid", "ipo", "hinge")


@dataclass(frozen=True)
class LossForm:
    """How a run computes its token log-probabilities (config/switches.LOSSES names them)."""

    name: str
    holds_logits: bool  # the full-vocabulary logits of a micro-batch exist at once
    where: str


LOSS_FORMS: dict[str, LossForm] = {f.name: f for f in (
    LossForm("liger", False, "Liger's fused linear cross-entropy (CUDA); preference objectives use finetune's chunks"),
    LossForm("finetune-chunked", False, "finetune's chunked loss: the LM head a chunk of tokens at a time (train/chunked_loss.py)"),
    LossForm("transformers", True, "the model's own forward: logits of every position, then the loss"),
)}


def log_prob_form(loss: str) -> str:
    """How a preference objective computes its sequence log-probabilities where the supervised run would
    use `loss`: through the LM head in chunks (finetune-chunked) unless the run holds the logits anyway
    (the model's own forward: ZeRO-3, TP, a quantized or adapted head, an uncovered architecture)."""
    return "transformers" if LOSS_FORMS[loss].holds_logits else "finetune-chunked"


def precomputes_reference(objective: str, precompute: bool | None, method: str) -> bool:
    """Whether a run computes its reference log-probabilities before training: --precompute-reference,
    else for full fine-tuning (a frozen copy would double the weights), never without a reference."""
    if not OBJECTIVES[objective].reference:
        return False
    return precompute if precompute is not None else method == "full"


def reference_kind(objective: str, precompute: bool | None, method: str) -> str | None:
    """How a run has its reference (train/reference.py): "precomputed", "adapters off" (LoRA/QLoRA: the
    base it adapts), "frozen copy" (full fine-tuning), or None without a reference."""
    if not OBJECTIVES[objective].reference:
        return None
    if precomputes_reference(objective, precompute, method):
        return "precomputed"
    return "frozen copy" if method == "full" else "adapters off"


def layout_problems(objective: str, model_parallel: int) -> list[str]:
    """A preference objective's sequence log-probabilities need whole rows and the whole vocabulary on a
    rank: no tensor or context parallelism (`model_parallel`: the GPUs of one TP or CP group)."""
    if OBJECTIVES[objective].preference and model_parallel > 1:
        return [f"--objective {objective} runs without tensor or context parallelism (a rank's slice of the "
                "vocabulary or of the rows holds no whole sequence log-probability); use FSDP2 or ZeRO-3 alone"]
    return []


def beta_of(objective: str, beta: float | None) -> float | None:
    """--beta, else the objective's default."""
    return beta if beta is not None else OBJECTIVES[objective].default_beta


def objective_problems(config) -> list[str]:
    """What in a TrainConfig the objective cannot run with, each with its fix (options.validate lists them)."""
    objective = OBJECTIVES.get(config.objective)
    if objective is None:
        return []  # options.validate names the choices
    problems = []
    if objective.preference and config.packing:
        problems.append(f"--packing with --objective {objective.name}: a preference loss compares whole answers to one "
                        "prompt, each sequence on its own row; packing would put several in one. Drop --packing")
    if objective.preference and config.train_on_prompt:
        problems.append(f"--train-on-prompt with --objective {objective.name}: the prompt is shared by the answers "
                        "compared, so it never enters a preference loss. Drop --train-on-prompt")
    if config.precompute_reference and not objective.reference:
        problems.append(f"--precompute-reference: --objective {objective.name} uses no reference model "
                        f"(those that do: {', '.join(o.name for o in OBJECTIVES.values() if o.reference)})")
    if config.dpo_loss != "sigmoid" and objective.name != "dpo":
        problems.append(f"--dpo-loss {config.dpo_loss} shapes DPO's loss; add --objective dpo or drop it")
    if config.beta is not None and objective.default_beta is None:
        problems.append(f"--beta weighs a preference objective; --objective {objective.name} has none")
    if config.beta is not None and not config.beta > 0:
        problems.append(f"--beta must be > 0, got {config.beta}")
    return problems
