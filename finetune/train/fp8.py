"""FP8 matmuls for the frozen base of LoRA (`--fp8`).

Each adapted linear's base weight is frozen, so it is cast to float8 once (e4m3, one scale for the
tensor), where a float8 recipe for trained weights casts it again every step. Per call, the input is
cast to e4m3 and, in the backward, the output's gradient to e5m2 (the wider range gradients need),
each with its own scale (its absolute maximum over the format's largest value), and both matmuls run
as `torch._scaled_mm`: float8 operands, fp32 accumulation, the result in the input's dtype. The base
weight gets no gradient, so no third matmul and no saved input: the LoRA branch, norms, attention,
the LM head and the loss stay in bf16.

The bf16 weight stays the module's parameter (the state dict, checkpoints, resume and export see
the model as without --fp8); the float8 copy is a plain attribute, one byte per frozen weight, that
follows the weight: cast again after `load_state_dict` (resume) and after any `.to()`. It is no
buffer, so DDP does not broadcast it every forward. On CUDA, `_scaled_mm` wants the first operand
row-major and the second column-major with sizes that are multiples of 16; linears of other sizes
keep their bf16 matmul. The kernel needs CUDA capability ≥ 8.9 (config.switches.fp8_problem refuses
the rest); torch's CPU build runs the same op, which is how the tests check it against bf16.
"""

from __future__ import annotations

import math

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# cuBLASLt's float8 matmuls take sizes in multiples of 16
FP8_ALIGNMENT = 16


def to_float8(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(`tensor` × largest / amax as `dtype`, amax / largest): one fp32 scale for the tensor, its
    absolute maximum over the largest value `dtype` holds, so that `float8 × scale` ≈ `tensor`.

    The product stays in `tensor`'s dtype (three passes over it: the maximum, the product, the cast).
    It needs no clamp: it exceeds the largest value by at most one rounding of that dtype, which the
    cast rounds back down (e4m3's next step would be 480 over 448, e5m2's 61,440 over 57,344)."""
    amax = torch.linalg.vector_norm(tensor.detach(), ord=math.inf, dtype=torch.float32).clamp(min=1e-12)
    inverse = torch.finfo(dtype).max / amax
    return (tensor * inverse).to(dtype), inverse.reciprocal()


class _Float8Matmul(torch.autograd.Function):
    """x @ Wᵀ with x cast to e4m3 and the frozen W given already cast; the backward's gradient
    x̄ = ȳ @ W with ȳ cast to e5m2. No gradient for W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight8: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x8, x_scale = to_float8(rows, E4M3)
        ctx.save_for_backward(weight8, weight_scale)
        out = torch._scaled_mm(x8, weight8.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=x.dtype,
                               use_fast_accum=True)
        return out.reshape(*x.shape[:-1], weight8.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        weight8, weight_scale = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad8, grad_scale = to_float8(rows, E5M2)
        column_major = weight8.t().contiguous().t()  # W, laid out as _scaled_mm's second operand must be
        grad_x = torch._scaled_mm(grad8, column_major, scale_a=grad_scale, scale_b=weight_scale, out_dtype=grad.dtype)
        return grad_x.reshape(*grad.shape[:-1], weight8.shape[1]), None, None


class Float8Linear(torch.nn.Linear):
    """A frozen `nn.Linear` whose matmuls run in float8; it holds the very `weight` and `bias`
    parameters of the linear it replaces, so names and the state dict are unchanged."""

    weight_fp8: torch.Tensor
    weight_scale: torch.Tensor

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Float8Linear:
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias
        layer.cast_weight()
        return layer

    def cast_weight(self) -> None:
        """The float8 copy of the weight as it is now."""
        self.weight_fp8, self.weight_scale = to_float8(self.weight.detach(), E4M3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Float8Matmul.apply(x, self.weight_fp8, self.weight_scale)
        return out if self.bias is None else out + self.bias

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.cast_weight()  # moved or cast weights: the copy follows
        return self

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self.cast_weight()  # a resumed checkpoint copied into the weight in place


def castable(linear: torch.nn.Module) -> bool:
    """A plain frozen linear layer whose sizes the float8 kernels take."""
    return (type(linear) is torch.nn.Linear and not linear.weight.requires_grad
            and linear.in_features % FP8_ALIGNMENT == 0 and linear.out_features % FP8_ALIGNMENT == 0)


def install(model: torch.nn.Module) -> tuple[int, int]:
    """Replace the frozen base linear of every LoRA-adapted layer of `model` (PEFT) by a Float8Linear,
    in place. Returns (replaced, left in bf16 because their sizes are not multiples of 16)."""
    replaced = kept = 0
    for module in list(model.modules()):
        base = getattr(module, "base_layer", None)
        if not hasattr(module, "lora_A") or not isinstance(base, torch.nn.Linear) or base.weight.requires_grad:
            continue
        if castable(base):
            module.base_layer = Float8Linear.from_linear(base)
            replaced += 1
        else:
            kept += 1
    return replaced, kept
