"""Load the model and tokenizer for a run: catalog name, Hugging Face id or local directory;
full fine-tuning, LoRA or QLoRA (4-bit NF4 base + LoRA adapters).

Catalog models without published weights (`tiny`) are initialised from their config with the run's
seed and written to `<output_dir>/base_model`, then loaded through the same `from_pretrained` path as
real checkpoints, so LoRA adapters and 4-bit quantization are exercised exactly as on a 7B model.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from finetune.catalog import models as catalog
from finetune.config import TrainConfig
from finetune.errors import FinetuneError


def resolve_source(config: TrainConfig) -> tuple[str, catalog.ModelSpec | None]:
    """Where the weights come from (local dir or Hub id) and the catalog entry, if any.
    `config.validate` has already refused names that are none of these."""
    if Path(config.model).is_dir():
        return config.model, None
    spec = catalog.lookup(config.model)
    if spec is not None:
        if spec.hf_id is None:
            return str((Path(config.output_dir) / "base_model").resolve()), spec
        return spec.hf_id, spec
    return config.model, None  # a Hugging Face id


def materialize_random_init(spec: catalog.ModelSpec, directory: Path, seed: int) -> None:
    """Write a seeded random-init model (config + safetensors) for catalog models without weights.

    Idempotent: an existing folder is reused so resumed runs and every rank load the same weights.
    """
    if (directory / "config.json").is_file():
        return
    from finetune.data import BUILTIN_DIR

    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(**spec.to_hf_config_dict())
    model = AutoModelForCausalLM.from_config(hf_config)
    # a folder per process: on a shared filesystem several nodes' main processes may race here
    tmp = directory.with_name(f"{directory.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(BUILTIN_DIR).save_pretrained(tmp)
    try:
        os.replace(tmp, directory)
    except OSError:  # another node finished first; its weights are identical (same seed)
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(source: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """The tokenizer saved beside the weights; pad falls back to EOS (Llama ships none)."""
    tokenizer = _from_pretrained(AutoTokenizer, source, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(config: TrainConfig, source: str, compute_dtype: torch.dtype) -> torch.nn.Module:
    """The model ready to train: full, LoRA (PEFT) or QLoRA (4-bit NF4 base via bitsandbytes + LoRA).

    Weights load in fp32 for full/LoRA so mixed precision keeps fp32 master weights; QLoRA computes
    in `compute_dtype` (the training dtype).
    """
    kwargs = {"dtype": torch.float32, "attn_implementation": "sdpa", "trust_remote_code": config.trust_remote_code}
    if config.method == "qlora":
        kwargs["quantization_config"] = nf4_config(compute_dtype)
    model = _from_pretrained(AutoModelForCausalLM, source, **kwargs)
    # no KV cache in training forwards: it costs memory, and a cache object disables transformers'
    # detection of packed sequences from position_ids (generation turns it back on per call)
    model.config.use_cache = False
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.method in ("lora", "qlora"):
        model = _add_lora(model, config)
    # from_pretrained returns eval mode; 4-bit layers must stay in train mode (see DESIGN.md's trap)
    model.train()
    return model


def check_packing_support(model: torch.nn.Module) -> None:
    """Packed rows rely on transformers' `create_causal_mask` turning position-id resets into a
    block-diagonal mask; models whose code builds masks another way would attend across examples."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    module = sys.modules[type(base.base_model).__module__]
    if not hasattr(module, "create_causal_mask"):
        raise FinetuneError(
            f"--packing: {type(base).__name__} does not derive attention masks from position ids, so packed "
            "examples would attend to each other. Drop --packing (padding is used instead)."
        )


def nf4_config(compute_dtype: torch.dtype):
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise FinetuneError("--method qlora needs bitsandbytes ≥ 0.43: pip install bitsandbytes") from e
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
        # same storage dtype as compute so FSDP can shard the packed 4-bit weights with everything else
        bnb_4bit_quant_storage=compute_dtype,
    )


def _add_lora(model: torch.nn.Module, config: TrainConfig) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if config.method == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=config.gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as e:  # PEFT: "Target modules {...} not found in the base model"
        raise FinetuneError(f"--lora-targets {config.lora_targets!r}: {e}") from e


def _from_pretrained(cls, source: str, **kwargs):
    """`cls.from_pretrained` with Hub and offline failures turned into one actionable error."""
    try:
        return cls.from_pretrained(source, **kwargs)
    except OSError as e:
        raise FinetuneError(
            f"Could not load '{source}': {str(e).splitlines()[0]}\n"
            "If this machine is offline or the repo is gated, download it elsewhere "
            f"(`huggingface-cli download {source} --local-dir DIR`) and pass --model DIR."
        ) from e


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit packed and ZeRO-3 partitioned weights count as their logical size."""
    trainable = total = 0
    for param in model.parameters():
        quant_state = getattr(param, "quant_state", None)
        if quant_state is not None:
            n = math.prod(quant_state.shape)
        else:  # ZeRO-3 leaves an empty placeholder and records the real size in ds_numel
            n = getattr(param, "ds_numel", param.numel())
        total += n
        trainable += n if param.requires_grad else 0
    return trainable, total
