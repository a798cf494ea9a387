#!/bin/bash
# Rendered by dskit 0.1.0. Plan: tiny-v2 on 1x2 cpu: world 2, EP 2, micro-batch 4, grad accum 1, bf16, ~0.01 GiB/GPU
# Submits this directory as the job's working_dir to a Ray cluster (RAY_ADDRESS, default the local head's
# dashboard) and follows its logs; the exit code is the job's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec ray job submit --address "${RAY_ADDRESS:-http://127.0.0.1:8265}" --working-dir "${here}" \
  --runtime-env "${here}/runtime_env.yaml" "$@" -- /opt/venv/bin/python -m dskit.ray_train
