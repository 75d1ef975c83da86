"""Everything finetune knows about a model family, one entry per transformers `model_type`.

How its config.json is read (Gemma 3 nests the language model under `text_config`), which class is a
decoder layer (FSDP2's wrap unit: transformers' `_no_split_modules` names it, tests/models/test_families.py
checks), which module is a sparse mixture-of-experts block (a ZeRO-3 leaf, so every rank gathers the
same experts whatever the router picked), the names LoRA can target (linear layers, and in
transformers 5 the experts' fused 3-D parameters), whether the chunked loss replaces the model's own,
and what llama.cpp calls the architecture. Adding a family is one entry here and one tiny config in
tests/models/test_families.py.

Data and pure functions only: the planner imports this without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from finetune.errors import FinetuneError


@dataclass(frozen=True)
class Experts:
    """A family's mixture-of-experts layer as transformers 5 builds it: a block holding a router and
    one module whose parameters stack every routed expert (`experts.gate_up_proj` [experts, 2 ×
    width, hidden] and `experts.down_proj`), optionally beside shared experts every token goes through."""

    count: str  # config key: routed experts per layer
    width: str  # config key: one expert's intermediate size
    block: str  # class of the sparse block (router + experts): ZeRO-3 gathers it whole
    router: str = "gate"  # the router's name inside the block (mlp.gate, gpt-oss: mlp.router); not a nn.Linear
    shared_width: str | None = None  # config key: the shared expert's intermediate size (Qwen2-MoE)
    shared_count: str | None = None  # config key: shared experts of `width` each (DeepSeek)
    shared_gate: bool = False  # Qwen2-MoE: a 1-output linear (shared_expert_gate) scales the shared expert
    bias: bool = False  # gpt-oss: biases on the router and on every expert's projections
    aux_loss: bool = True  # the CausalLM adds router_aux_loss_coef × load-balancing loss when output_router_logits

    @property
    def parameters(self) -> tuple[str, ...]:
        """The fused expert parameters, as PEFT's `target_parameters` names them."""
        return ("experts.gate_up_proj", "experts.down_proj")


@dataclass(frozen=True)
class Family:
    """One transformers `model_type` (see the module docstring)."""

    model_type: str
    decoder_layer: str  # the decoder layer class: FSDP2's unit, transformers' _no_split_modules
    attention: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # linear names, forward order
    mlp: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")  # a dense MLP's linears (MoE: dense layers, shared experts)
    norms_per_layer: int = 2  # Gemma 2/3 norm before and after attention and MLP: 4
    norm_weights: bool = True  # OLMo's LayerNorm has no parameters
    qk_norm: str | None = None  # RMSNorm on queries and keys: per "head" (head_dim) or over the "width" (all heads)
    mla: bool = False  # DeepSeek's multi-head latent attention (low-rank q and kv projections)
    sinks: bool = False  # gpt-oss: one learned attention-sink logit per head per layer
    sdpa: bool = True  # transformers runs it with torch's SDPA (gpt-oss's sinks need eager attention: s² scores kept)
    # biases of the attention projections: "config" (q, k, v and o follow config.json's attention_bias,
    # `bias_default` when it has none), "qkv" (always on q, k, v: Qwen2), "none" (Mistral ignores the key)
    attention_bias: str = "config"
    bias_default: bool = False
    tied: bool = False  # tie_word_embeddings when config.json omits it
    experts: Experts | None = None
    text_config: bool = False  # the language model's numbers sit under config.json's text_config
    tower: tuple[str, ...] = ()  # modules outside the language model (a vision tower): never LoRA targets
    # dense linears (dense layers, shared experts) PEFT 0.21 takes for the experts they were in transformers 4
    # (its v4 → v5 renaming for Qwen2-MoE-like families): LoRA reaches them through their weight instead
    peft_renames: tuple[str, ...] = ()
    chunked_loss: bool = False  # head is a bare linear on the last hidden state, checked in tests/train/test_chunked_loss.py
    # every layer attends within config.json's sliding_window (None: unlimited), which defaults to this
    # when the file has no such key (transformers' config class default)
    sliding: bool = False
    sliding_default: int | None = None
    gguf_writer: bool = False  # finetune's own GGUF writer (export/gguf.py) writes it
    llama_cpp: str | None = None  # llama.cpp's architecture (convert_hf_to_gguf.py knows it)

    @property
    def moe(self) -> bool:
        return self.experts is not None

    @property
    def linears(self) -> tuple[str, ...]:
        """Every linear layer name of a decoder layer, dense MLP and shared expert included."""
        return (*self.attention, *self.mlp)


MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
RENAMED = ("gate_proj", "up_proj", "down_proj")

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaDecoderLayer", chunked_loss=True, gguf_writer=True, llama_cpp="llama"),
    Family("mistral", "MistralDecoderLayer", attention_bias="none", chunked_loss=True, gguf_writer=True, llama_cpp="llama",
           sliding=True, sliding_default=4096),
    Family("qwen2", "Qwen2DecoderLayer", attention_bias="qkv", chunked_loss=True, llama_cpp="qwen2"),
    Family("qwen3", "Qwen3DecoderLayer", qk_norm="head", chunked_loss=True, llama_cpp="qwen3"),
    Family("gemma", "GemmaDecoderLayer", tied=True, llama_cpp="gemma"),
    Family("gemma2", "Gemma2DecoderLayer", norms_per_layer=4, tied=True, llama_cpp="gemma2"),
    Family("gemma3_text", "Gemma3DecoderLayer", norms_per_layer=4, qk_norm="head", tied=True, llama_cpp="gemma3"),
    Family("gemma3", "Gemma3DecoderLayer", norms_per_layer=4, qk_norm="head", tied=True, text_config=True,
           tower=("vision_tower", "multi_modal_projector"), llama_cpp="gemma3"),
    Family("phi3", "Phi3DecoderLayer", attention=("qkv_proj", "o_proj"), mlp=("gate_up_proj", "down_proj"), llama_cpp="phi3"),
    Family("olmo", "OlmoDecoderLayer", norm_weights=False, llama_cpp="olmo"),
    Family("olmo2", "Olmo2DecoderLayer", qk_norm="width", llama_cpp="olmo2"),
    Family("granite", "GraniteDecoderLayer", llama_cpp="granite"),
    Family("mixtral", "MixtralDecoderLayer", mlp=(), attention_bias="none", chunked_loss=True, llama_cpp="llama", sliding=True,
           experts=Experts("num_local_experts", "intermediate_size", "MixtralSparseMoeBlock")),
    Family("qwen2_moe", "Qwen2MoeDecoderLayer", attention_bias="qkv", chunked_loss=True, llama_cpp="qwen2moe",
           experts=Experts("num_experts", "moe_intermediate_size", "Qwen2MoeSparseMoeBlock",
                           shared_width="shared_expert_intermediate_size", shared_gate=True)),
    Family("qwen3_moe", "Qwen3MoeDecoderLayer", qk_norm="head", peft_renames=RENAMED, chunked_loss=True, llama_cpp="qwen3moe",
           experts=Experts("num_experts", "moe_intermediate_size", "Qwen3MoeSparseMoeBlock")),
    Family("olmoe", "OlmoeDecoderLayer", mlp=(), qk_norm="width", peft_renames=RENAMED, chunked_loss=True, llama_cpp="olmoe",
           experts=Experts("num_experts", "intermediate_size", "OlmoeSparseMoeBlock")),
    Family("gpt_oss", "GptOssDecoderLayer", mlp=(), sinks=True, sdpa=False, bias_default=True, chunked_loss=True, llama_cpp="gpt-oss",
           experts=Experts("num_local_experts", "intermediate_size", "GptOssMLP", router="router", bias=True)),
    Family("deepseek_v2", "DeepseekV2DecoderLayer", attention=MLA, mla=True, peft_renames=RENAMED, chunked_loss=True, llama_cpp="deepseek2",
           experts=Experts("n_routed_experts", "moe_intermediate_size", "DeepseekV2Moe", shared_count="n_shared_experts",
                           aux_loss=False)),
    Family("deepseek_v3", "DeepseekV3DecoderLayer", attention=MLA, mla=True, peft_renames=RENAMED, chunked_loss=True, llama_cpp="deepseek2",
           experts=Experts("n_routed_experts", "moe_intermediate_size", "DeepseekV3MoE", shared_count="n_shared_experts",
                           aux_loss=False)),
)}


