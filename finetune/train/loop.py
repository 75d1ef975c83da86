"""The training loop and evaluation: the same code for every strategy.

Strategies (DDP, FSDP2, DeepSpeed ZeRO) arrive inside the prepared `accelerator`, `model`,
`optimizer` and `train_loader`; nothing here asks which one is running.

Loss normalization (the decision that makes runs comparable across batch splits and world sizes):
every unit of an optimizer step weighs the same, whichever micro-batch or rank it sits on: a target
token for supervised fine-tuning, an example (a preference pair, or a labelled row) for the
preference objectives (train/objectives.py). The loop counts units over the whole accumulation
window on all ranks that read different rows before the first forward, asks the objective for
`sum(unit losses) / global_units`, and multiplies by `accumulation × ranks sharing the tokens` to
undo `accelerator.backward`'s division by the accumulation steps and the gradient averaging over
ranks. So micro 4 × accum 1 ≡ micro 1 × accum 4 ≡ 2 ranks × micro 2 ≡ 2 tensor-parallel ranks ×
micro 4 (parallel.LossRanks: the ranks of a TP group read the same rows; those of a CP group share
each row's tokens).
A mixture of experts' load-balancing loss (added by the model when its config sets
output_router_logits) is a mean per micro-batch: it is averaged over micro-batches and ranks instead,
and logged apart from the token loss.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from finetune.config.names import IGNORE_INDEX
from finetune.train.log_probs import sequence_log_probs
from finetune.train.objectives import Preference, Supervised, count_target_tokens, score
from finetune.train.parallel import LossRanks, sequence_shards

if TYPE_CHECKING:  # the loop calls them; it never needs to build them
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase

    from finetune.checkpoint.checkpointer import Checkpointer
    from finetune.checkpoint.progress import Progress
    from finetune.train.metrics import MetricsRecorder


def count_input_tokens(batch: dict) -> torch.Tensor:
    """Tokens the model reads (for throughput): all but padding; packed rows carry no mask and count whole."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    return torch.tensor(batch["input_ids"].numel(), device=batch["input_ids"].device)


def accumulation_windows(batches: Iterable, size: int) -> Iterator[list]:
    """Consecutive groups of `size` micro-batches; a trailing partial group is dropped so every
    optimizer step sees the same number of micro-batches (and resume lands on a window boundary).

    A window is read whole before its first forward, so the dataloader of an epoch's last window has
    already ended when it trains: the Accelerator must count micro-batches, not sync at the end of
    the dataloader (`sync_with_dataloader=False`, set in accelerator.build_accelerator)."""
    iterator = iter(batches)
    while len(window := list(itertools.islice(iterator, size))) == size:
        yield window


SUPERVISED = Supervised()


def epoch_batches(accelerator: Accelerator, train_loader: DataLoader, progress: Progress,
                  checkpointer: Checkpointer | None) -> Iterable:
    """The micro-batches of the epoch `progress` is in, from where it left off: the epoch's order,
    minus what a resumed run already trained on, with the RNG as the checkpoint saved it."""
    train_loader.set_epoch(progress.epoch)
    batches = train_loader
    if progress.batches_in_epoch:  # resuming mid-epoch: same order, minus what was already trained on
        batches = accelerator.skip_first_batches(train_loader, progress.batches_in_epoch)
    if checkpointer is not None:  # after a resume: RNG as saved, once the iterator exists
        batches = checkpointer.with_rng_restored(batches)
    return batches


