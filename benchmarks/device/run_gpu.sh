#!/usr/bin/env bash
# The last device call: install MLX's CUDA backend from the carried parts, run the oracle tests
# and the benchmark on the GPU, and leave the figures in $OUT (what the device tool returns).
#
#   benchmarks/device/run_gpu.sh [bench_device.py options]      # timeout_s 600 for the call
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/mlx-voicechat-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t0=$(date +%s)
benchmarks/device/install.sh 2>&1 | tee "$OUT/install.log" || exit 1
. /tmp/mlx-voicechat-env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# What is left of a 600 s call after the install, less 25 s to write and return the files.
budget=$((575 - ($(date +%s) - t0)))
timeout $((budget + 15)) python3 benchmarks/bench_device.py --device gpu --budget "$budget" \
  --out "$OUT/device-gpu-full.json" "$@" 2>&1 | tee "$OUT/bench.log"
