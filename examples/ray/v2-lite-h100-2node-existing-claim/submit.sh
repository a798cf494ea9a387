#!/bin/bash
# Rendered by dskit 0.1.0. Plan: deepseek-v2-lite on 2x8 h100-80gb: world 16, EP 2, micro-batch 16, grad accum 1, activation checkpointing, bf16, ~46.09 GiB/GPU, predicted 12,174 tokens/s/GPU (20% MFU)
# Submits this directory as the job's working_dir to a Ray cluster (RAY_ADDRESS, default the local head's
# dashboard) and follows its logs; the exit code is the job's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec ray job submit --address "${RAY_ADDRESS:-http://127.0.0.1:8265}" --working-dir "${here}" \
  --runtime-env "${here}/runtime_env.yaml" "$@" -- python3 -m dskit.ray_train
