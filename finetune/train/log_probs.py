"""Each sequence's log-probability of its answer tokens: what every preference objective reads.

`install(model, form)` gives a CausalLM instance (not its PEFT wrapper, whose forward calls this one)
a second way to be called: `model(input_ids=..., attention_mask=..., log_probs_of=labels)` returns
`SequenceLogProbs` (per row, the sum of the log-probabilities of the tokens whose label is not -100,
and how many there are) instead of logits. Called through the prepared model, so DDP, FSDP2 and
DeepSpeed see an ordinary forward. Two forms (config.objectives.log_prob_form):

- `finetune-chunked`: the backbone's last hidden states of the answer positions go through the LM head
  a chunk of tokens at a time (config.switches.chunk_tokens), so the logits of a micro-batch's doubled
  rows never exist whole. A sequence's log-probability is a sum over its tokens, so the gradient of a
  token's log-probability with respect to its hidden state, (one-hot − softmax) · W, is computed in the
  forward and backward only scales it by the loss's gradient for that sequence; a trainable head
  (full fine-tuning) instead gets its gradient in backward, recomputing each chunk's logits once.
- `transformers`: the model's own forward, then log-softmax over its full logits (where the head may
  not be read outside its forward: ZeRO-3, TP, an adapted or quantized head).

Without `log_probs_of` the forward is the one it wraps (evaluation, generation, the supervised loss).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from transformers.utils import ModelOutput

from finetune.config.names import IGNORE_INDEX
from finetune.config.objectives import log_prob_form
from finetune.config.resolve import ResolvedRun
from finetune.config.switches import chunk_tokens


@dataclass
class SequenceLogProbs(ModelOutput):
    logps: torch.Tensor | None = None  # [rows] fp32 (fp64 for an fp64 model): sum of the answer tokens' log-probabilities
    tokens: torch.Tensor | None = None  # [rows]: answer tokens (labels not -100, shifted by one)


def form_of(run: ResolvedRun) -> str:
    """The form `run` computes log-probabilities in: its loss's (`run` as train.speedups.with_model
    returns it once the model is built)."""
    return log_prob_form(run.switches.loss)


def install(model: torch.nn.Module, form: str) -> None:
    """Add the `log_probs_of` call to `model`'s forward (`form`: finetune-chunked or transformers)."""
    own_forward = model.forward

    @functools.wraps(type(model).forward)  # generate() checks its kwargs against this signature
    def forward(*args, log_probs_of=None, **kwargs):
        if log_probs_of is None:
            return own_forward(*args, **kwargs)
        if form == "transformers":
            logits = own_forward(*args, **kwargs).logits
            return SequenceLogProbs(*full_log_probs(logits, log_probs_of))
        hidden = getattr(model, model.base_model_prefix)(*args, **kwargs).last_hidden_state
        return SequenceLogProbs(*chunked_log_probs(hidden, model.get_output_embeddings().weight, log_probs_of))

    model.forward = forward


