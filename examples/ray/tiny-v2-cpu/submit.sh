#!/bin/bash
# Rendered by dskit 0.1.0. Plan: tiny-v2 on 1x2 cpu: world 2, ZeRO-3, EP 2, micro-batch 4, grad accum 1, bf16, ~0.01 GiB/GPU
# Submits this directory as the job's working_dir to a Ray cluster (RAY_ADDRESS, default the local head's
# dashboard) and follows its logs; the exit code is the job's. Arguments go to `ray job submit` (e.g.
# --no-wait). The submission id is chosen here and appended with the address to the jobs file, one
# line in one write, for `dskit status RUN_DIR`.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
address=${RAY_ADDRESS:-http://127.0.0.1:8265}
prev=
for arg in "$@"; do
  if [ "${prev}" = --address ]; then
    address=${arg}
  fi
  case "${arg}" in
    --address=*) address=${arg#--address=} ;;
    --submission-id | --submission-id=* | --job-id | --job-id=*)
      echo "dskit: submit.sh chooses the submission id itself (recorded for dskit status)" >&2
      exit 2
      ;;
  esac
  prev=${arg}
done
case "${address}" in
  '' | *[[:space:]]*)
    echo "dskit: the Ray address must be one word, got '${address}'" >&2
    exit 2
    ;;
esac
id=dskit-run-"$(date -u +%Y%m%d-%H%M%S)-$$"
printf '%s %s\n' "${id}" "${address}" >>"${here}/jobs" ||
  echo "dskit: warning: could not record submission ${id} in ${here}" >&2
exec ray job submit --address "${address}" --submission-id "${id}" --working-dir "${here}" \
  --runtime-env "${here}/runtime_env.yaml" "$@" -- /opt/venv/bin/python -m dskit.launch.ray_train
