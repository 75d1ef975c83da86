"""The model a run trains, without its weights: the dtype and quantization it is built in, what every
model goes through before training (no KV cache, gradient checkpointing, LoRA adapters, a frozen
vision tower), the tensor-parallel layout, and the whole model at full size on fake tensors.

Apart from loading.py, which puts weights into this structure (from_pretrained, finetune's own
random inits and GGUF conversions, the tokenizer), because `--dry-run`, `finetune plan --simulate`
and the planner's checks build the same model with no weights at all: nothing here reads a weight
file, so what they measure is the trainer's construction, and the one place that decides it.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

from finetune.config.objectives import OBJECTIVES
from finetune.config.options import TrainConfig
from finetune.config.resolve import ResolvedRun
from finetune.errors import FinetuneError
from finetune.models import families
from finetune.train import chunked_loss, log_probs, parallel, sliding_window
from finetune.train.speedups import with_model


def model_kwargs(run: ResolvedRun) -> dict:
    """`from_pretrained` dtype and quantization for the run's method and precision. Weights published
    in MXFP4 (gpt-oss) load dequantized to the run's dtype, for LoRA and full fine-tuning: QLoRA
    would need a second quantizer on top, so it asks for a 16-bit copy instead."""
    kwargs: dict = {"dtype": getattr(torch, run.precision.weights)}
    if run.spec is not None and run.spec.quantized == "mxfp4":
        if run.config.method == "qlora":
            raise FinetuneError(f"--method qlora: {run.spec.name}'s published weights are MXFP4; QLoRA quantizes "
                                "16-bit weights to NF4. Use --method lora (finetune loads MXFP4 dequantized to bf16), "
                                "or pass a bf16 copy of the model as --model.")
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    if run.config.method == "qlora":
        fam = families.family(run.spec.model_type) if run.spec is not None else None
        kwargs["quantization_config"] = nf4_config(getattr(torch, run.precision.compute), fam)
    return kwargs


def nf4_config(compute_dtype: torch.dtype, fam: families.Family | None = None):
    """QLoRA's NF4 settings; for a mixture of experts the config whose quantizer packs the fused experts
    too (train/experts_4bit.py), and a vision tower (with the LM head) left in 16 bits."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise FinetuneError("--method qlora needs bitsandbytes ≥ 0.43: pip install bitsandbytes") from e
    from transformers import BitsAndBytesConfig

    config_class = BitsAndBytesConfig
    if fam is not None and fam.moe:
        from finetune.train.experts_4bit import Nf4ExpertsConfig as config_class
    return config_class(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
        # same storage dtype as compute so FSDP can shard the packed 4-bit weights with everything else
        bnb_4bit_quant_storage=compute_dtype,
        llm_int8_skip_modules=["lm_head", *fam.tower] if fam is not None and fam.tower else None,
    )


def prepare_for_training(model: torch.nn.Module, config: TrainConfig) -> torch.nn.Module:
    """What every loaded model goes through before training: no KV cache, gradient checkpointing,
    LoRA adapters, train mode. Shared by training and `--dry-run`'s meta-device build.

    QLoRA needs nothing more: PEFT freezes the base, and non-reentrant checkpointing needs no
    input-gradient hook. (PEFT's prepare_model_for_kbit_training would also upcast every
    non-quantized weight to fp32, which is what -mixed precisions load anyway and -true ones avoid.)
    """
    # no KV cache in training forwards: it costs memory, and a cache object disables transformers'
    # detection of packed sequences from position_ids (generation turns it back on per call)
    model.config.use_cache = False
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        keep_activations_after(model, config.gradient_checkpointing_layers)
    fam = families.family(model.config.model_type)
    if config.method == "full" and fam is not None:  # text fine-tuning: a vision tower stays as published
        for name, param in model.named_parameters():
            if set(name.split(".")) & set(fam.tower):
                param.requires_grad_(False)
    if config.method in ("lora", "qlora"):
        model = _add_lora(model, config)
    # from_pretrained returns eval mode; 4-bit layers must stay in train mode: on CPUs with avx512_bf16,
    # bitsandbytes repacks 4-bit weights in place in any eval-mode forward without grad, which silently
    # corrupts a model sharded under FSDP2 (evaluation runs under no_grad in train mode instead)
    model.train()
    return model


def keep_activations_after(model: torch.nn.Module, recomputed: int | None) -> None:
    """Checkpoint only the first `recomputed` decoder layers (None: all; resolve checked the count).
    The later ones keep their activations, so backward, which meets them first, frees those before
    it recomputes any layer."""
    if recomputed is not None:
        for layer in [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)][recomputed:]:
            layer.gradient_checkpointing = False


def _add_lora(model: torch.nn.Module, config: TrainConfig) -> torch.nn.Module:
    from peft import get_peft_model

    try:
        wrapped = get_peft_model(model, lora_config(model, config))
    except ValueError as e:  # PEFT: "Target modules {...} not found in the base model"
        raise FinetuneError(f"--lora-targets {config.lora_targets!r}: {e}") from e
    if any(hasattr(module, "parametrizations") for module in model.modules()):  # 4-bit experts under LoRA
        from finetune.train import experts_4bit

        experts_4bit.fit_lora_to_4bit_experts(wrapped)
    return wrapped


