#!/bin/bash
# Rendered by dskit 0.1.0. Import the image for pyxis/enroot on a shared filesystem, then set
# runtime.image to the .sqsh path (or pass a registry reference and let pyxis import it per job).
#   usage: bash enroot-import.sh REGISTRY [OUTPUT.sqsh]
set -euo pipefail
registry=${1:?usage: $0 REGISTRY [OUTPUT.sqsh]}
out=${2:-dskit-cpu.sqsh}
enroot import --output "$out" "docker://${registry}#"dskit:cpu-torch2.13.0-cpu-ds0.19.8
echo "set runtime.image: $(realpath "$out")"
