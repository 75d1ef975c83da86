"""--fp8 on CPU (torch's CPU build runs `_scaled_mm` on float8): the float8 matmuls are the product
of the dequantized operands, laid out as CUDA's kernel demands; a LoRA model with its base in float8
computes the loss and adapter gradients of the bf16 model within float8's rounding; the copy follows
the weight; compiled blocks run it; and runs that cannot use it are refused in one line."""

import copy

import pytest
import torch
from helpers import speed_up, tiny_model

from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.errors import ConfigError
from finetune.train import fp8
from finetune.train.skeleton import prepare_for_training
from finetune.train.speedups import compile_blocks


def frozen_linear(in_features=64, out_features=48, seed=0, bias=False):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    linear.weight.requires_grad_(False)
    return linear


def test_float8_matmuls_are_the_product_of_the_dequantized_operands():
    """Forward x @ Wᵀ and backward ȳ @ W equal the fp32 products of the float8 operands times their
    scales (the kernel's fp32 accumulation: 1e-5), and the fp32 products of x, W, ȳ within e4m3/e5m2
    rounding (3 and 2 mantissa bits: ≤ 8 % of the norm on random data)."""
    linear = frozen_linear()
    layer = fp8.Float8Linear.from_linear(linear)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 64, generator=g, requires_grad=True)
    grad = torch.randn(3, 5, 48, generator=g)
    out = layer(x)
    out.backward(grad)
    x8, sx = fp8.to_float8(x.detach().reshape(-1, 64), fp8.E4M3)
    g8, sg = fp8.to_float8(grad.reshape(-1, 48), fp8.E5M2)
    w = layer.weight_fp8.float() * layer.weight_scale
    assert torch.allclose(out.detach().reshape(-1, 48), (x8.float() * sx) @ w.t(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad.reshape(-1, 64), (g8.float() * sg) @ w, rtol=1e-5, atol=1e-5)
    exact_out, exact_grad = x.detach() @ linear.weight.t(), grad @ linear.weight
    assert (out.detach() - exact_out).norm() / exact_out.norm() < 0.08
    assert (x.grad - exact_grad).norm() / exact_grad.norm() < 0.08
    assert layer.weight is linear.weight and linear.weight.grad is None


def test_operands_are_laid_out_as_cudas_float8_kernel_takes_them(monkeypatch):
    """CUDA's _scaled_mm wants the first operand row-major, the second column-major, sizes in multiples
    of 16 and never two e5m2 operands; the CPU op takes anything, so the layouts are checked here."""
    seen = []
    real = torch._scaled_mm

    def checking(a, b, **kwargs):
        seen.append((a.dtype, b.dtype))
        assert a.is_contiguous() and b.t().is_contiguous()
        assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0
        return real(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", checking)
    layer = fp8.Float8Linear.from_linear(frozen_linear(bias=True))
    layer(torch.randn(2, 7, 64, requires_grad=True)).sum().backward()
    assert seen == [(fp8.E4M3, fp8.E4M3), (fp8.E5M2, fp8.E4M3)]


def lora_model(dtype=torch.bfloat16):
    """A tiny LoRA Llama (width 64: every linear a multiple of 16) as the trainer prepares it, with
    its B matrices drawn so that gradients flow through both adapter matrices."""
    model = prepare_for_training(tiny_model(hidden=64).to(dtype), TrainConfig(method="lora"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02, generator=torch.Generator().manual_seed(2))
    return model


def loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_lora_with_a_float8_base_computes_the_loss_and_gradients_of_bf16():
    """Tolerances: the loss within 1e-3 relative, each adapter gradient at cosine ≥ 0.99 with bf16's
    and within 15 % of its norm (measured here: 1e-4, ≥ 0.995, ≤ 9.3 %); the state dict is the bf16
    model's, names and values."""
    plain = lora_model()
    fast = copy.deepcopy(plain)
    said = []
    speed_up(fast, TrainConfig(method="lora", fp8=True, precision="bf16-true"), say=said.append, fp8_device=True)
    assert said[-1].endswith("attention sdpa, fp8 on (14 base linears)")  # 7 linears × 2 layers
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    (loss, grads), (loss8, grads8) = loss_and_grads(plain, ids), loss_and_grads(fast, ids)
    assert abs(loss8 - loss) / loss < 1e-3
    assert len(grads8) == len(grads) == 28
    for name, g in grads.items():
        assert torch.nn.functional.cosine_similarity(grads8[name].flatten(), g.flatten(), dim=0) >= 0.99, name
        assert (grads8[name] - g).norm() / g.norm() < 0.15, name
    plain_state, fast_state = plain.state_dict(), fast.state_dict()
    assert list(fast_state) == list(plain_state) and all(torch.equal(fast_state[k], plain_state[k]) for k in plain_state)


def test_the_float8_copy_follows_the_weight_through_resume_and_moves():
    layer = fp8.Float8Linear.from_linear(frozen_linear())
    resumed = {"weight": torch.randn(48, 64) * 3}
    layer.load_state_dict(resumed)
    assert torch.equal(layer.weight_fp8, fp8.to_float8(resumed["weight"], fp8.E4M3)[0])
    layer.to(torch.bfloat16)  # e.g. DeepSpeed's module.bfloat16()
    assert layer.weight.dtype == torch.bfloat16 and layer.weight_fp8.dtype == fp8.E4M3
    assert not list(layer.buffers()), "no buffer: DDP would broadcast it every forward"


def test_linears_whose_sizes_the_kernel_does_not_take_keep_bf16():
    model = prepare_for_training(tiny_model(hidden=40), TrainConfig(method="lora"))  # width 40: not a multiple of 16
    replaced, kept = fp8.install(model)
    assert replaced + kept == 14 and kept > 0
    assert sum(isinstance(m, fp8.Float8Linear) for m in model.modules()) == replaced


def test_compiled_blocks_run_the_float8_matmuls_as_eager_does():
    eager = lora_model(torch.float32)
    fp8.install(eager)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, backend="aot_eager")  # Dynamo's capture and AOTAutograd, as in test_speedups.py
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    (loss, grads), (loss_c, grads_c) = loss_and_grads(eager, ids), loss_and_grads(compiled, ids)
    assert loss_c == pytest.approx(loss.item(), rel=1e-6)
    assert all(torch.allclose(grads_c[name], g, atol=1e-6) for name, g in grads.items())


@pytest.mark.parametrize(("flags", "device", "launch", "reason"), [
    (dict(method="lora"), Device(), Launch(),
     "--fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (L40S, RTX 4090, H100, H200)"),
    (dict(method="lora"), Device(cuda=True, bf16=True), Launch(),
     "--fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (L40S, RTX 4090, H100, H200)"),
    (dict(method="qlora"), Device(cuda=True, bf16=True, fp8=True), Launch(),
     "--fp8 casts LoRA's frozen 16-bit base weights to float8, and QLoRA's base is 4-bit already: use --method lora "
     "or drop --fp8"),
    (dict(method="full"), Device(cuda=True, bf16=True, fp8=True), Launch(),
     "--fp8 casts LoRA's frozen 16-bit base weights to float8, and full fine-tuning trains them: use --method lora "
     "or drop --fp8"),
    (dict(method="lora", precision="bf16-mixed"), Device(cuda=True, bf16=True, fp8=True), Launch(),
     "--fp8 casts LoRA's base from bf16 weights: use --precision bf16-true, not bf16-mixed"),
    (dict(method="lora"), Device(cuda=True, bf16=True, fp8=True), Launch(world_size=2, fsdp=True),
     "--fp8 keeps a float8 copy of every frozen weight whole on each GPU: one GPU or DDP, not FSDP2"),
])
def test_runs_that_cannot_use_fp8_are_refused_in_one_line_before_anything_loads(tmp_path, flags, device, launch, reason):
    config = TrainConfig(fp8=True, output_dir=str(tmp_path / "out"), **flags)
    with pytest.raises(ConfigError) as refused:
        resolve_run(config, launch, device)
    assert str(refused.value) == reason
    assert not (tmp_path / "out").exists()


def test_fp8_resolves_on_one_float8_gpu_and_on_ddp(tmp_path):
    device = Device(cuda=True, bf16=True, fp8=True)
    for launch in (Launch(), Launch(world_size=2)):
        run = resolve_run(TrainConfig(method="lora", fp8=True, output_dir=str(tmp_path)), launch, device)
        assert run.config.fp8 and run.precision.name == "bf16-true" and run.strategy.name in ("single", "ddp")
