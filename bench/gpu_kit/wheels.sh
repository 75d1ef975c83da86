#!/usr/bin/env bash
# For a GPU machine without network: run this where there is network. It downloads the wheels finetune's
# GPU steps need beyond torch, accelerate, transformers and peft (datasets and its deps, bitsandbytes,
# deepspeed, trl, liger-kernel) for Python 3.12 on manylinux x86_64 into bench/gpu_kit/wheels/ (ignored by
# git), slims the three big ones, and checks that the working tree plus the wheels fit 64 MiB. Copy the
# repository with that folder to the GPU machine; there, OUT=results bash bench/gpu_kit/run.sh installs
# the ones it lacks.
set -euo pipefail
cd "$(dirname "$0")/../.."
python bench/gpu_kit/wheels.py download --dest bench/gpu_kit/wheels "$@"
