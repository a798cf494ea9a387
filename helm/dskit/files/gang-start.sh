#!/bin/bash
# Entrypoint of a TrainJob's pods, whose runtime takes no init container: the gang wait of the Job's
# init step (wait-peers.sh: every pod's DNS name resolves), then COMMAND (dskit's launcher).
# Usage: gang-start.sh TIMEOUT_SECONDS PREFIX COUNT DOMAIN -- COMMAND...
# waits for PREFIX-0.DOMAIN ... PREFIX-(COUNT-1).DOMAIN: generated here, as a TrainJob's command holds
# at most 128 words.
set -euo pipefail
if [ "$#" -lt 6 ] || [ "$5" != "--" ]; then
  echo "usage: gang-start.sh TIMEOUT_SECONDS PREFIX COUNT DOMAIN -- COMMAND..." >&2
  exit 2
fi
timeout=$1 prefix=$2 count=$3 domain=$4
shift 5
hosts=()
for ((i = 0; i < count; i++)); do
  hosts+=("${prefix}-${i}.${domain}")
done
if [ "${#hosts[@]}" -gt 0 ]; then
  bash "$(dirname "$0")/wait-peers.sh" "${timeout}" "${hosts[@]}"
fi
exec "$@"
