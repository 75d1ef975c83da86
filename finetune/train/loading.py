"""Load a run's weights and tokenizer into the model skeleton.py describes: catalog name, Hugging Face
id, local directory or GGUF file; full fine-tuning, LoRA or QLoRA (4-bit NF4 base + LoRA adapters).

Catalog models without published weights (`tiny`) are initialised from their config with the run's
seed and written to `<output_dir>/base_model`, then loaded through the same `from_pretrained` path as
real checkpoints, so LoRA adapters and 4-bit quantization are exercised exactly as on a 7B model.
GGUF files (and catalog models shipped as one, `smollm2-135m`) are converted once into a cached
Hugging Face folder (see gguf_import) and load from there like any local model.

Apart from skeleton.py (what the model is built as) because only a run that trains reads weights:
this module reads and writes weight folders, may reach the Hub, and waits on the process group;
`--dry-run` and `--simulate` never call it.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from finetune.config.resolve import ResolvedRun
from finetune.errors import FinetuneError
from finetune.models import catalog, families, gguf_import
from finetune.models.source import ModelSource
from finetune.train import skeleton


def materialize(model: ModelSource, seed: int = 0) -> str:
    """Where `model`'s weights load from (`model.weights`), after writing them when finetune makes them
    itself: a catalog shape's random init seeded with `seed` (the run's --seed), or the conversion of
    a GGUF file. Every process may call this: both write once, atomically (see `write_random_init`,
    `gguf_import.convert`).

    Under a process group formed before the run (Ray Train forms it before a worker's function
    starts), transformers' `save_pretrained` writes weights on global rank 0 only, so rank 0 writes
    and the others wait for it at a barrier instead of publishing a folder without weights."""
    group_formed = torch.distributed.is_initialized()
    if not group_formed or torch.distributed.get_rank() == 0:
        if model.kind == "gguf":
            gguf_import.convert(model.gguf, Path(model.weights))
        elif model.kind == "random-init":
            materialize_random_init(catalog.get(model.name), Path(model.weights), seed=seed)
    if group_formed and model.kind in ("gguf", "random-init"):
        torch.distributed.barrier()
    return model.weights


def materialize_random_init(spec: catalog.ModelSpec, directory: Path, seed: int,
                            dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
    """Write a seeded random-init model of a catalog shape without published weights, with the
    builtin tokenizer (see `write_random_init`). Benchmarks of published shapes write them once in
    the checkpoint's 16-bit dtype and initialise on the GPU (`dtype`, `device`): a 7B shape is then
    13 GB and seconds, not 27 GB and minutes."""
    from finetune.data import BUILTIN_DIR

    write_random_init(AutoConfig.for_model(**spec.to_hf_config_dict()), AutoTokenizer.from_pretrained(BUILTIN_DIR),
                      directory, seed, dtype, device)


def write_random_init(hf_config, tokenizer: PreTrainedTokenizerBase, directory: Path, seed: int,
                      dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
    """Save a seeded random-init model of `hf_config` (config + safetensors) and `tokenizer` to
    `directory`, which `from_pretrained` then loads like any checkpoint.

    Idempotent: an existing folder is reused so resumed runs and every rank load the same weights.
    Written to a folder per process and renamed: on a shared filesystem several nodes' main
    processes may race here, and the first rename wins (the same seed gives the same weights).
    """
    if (directory / "config.json").is_file():
        return
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    tmp = directory.with_name(f"{directory.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    del model
    try:
        os.replace(tmp, directory)
    except OSError:  # another process finished first; its weights are identical
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(source: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """The tokenizer saved beside the weights; pad falls back to EOS (Llama ships none)."""
    tokenizer = _from_pretrained(AutoTokenizer, source, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(run: ResolvedRun, device: torch.device) -> torch.nn.Module:
    """The model ready to train: full, LoRA (PEFT) or QLoRA (4-bit NF4 base via bitsandbytes + LoRA).

    Weights load in the precision's weight dtype (fp32 for -mixed, so the optimizer updates fp32
    master weights; 16-bit for -true); QLoRA's 4-bit matmuls compute in the compute dtype, and the
    modules it does not quantize (embeddings, norms, LM head) keep the weight dtype. On a GPU, runs
    whose strategy does not shard weights load straight onto it, so host RAM holds one checkpoint
    shard at a time rather than a copy of the model per process (FSDP and ZeRO-3 load through
    Accelerate's rank-0 / zero.Init paths instead).
    """
    kwargs = skeleton.model_kwargs(run)
    if run.parallelism.tp > 1:
        kwargs["distributed_config"] = skeleton.tensor_parallel_layout(run)
    elif device.type == "cuda" and not run.strategy.shards_weights:
        kwargs["device_map"] = {"": device}
    attention = families.attention_implementation(run.spec.model_type if run.spec is not None else "")
    model = _from_pretrained(AutoModelForCausalLM, run.model.weights, attn_implementation=attention,
                             trust_remote_code=run.config.trust_remote_code, **kwargs)
    if run.strategy.zero_stage == 3:
        skeleton.mark_zero3_leaves(model)
    model = skeleton.prepare_for_training(model, run.config)
    if run.parallelism.tp > 1:
        skeleton.finish_tensor_parallel(model, run)
    return model


def load_frozen(run: ResolvedRun, dtype: torch.dtype) -> torch.nn.Module:
    """The base weights once more, as a frozen model in `dtype` (a preference objective's reference
    for full fine-tuning: train/reference.py): no gradients, eval mode, no KV cache."""
    attention = families.attention_implementation(run.spec.model_type if run.spec is not None else "")
    model = _from_pretrained(AutoModelForCausalLM, run.model.weights, attn_implementation=attention,
                             trust_remote_code=run.config.trust_remote_code, dtype=dtype)
    model.requires_grad_(False)
    model.config.use_cache = False
    return model.eval()


def _from_pretrained(cls, source: str, **kwargs):
    """`cls.from_pretrained` with Hub and offline failures turned into one actionable error."""
    try:
        return cls.from_pretrained(source, **kwargs)
    except OSError as e:
        raise FinetuneError(
            f"Could not load '{source}': {str(e).splitlines()[0]}\n"
            "If this machine is offline or the repo is gated, download it elsewhere "
            f"(`hf download {source} --local-dir DIR`) and pass --model DIR."
        ) from e
    except ValueError as e:  # unknown model_type, no causal-LM class for this config, unusable tokenizer files
        raise FinetuneError(
            f"Could not load '{source}': {str(e).splitlines()[0]}\n"
            "--model must be a causal language model this transformers version knows: config.json with a "
            "supported model_type, tokenizer files and weights."
        ) from e
    except RuntimeError as e:
        if "mismatched" not in str(e) and "loading state_dict" not in str(e):
            raise
        raise FinetuneError(  # transformers logs which tensors differ as a warning, shown with --verbose
            f"Could not load '{source}': its weights do not have the shapes its config.json gives "
            "(run with --verbose to see transformers' report of each tensor)."
        ) from e