def family(model_type: str) -> Family | None:
    return FAMILIES.get(model_type)


def get(model_type: str, name: str) -> Family:
    """The family of `model_type`; FinetuneError naming the known ones otherwise (`name`: the model, for the message)."""
    found = family(model_type)
    if found is None:
        raise FinetuneError(f"{name}: model_type {model_type!r} is not supported; finetune knows "
                            f"{', '.join(sorted(FAMILIES))}.")
    return found


def chunked_loss_types() -> tuple[str, ...]:
    return tuple(t for t, f in FAMILIES.items() if f.chunked_loss)


def attention_implementation(model_type: str) -> str:
    """transformers' attention kernel finetune loads a model with: SDPA, or eager where the family has no SDPA path."""
    found = family(model_type)
    return "eager" if found is not None and not found.sdpa else "sdpa"


# ---------------------------------------------------------------- config.json ↔ the planner's numbers


def language_config(config: dict) -> dict:
    """The config of the language model: `text_config` (with the outer model_type) where the family
    nests it, else `config` itself."""
    found = family(config.get("model_type", ""))
    if found is not None and found.text_config:
        return {**config.get("text_config", {}), "model_type": config["model_type"],
                **({"tie_word_embeddings": config["tie_word_embeddings"]} if "tie_word_embeddings" in config else {})}
    return config


# transformers' attribute_map lets a config.json name the expert count under any of these (Qwen3-MoE's
# published config says num_experts, transformers 5 writes num_local_experts); gpt-oss also says experts_per_token
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token")


def moe_fields(config: dict, fam: Family) -> dict:
    """The ModelSpec fields of a family's experts, read from its (language) config."""
    experts = fam.experts
    if experts is None:
        return {}
    layers = config["num_hidden_layers"]
    width = config[experts.width]
    count = next((config[key] for key in (experts.count, *EXPERT_COUNT_KEYS) if config.get(key)), None)
    top_k = next((config[key] for key in TOP_K_KEYS if config.get(key)), None)
    if not count or not top_k:
        raise KeyError(experts.count if not count else TOP_K_KEYS[0])
    shared = (config.get(experts.shared_width) or 0) if experts.shared_width else \
        (config.get(experts.shared_count) or 0) * width if experts.shared_count else 0
    return {"num_experts": count, "experts_per_token": top_k,
            "expert_intermediate_size": width, "shared_expert_intermediate_size": shared,
            "dense_layers": layers - sum(map(bool, sparse_layers(config))),
            "router_aux_loss": bool(config.get("output_router_logits")) and experts.aux_loss}


def sparse_layers(config: dict) -> list[bool]:
    """Which decoder layers hold experts, as each family's decoder layer decides it."""
    layers = config["num_hidden_layers"]
    if "first_k_dense_replace" in config:  # DeepSeek
        return [i >= (config.get("first_k_dense_replace") or 0) for i in range(layers)]
    only_mlp, step = set(config.get("mlp_only_layers") or ()), config.get("decoder_sparse_step") or 1
    return [i not in only_mlp and (i + 1) % step == 0 for i in range(layers)]


def bias_fields(config: dict, fam: Family) -> dict:
    """ModelSpec's attention_bias (on q, k, v) and o_proj_bias, as the family's attention builds them."""
    if fam.attention_bias != "config":
        return {"attention_bias": fam.attention_bias == "qkv", "o_proj_bias": False}
    bias = bool(config.get("attention_bias", fam.bias_default))
    return {"attention_bias": bias, "o_proj_bias": bias}


def mla_fields(config: dict) -> dict:
    return {"q_lora_rank": config.get("q_lora_rank") or 0, "kv_lora_rank": config["kv_lora_rank"],
            "qk_rope_head_dim": config["qk_rope_head_dim"], "qk_nope_head_dim": config["qk_nope_head_dim"],
            "v_head_dim": config["v_head_dim"]}


