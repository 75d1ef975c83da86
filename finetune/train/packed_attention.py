"""Attention over packed rows without a dense mask (`--attention varlen`): torch's variable-length
FlashAttention (`torch.nn.attention.varlen.varlen_attn`, CUDA, torch ≥ 2.11), registered with
transformers as an attention function.

Why: under SDPA, transformers turns the position resets of packed rows into a block-diagonal mask of
micro × s × s booleans; torch converts it to the query's dtype and saves that copy for backward in
every layer, and runs its memory-efficient kernel over the whole square, masked half included
(plan/memory.py and plan/traffic.py count the mask where a run builds one). Here each example is one
sequence of the kernel: the collator hands the micro-batch over as one row with the examples'
offsets (`cu_seq_lens_q`, `max_length_q`, data/collate.flattened), computed on the host, so no layer
waits on the GPU to find them.

Calls without those offsets keep the plain path's meaning: a padding mask (evaluation's padded rows)
or a KV cache (generation's decoding steps) go to transformers' SDPA with the mask `sdpa_mask` builds;
an unpadded forward without offsets (generation's first step) reads its examples from the position
ids, every row starting one. The kernel's own check runs on a GPU only
(tests/gpu_kit/test_gpu.py); on CPU, tests/train/test_packed_attention.py runs everything around it
with SDPA per example standing in for it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from finetune.config.switches import ATTENTION_KERNELS
from finetune.models.families import attention_implementation

NAME = ATTENTION_KERNELS["varlen"]
# (query (tokens, heads, head_dim), key, value (tokens, kv_heads, head_dim), cu_seq_lens (int32: each
# example's first token, then the total), longest example, scale, (left, right) window) → like query
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float | None, tuple[int, int]], torch.Tensor]
# torch's FlashAttention kernels: NVIDIA compute capability 8.0 and newer
FLASH_CAPABILITY = (8, 0)


def register(name: str = NAME, kernel: Kernel | None = None) -> str:
    """Make `name` an attention implementation transformers models accept, running `kernel` (torch's
    varlen_attn unless given) on packed rows; returns `name`."""
    AttentionInterface.register(name, attention_function(kernel or torch_varlen()))
    AttentionMaskInterface.register(name, mask_unless_unpadded)
    return name


def problem(model: torch.nn.Module) -> str | None:
    """Why `model` (a transformers model) cannot run this kernel here, or None."""
    config = model.config
    if attention_implementation(config.model_type) != "sdpa":
        return f"--attention varlen: {config.model_type}'s attention sinks run on transformers' eager attention; use --attention sdpa"
    if getattr(config, "attn_logit_softcapping", None):
        return f"--attention varlen: {config.model_type} soft-caps its attention scores, which varlen_attn does not; use --attention sdpa"
    if getattr(config, "attention_dropout", 0.0):
        return f"--attention varlen has no attention dropout, and the model's config sets {config.attention_dropout}; use --attention sdpa"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < FLASH_CAPABILITY:
        found = ".".join(map(str, torch.cuda.get_device_capability()))
        return f"--attention varlen runs FlashAttention, which needs compute capability ≥ 8.0 (this GPU: {found}); use --attention sdpa"
    return None


def mask_unless_unpadded(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask transformers builds for this implementation: none without a padding mask (the kernel
    keeps packed examples apart by their offsets), else SDPA's, for the calls that go to SDPA."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def attention_function(kernel: Kernel) -> Callable:
    """transformers' attention-function contract: query (batch, heads, q_len, head_dim), key and value
    (batch, kv_heads, kv_len, head_dim) → (output (batch, q_len, heads, value's head_dim), no weights).
    16-bit under autocast as SDPA is (autocast does not reach a custom kernel); a sliding window of
    w keys as transformers' mask has it (the key itself and the w - 1 before); a value narrower than
    the query (DeepSeek's latent attention) padded to the query's width, as FlashAttention wants."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
        if attention_mask is not None or query.shape[2] != key.shape[2]:  # padding, or decoding against a cache
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                          sliding_window=sliding_window, **kwargs)
        batch, heads, length, dim = query.shape
        value_dim = value.shape[-1]
        cu_seq_lens, longest = example_offsets(kwargs, batch, length, query.device)
        device = query.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
        value = value if value_dim == dim else torch.nn.functional.pad(value, [0, dim - value_dim])
        q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim).to(dtype) for t in (query, key, value))
        window = (-1 if sliding_window is None else sliding_window - 1, 0)
        out = kernel(q, k, v, cu_seq_lens, longest, scaling, window)
        return out[..., :value_dim].reshape(batch, length, heads, value_dim), None

    return attention


def example_offsets(kwargs: dict, batch: int, length: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(cu_seq_lens, longest example) of a batch flattened row after row: the collator's, or else
    read from the position ids (each 0 begins an example; every row starts at 0), which waits on the
    GPU once per layer."""
    if kwargs.get("cu_seq_lens_q") is not None:
        return kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    positions = kwargs.get("position_ids")
    positions = torch.arange(length, device=device)[None] if positions is None else positions
    starts = (positions.expand(batch, length) == 0).flatten()
    offsets = torch.cat([starts.nonzero().flatten(), torch.tensor([batch * length], device=device)])
    return offsets.to(torch.int32), int(offsets.diff().max())


def torch_varlen() -> Kernel:
    """torch's varlen_attn as a Kernel. torch ≥ 2.12 asks for `enable_gqa` when key and value have
    fewer heads than the query; 2.11's takes them as they are (FlashAttention groups heads itself)."""
    from torch.nn.attention.varlen import varlen_attn

    asks_gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters

    def kernel(q, k, v, cu_seq_lens, longest, scale, window):
        grouped = {"enable_gqa": True} if asks_gqa and k.shape[1] != q.shape[1] else {}
        return varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, longest, longest, scale=scale, window_size=window, **grouped)

    return kernel