def lora_config(model: torch.nn.Module, config: TrainConfig):
    """PEFT's LoraConfig for --lora-targets on this model (families.lora_targets: linear modules,
    fused expert parameters, a router trained whole, never a vision tower), or as PEFT reads the
    names for a family finetune does not know."""
    from peft import LoraConfig

    common = dict(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout, task_type="CAUSAL_LM")
    fam = families.family(model.config.model_type)
    if fam is None:
        return LoraConfig(target_modules=config.lora_target_modules, **common)
    targets = families.lora_targets(config.lora_targets, fam, config.model, quantized=config.method == "qlora")
    # never a vision tower, nor the container of a 4-bit expert's dequantization (experts.parametrizations.down_proj
    # is no down_proj linear of a shared expert)
    excluded = (*targets.exclude, "parametrizations")
    if targets.experts and config.lora_dropout:
        raise FinetuneError(f"--lora-targets {config.lora_targets}: LoRA on fused expert parameters has no dropout "
                            "(PEFT cannot drop out the input of one expert); use --lora-dropout 0.")
    return LoraConfig(target_modules=list(targets.modules) or None,
                      target_parameters=expert_parameter_names(model, targets) or None,
                      modules_to_save=list(targets.whole) or None,
                      exclude_modules=rf"(.*\.)?({'|'.join(excluded)})(\..*)?", **common)


def expert_parameter_names(model: torch.nn.Module, targets: families.LoraTargets) -> list[str]:
    """PEFT's target_parameters for `targets`: the suffixes (experts.gate_up_proj) match plain
    parameters, but a parameter bitsandbytes quantized in place (a parametrization) matches only
    by its full name, one per layer."""
    names = []
    for target in targets.parameters:
        module_suffix, _, param = target.rpartition(".")
        quantized = [name for name, module in model.named_modules()
                     if name.endswith(module_suffix) and param in getattr(module, "parametrizations", {})]
        names += [f"{name}.{param}" for name in quantized] or [target]
    return names


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


def mark_zero3_leaves(model: torch.nn.Module) -> None:
    """Make each sparse mixture-of-experts block one ZeRO-3 unit: its experts are gathered whole, so
    every rank joins the same all-gathers whichever experts its tokens were routed to."""
    fam = families.family(model.config.model_type)
    if fam is None or fam.experts is None:
        return
    from deepspeed.utils import set_z3_leaf_modules

    blocks = {type(m) for m in model.modules() if type(m).__name__ == fam.experts.block}
    if blocks:
        set_z3_leaf_modules(model, list(blocks))


def tensor_parallel_layout(run: ResolvedRun, hf_config=None):
    """transformers' own layout of a --tp run (train/parallel.py says why it, not Accelerate): the
    model's TP plan with finetune's sequence-parallel rules over each group of `tp` consecutive ranks,
    then FSDP2 over the data-parallel ranks, weights loaded straight into their shards. Under
    bf16-mixed FSDP2 gathers bf16 copies of the fp32 weights, as Accelerate's FSDP2 mixed precision does.
    `hf_config`: the model's config, when not read from its weights' folder."""
    from transformers.distributed import DistributedConfig

    hf_config = hf_config or AutoConfig.from_pretrained(run.model.weights, trust_remote_code=run.config.trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=run.config.trust_remote_code)
    p = run.parallelism
    return DistributedConfig(tp_size=p.tp, fsdp_size=p.dp_shard, dp_replicate_size=p.dp_replicate,
                             tp_plan=parallel.sequence_parallel_plan(skeleton),
                             fsdp_mixed_precision=run.precision.name == "bf16-mixed")


def finish_tensor_parallel(model: torch.nn.Module, run: ResolvedRun) -> None:
    """What a TP model needs once prepared for training: its LoRA adapters read whole rows as local
    tensors (parallel.adapters_read_local_rows), and FSDP2 around what transformers left unsharded."""
    parallel.adapters_read_local_rows(model)
    shard_what_transformers_left(model, run)


