#!/bin/bash
# Init step of every dskit pod: wait until each pod's DNS name (headless Service) resolves.
# Usage: wait-peers.sh TIMEOUT_SECONDS HOST...
#
# A headless Service publishes a pod's name only once that pod exists and has an IP. Pods of one Job
# are scheduled at different times, and torchrun gives up on a rendezvous endpoint it cannot resolve;
# waiting here for all of them also means the whole gang is placed before the rendezvous clock starts.
set -euo pipefail
if [ "$#" -lt 2 ]; then
  echo "usage: wait-peers.sh TIMEOUT_SECONDS HOST..." >&2
  exit 2
fi
timeout=$1
shift
deadline=$((SECONDS + timeout))
for host in "$@"; do
  until getent hosts "${host}" >/dev/null; do
    if [ "${SECONDS}" -ge "${deadline}" ]; then
      echo "dskit: ${host} did not resolve within ${timeout}s: is its pod pending (kubectl get pods)?" >&2
      exit 1
    fi
    sleep 2
  done
  echo "dskit: ${host} resolves"
done