def config_fields(spec: dict) -> dict:
    """The config.json fields transformers needs to build the architecture a ModelSpec describes
    (`spec`: its fields as a dict), beyond the ones every family shares."""
    fam = get(spec["model_type"], spec["name"])
    config = {"attention_bias": spec["attention_bias"]} if fam.attention_bias == "config" else {}
    if fam.sliding:
        config["sliding_window"] = spec["sliding_window"]
    if fam.experts is not None:
        experts = fam.experts
        config |= {experts.count: spec["num_experts"], "num_experts_per_tok": spec["experts_per_token"],
                   experts.width: spec["expert_intermediate_size"], "output_router_logits": spec["router_aux_loss"]}
        if experts.shared_width:
            config[experts.shared_width] = spec["shared_expert_intermediate_size"]
        if experts.shared_count:
            config[experts.shared_count] = spec["shared_expert_intermediate_size"] // spec["expert_intermediate_size"]
        dense = spec["dense_layers"]
        config |= {"first_k_dense_replace": dense} if fam.mla else {"mlp_only_layers": list(range(dense))} if dense else {}
    if fam.mla:
        config |= {"q_lora_rank": spec["q_lora_rank"] or None, "kv_lora_rank": spec["kv_lora_rank"],
                   "qk_rope_head_dim": spec["qk_rope_head_dim"], "qk_nope_head_dim": spec["qk_nope_head_dim"],
                   "v_head_dim": spec["v_head_dim"], "n_group": 1, "topk_group": 1}
    return config


def nest(config: dict, tower: dict | None) -> dict:
    """A flat language-model config written as the family's config.json: Gemma 3's nests it under
    text_config beside the vision tower's config."""
    fam = family(config["model_type"])
    if fam is None or not fam.text_config:
        return config
    text = {k: v for k, v in config.items() if k not in ("model_type", "tie_word_embeddings")}
    return {"model_type": config["model_type"], "tie_word_embeddings": config.get("tie_word_embeddings", fam.tied),
            "text_config": text, **({"vision_config": tower} if tower else {})}


# Gemma 3 4B, 12B and 27B share one vision tower, SigLIP So400m at 896 px (google/gemma-3-12b-it/config.json's
# vision_config); `mm_tokens_per_image` 256 sits beside it.
GEMMA3_VISION = {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                 "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
                 "vision_use_head": False}


