#!/bin/bash
# Rendered by dskit 0.1.0. Submits job.sbatch (the same as `sbatch job.sbatch`).
# Arguments go to sbatch (e.g. --partition=NAME). Each job id is appended to the run directory's jobs
# file, one line in one write, for `dskit status RUN_DIR` (job.sbatch also records its own id when it
# starts, so a job submitted with plain sbatch is found too).
set -euo pipefail
submit() {
  local out
  out=$(sbatch --parsable "$@" /runs/v3-h100-16node-apptainer-efa/job.sbatch)
  job=${out%%;*}
  case "${job}" in
    '' | *[!0-9]*)
      echo "dskit: unexpected answer from sbatch --parsable: ${out}" >&2
      exit 1
      ;;
  esac
  printf '%s\n' "${job}" >>/runs/v3-h100-16node-apptainer-efa/jobs ||
    echo "dskit: warning: could not record job ${job} in "/runs/v3-h100-16node-apptainer-efa/jobs >&2
}
submit "$@"
echo "submitted job ${job}"
