#!/usr/bin/env bash
# The GPU validation kit: one device command, under 10 minutes, results only under $OUT.
#   bash bench/gpu_kit/wheels.sh                                             # once, on the CPU machine
#   run(command="bash bench/gpu_kit/run.sh", carry=["bench/gpu_kit/wheels"])  # on the device: the first command a GPU gets
# Steps (each prints "== step" into $OUT/run.log):
#   1. environment: GPU, driver, packages                         → $OUT/environment.txt
#   2. install the carried wheels the image lacks (offline, never replacing installed packages),
#      then the project (--no-deps)                                → $OUT/pip-check.txt
#   3. stop with exit code 3 when there is no CUDA device (everything above runs on CPU too)
#   4. bench/gpu_kit/defaults.py (KIT_STEPS=defaults, ~KIT_DEFAULTS_SECONDS): on 2-layer cuts of full-width
#      Mistral-7B and Llama-3.1-8B, the model's own loss vs the chunked loss vs Liger for LoRA and QLoRA
#      (loss, LoRA gradients, peak memory vs plan, ms per update), fused vs foreach AdamW, whether
#      expandable segments take effect                             → $OUT/defaults.md, defaults.csv
#   5. bench/gpu_kit/speed_terms.py (KIT_STEPS=terms, ~KIT_TERMS_SECONDS): where a micro-batch's time goes on 2- and
#      4-layer cuts of the shapes the speed model misses most (Qwen2.5-1.5B, Qwen2.5-7B, Llama-3.2-3B) and two
#      it fits: host issue, GPU busy by kernel class, kernel count per layer and for the rest, beside the plan's
#                                                                  → $OUT/speed_terms.md, speed_terms.csv
#   6. bench/gpu_kit/throughput.py (KIT_STEPS=throughput): the 7B rows, finetune's defaults and their A/B
#      first (--no-chunked-loss, the planned partial checkpointing with its memory vs the plan, --liger),
#      then TRL + Liger, TRL, a bare PEFT loop, the compiled rows, until the deadline
#                                                                  → $OUT/throughput.csv, throughput-*.log
#   7. pytest -m gpu (KIT_STEPS=tests): real CUDA steps of every method, FSDP2, ZeRO-2-offload,
#      resume/export, fit check                                    → $OUT/gpu-tests.log, gpu-tests.xml
#   8. finetune doctor (KIT_STEPS=doctor)                          → $OUT/doctor.txt, doctor.json
#   9. bench/gpu_kit/memory.py until the deadline (KIT_STEPS=memory), rows forked from a preloaded server
#      (forked.py)                                                 → $OUT/memory.md, memory.csv
#  10. bench/gpu_kit/layouts.py (KIT_STEPS=layouts, 2+ GPUs): FSDP2 + TP and FSDP2 + CP rows beside FSDP2 alone
#      on the same GPUs; rows needing more GPUs than the machine has are listed → $OUT/layouts.md, layouts.csv
# Knobs: KIT_STEPS (default "defaults terms throughput": what a lent GPU answers first; "tests doctor memory" for a
# second command), KIT_SECONDS (total budget, default 570), KIT_DEFAULTS_SECONDS (cap for step 4, default 200),
# KIT_TERMS_SECONDS (cap for step 5, default 150),
# KIT_TEST_SECONDS (cap for step 7, default 300), KIT_WHEELS (wheels folder), KIT_WORK (scratch: random-init
# checkpoints, caches; default /tmp/finetune-gpukit, reused by a second command on the same machine),
# KIT_MEMORY_ARGS (extra memory.py flags, e.g. "--models llama-7b,llama-3.1-8b"), KIT_THROUGHPUT_ARGS (extra
# throughput.py flags, e.g. "--method qlora --micro-batch-size 4"), KIT_DEFAULTS_ARGS (extra defaults.py flags).
set -euo pipefail
: "${OUT:?set OUT to the folder the results go to}"
cd "$(dirname "$0")/../.."
START=$(date +%s)
BUDGET=${KIT_SECONDS:-570}
WHEELS=${KIT_WHEELS:-bench/gpu_kit/wheels}
WORK=${KIT_WORK:-/tmp/finetune-gpukit}
STEPS=${KIT_STEPS:-defaults terms throughput}
mkdir -p "$OUT" "$WORK"
export HF_HOME="$WORK/hf" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR="$WORK/torch_extensions" TRITON_CACHE_DIR="$WORK/triton" MPLCONFIGDIR="$WORK/mpl" TORCHINDUCTOR_CACHE_DIR="$WORK/inductor"
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
exec > >(tee -a "$OUT/run.log") 2>&1

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
step() { echo; echo "== $(date -u +%H:%M:%S) [$(left) s left] $*"; }
wanted() { [[ " $STEPS " == *" $1 "* ]]; }