def train(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          scheduler: torch.optim.lr_scheduler.LRScheduler, train_loader: DataLoader, *, progress: Progress,
          max_steps: int, max_grad_norm: float, metrics: MetricsRecorder, checkpointer: Checkpointer | None = None,
          evaluate: Callable[[], dict] | None = None, eval_every: int = 0, router_aux_loss_coef: float = 0.0,
          objective: Supervised | Preference = SUPERVISED) -> None:
    """Run optimizer updates until `progress.step == max_steps` (or a preemption signal).

    `metrics` receives one record per update; `evaluate()` runs every `eval_every` updates; `checkpointer`
    decides when to save (finetune/checkpoint/checkpointer.py);
    `router_aux_loss_coef` is the weight the model gives its load-balancing loss, if it adds one;
    `objective` what the loss is and what it counts (train/objectives.py).
    """
    accumulation, ranks = accelerator.gradient_accumulation_steps, LossRanks(accelerator)
    model.train()
    while progress.step < max_steps:
        for window in accumulation_windows(epoch_batches(accelerator, train_loader, progress, checkpointer), accumulation):
            started, cpu_started = time.perf_counter(), time.process_time()  # the window in hand
            counts = torch.stack([sum(count(b) for b in window) for count in (objective.count, count_target_tokens, count_input_tokens)])
            global_units, global_targets, global_inputs = ranks.sum_over_rows(counts)
            objective.start_window(model, window, ranks)
            step_loss, step_aux = (torch.zeros((), dtype=torch.float64, device=accelerator.device) for _ in range(2))
            grad_norm = None  # clipped on the window's last micro-batch, where the gradients are synced
            for batch in window:
                with accelerator.accumulate(model), sequence_shards(accelerator, batch):
                    unit_loss, aux = objective.loss(model, batch, global_units)
                    aux = aux if router_aux_loss_coef else None
                    balance = 0.0 if aux is None else router_aux_loss_coef * aux  # a mean per micro-batch
                    loss = unit_loss - balance  # local sum / global count
                    accelerator.backward(loss * accumulation * ranks.sharing + balance)
                    step_loss += loss.detach()
                    if aux is not None:
                        step_aux += aux.detach() / (accumulation * ranks.sharing)
                    if accelerator.sync_gradients:
                        if max_grad_norm:
                            grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            progress.step += 1
            progress.batches_in_epoch += len(window)
            progress.tokens_seen += int(global_targets)
            metrics.record_step(
                step=progress.step,
                loss=ranks.sum_over_shares(step_loss).item(),
                aux_loss=ranks.sum_over_shares(step_aux).item() if router_aux_loss_coef else None,
                lr=lr, grad_norm=None if grad_norm is None else float(grad_norm),
                tokens=int(global_inputs),
                seconds=time.perf_counter() - started,
                cpu_seconds=time.process_time() - cpu_started,
            )
            if evaluate is not None and eval_every and progress.step % eval_every == 0 and progress.step < max_steps:
                metrics.record_eval(progress.step, evaluate())
                model.train()
            if checkpointer is not None and checkpointer.should_save(progress.step):
                checkpointer.save(progress)
            if progress.step >= max_steps or (checkpointer is not None and checkpointer.preempted):
                return
        progress.epoch += 1
        progress.batches_in_epoch = 0


# ---------------------------------------------------------------- evaluation


def progress_bar(shown: bool) -> dict:
    """tqdm options of an eval bar: shown on the main process only, gone once done."""
    return {"disable": not shown, "leave": False, "file": sys.stdout, "dynamic_ncols": True}


@torch.no_grad()
def evaluation_loss(accelerator: Accelerator, model: torch.nn.Module, eval_loader: DataLoader) -> float:
    """Token-weighted mean loss over the whole eval set, each example counted once across ranks, or,
    from a loader Accelerate did not shard (TP, CP: every rank reads every row), once per rank in the
    count as in the sum. Batches arrive on the device from a prepared loader, else are moved there."""
    sums, counts = [], []
    for batch in tqdm(eval_loader, desc="eval loss", **progress_bar(accelerator.is_main_process)):
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        logits = model(**{k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}).logits.float()
        targets = batch["labels"][:, 1:]
        token_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
        sums.append(token_loss.sum(dim=1))
        counts.append((targets != IGNORE_INDEX).sum(dim=1))
    per_example_sum = accelerator.gather_for_metrics(torch.cat(sums))
    per_example_count = accelerator.gather_for_metrics(torch.cat(counts))
    return (per_example_sum.sum() / per_example_count.sum().clamp(min=1)).item()


@torch.no_grad()
def greedy_completions(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]],
                       max_new_tokens: int, show_progress: bool = False) -> list[str]:
    """Greedy generations for prompt token ids, decoded without the prompt and special tokens.

    One prompt at a time: unpadded, each answer is what `generate` gives that prompt alone, as a user
    reloading the export asks it (a padded batch can flip a near-tied token), and the bar advances
    per prompt. Every rank generates the same prompts: under FSDP/ZeRO-3 each forward is a
    collective, so all ranks must run the same number of forwards.
    """
    device = next(model.parameters()).device
    completions = []
    for ids in tqdm(prompts, desc="eval generate", unit="prompt", **progress_bar(show_progress)):
        input_ids = torch.tensor([ids], device=device)
        output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        completions.append(tokenizer.decode(output[0, len(ids):], skip_special_tokens=True))
    return completions


