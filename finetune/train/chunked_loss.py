"""The training loss through the LM head in chunks of tokens, never holding the full-vocabulary logits.

A causal LM's loss holds 12 bytes per vocabulary entry per token at the start of backward (the
logits, fp32 log-softmax and its gradient, the logits' gradient; plan/memory.py). At seq 4096 and
micro batch 4 that is 5.9 GiB for a 32k vocabulary and 23 GiB for Llama 3's 128k, more than the
rest of a QLoRA step. Here the head runs on a chunk of tokens at a time: logits, loss and the
gradients of the hidden states and the head weight are computed chunk by chunk in the forward
(where the loss is a plain sum, its gradient needs nothing from later), and backward only scales
them; positions without a target (prompts, padding) never reach the head. TRL's fused LM head and
Liger's fused linear cross-entropy do the same; this one is plain torch, so it also runs on CPU and
wherever Liger is not installed.

`install` patches the instance's forward: called with `labels`, it runs the backbone and returns
the loss (no logits), plus a mixture of experts' load-balancing loss where its config turns that on,
as the model's own forward adds it; without labels (evaluation, generation) it is the model's own forward.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from finetune.config.names import IGNORE_INDEX
from finetune.config.switches import chunk_tokens


def head_problem(model: torch.nn.Module) -> str | None:
    """What rules out reading this loaded model's LM head as a weight matrix outside its forward
    (the chunked loss and Liger's fused loss both do), or None: config.switches gates both on it."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return "its LM head is not a plain linear layer"
    if tuple(head.weight.shape) != (head.out_features, head.in_features):  # e.g. bitsandbytes' packed 4-bit storage
        return "its LM head is quantized"
    return None


def install(model: torch.nn.Module) -> None:
    """Route `model(..., labels=...)` through the chunked loss (model: the transformers CausalLM,
    not its PEFT wrapper, whose forward calls this one)."""
    own_forward = model.forward

    @functools.wraps(type(model).forward)  # generate() checks its kwargs against this signature
    def forward(*args, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if labels is None:
            extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
            return own_forward(*args, **kwargs, **extra)
        backbone = getattr(model, model.base_model_prefix)(*args, **kwargs)
        loss = chunked_cross_entropy(backbone.last_hidden_state, model.get_output_embeddings().weight, labels,
                                     num_items_in_batch, shift_labels)
        aux = router_loss(model, backbone, kwargs.get("attention_mask"))
        return MoeCausalLMOutputWithPast(loss=loss if aux is None else loss + model.router_aux_loss_coef * aux, aux_loss=aux)

    model.forward = forward


def router_loss(model: torch.nn.Module, backbone, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The load-balancing loss a mixture of experts' CausalLM adds when its config sets
    output_router_logits (the backbone then returns the router logits): the model module's own
    function, called as the model's forward calls it. None for other models."""
    router_logits = getattr(backbone, "router_logits", None)
    if not router_logits:
        return None
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    return balance(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)


def chunked_cross_entropy(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                          num_items_in_batch: torch.Tensor | int | None = None,
                          shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """What transformers' causal-LM loss gives for `head(hidden)` and `labels` (shifted by one, or
    `shift_labels` as given: a context-parallel rank's slice of each row comes with them; IGNORE_INDEX
    skipped; the sum over `num_items_in_batch` when given, else the mean), with the head computed in
    the dtype the model's own forward would use (autocast's, else the weight's).

    Only the positions with a target go through the head: prompts and padding cost nothing (under
    SFT's answer-only loss that is often most of a batch)."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head_weight.dtype
    head_weight, vocabulary = Vocabulary.held(head_weight)
    if isinstance(hidden, DTensor):  # sequence-parallel TP: whole rows; this rank's vocabulary adds a part of their gradient
        hidden = hidden.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    inputs, targets = with_targets(hidden, labels) if shift_labels is None else with_targets(hidden, shift_labels, shift=0)
    inputs = inputs.to(dtype)
    weight = head_weight.to(dtype)
    grads = torch.is_grad_enabled() and (inputs.requires_grad or weight.requires_grad)
    with torch.autocast(device, enabled=False):
        total = _ChunkedCrossEntropy.apply(inputs, weight, targets, chunk_tokens(weight.size(0)), grads, vocabulary)
    return total / (num_items_in_batch if num_items_in_batch is not None else len(targets))


class Vocabulary:
    """The rows of the vocabulary a head weight holds: all of them, or under tensor parallelism this rank's
    shard (rows start … start + size of the whole vocabulary), whose maxima, sums and picked logits are
    combined over the TP group so that every rank computes the whole loss."""

    def __init__(self, start: int = 0, group=None):
        self.start, self.group = start, group

    @classmethod
    def held(cls, weight: torch.Tensor) -> tuple[torch.Tensor, Vocabulary]:
        """(the weight as a plain tensor, its vocabulary). A DTensor split by vocabulary rows on a mesh
        dimension named "tp" keeps its shard (its gradient stays this shard's); any other DTensor (FSDP2
        between its root's gathers) is gathered whole (its gradient is scattered back)."""
        if not isinstance(weight, DTensor):
            return weight, cls()
        mesh, placements = weight.device_mesh, weight.placements
        names = mesh.mesh_dim_names or ()
        if "tp" not in names or placements[names.index("tp")] != Shard(0):
            return weight.full_tensor(), cls()
        tp = names.index("tp")
        whole = [placement if dim == tp else Replicate() for dim, placement in enumerate(placements)]
        rows = -(-weight.size(0) // mesh.size(tp))  # torch.chunk's split: ceil(vocabulary / tp) rows a rank
        start = min(mesh.get_local_rank(tp) * rows, weight.size(0))
        return weight.redistribute(placements=whole).to_local(), cls(start, mesh.get_group(tp))

    def combine(self, tensor: torch.Tensor, op) -> torch.Tensor:
        """`tensor` reduced in place over the ranks holding the other shards (nothing without them)."""
        if self.group is not None:
            torch.distributed.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def picked(self, targets: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(column of each target among the `size` rows held, 1 where this shard holds it else 0)."""
        local = targets - self.start
        held = (local >= 0) & (local < size)
        return local.clamp(0, size - 1).unsqueeze(1), held.unsqueeze(1)


def with_targets(hidden: torch.Tensor, labels: torch.Tensor, shift: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states that predict a target, and those targets, as flat rows: position i predicts
    labels[i + shift] (1: the labels of the inputs; 0: labels shifted already)."""
    width = labels.size(1) - shift
    if is_fake(labels):  # `plan --simulate` runs on fake tensors, which cannot count targets; its labels are all targets
        return hidden[:, :width].reshape(-1, hidden.size(-1)), labels[:, shift:].reshape(-1)
    rows, positions = (labels[:, shift:] != IGNORE_INDEX).nonzero(as_tuple=True)
    flat = hidden.reshape(-1, hidden.size(-1))
    return flat.index_select(0, rows * hidden.size(1) + positions), labels[rows, positions + shift]


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of token losses of `inputs @ weight.T` against `targets` (every one a real target), `chunk`
    tokens at a time; the gradients are computed alongside (when `grads`) and kept, instead of the logits."""

    @staticmethod
    def forward(ctx, inputs, weight, targets, chunk, grads, vocabulary):
        want_inputs, want_weight = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=inputs.device)
        grad_inputs = torch.zeros_like(inputs) if want_inputs else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, inputs.size(0), chunk):
            end = min(start + chunk, inputs.size(0))
            total += _chunk(inputs[start:end], weight, targets[start:end],
                            grad_inputs[start:end] if want_inputs else None, grad_weight, vocabulary)
        ctx.save_for_backward(grad_inputs, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        # scaled in place: the graph is freed after this backward (the loop never retains it), and a
        # copy of the head's fp32 gradient would double its memory
        grad_inputs, grad_weight = ctx.saved_tensors
        return (None if grad_inputs is None else grad_inputs.mul_(grad_total.to(grad_inputs.dtype)),
                None if grad_weight is None else grad_weight.mul_(grad_total).to(ctx.weight_dtype), None, None, None, None)


def _chunk(rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad_rows: torch.Tensor | None,
           grad_weight: torch.Tensor | None, vocabulary: Vocabulary) -> torch.Tensor:
    """One chunk's summed token loss; its gradients written into `grad_rows` and added to
    `grad_weight` where given (for the vocabulary rows `weight` holds: a TP rank's `grad_rows` is its
    part of the sum). A function of its own so that the chunk's logits are gone before the next
    chunk's are made."""
    picked, held = vocabulary.picked(targets, weight.size(0))
    # one fp32 copy of the logits, worked on in place: exp(logits − max), then the softmax's gradient
    logits = (rows @ weight.T).float()
    picked_logit = vocabulary.combine(logits.gather(1, picked).mul_(held).squeeze(1), ReduceOp.SUM)
    largest = vocabulary.combine(logits.amax(dim=1, keepdim=True), ReduceOp.MAX)
    sums = vocabulary.combine(logits.sub_(largest).exp_().sum(dim=1, keepdim=True), ReduceOp.SUM)
    loss = ((sums.log() + largest).squeeze(1) - picked_logit).sum()
    if grad_rows is None and grad_weight is None:
        return loss
    # d(loss)/d(logits) = softmax − one-hot
    logits.div_(sums).scatter_add_(1, picked, -held.to(logits.dtype))
    grad_logits = logits.to(rows.dtype)
    del logits
    if grad_rows is not None:
        torch.matmul(grad_logits, weight, out=grad_rows)
    if grad_weight is not None:
        grad_weight += (grad_logits.T @ rows).float()
    return loss
