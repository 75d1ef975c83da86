#!/usr/bin/env bash
# Run on the CPU machine (online) before a device session: downloads the wheels the GPU device
# image lacks (datasets and its deps, bitsandbytes, deepspeed, trl, liger-kernel) for its Python 3.12 into
# bench/gpu_kit/wheels/ (ignored by git), slims the three big ones, and checks that the working tree
# plus the wheels fit the 64 MiB a device command carries. Then, on the device:
#   run(command="bash bench/gpu_kit/run.sh", carry=["bench/gpu_kit/wheels"])
set -euo pipefail
cd "$(dirname "$0")/../.."
python bench/gpu_kit/wheels.py download --dest bench/gpu_kit/wheels "$@"