step "environment"
{
  date -u
  python -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPUs', torch.cuda.device_count())"
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  python -m pip list 2>/dev/null
} > "$OUT/environment.txt"
head -2 "$OUT/environment.txt"

step "install wheels from $WHEELS and the project"
python bench/gpu_kit/wheels.py install --dest "$WHEELS"
python -m pip install -q --no-index --no-deps --no-build-isolation -e .
python -m pip check > "$OUT/pip-check.txt" 2>&1 || echo "pip check reports conflicts (kept going): see pip-check.txt"
python -c "import datasets, bitsandbytes, deepspeed, finetune; print('imports ok: datasets', datasets.__version__, '| bitsandbytes', bitsandbytes.__version__, '| deepspeed', deepspeed.__version__)" \
  || echo "an import failed (kept going): the steps that need it will fail and say so"
python -c "import trl, liger_kernel.transformers; print('imports ok: trl', trl.__version__, '| liger-kernel')" \
  || echo "trl or liger-kernel does not import (kept going): throughput.py's rows that need it will say so"

step "CUDA"
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device: stopping before the GPU steps (exit 3)"
  exit 3
fi

if wanted defaults; then
  step "defaults: the losses, AdamW and the allocator on 2-layer cuts"
  cap=${KIT_DEFAULTS_SECONDS:-200}; (( $(left) - 10 < cap )) && cap=$(( $(left) - 10 ))
  # no case starts within 20 s of the deadline; the timeout only stops one that hangs (its row is then missing)
  # shellcheck disable=SC2086
  timeout --kill-after 10 $(( cap + 40 )) python bench/gpu_kit/defaults.py --out "$OUT" --work "$WORK/defaults" \
    --deadline $(( $(date +%s) + cap )) ${KIT_DEFAULTS_ARGS:-} || echo "defaults: exit $? (see defaults.md)"
  rm -rf "$WORK/defaults"
fi

if wanted terms; then
  step "speed terms: host issue and GPU kernels per decoder layer, beside the plan"
  cap=${KIT_TERMS_SECONDS:-150}; (( $(left) - 10 < cap )) && cap=$(( $(left) - 10 ))
  timeout --kill-after 10 $(( cap + 60 )) python bench/gpu_kit/speed_terms.py --out "$OUT" --work "$WORK/terms" \
    --deadline $(( $(date +%s) + cap )) || echo "speed terms: exit $? (see speed_terms.md)"
  rm -rf "$WORK/terms"
fi

if wanted throughput; then
  step "throughput: finetune's defaults and their A/B, TRL, a bare PEFT loop"
  # shellcheck disable=SC2086
  python bench/gpu_kit/throughput.py --out "$OUT" --work "$WORK/memory" --deadline $(( START + BUDGET - 10 )) ${KIT_THROUGHPUT_ARGS:-} \
    || echo "throughput: exit $? (a finetune row failed; see throughput.csv)"
fi

if wanted tests; then
  step "pytest -m gpu"
  cap=${KIT_TEST_SECONDS:-300}; budget=$(( $(left) - 150 )); (( budget < cap )) && cap=$budget
  export KIT_RANDOM_INIT="$WORK/memory/random-init"  # the 1B checkpoint the tests write, reused by the grid
  timeout --kill-after 10 "$cap" python -m pytest -m gpu -v --tb=short tests/gpu_kit/test_gpu.py --junitxml "$OUT/gpu-tests.xml" \
    > "$OUT/gpu-tests.log" 2>&1 || echo "GPU tests: exit $? (see gpu-tests.log)"
  tail -25 "$OUT/gpu-tests.log"
fi

if wanted doctor; then
  step "finetune doctor"
  python -m finetune doctor --output-dir "$WORK" > "$OUT/doctor.txt" 2>&1 || true
  python -m finetune doctor --output-dir "$WORK" --json > "$OUT/doctor.json" 2>/dev/null || true
  cat "$OUT/doctor.txt"
fi

if wanted memory; then
  step "memory and speed grid"
  # shellcheck disable=SC2086
  python bench/gpu_kit/memory.py --out "$OUT" --work "$WORK/memory" --deadline $(( START + BUDGET - 10 )) ${KIT_MEMORY_ARGS:-} \
    || echo "memory grid: exit $?"
fi

if wanted layouts; then
  step "TP and CP layouts"
  python bench/gpu_kit/layouts.py --out "$OUT" --work "$WORK/memory" --deadline $(( START + BUDGET - 10 )) \
    || echo "layouts: exit $?"
fi

step "done"
rm -rf "$WORK/memory/runs"
