"""The family table (models/families.py) against the models transformers builds: one tiny config per
family, and for each the planner's parameter count, the decoder layer FSDP2 wraps, the sparse block
ZeRO-3 treats as a leaf, the names LoRA targets and the kinds the run's table sorts parameters into.

Adding a family is an entry in families.FAMILIES and one in FAMILY_CONFIGS here."""

from __future__ import annotations

from dataclasses import replace

import peft
import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from finetune.errors import FinetuneError
from finetune.export import gguf
from finetune.models import families
from finetune.models.source import spec_from_config
from finetune.plan.params import count_params, layer_kinds, lora_params, resolve_lora_targets

BASE = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=128, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=1)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16,
           n_group=1, topk_group=1)  # latent attention's rotary embedding is head_dim wide: qk_rope_head_dim
FAMILY_CONFIGS = {  # model_type → what its tiny config.json changes from BASE (3 layers, so dense and sparse layers mix)
    "llama": dict(attention_bias=True), "mistral": {}, "qwen2": {}, "qwen3": {}, "gemma": {}, "gemma2": {},
    "gemma3_text": {}, "phi3": {}, "olmo": {}, "olmo2": {}, "granite": {},
    "gemma3": dict(text_config=dict(BASE, vocab_size=300), mm_tokens_per_image=4,
                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=28, patch_size=14)),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      mlp_only_layers=[0]),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "deepseek_v2": dict(MLA, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
                        first_k_dense_replace=1, q_lora_rank=None),
    "deepseek_v3": dict(MLA, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, q_lora_rank=24),
}


def family_config(model_type: str) -> dict:
    changes = FAMILY_CONFIGS[model_type]
    settings = changes if "text_config" in changes else {**BASE, **changes}
    return transformers.AutoConfig.for_model(model_type, **settings).to_dict()


def build(config: dict):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))


def test_every_family_has_a_tiny_config():
    assert set(FAMILY_CONFIGS) == set(families.FAMILIES)


@pytest.mark.parametrize("model_type", sorted(families.FAMILIES))
def test_family_entry_matches_the_model_transformers_builds(model_type):
    config = family_config(model_type)
    fam, spec, model = families.FAMILIES[model_type], spec_from_config(config, model_type), build(config)
    counts = count_params(spec)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert fam.decoder_layer in model._no_split_modules  # FSDP2's transformer-based wrap unit
    classes = {type(m).__name__ for m in model.modules()}
    assert fam.decoder_layer in classes
    if fam.experts is not None:
        assert fam.experts.block in classes  # the ZeRO-3 leaf
        assert counts.active < counts.total
    written = spec_from_config(spec.to_hf_config_dict(), model_type)  # the catalog writes what it reads
    assert replace(written, tower_params=spec.tower_params) == spec  # (with Gemma 3's published vision tower)
    kinds = {}
    for name, param in model.named_parameters():
        kind = families.parameter_kind(name, fam)
        kinds[kind] = kinds.get(kind, 0) + param.numel()
    assert kinds.get("other", 0) == spec.tower_params  # every language-model parameter has its kind
    assert kinds["embeddings"] == counts.embedding and kinds.get("head", 0) == counts.head
    expert_params = sum(n * sum(linear.params for linear in linears if linear.kind == "experts")
                        for n, linears in layer_kinds(spec))
    assert kinds.get("experts", 0) == expert_params


@pytest.mark.parametrize("model_type", sorted(families.FAMILIES))
def test_lora_on_every_family_trains_what_the_planner_counts(model_type):
    from finetune.config.options import TrainConfig
    from finetune.train.skeleton import lora_config

    config, fam = family_config(model_type), families.FAMILIES[model_type]
    spec = spec_from_config(config, model_type)
    for targets in ["all-linear"] + (["all-linear+experts", "experts.down_proj,router"] if fam.moe else []):
        model = build(config)
        wrapped = peft.get_peft_model(model, lora_config(model, TrainConfig(method="lora", lora_r=4, lora_targets=targets)))
        trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
        assert trainable == lora_params(spec, 4, resolve_lora_targets(spec, targets)), targets
        adapted = {families.parameter_kind(n, fam) for n, p in wrapped.named_parameters() if p.requires_grad}
        assert "other" not in adapted and ("experts" in adapted) == (targets != "all-linear")
        assert "router" not in adapted or "router" in targets  # frozen unless asked


def test_lora_targets_say_what_a_family_accepts():
    mixtral = families.FAMILIES["mixtral"]
    targets = families.lora_targets("all-linear+experts", mixtral, "m")
    assert targets.modules == ("q_proj", "k_proj", "v_proj", "o_proj")  # Mixtral has no dense MLP
    assert targets.parameters == ("experts.gate_up_proj", "experts.down_proj") and not targets.whole
    assert families.lora_targets("q_proj,router", mixtral, "m").whole == ("gate",)
    with pytest.raises(FinetuneError, match="gate_proj names nothing .* all-linear, q_proj.*experts.*router"):
        families.lora_targets("gate_proj", mixtral, "m")
    with pytest.raises(FinetuneError, match="experts names nothing"):
        families.lora_targets("experts", families.FAMILIES["llama"], "m")
    [warning] = families.lora_warnings("all-linear", mixtral, families.lora_targets("all-linear", mixtral, "m"))
    assert "no expert" in warning and "--lora-targets all-linear+experts" in warning
    assert families.lora_warnings("all-linear+experts", mixtral, targets) == []
    deepseek = families.FAMILIES["deepseek_v2"]  # dense first layers and shared experts: gate_proj etc.
    lora = families.lora_targets("all-linear+experts", deepseek, "m")
    assert "gate_proj.weight" in lora.parameters and "gate_proj" not in lora.modules  # PEFT would rename the module
    qlora = families.lora_targets("all-linear+experts", deepseek, "m", quantized=True)
    assert qlora.left_out == ("gate_proj", "up_proj", "down_proj") and "gate_proj.weight" not in qlora.parameters
    [warning] = families.lora_warnings("all-linear+experts", deepseek, qlora)
    assert "gate_proj, up_proj, down_proj of the dense layers and shared experts get no adapter under QLoRA" in warning


def test_table_decides_chunked_loss_and_gguf():
    from finetune.config.names import CHUNKED_LOSS_ARCHITECTURES

    assert set(CHUNKED_LOSS_ARCHITECTURES) == {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
                                               "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3"}
    assert gguf.ARCHITECTURES == {"llama": "llama", "mistral": "llama"}
    with pytest.raises(FinetuneError, match="'qwen3_moe'.*convert_hf_to_gguf.py writes it as 'qwen3moe'"):
        gguf.check_gguf_support({"model_type": "qwen3_moe"}, None)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gemma3", "deepseek_v3", "gpt_oss"])
def test_shrunk_configs_build_the_same_classes(model_type):
    config = families.shrink(family_config(model_type), layers=2, hidden=32, overrides={"vocab_size": 64})
    model = build(config)
    fam = families.FAMILIES[model_type]
    assert fam.decoder_layer in {type(m).__name__ for m in model.modules()}
    spec = spec_from_config(config, model_type)
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (2, 32, 64)
    assert count_params(spec).total == sum(p.numel() for p in model.parameters())