def evaluate(accelerator: Accelerator, model: torch.nn.Module, eval_loader: DataLoader | None,
             tokenizer: PreTrainedTokenizerBase, eval_prompts: list[dict], keep_train_mode: bool) -> dict:
    """Eval loss (none without `eval_loader`), exact-match accuracy of greedy generations, and the
    generations themselves.

    `keep_train_mode` evaluates without switching to eval mode: 4-bit bitsandbytes layers repack
    their weights in place on eval-mode no-grad forwards, which corrupts sharded QLoRA models.
    """
    if not keep_train_mode:
        model.eval()
    result = {} if eval_loader is None else {"eval_loss": evaluation_loss(accelerator, model, eval_loader)}
    if eval_prompts:
        expected = [p["expected"] for p in eval_prompts]
        max_new_tokens = max(len(tokenizer(e, add_special_tokens=False)["input_ids"]) for e in expected) + 2
        got = greedy_completions(accelerator.unwrap_model(model), tokenizer, [p["prompt_ids"] for p in eval_prompts],
                                 max_new_tokens, show_progress=accelerator.is_main_process)
        matches = [g.strip() == e.strip() for g, e in zip(got, expected)]
        result["exact_match"] = sum(matches) / len(matches)
        result["samples"] = [{"prompt": p["prompt"], "expected": p["expected"], "generated": g}
                             for p, g in zip(eval_prompts, got)]
    model.train()
    return result


@torch.no_grad()
def preference_evaluation(accelerator: Accelerator, model: torch.nn.Module, eval_loader: DataLoader,
                          objective: Preference) -> dict:
    """A preference objective's held-out numbers, each example counted once across ranks: its loss
    (`eval_loss`, KTO's KL estimate taken over the whole eval set), `preference_accuracy` (pairs: the
    chosen answer's reward above the rejected one's; labelled rows: the reward on the side of the KL
    estimate its label says) and `reward_margin` (pairs: chosen − rejected reward; labelled rows: the
    mean reward of desirable rows − that of the others). A reward is β × the log-ratio to the reference
    (DPO, KTO), or β × the mean token log-probability (SimPO, ORPO)."""
    paired = objective.objective.rows == "paired"
    columns = []
    for batch in tqdm(eval_loader, desc="eval preference", **progress_bar(accelerator.is_main_process)):
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        policy, tokens = sequence_log_probs(model, batch)
        reference = objective.reference.log_probs(model, batch) if objective.reference else torch.zeros_like(policy)
        if paired:  # one row per pair: chosen and rejected side by side
            table = torch.cat([v.double().view(2, -1) for v in (policy, tokens, reference)]).T
        else:
            kl = sequence_log_probs(model, batch, "kl_")[0] - objective.reference.log_probs(model, batch, "kl_")
            table = torch.stack([policy.double(), tokens.double(), reference.double(), batch["desirable"].double(),
                                 kl.double()], dim=1)
        # per batch, while the eval loader is Accelerate's active one: its last batch's padding is dropped by
        # that loader's remainder (after the loop, a train loader that ended its epoch would be the active one)
        columns.append(accelerator.gather_for_metrics(table))
    return preference_numbers(objective, torch.cat(columns), paired)


def preference_numbers(objective: Preference, table: torch.Tensor, paired: bool) -> dict:
    """`preference_evaluation`'s numbers from its gathered table (a row per example)."""
    if paired:
        policy, tokens, reference = (torch.cat([table[:, i], table[:, i + 1]]) for i in (0, 2, 4))
        scores = score(objective.objective, objective.settings, policy, tokens, reference if objective.reference else None)
        right, margin = scores.chosen > scores.rejected, (scores.chosen - scores.rejected).mean()
    else:
        policy, tokens, reference, desirable, kl = table.T
        desirable, z = desirable.bool(), kl.mean().clamp(min=0)
        scores = score(objective.objective, objective.settings, policy, tokens, reference, desirable, z)
        right = (scores.chosen > objective.settings.beta * z) == desirable
        margin = scores.chosen[desirable].mean() - scores.chosen[~desirable].mean()
    return {"eval_loss": scores.loss.mean().item(), "preference_accuracy": right.double().mean().item(),
            "reward_margin": margin.item()}