def tower_params(config: dict, text_hidden: int) -> int:
    """Parameters of a SigLIP vision tower and Gemma 3's projector to `text_hidden`, from config.json's
    vision_config (transformers' defaults where a key is missing): patch embedding, positions, encoder
    layers (two LayerNorms, q/k/v/out with biases, fc1/fc2), post LayerNorm, the optional pooling head;
    the projector's matrix and its RMSNorm."""
    vision = config.get("vision_config")
    if not vision:
        return 0
    h, inter = vision.get("hidden_size", 768), vision.get("intermediate_size", 3072)
    patch, image = vision.get("patch_size", 16), vision.get("image_size", 224)
    mlp = h * inter + inter + inter * h + h
    embeddings = vision.get("num_channels", 3) * patch * patch * h + h + (image // patch) ** 2 * h
    layer = 2 * 2 * h + 4 * (h * h + h) + mlp
    head = h + 3 * h * h + 3 * h + h * h + h + 2 * h + mlp if vision.get("vision_use_head", True) else 0
    return embeddings + vision.get("num_hidden_layers", 12) * layer + 2 * h + head + h * text_hidden + h


def shrink(config: dict, layers: int, hidden: int, heads: int = 4, overrides: dict | None = None) -> dict:
    """A Hugging Face config dict of the same architecture, made tiny: `layers` decoder layers of width
    `hidden`, `heads` query heads of hidden / heads each, an MLP twice as wide, and the same multi-head
    or grouped-query ratio (at least one key/value head). Per-layer lists (`layer_types`) keep their
    first layers; every other field (model type, biases, rope, vocabulary) stays. Experts keep their
    number up to 8, route each token to at most a quarter of them, and get an intermediate size of
    hidden / 2; latent attention ranks
    shrink with the width; a vision tower becomes one layer of width 32. `overrides` (a vocabulary,
    token ids) are set on the language model's config.

    Rehearsals and tests shrink real entries this way, so the same classes, FSDP wrap policies, ZeRO-3
    leaves and LoRA targets run on a CPU in seconds.
    """
    fam = family(config.get("model_type", ""))
    if fam is not None and fam.text_config:
        text = shrink({**config.get("text_config", {}), "model_type": "gemma3_text"}, layers, hidden, heads, overrides)
        vision = {**(config.get("vision_config") or {}), "hidden_size": 32, "intermediate_size": 64,
                  "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
        return {**config, "text_config": {k: v for k, v in text.items() if k != "model_type"}, "vision_config": vision,
                "mm_tokens_per_image": 4}
    original_layers, original_heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or original_heads
    shrunk = {key: value[:layers] if isinstance(value, list) and len(value) == original_layers else value
              for key, value in config.items()}
    shrunk |= {"num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": 2 * hidden,
               "num_attention_heads": heads, "head_dim": hidden // heads,
               "num_key_value_heads": max(1, heads * kv_heads // original_heads)}
    if fam is not None and fam.experts is not None:
        experts = fam.experts
        count_key = next(key for key in (experts.count, *EXPERT_COUNT_KEYS) if config.get(key))
        count = min(8, config[count_key])
        top_k = min(next(config[key] for key in TOP_K_KEYS if config.get(key)), max(1, count // 4))  # routing still chooses
        shrunk |= {count_key: count, experts.width: hidden // 2, "num_experts_per_tok": top_k}
        if experts.shared_width:
            shrunk[experts.shared_width] = hidden
        shrunk["mlp_only_layers"] = [i for i in config.get("mlp_only_layers") or () if i < layers]
        if "first_k_dense_replace" in config:
            shrunk["first_k_dense_replace"] = min(config["first_k_dense_replace"] or 0, layers - 1)
    if fam is not None and fam.mla:  # latent attention is multi-head: as many key/value heads as query heads
        rope = hidden // heads // 2  # transformers' rotary embedding of latent attention is head_dim wide
        shrunk |= {"num_key_value_heads": heads, "kv_lora_rank": hidden // 4, "head_dim": rope,
                   "q_lora_rank": hidden // 2 if config.get("q_lora_rank") else None, "qk_rope_head_dim": rope,
                   "qk_nope_head_dim": hidden // heads, "v_head_dim": hidden // heads, "n_group": 1, "topk_group": 1}
    return shrunk | (overrides or {})


# ---------------------------------------------------------------- parameters by kind

KINDS = ("attention", "dense MLP", "experts", "router", "embeddings", "head", "norms", "other")
_NORM = re.compile(r"(^|_)(norm|layernorm|ln)(_|$)|norm$")


def parameter_kind(name: str, fam: Family | None) -> str:
    """Which part of the model a parameter (its name in named_parameters, PEFT's wrappers and
    bitsandbytes' parametrizations included) belongs to: one of KINDS. Adapters count with the
    module they adapt. Shared experts run on every token: they count as dense MLP."""
    parts = [p for p in name.split(".") if p not in ("base_model", "model", "base_layer", "default", "original",
                                                      "parametrizations", "modules_to_save", "language_model")]
    if fam is not None and any(part in fam.tower for part in parts):
        return "other"
    modules = [p for p in parts if not p.startswith("lora_")]
    last = modules[-2] if len(modules) > 1 and modules[-1] in ("weight", "bias") else modules[-1]
    if "embed_tokens" in modules or "wte" in modules:
        return "embeddings"
    if "lm_head" in modules:
        return "head"
    router = fam.experts.router if fam is not None and fam.experts is not None else None
    if "shared_expert_gate" in modules or (router is not None and router in modules[:-1] and "mlp" in modules):
        return "router"
    if "experts" in modules:
        return "experts"
    if _NORM.search(last):
        return "norms"
    if "self_attn" in modules or "attn" in modules:
        return "attention"
    if "mlp" in modules or "feed_forward" in modules:
        return "dense MLP"
    return "other"


# ---------------------------------------------------------------- LoRA targets

ALL_LINEAR = "all-linear"
EXPERTS = "experts"
ROUTER = "router"
LM_HEAD = "lm_head"  # PEFT adapts the output layer only when it is named: "all-linear" leaves it out
PRESETS = (ALL_LINEAR, f"{ALL_LINEAR}+{EXPERTS}")


@dataclass(frozen=True)
class LoraTargets:
    """What `--lora-targets` adapts in one family, as PEFT's LoraConfig takes it: linear module names
    (target_modules), parameters (target_parameters: fused experts, one LoRA per expert, and the
    weights of linears PEFT would rename) and modules trained whole (modules_to_save: the router,
    only when named)."""

    modules: tuple[str, ...]
    parameters: tuple[str, ...] = ()
    whole: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()  # module names under `modules` that are not the language model's
    left_out: tuple[str, ...] = ()  # linears asked for that this run cannot adapt (see `lora_targets`)

    @property
    def experts(self) -> bool:
        return any(p.startswith(f"{EXPERTS}.") for p in self.parameters)

    def adapts(self, linear: str) -> bool:
        """Whether a linear (or fused expert parameter) of that name gets an adapter."""
        return linear in self.modules or linear in self.parameters or f"{linear}.weight" in self.parameters


def lora_targets(text: str, fam: Family, name: str, quantized: bool = False) -> LoraTargets:
    """`--lora-targets` for a model of family `fam`: a comma list of linear names of a decoder layer,
    `lm_head`, `all-linear` (every linear of the decoder layers, the shared experts' included, never
    a router or the head), `experts` (every routed expert's fused projections, through PEFT's
    target_parameters), `experts.gate_up_proj` / `experts.down_proj`, `router` (trained whole), or
    the preset `all-linear+experts` (attention, MLPs and experts).

    Linears PEFT 0.21 would take for experts (`Family.peft_renames`) are adapted through their weight
    (target_parameters); under QLoRA (`quantized`) their weights are 4-bit and they are left out.

    Raises FinetuneError naming what this family accepts when a term names nothing in it.
    """
    terms = [word for t in text.split(",") if t.strip()
             for word in ([ALL_LINEAR, EXPERTS] if t.strip() == PRESETS[1] else [t.strip()])]
    linear = fam.linears
    expert_params = fam.experts.parameters if fam.experts else ()
    modules, parameters, whole, unknown = [], [], [], []
    for term in terms:
        if term == ALL_LINEAR:
            modules += linear
        elif term == EXPERTS and expert_params:
            parameters += expert_params
        elif term in expert_params:
            parameters.append(term)
        elif term == ROUTER and fam.experts is not None:
            whole += [fam.experts.router, *(["shared_expert_gate"] if fam.experts.shared_gate else [])]
        elif term in linear or term == LM_HEAD:
            modules.append(term)
        else:
            unknown.append(term)
    if unknown or not terms:
        accepted = [ALL_LINEAR, *linear, LM_HEAD] + ([EXPERTS, *expert_params, ROUTER] if fam.experts else [])
        raise FinetuneError(f"--lora-targets {text!r}: {', '.join(unknown) or 'empty'} names nothing LoRA can adapt in "
                            f"{name}. Use a comma list of: {', '.join(accepted)}"
                            + (f" (presets: {', '.join(PRESETS)})." if fam.experts else "."))
    renamed = [m for m in dict.fromkeys(modules) if m in fam.peft_renames]
    modules = [m for m in modules if m not in renamed]
    parameters += [] if quantized else [f"{m}.weight" for m in renamed]
    return LoraTargets(tuple(dict.fromkeys(modules)), tuple(dict.fromkeys(parameters)), tuple(dict.fromkeys(whole)),
                       exclude=fam.tower, left_out=tuple(renamed) if quantized else ())


def lora_warnings(text: str, fam: Family, targets: LoraTargets) -> list[str]:
    """One line each for what a LoRA run of this family asked for that will not train: no expert of a
    mixture of experts (`all-linear` means attention and dense MLPs, experts are not linear layers),
    and, under QLoRA, the dense linears `lora_targets` had to leave out."""
    warnings = []
    if fam.experts is not None and not targets.experts:
        warnings.append(f"--lora-targets {text}: no expert of this mixture-of-experts model trains (its experts are fused "
                        f"3-D parameters, not linear layers); --lora-targets {ALL_LINEAR}+{EXPERTS} adapts them too.")
    if targets.left_out:
        warnings.append(f"--lora-targets {text}: {', '.join(targets.left_out)} of the dense layers and shared experts get no "
                        "adapter under QLoRA (PEFT 0.21 takes those names for the experts'; their 4-bit weights cannot "
                        "take one through target_parameters); --method lora adapts them.")
    return warnings