def sequence_log_probs(model: torch.nn.Module, batch: dict, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability sums, answer tokens) of the sequences `batch` holds under `prefix`
    (`kl_`: KTO's mismatched ones), through the prepared `model`'s forward."""
    out = model(input_ids=batch[prefix + "input_ids"], attention_mask=batch[prefix + "attention_mask"],
                log_probs_of=batch[prefix + "labels"])
    return out.logps, out.tokens


def full_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row sums of the target tokens' log-probabilities from full logits [rows, width, vocab]."""
    targets = labels[:, 1:]
    picked = logits[:, :-1].to(wide(logits.dtype)).log_softmax(-1).gather(2, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != IGNORE_INDEX)).sum(dim=1), answer_tokens(labels)


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype log-softmax runs in: fp32, or fp64 for fp64 inputs (the tests' exact comparisons)."""
    return torch.promote_types(dtype, torch.float32)


def answer_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Answer tokens per row: labels shifted by one (as the loss reads them), not ignored."""
    return (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)


def answer_positions(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hidden states that predict an answer token, those tokens, and the row of each, as flat rows."""
    if is_fake(labels):  # `plan --simulate`: fake tensors cannot be counted; their labels are all targets
        rows = torch.arange(labels.size(0), device=labels.device).repeat_interleave(labels.size(1) - 1)
        return hidden[:, :-1].reshape(-1, hidden.size(-1)), labels[:, 1:].reshape(-1), rows
    rows, positions = (labels[:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
    flat = hidden.reshape(-1, hidden.size(-1))
    return flat.index_select(0, rows * hidden.size(1) + positions), labels[rows, positions + 1], rows


def chunked_log_probs(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row sums of the target tokens' log-probabilities under `head(hidden)`, the head computed in the
    dtype the model's own forward would use (autocast's, else the weight's), a chunk of tokens at a time."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head_weight.dtype
    inputs, targets, rows = answer_positions(hidden, labels)
    if isinstance(head_weight, DTensor):  # FSDP2 between its root's gathers: gather it (its gradient is scattered back)
        head_weight = head_weight.full_tensor()
    inputs, weight = inputs.to(dtype), head_weight.to(dtype)
    grads = torch.is_grad_enabled() and (inputs.requires_grad or weight.requires_grad)
    with torch.autocast(device, enabled=False):
        sums = _ChunkedLogProbs.apply(inputs, weight, targets, rows, labels.size(0), chunk_tokens(weight.size(0)), grads)
    return sums, answer_tokens(labels)


class _ChunkedLogProbs(torch.autograd.Function):
    """Per-row sums of the token log-probabilities of `inputs @ weight.T` at `targets`, `chunk` tokens at a time."""

    @staticmethod
    def forward(ctx, inputs, weight, targets, rows, num_rows, chunk, grads):
        want_inputs, want_weight = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        sums = torch.zeros(num_rows, dtype=wide(inputs.dtype), device=inputs.device)
        # a frozen head: the inputs' gradient now, scaled in backward; a trained one: both recomputed in backward
        grad_inputs = torch.empty_like(inputs) if want_inputs and not want_weight else None
        for start in range(0, inputs.size(0), chunk):
            end = min(start + chunk, inputs.size(0))
            sums.index_add_(0, rows[start:end], _chunk(inputs[start:end], weight, targets[start:end],
                                                       None if grad_inputs is None else grad_inputs[start:end]))
        ctx.save_for_backward(grad_inputs, rows, *((inputs, weight, targets) if want_weight else ()))
        ctx.chunk, ctx.want_inputs = chunk, want_inputs
        return sums

    @staticmethod
    def backward(ctx, grad_sums):
        grad_inputs, rows, *recompute = ctx.saved_tensors
        scale = grad_sums.to(wide(grad_sums.dtype)).index_select(0, rows).unsqueeze(1)  # each token: its sequence's gradient
        if not recompute:
            # scaled in place: the graph is freed after this backward (the loop never retains it)
            return grad_inputs.mul_(scale.to(grad_inputs.dtype)), None, None, None, None, None, None
        inputs, weight, targets = recompute
        grad_inputs = torch.empty_like(inputs) if ctx.want_inputs else None
        grad_weight = torch.zeros(weight.shape, dtype=wide(weight.dtype), device=weight.device)
        for start in range(0, inputs.size(0), ctx.chunk):
            end = min(start + ctx.chunk, inputs.size(0))
            grad_logits = _scaled_grad_logits(inputs[start:end], weight, targets[start:end], scale[start:end])
            if grad_inputs is not None:
                torch.matmul(grad_logits, weight, out=grad_inputs[start:end])
            grad_weight += (grad_logits.T @ inputs[start:end]).to(grad_weight.dtype)
        return grad_inputs, grad_weight.to(weight.dtype), None, None, None, None, None


def _chunk(rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad_rows: torch.Tensor | None) -> torch.Tensor:
    """One chunk's token log-probabilities; d(log-prob)/d(rows) = (one-hot − softmax) · W written into
    `grad_rows` where given. A function of its own so the chunk's logits are gone before the next's are made."""
    picked = targets.unsqueeze(1)
    logits = (rows @ weight.T).to(wide(rows.dtype))  # one fp32 copy, worked on in place
    picked_logit = logits.gather(1, picked).squeeze(1)
    largest = logits.amax(dim=1, keepdim=True)
    sums = logits.sub_(largest).exp_().sum(dim=1, keepdim=True)
    log_probs = picked_logit - (sums.log() + largest).squeeze(1)
    if grad_rows is not None:
        grad_logits = logits.div_(sums).neg_().scatter_add_(1, picked, torch.ones_like(picked, dtype=logits.dtype))
        torch.matmul(grad_logits.to(rows.dtype), weight, out=grad_rows)
    return log_probs


def _scaled_grad_logits(rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(one-hot − softmax) of a chunk's logits, each token's row scaled by its sequence's gradient."""
    picked = targets.unsqueeze(1)
    logits = (rows @ weight.T).to(wide(rows.dtype))
    logits.sub_(logits.amax(dim=1, keepdim=True)).exp_()
    logits.div_(logits.sum(dim=1, keepdim=True)).neg_().scatter_add_(1, picked, torch.ones_like(picked, dtype=logits.dtype))
    return logits.mul_(scale).to(rows.dtype)