def shard_what_transformers_left(model: torch.nn.Module, run: ResolvedRun) -> None:
    """Make the outermost module an FSDP2 unit over the data-parallel ranks, if transformers did not:
    with TP alone (its FSDP runs only over 2 or more ranks), and around LoRA adapters, added after
    it loaded. Accelerate then leaves the layout as it is, and saves it as sharded checkpoints. With
    TP alone each decoder layer is a unit of its own too, as transformers' FSDP plan makes them:
    under bf16-mixed a unit holds its 16-bit copy only while it computes, not the whole model's."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if isinstance(model, FSDPModule):
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if run.precision.name == "bf16-mixed" else MixedPrecisionPolicy()
    mesh = base._device_mesh["fsdp"]
    if not any(isinstance(module, FSDPModule) for module in base.modules()):
        for layer in [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def build_skeleton(run: ResolvedRun):
    """The model `loading.load_model` would build, at full size, on fake tensors (shapes and dtypes, no data
    or memory): same dtype, 4-bit replacement (transformers' own bitsandbytes integration) and
    quantization (bitsandbytes' own, so the packed storage is what it allocates), LoRA wrapping and
    preparation.
    What `--dry-run` and `finetune plan --simulate` measure.

    Returns (model, fake_mode): run anything that touches the model's tensors inside `with fake_mode:`.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    hf_config = skeleton_config(run)
    kwargs = model_kwargs(run)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=kwargs["dtype"],
                                                 attn_implementation=families.attention_implementation(hf_config.model_type))
    if run.config.method == "qlora":
        from bitsandbytes.functional import quantize_4bit
        from transformers.quantizers import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(kwargs["quantization_config"], pre_quantized=False)
        quantizer.preprocess_model(model, dtype=kwargs["dtype"], device_map=None)  # nn.Linear → Linear4bit
        # bitsandbytes builds its code tables from real values on first use: once, outside fake mode
        quantize_4bit(torch.zeros(256 * 64), compress_statistics=True, quant_type="nf4")
    model = prepare_for_training(model, run.config)
    if getattr(kwargs.get("quantization_config"), "quant_method", None) == "finetune_nf4_experts":
        from finetune.train import experts_4bit

        experts_4bit.mark_for_skeleton(model, kwargs["quantization_config"])  # packed as loading packs them
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    run = with_model(run, base)
    if run.switches.chunked_loss:  # as train.speedups installs it
        chunked_loss.install(base)
    sliding_window.switch_off_inert_window(base, run.config.max_seq_len)  # as train.speedups does
    if OBJECTIVES[run.config.objective].preference:  # as train.run installs it
        log_probs.install(base, log_probs.form_of(run))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        give_fake_storage(model)
    return model, fake_mode


def skeleton_config(run: ResolvedRun):
    """The Hugging Face config a skeleton is built from: the catalog's, else the model's own."""
    if run.spec is not None:
        return AutoConfig.for_model(**run.spec.to_hf_config_dict())
    return AutoConfig.from_pretrained(run.model.weights, trust_remote_code=run.config.trust_remote_code)


def build_frozen_skeleton(run: ResolvedRun, fake_mode) -> torch.nn.Module:
    """The frozen copy a preference objective holds as its reference (`loading.load_frozen`, train/reference.py),
    at full size on fake tensors of `fake_mode` (the policy skeleton's)."""
    hf_config = skeleton_config(run)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, run.precision.compute),
                                                 attn_implementation=families.attention_implementation(hf_config.model_type))
    model.requires_grad_(False)
    model.config.use_cache = False
    log_probs.install(model, log_probs.form_of(run))
    with fake_mode:
        give_fake_storage(model)
    return model.eval()


def give_fake_storage(model: torch.nn.Module) -> None:
    """Swap every meta parameter and buffer for a fake CPU tensor of the same shape and dtype; tied
    weights stay tied. A 4-bit weight becomes what bitsandbytes' quantization allocates for it: the
    packed weight, and its quantization state (absmax, nested absmax and code tables) as buffers."""
    # every slot first, holding the meta tensors alive so their ids stay unique while we swap
    slots = [(module, table, is_param, name, tensor) for module in model.modules()
             for table, is_param in ((module._parameters, True), (module._buffers, False))
             for name, tensor in table.items() if tensor is not None]
    fakes: dict[int, torch.Tensor] = {}
    quantized: dict[tuple, tuple] = {}  # one quantization per distinct weight shape
    for module, table, is_param, name, tensor in slots:
        if type(tensor).__name__ == "Params4bit":
            key = (tuple(tensor.shape), tensor.dtype, tensor.blocksize, tensor.compress_statistics,
                   tensor.quant_type, tensor.quant_storage)
            if key not in quantized:
                quantized[key] = _quantized_4bit(tensor)
            pieces = {piece: torch.empty_like(value) for piece, value in quantized[key][0].items()}
            table[name] = torch.nn.Parameter(pieces.pop("packed"), requires_grad=False)
            table[name].quant_state = quantized[key][1]  # its logical shape, for parameter counts
            for piece, value in pieces.items():
                module.register_buffer(f"{name}_{piece}", value, persistent=False)
            continue
        if id(tensor) not in fakes:
            fake = torch.empty_like(tensor, device="cpu")
            fakes[id(tensor)] = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad) if is_param else fake
        table[name] = fakes[id(tensor)]


def _quantized_4bit(weight) -> tuple[dict[str, torch.Tensor], object]:
    """The tensors bitsandbytes allocates when it quantizes `weight` as Params4bit does: the packed
    weight and the pieces of its quantization state; and that QuantState."""
    from bitsandbytes.functional import quantize_4bit

    packed, state = quantize_4bit(torch.empty(weight.shape, dtype=weight.dtype), blocksize=weight.blocksize,
                                  compress_statistics=weight.compress_statistics, quant_type=weight.quant_type,
                                  quant_storage=weight.quant_storage)
    pieces = {"packed": packed, "absmax": state.absmax, "code": state.code}
    if state.nested:
        pieces |= {"offset": state.offset, "nested_absmax": state.state2.absmax, "nested_code": state.state2.code}
    return pieces, state
