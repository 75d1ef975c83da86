"""QLoRA's 4-bit experts: NF4 for the fused 3-D expert parameters that transformers' bitsandbytes
integration leaves in 16 bits (it quantizes nn.Linear only), quantized one layer at a time as the
checkpoint loads.

transformers 5 builds each layer's `experts.gate_up_proj` / `experts.down_proj` from the checkpoint
(fusing per-expert tensors where the file has them) and hands it to the quantizer's operation before
it is set on the model; here that operation packs it with bitsandbytes' own `quantize_4bit` (the NF4,
double quantization and storage dtype of the run's BitsAndBytesConfig), so the 16-bit experts of one
layer exist only while that layer loads. Once loaded, each packed parameter gets bitsandbytes'
`Bnb4bitParametrization`, which dequantizes it when the experts' forward reads it (once per forward,
cached) — the mechanism bitsandbytes provides for parameters outside nn.Linear. PEFT's
target_parameters then puts LoRA on top of the dequantized weight.

The quantizer is registered with transformers under its own method name, so it is chosen by
`from_pretrained(quantization_config=Nf4ExpertsConfig(...))` like any quantization backend.
"""

from __future__ import annotations

from types import MethodType

import torch
from bitsandbytes.functional import quantize_4bit
from bitsandbytes.nn.parametrize import Bnb4bitParametrization
from torch.nn.utils import parametrize
from transformers import BitsAndBytesConfig
from transformers.core_model_loading import ConversionOps
from transformers.integrations.bitsandbytes import Bnb4bitQuantize
from transformers.quantizers import register_quantization_config, register_quantizer
from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name

METHOD = "finetune_nf4_experts"
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # transformers 5's fused experts (models/families.Experts)


def is_expert_parameter(module: torch.nn.Module, name: str) -> bool:
    """A fused expert parameter: 3-D [experts, out, in] (or [experts, in, out]) under one of EXPERT_PARAMETERS."""
    param = module._parameters.get(name) if name in EXPERT_PARAMETERS else None
    return param is not None and param.dim() == 3


@register_quantization_config(METHOD)
class Nf4ExpertsConfig(BitsAndBytesConfig):
    """A BitsAndBytesConfig (4-bit) whose quantizer also packs the fused expert parameters."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.quant_method = METHOD


class QuantizeOnLoad(ConversionOps):
    """The quantizer's operation on each loaded tensor: an expert parameter packed to NF4 here (its
    QuantState kept on the packed parameter), a linear's weight as transformers' bitsandbytes does it."""

    def __init__(self, quantizer: Nf4ExpertsQuantizer):
        self.quantizer = quantizer

    def convert(self, input_dict: dict, full_layer_name: str | None = None, model=None, **kwargs) -> dict:
        result = {}
        for name, value in input_dict.items():
            value = value[0] if isinstance(value, list) else value
            module, short = get_module_from_name(model, name)
            if is_expert_parameter(module, short):
                result[name] = pack(value, self.quantizer.quantization_config)
            else:
                result |= Bnb4bitQuantize(self.quantizer).convert({name: value}, full_layer_name=full_layer_name, model=model)
        return result


def pack(value: torch.Tensor, config: BitsAndBytesConfig) -> torch.nn.Parameter:
    """`value` as bitsandbytes' packed NF4 storage, a frozen parameter carrying its QuantState."""
    packed, state = quantize_4bit(value, compress_statistics=config.bnb_4bit_use_double_quant,
                                  quant_type=config.bnb_4bit_quant_type, quant_storage=config.bnb_4bit_quant_storage)
    param = torch.nn.Parameter(packed, requires_grad=False)
    param.quant_state = state  # its logical shape, for parameter counts (train/inventory.py)
    return param


