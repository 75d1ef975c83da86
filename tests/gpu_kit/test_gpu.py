"""Real CUDA training through the command line a user runs: every method on `tiny` and on a 1B
catalog shape (random init, no download), FSDP2 and ZeRO-2-offload in one process, save → resume and
save → export, the fit check, and `finetune doctor`.

Marked `gpu`: `bench/gpu_kit/run.sh` runs them on a lent GPU (`pytest -m gpu`); CI deselects them
(`-m "not slow and not gpu"`); without CUDA they are skipped with that reason. Each `python -m
finetune` is forked from a server that has imported the trainer already (bench/gpu_kit/forked.py:
the same entry and flags, its own process and CUDA context, without the ~10 s of imports a fresh
interpreter pays); each has a time limit past which its Python stack is printed and the test fails.
Under the kit (KIT_TEST_DEADLINE, epoch seconds) a test that would end past the step's deadline is
skipped, saying so, so pytest ends inside its cap and writes its report.
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO
from safetensors.torch import load_file

sys.path.insert(0, str(REPO / "bench/gpu_kit"))

from forked import RowRunner, read_log, run_logged  # noqa: E402
from memory import random_checkpoint  # noqa: E402

from finetune.models.catalog import get  # noqa: E402
from finetune.plan.params import count_params  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: bench/gpu_kit/run.sh")]

GIB = 2**30
# a few updates at a constant, large LR: enough to see the loss fall from a random init
SHORT = ["--max-steps", "4", "--warmup-steps", "0", "--lr-schedule", "constant", "--log-every", "1",
         "--max-eval-examples", "8", "--num-samples", "0", "--max-seq-len", "128"]
METHODS = [("full", "bf16-mixed", "1e-3"), ("lora", "bf16-true", "3e-3"), ("qlora", "bf16-true", "3e-3")]
LLAMA_1B = get("llama-3.2-1b")
RUN_SECONDS = 150  # one finetune process of these tests; past it, its stack is printed and the test fails
# seconds a test may take on the H200 (the deadline's guess): the 1B shape loads 2.5 GB, FSDP2 starts
# accelerate's launcher and a worker, ZeRO-2-offload needs DeepSpeed's CPU Adam (run.sh builds it while
# the earlier steps run; built here, it adds about a minute)
NEEDS = {"test_1b_catalog_shape_trains_on_cuda_in_the_planned_dtypes": 40, "test_fsdp2_in_one_process": 60,
         "test_doctor_sees_the_gpu": 40, "test_zero2_offload_in_one_process": 60,
         "test_varlen_attention_trains_packed_rows_as_sdpa_trains_each_example": 40}


def skip_past_the_kits_deadline(seconds: float) -> None:
    """Under the kit, what would end after KIT_TEST_DEADLINE does not start."""
    deadline = os.environ.get("KIT_TEST_DEADLINE")
    if deadline and time.time() + seconds > float(deadline):
        pytest.skip("not run: the kit's time for the GPU tests ran out first (KIT_TEST_SECONDS)")


@pytest.fixture(autouse=True)
def kit_deadline(request):
    skip_past_the_kits_deadline(NEEDS.get(request.node.originalname, 30))


@pytest.fixture(scope="session")
def runner() -> RowRunner:
    """The forked processes' server (started on first use, with the offline Hub its rows need)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    return RowRunner()


def finetune(runner: RowRunner, log: Path, *args: str, expect: int = 0, timeout: float = RUN_SECONDS) -> str:
    """`python -m finetune ARGS` (forked), its output in `log`; asserts its exit code; returns the output."""
    result = runner.run(["-m", "finetune", *args], log, timeout)
    output = read_log(log)
    assert result["status"] == ("ok" if expect == 0 else f"exit {expect}"), f"finetune {' '.join(args)}: {result}\n{output[-4000:]}"
    return output


def updates(output_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="session")
def llama_1b(tmp_path_factory, runner) -> Path:
    """llama-3.2-1b's shape in bf16 with random weights, written once (run.sh shares it with memory.py)."""
    skip_past_the_kits_deadline(NEEDS["test_1b_catalog_shape_trains_on_cuda_in_the_planned_dtypes"])  # runs before kit_deadline
    cache = Path(os.environ.get("KIT_RANDOM_INIT") or tmp_path_factory.mktemp("random-init"))
    return random_checkpoint(LLAMA_1B.name, cache, timeout_s=RUN_SECONDS, runner=runner)


@pytest.mark.parametrize("method, precision, lr", METHODS, ids=[m[0] for m in METHODS])
def test_tiny_trains_on_cuda(method, precision, lr, runner, tmp_path):
    out = tmp_path / "run"
    finetune(runner, tmp_path / "run.log", "--model", "tiny", "--method", method, "--precision", precision, "--lr", lr,
             "--micro-batch-size", "16", "--output-dir", str(out), *SHORT)
    steps = updates(out)
    losses = [r["loss"] for r in steps]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert 0 < steps[-1]["peak_gpu_allocated_gib"] <= steps[-1]["peak_gpu_reserved_gib"]
    saved = out / ("model.safetensors" if method == "full" else "adapter_model.safetensors")
    assert sum(t.numel() for t in load_file(saved).values()) > 0


