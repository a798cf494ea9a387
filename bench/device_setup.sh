#!/bin/bash
# On the lent GPU machine: join the carried parts of the wheel bundle and unpack it. A call carries at
# most 64 MiB, so the bundle (a tar of site.tar.xz: dskit's wheels unpacked, FlashAttention-4's lock
# included; tt.tar.xz: torchtitan's runner and assets; ttw/ and dsw/: wheels) is split in parts: each
# call but the last copies its part to /tmp/parts/ (within the 30 s the machine stays warm), the last
# carries the last part and runs this. dskit's wheels go to /tmp/site, torchtitan's to /tmp/ttsite (kept
# apart, its README says). It writes /tmp/env.sh, which each later call sources: PYTHONPATH with the
# directories the wheels' .pth files would add (Python reads .pth files only in site directories, not on
# PYTHONPATH: nvidia-cutlass-dsl's puts its `cutlass` package on the path that way), and checks that
# FlashAttention-4 imports. The bundle is built by bench/device_bundle.sh.
#   bash bench/device_setup.sh .device/pac      (the last part)
set -euo pipefail
second=${1:?usage: device_setup.sh PART2}
B=/tmp/b
mkdir -p "$B" /tmp/site /tmp/ttsite /tmp/tt
last=$(basename "$second")
for p in /tmp/parts/p*; do  # every part before the last must be there: the machine stayed warm
  [ -f "$p" ] || { echo "earlier parts (/tmp/parts/) missing: the machine was not warm" >&2; exit 3; }
done
n_before=$(find /tmp/parts -name "p*" -type f | wc -l)
want=$(( $(printf '%d' "'${last:2:1}") - $(printf '%d' "'a") ))
[ "$n_before" -eq "$want" ] || { echo "$n_before parts in /tmp/parts, $want expected before $last" >&2; exit 3; }
cat /tmp/parts/p* "$second" > "$B/bundle.tar"
tar xf "$B/bundle.tar" -C "$B"
tar xJf "$B/site.tar.xz" -C /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$B"/dsw/*.whl
if [ -f "$B/tt.tar.xz" ]; then  # torchtitan's runner: only in bundles built with TT_DIR
  python3 -m pip install -q --no-index --no-deps --target /tmp/ttsite "$B"/ttw/*.whl
  tar xJf "$B/tt.tar.xz" -C /tmp/tt
  sed -i "s|ASSETS|/tmp/tt/run/assets|g" /tmp/tt/run/base.toml
fi
cat > /tmp/env.sh <<ENV
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:\$PWD
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/ext TT_PYTHONPATH=/tmp/ttsite
ENV
# shellcheck disable=SC1091
. /tmp/env.sh
python3 -c "import flash_attn.cute, cutlass.cute; print('FlashAttention-4 imports')"
echo "set up: /tmp/site$([ -f "$B/tt.tar.xz" ] && echo ", /tmp/ttsite, /tmp/tt/run"); now: . /tmp/env.sh"