@register_quantizer(METHOD)
class Nf4ExpertsQuantizer(Bnb4BitHfQuantizer):
    """transformers' 4-bit bitsandbytes quantizer, with the fused expert parameters quantized too."""

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module, name = get_module_from_name(model, param_name)
        return super().param_needs_quantization(model, param_name, **kwargs) or is_expert_parameter(module, name)

    def get_quantize_ops(self):
        return QuantizeOnLoad(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        dequantize_on_access(model)
        return super()._process_model_after_weight_loading(model, **kwargs)


def dequantize_on_access(model: torch.nn.Module) -> None:
    """Give every packed expert parameter bitsandbytes' dequantizing parametrization: reading
    `experts.gate_up_proj` then returns the 16-bit weight, built from the packed one, once per forward.

    Registered here rather than with bitsandbytes' `replace_parameter_4bit_prequantized`, whose
    state-dict hook renames the packed parameter to the dequantized one's name for from_pretrained:
    torch's distributed checkpoint (FSDP2) then resolves that name and dequantizes a shard. A
    training checkpoint keeps the packed parameter as it is; a resume quantizes the same base again."""
    for module in list(model.modules()):
        experts = [name for name in EXPERT_PARAMETERS if hasattr(module._parameters.get(name), "quant_state")]
        for name in experts:
            parametrize.register_parametrization(module, name, Bnb4bitParametrization(module._parameters[name].quant_state),
                                                 unsafe=True)
        if experts:
            dequantize_once_per_forward(module)


def dequantize_once_per_forward(module: torch.nn.Module) -> None:
    """Run the module's forward inside torch's `parametrize.cached()`, so a weight read twice is
    dequantized once; closed even when a checkpointed recompute stops the forward early."""
    open_contexts = []

    def enter(module, args) -> None:
        open_contexts.append(parametrize.cached())
        open_contexts[-1].__enter__()

    def leave(module, args, output) -> None:
        open_contexts.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def mark_for_skeleton(model: torch.nn.Module, config: BitsAndBytesConfig) -> None:
    """`--dry-run`'s skeleton (skeleton.build_skeleton): make each meta expert parameter a bitsandbytes
    Params4bit of the run's settings, which skeleton.give_fake_storage then gives the packed storage
    and quantization state this module's packing allocates."""
    from bitsandbytes.nn import Params4bit

    for module in model.modules():
        for name in EXPERT_PARAMETERS:
            if is_expert_parameter(module, name):
                module._parameters[name] = Params4bit(
                    module._parameters[name].data, requires_grad=False, compress_statistics=config.bnb_4bit_use_double_quant,
                    quant_type=config.bnb_4bit_quant_type, quant_storage=config.bnb_4bit_quant_storage)


def fit_lora_to_4bit_experts(model: torch.nn.Module) -> None:
    """Work around two faults of PEFT 0.21's ParamWrapper over a parameter that another
    parametrization (the dequantization here) already owns; tests/models/test_moe_training.py checks both.

    - It adds its LoRA as a parametrization for each forward and removes it after, looking only for
      a `_LoraParameterProxy`, while for fused experts it registers a `_LoraFactorsProxy`: the proxy
      stays and every forward stacks one more (W + n·ΔW). Removal here finds either kind.
    - With two expert parameters adapted, the wrappers nest, and the inner one registers its LoRA
      inside the outer one's `parametrize.cached()`, where registering evaluates (and caches) the
      weight as it was before: the forward then reads it without that LoRA. The experts drop such
      entries as their forward starts; and the wrappers read dtype and device from the packed
      parameter's QuantState rather than dequantizing a whole expert stack to learn them.
    """
    from peft.tuners.lora.layer import ParamWrapper, _LoraFactorsProxy, _LoraParameterProxy

    def remove_lora_proxy(wrapper) -> None:
        proxies = wrapper.get_base_layer().parametrizations[wrapper.parameter_name]
        if len(proxies) == 1:
            return ParamWrapper._remove_parametrizations(wrapper)
        last = max(i for i, proxy in enumerate(proxies) if isinstance(proxy, (_LoraFactorsProxy, _LoraParameterProxy)))
        del proxies[last]

    def parameter_like(wrapper) -> torch.Tensor:
        """What the wrapper reads of its parameter after setup (dtype, device, requires_grad), uncached;
        from the dequantizing parametrization, which keeps its QuantState whatever FSDP2 makes of the
        packed parameter."""
        chain = wrapper.get_base_layer().parametrizations[wrapper.parameter_name]
        return torch.empty(0, dtype=chain[0].quant_state.dtype, device=chain.original.device)

    def evict_stale_weights(experts, args) -> None:
        for name in experts.parametrizations:
            parametrize._cache.pop((id(experts), name), None)

    for module in model.modules():
        if isinstance(module, ParamWrapper) and wrapper_over_4bit(module):
            module._remove_parametrizations = MethodType(remove_lora_proxy, module)
            module.get_param = MethodType(parameter_like, module)
            experts = module.get_base_layer()
            if not getattr(experts, "_evicts_stale_weights", False):
                experts.register_forward_pre_hook(evict_stale_weights)
                experts._evicts_stale_weights = True


def wrapper_over_4bit(wrapper) -> bool:
    parametrizations = getattr(wrapper.get_base_layer(), "parametrizations", {})
    return wrapper.parameter_name in parametrizations and hasattr(parametrizations[wrapper.parameter_name][0], "quant_state")
