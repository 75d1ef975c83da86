"""A sliding window that no training row reaches, switched off for the forwards it cannot change.

Mistral-7B v0.1 (and any Mistral or Mixtral config that sets one) lets each token attend only within
`config.sliding_window` tokens: transformers' mask lets query i see key j when 0 ≤ i − j < window
(masking_utils' `sliding_window_overlay`: kv_idx > q_idx − window). In a row of at most `window`
tokens every i − j is below the window, so that mask is the plain causal mask. transformers builds it
explicitly all the same once a row is as long as the window (SDPA's path skips the mask only for
shorter rows), and an explicit mask rules out SDPA's flash kernel: the masked kernel computes every
score, the masked half included (plan/speed.py's `attention_cost`).

So when no training row can exceed the window (--max-seq-len ≤ window), each forward of the decoder
stack over rows no longer than the window and without a KV cache runs with the window off: the same
attention, and SDPA gets no mask (packed rows and padding still get theirs). Only the decoder stack's
own view of the config changes, and only during such a forward: the model's config (what checkpoints
and exports save), its layers, and generation (which carries a KV cache and may run past the window)
keep the window. A forward the wrapper cannot read (positional inputs) keeps it too.
"""

from __future__ import annotations

import copy
import functools

import torch

from finetune.models import families


def inert_window(model: torch.nn.Module, max_seq_len: int) -> int | None:
    """The sliding window of `model` (transformers, PEFT-wrapped or not) when rows of `max_seq_len`
    tokens cannot reach past it and every layer takes it from `config.sliding_window` (the families
    models/families.py marks `sliding`; per-layer `layer_types` alternate local and global layers and
    are left alone); None otherwise."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    fam = families.family(config.model_type)
    window = getattr(config, "sliding_window", None)
    if fam is None or not fam.sliding or window is None or getattr(config, "layer_types", None) is not None:
        return None
    return window if max_seq_len <= window else None


def switch_off_inert_window(model: torch.nn.Module, max_seq_len: int) -> str | None:
    """Run `model`'s decoder stack without its sliding window on the forwards the window cannot
    change (module docstring), in place. Returns the line the run prints, or None when the model
    keeps its window (it has none, or rows of `max_seq_len` tokens may pass it)."""
    window = inert_window(model, max_seq_len)
    if window is None:
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder()
    forward = decoder.forward

    @functools.wraps(forward)
    def unwindowed(*args, **kwargs):
        if args or not _rows_within(window, decoder.config, kwargs):
            return forward(*args, **kwargs)
        windowed = decoder.config
        decoder.config = copy.copy(windowed)
        decoder.config.sliding_window = None
        try:
            return forward(**kwargs)
        finally:
            decoder.config = windowed

    decoder.forward = unwindowed
    return (f"sliding window {window} off: rows of at most {max_seq_len} tokens never reach past it, so "
            "attention is the plain causal one (no mask handed to SDPA)")


def _rows_within(window: int, config, kwargs: dict) -> bool:
    """A forward without a KV cache whose rows are no longer than `window`."""
    use_cache = kwargs.get("use_cache")
    if kwargs.get("past_key_values") is not None or (config.use_cache if use_cache is None else use_cache):
        return False
    rows = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    return rows is not None and rows.shape[1] <= window
