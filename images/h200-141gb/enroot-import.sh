#!/bin/bash
# Rendered by dskit 0.1.0. Import the image for pyxis/enroot on a shared filesystem, then set
# runtime.image to the .sqsh path (or pass a registry reference and let pyxis import it per job).
#   usage: bash enroot-import.sh REGISTRY [OUTPUT.sqsh]
set -euo pipefail
registry=${1:?usage: $0 REGISTRY [OUTPUT.sqsh]}
out=${2:-dskit-h200-141gb.sqsh}
enroot import --output "$out" "docker://${registry}#"dskit:h200-141gb-torch2.11.0-cu13.0-fa4-4.0.0b36-ds0.19.8
echo "set runtime.image: $(realpath "$out")"