# lower LRs than the tiny model's: at 1e-3 full fine-tuning of a random-init 1B overshoots (12.8 → 10.7 → 15.7)
METHODS_1B = [("full", "bf16-mixed", "1e-4"), ("lora", "bf16-true", "1e-3"), ("qlora", "bf16-true", "1e-3")]
# one sentence, repeated: what the model can learn in a few updates, and an eval set that holds the same rows
LEARNABLE = "the quick brown fox jumps over the lazy dog and then the dog sleeps in the warm sun"


@pytest.mark.parametrize("method, precision, lr", METHODS_1B, ids=[m[0] for m in METHODS_1B])
def test_1b_catalog_shape_trains_on_cuda_in_the_planned_dtypes(method, precision, lr, llama_1b, runner, tmp_path):
    """It learns: after 8 updates on a repeated sentence, the loss on held-out copies of it is at
    least 1 nat below where the random init started. The peak shows what the weights are stored
    in: full keeps fp32 weights, gradients and Adam (≥ 16 B/parameter); LoRA's bf16 base stays
    under the 4 B/parameter an fp32 base would take; QLoRA's 4-bit base under the 2 B/parameter of
    a bf16 one."""
    data, out = tmp_path / "learnable.jsonl", tmp_path / "run"
    data.write_text("".join(json.dumps({"text": LEARNABLE}) + "\n" for _ in range(64)))
    finetune(runner, tmp_path / "run.log", "--model", str(llama_1b), "--method", method, "--precision", precision, "--lr", lr,
             "--dataset", str(data), "--format", "text", "--eval-split", "0.25", "--micro-batch-size", "4",
             "--no-save-final", "--output-dir", str(out), *SHORT, "--max-steps", "8")
    steps = updates(out)
    evals = [r["eval_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    assert len(steps) == 8 and all(math.isfinite(r["loss"]) for r in steps)
    assert evals[-1] < evals[0] - 1.0, evals
    peak = steps[-1]["peak_gpu_allocated_gib"] * GIB
    params = count_params(LLAMA_1B).total
    if method == "full":
        assert peak >= 0.95 * 16 * params
    elif method == "lora":
        assert 2 * params < peak < 4 * params
    else:
        assert peak < 2 * params


def test_fsdp2_in_one_process(tmp_path):
    """Through accelerate's launcher, as a user starts FSDP2 (its own processes, not forked)."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs/fsdp.yaml"),
              "--num_processes", "1", "-m", "finetune"]
    result = run_logged([*launch, "--model", "tiny", "--precision", "bf16-mixed", "--micro-batch-size", "16", "--save-every", "4",
                         "--output-dir", str(out), *SHORT], log, RUN_SECONDS)
    output = read_log(log)
    assert result["status"] == "ok", output[-4000:]
    assert "strategy: FSDP" in output
    losses = [r["loss"] for r in updates(out)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert (out / "checkpoints/step-000004/pytorch_model_fsdp_0").is_dir()


# a tiny run saved every 2 updates and at its end; no evaluation (its generations cost more than its updates)
SAVED = ["--model", "tiny", "--precision", "bf16-mixed", "--micro-batch-size", "16", "--save-every", "2", *SHORT,
         "--max-eval-examples", "0"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, runner) -> Path:
    skip_past_the_kits_deadline(60)  # this run and the test's own
    out = tmp_path_factory.mktemp("saved") / "whole"
    finetune(runner, out.parent / "whole.log", *SAVED, "--output-dir", str(out))
    return out


def test_resume_on_cuda_repeats_the_uninterrupted_losses(saved_run, runner, tmp_path):
    """A run saved at step 2 and resumed elsewhere repeats the uninterrupted run's losses."""
    resumed = tmp_path / "resumed"
    finetune(runner, tmp_path / "resumed.log", *SAVED, "--output-dir", str(resumed), "--resume",
             str(saved_run / "checkpoints/step-000002"))
    expected = [r["loss"] for r in updates(saved_run)][2:]
    assert [r["step"] for r in updates(resumed)] == [3, 4]
    assert [r["loss"] for r in updates(resumed)] == pytest.approx(expected, rel=1e-3)  # CUDA kernels may reorder sums


def test_export_on_cuda_holds_the_weights_saved_at_the_end(saved_run, runner, tmp_path):
    exported = tmp_path / "exported"
    finetune(runner, tmp_path / "export.log", "export", str(saved_run), "--out", str(exported))
    from transformers import AutoModelForCausalLM

    final, export = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict() for path in (saved_run, exported))
    assert final.keys() == export.keys()
    for name, tensor in final.items():
        torch.testing.assert_close(export[name], tensor, rtol=0, atol=0)


def test_fit_check_stops_a_run_that_cannot_fit_before_loading(runner, tmp_path):
    """llama-3.1-8b full fine-tuning needs ~16 B × 8B parameters: more than any single GPU. The run
    must stop before loading weights (there are none in the folder) and point at `finetune plan`."""
    from transformers import AutoConfig, AutoTokenizer

    from finetune.data import BUILTIN_DIR

    model = tmp_path / "llama-3.1-8b-shape"
    AutoConfig.for_model(**get("llama-3.1-8b").to_hf_config_dict()).save_pretrained(model)
    AutoTokenizer.from_pretrained(BUILTIN_DIR).save_pretrained(model)
    output = finetune(runner, tmp_path / "run.log", "--model", str(model), "--method", "full", "--precision", "bf16-mixed",
                      "--micro-batch-size", "8", "--max-seq-len", "2048", "--max-steps", "1", "--output-dir", str(tmp_path / "run"),
                      expect=2)
    assert "finetune plan" in output and "GiB" in output


def test_doctor_sees_the_gpu(tmp_path):
    """As its own process: its --json report is the whole of stdout."""
    result = subprocess.run([sys.executable, "-m", "finetune", "doctor", "--json", "--output-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=RUN_SECONDS, cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)})
    report = json.loads(result.stdout)
    by_check = {f["check"]: f for f in report["findings"]}
    name = torch.cuda.get_device_name(0)
    assert by_check["gpus"]["status"] == "ok" and name in by_check["gpus"]["detail"]
    assert by_check["bf16"]["status"] == ("ok" if torch.cuda.is_bf16_supported() else "warn")
    assert by_check["versions"]["status"] != "fail" and "driver" in by_check["versions"]["detail"]
    assert report["machines"][0]["nccl"] is not None
    assert result.returncode == (0 if report["ok"] else 1)


def test_varlen_attention_trains_packed_rows_as_sdpa_trains_each_example(runner, tmp_path):
    """--attention varlen's kernel, which the CPU tests (tests/train/test_packed_attention.py) replace by
    SDPA per example: a tiny Llama with grouped KV heads in bf16, a micro-batch of packed rows
    flattened, gives the loss and gradients of SDPA on the same examples unpacked (bf16: 1 % of the
    loss, 3 % of each gradient's norm); a short packed run with it learns."""
    import copy

    from helpers import tiny_model, word_tokenizer

    from finetune.data.collate import Collator
    from finetune.train import packed_attention

    plain = tiny_model(hidden=128).to("cuda", torch.bfloat16)  # 4 heads of 32, 2 KV heads
    varlen = copy.deepcopy(plain)
    varlen.set_attn_implementation(packed_attention.register())
    g = torch.Generator().manual_seed(0)
    examples = [torch.randint(1, 62, (n,), generator=g).tolist() for n in (70, 90, 50, 120, 30, 100)]
    rows = [{"input_ids": e, "labels": e} for e in examples]
    packed = [{"input_ids": a + b, "labels": [-100] + a[1:] + [-100] + b[1:], "position_ids": [*range(len(a)), *range(len(b))]}
              for a, b in zip(examples[::2], examples[1::2])]
    results = []
    for model, batch in ((plain, Collator(word_tokenizer())(rows)), (varlen, Collator(word_tokenizer(), flatten=True)(packed))):
        batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        loss = model(**batch, num_items_in_batch=torch.tensor(sum(len(e) - 1 for e in examples), device="cuda")).loss
        loss.backward()
        results.append((loss.item(), [p.grad.float() for p in model.parameters()]))
    (loss, grads), (loss_varlen, grads_varlen) = results
    assert loss_varlen == pytest.approx(loss, rel=1e-2)
    assert all((g - h).norm() <= 0.03 * g.norm() + 1e-6 for g, h in zip(grads, grads_varlen))

    out = tmp_path / "run"
    output = finetune(runner, tmp_path / "run.log", "--model", "tiny", "--method", "lora", "--precision", "bf16-true", "--lr",
                      "3e-3", "--packing", "--attention", "varlen", "--micro-batch-size", "4", "--output-dir", str(out), *SHORT)
    assert "attention varlen" in output
    losses = [r["loss"] for r in updates(out)]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


def test_zero2_offload_in_one_process(runner, tmp_path):
    """Last: DeepSpeed JIT-compiles its CPU Adam on first use (about a minute) where run.sh has not."""
    out = tmp_path / "run"
    output = finetune(runner, tmp_path / "run.log", "--model", "tiny", "--precision", "bf16-mixed", "--micro-batch-size", "16",
                      "--deepspeed", str(REPO / "ds_configs/zero2_offload.json"), "--output-dir", str(out), *SHORT)
    assert "ZeRO stage 2, offload optimizer → cpu" in output
    losses = [r["loss"] for r in updates(out)]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
