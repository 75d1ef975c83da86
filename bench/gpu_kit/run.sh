#!/usr/bin/env bash
# The GPU validation kit on any CUDA machine: one command, results only under $OUT.
#   OUT=results bash bench/gpu_kit/run.sh                       # the first command a GPU gets (≤ 10 minutes)
#   OUT=results KIT_STEPS="terms memory" bash bench/gpu_kit/run.sh   # a second one on the same machine
# Without network, carry the wheels the machine lacks (bash bench/gpu_kit/wheels.sh where there is network)
# in bench/gpu_kit/wheels/; with network and the packages installed, nothing needs carrying.
# What comes back: per step a summary pair STEP.csv + STEP.md in $OUT, and $OUT/logs.tar.gz holding every log
# (run.log, environment.txt, pip-check.txt, each row's log, pytest's log and JUnit XML, doctor's report),
# rewritten after every step, so a command stopped early still returns what it had.
# Steps, in this order, those named in KIT_STEPS (each prints "== step" into run.log):
#   environment: GPU, driver, packages; install the carried wheels the machine lacks (offline, never
#   replacing an installed package) and the project (--no-deps); stop with exit code 3 without a CUDA device
#   defaults    bench/gpu_kit/defaults.py on 2-layer cuts of 7B/8B shapes: the model's own loss vs the chunked
#               loss vs Liger, fused vs foreach AdamW, expandable segments (cap KIT_DEFAULTS_SECONDS) → defaults.*
#   terms       bench/gpu_kit/speed_terms.py: host issue and GPU kernels per decoder layer and for the rest,
#               beside the speed model's terms (cap KIT_TERMS_SECONDS; KIT_TERMS_ARGS="--cases 'mistral-*'") → speed_terms.*
#   throughput  bench/gpu_kit/throughput.py: bench/gpu_kit/rows.py's rows, first finetune's best plans beside
#               TRL + Liger, the anchor's shape, the mixture-of-experts cuts, then the rest, until the time left
#               for the later steps (KIT_THROUGHPUT_ARGS="--rows first") → throughput.*
#   tests       pytest -m gpu tests/gpu_kit/test_gpu.py (cap KIT_TEST_SECONDS; tests that would end past it
#               are skipped, saying so) → gpu-tests.*
#   doctor      finetune doctor → into the logs
#   memory      bench/gpu_kit/memory.py, the single-GPU grid, until the deadline (KIT_MEMORY_ARGS) → memory.*
#   layouts     bench/gpu_kit/layouts.py, TP and CP rows (2+ GPUs) → layouts.*
# Knobs: KIT_STEPS (default "throughput tests"), KIT_SECONDS (the whole command, default 580), KIT_TEST_SECONDS
# (default 180, kept free for the tests when throughput runs before them), KIT_DEFAULTS_SECONDS (200),
# KIT_TERMS_SECONDS (150), KIT_WHEELS (the wheels folder), KIT_WORK (scratch: random-init checkpoints, caches;
# default /tmp/finetune-gpukit, reused by a later command on the same machine), KIT_THROUGHPUT_ARGS, KIT_TERMS_ARGS,
# KIT_MEMORY_ARGS, KIT_DEFAULTS_ARGS (extra flags of each script).
set -euo pipefail
: "${OUT:?set OUT to the folder the results go to}"
cd "$(dirname "$0")/../.."
START=$(date +%s)
BUDGET=${KIT_SECONDS:-580}
TEST_SECONDS=${KIT_TEST_SECONDS:-180}
WHEELS=${KIT_WHEELS:-bench/gpu_kit/wheels}
WORK=${KIT_WORK:-/tmp/finetune-gpukit}
STEPS=${KIT_STEPS:-throughput tests}
LOGS="$WORK/logs"
rm -rf "$LOGS"
mkdir -p "$OUT" "$WORK" "$LOGS"
export HF_HOME="$WORK/hf" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="$WORK/torch_extensions" TRITON_CACHE_DIR="$WORK/triton" MPLCONFIGDIR="$WORK/mpl" TORCHINDUCTOR_CACHE_DIR="$WORK/inductor"
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
exec > >(tee -a "$LOGS/run.log") 2>&1

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
step() { archive; echo; echo "== $(date -u +%H:%M:%S) [$(left) s left] $*"; }
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
archive() {  # every log so far, as one file (written aside, then renamed: never half an archive)
  local status=0  # 1: run.log grew while tar read it, which is expected
  tar --warning=no-file-changed -czf "$OUT/logs.tar.gz.partial" -C "$LOGS" . 2>/dev/null || status=$?
  (( status <= 1 )) && mv "$OUT/logs.tar.gz.partial" "$OUT/logs.tar.gz"
  return 0
}
keep_row_logs() {  # the grid's and the layouts' row logs (throughput.py copies its own)
  local run
  for run in "$WORK"/memory/runs/*/; do
    [[ -f "$run/run.log" && "$(basename "$run")" != throughput-* ]] && cp "$run/run.log" "$LOGS/$(basename "$run").log"
  done
  return 0
}
trap archive EXIT

files=1
for s in defaults terms throughput tests memory layouts; do wanted "$s" && files=$(( files + 2 )); done
(( files > 8 )) && echo "note: KIT_STEPS=\"$STEPS\" writes $files files to \$OUT; a machine that returns at most 8 needs fewer steps per command"

step "environment"
{
  date -u
  python -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPUs', torch.cuda.device_count())"
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  df -h "$WORK" 2>&1
  python -m pip list 2>/dev/null
} > "$LOGS/environment.txt"
head -2 "$LOGS/environment.txt"

step "install wheels from $WHEELS and the project"
python bench/gpu_kit/wheels.py install --dest "$WHEELS"
python -m pip install -q --no-index --no-deps --no-build-isolation -e .
python -m pip check > "$LOGS/pip-check.txt" 2>&1 || echo "pip check reports conflicts (kept going): see pip-check.txt"
python -c "import datasets, bitsandbytes, deepspeed, finetune; print('imports ok: datasets', datasets.__version__, '| bitsandbytes', bitsandbytes.__version__, '| deepspeed', deepspeed.__version__)" \
  || echo "an import failed (kept going): the steps that need it will fail and say so"
python -c "import trl, liger_kernel.transformers; print('imports ok: trl', trl.__version__, '| liger-kernel')" \
  || echo "trl or liger-kernel does not import (kept going): throughput.py's rows that need it will say so"

step "CUDA"
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device: stopping before the GPU steps (exit 3)"
  exit 3
fi
if wanted tests; then
  # The ZeRO-2-offload test needs DeepSpeed's CPU Adam, JIT-compiled on first use (about a minute of one
  # core): built now, at the lowest priority, while the checkpoints are written and the rows run on the GPU,
  # so the test finds it built (a build still running when the test starts is waited for, not repeated)
  nice -n 19 python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
    > "$LOGS/deepspeed-cpu-adam.log" 2>&1 &
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
  # shellcheck disable=SC2086
  timeout --kill-after 10 $(( cap + 60 )) python bench/gpu_kit/speed_terms.py --out "$OUT" --work "$WORK/terms" \
    --deadline $(( $(date +%s) + cap )) ${KIT_TERMS_ARGS:-} || echo "speed terms: exit $? (see speed_terms.md)"
  rm -rf "$WORK/terms"
fi

if wanted throughput; then
  step "throughput: finetune's plans beside TRL, the anchor's shape, the mixture-of-experts cuts, the rest"
  reserve=10; wanted tests && reserve=$(( reserve + TEST_SECONDS ))
  # shellcheck disable=SC2086
  python bench/gpu_kit/throughput.py --out "$OUT" --logs "$LOGS" --work "$WORK/memory" \
    --deadline $(( START + BUDGET - reserve )) ${KIT_THROUGHPUT_ARGS:-} || echo "throughput: exit $? (a finetune row failed; see throughput.md)"
fi

if wanted tests; then
  step "pytest -m gpu"
  cap=$TEST_SECONDS; (( $(left) - 10 < cap )) && cap=$(( $(left) - 10 ))
  export KIT_RANDOM_INIT="$WORK/memory/random-init"  # the 1B checkpoint the tests write, reused by the grid
  export KIT_TEST_DEADLINE=$(( $(date +%s) + cap - 5 ))  # no test starts that would end after it: pytest ends and reports
  timeout --kill-after 10 $(( cap + 15 )) python -m pytest -m gpu -v --tb=short tests/gpu_kit/test_gpu.py \
    --junitxml "$LOGS/gpu-tests.xml" > "$LOGS/gpu-tests.log" 2>&1 || echo "GPU tests: exit $? (see gpu-tests.md)"
  python bench/gpu_kit/gpu_tests.py --xml "$LOGS/gpu-tests.xml" --log "$LOGS/gpu-tests.log" --out "$OUT"
fi

if wanted doctor; then
  step "finetune doctor"
  python -m finetune doctor --output-dir "$WORK" > "$LOGS/doctor.txt" 2>&1 || true
  python -m finetune doctor --output-dir "$WORK" --json > "$LOGS/doctor.json" 2>/dev/null || true
  cat "$LOGS/doctor.txt"
fi

if wanted memory; then
  step "memory and speed grid"
  # shellcheck disable=SC2086
  python bench/gpu_kit/memory.py --out "$OUT" --work "$WORK/memory" --deadline $(( START + BUDGET - 10 )) ${KIT_MEMORY_ARGS:-} \
    || echo "memory grid: exit $?"
  keep_row_logs
fi

if wanted layouts; then
  step "TP and CP layouts"
  python bench/gpu_kit/layouts.py --out "$OUT" --work "$WORK/memory" --deadline $(( START + BUDGET - 10 )) \
    || echo "layouts: exit $?"
  keep_row_logs
fi

step "done: $(ls "$OUT" | tr '\n' ' ')"
rm -rf "$WORK/memory/runs"
