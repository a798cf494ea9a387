#!/bin/bash
# On the lent GPU machine: join the two carried parts of the wheel bundle and unpack it. A call carries
# at most 64 MiB, so the bundle (a tar of site.tar.xz: dskit's wheels unpacked, FlashAttention-4's lock
# included; tt.tar.xz: torchtitan's runner and assets; ttw/ and dsw/: wheels) is split in two: one call
# copies part 1 to /tmp/parts/paa, the next (within the 30 s the machine stays warm) carries part 2 and
# runs this. dskit's wheels go to /tmp/site, torchtitan's to /tmp/ttsite (kept apart, its README says).
# The bundle is built by bench/device_bundle.sh.
#   bash bench/device_setup.sh .device/pab
set -euo pipefail
second=${1:?usage: device_setup.sh PART2}
B=/tmp/b
mkdir -p "$B" /tmp/site /tmp/ttsite /tmp/tt
[ -f /tmp/parts/paa ] || { echo "part 1 (/tmp/parts/paa) missing: the machine was not warm" >&2; exit 3; }
cat /tmp/parts/paa "$second" > "$B/bundle.tar"
tar xf "$B/bundle.tar" -C "$B"
tar xJf "$B/site.tar.xz" -C /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$B"/dsw/*.whl
if [ -f "$B/tt.tar.xz" ]; then  # torchtitan's runner: only in bundles built with TT_DIR
  python3 -m pip install -q --no-index --no-deps --target /tmp/ttsite "$B"/ttw/*.whl
  tar xJf "$B/tt.tar.xz" -C /tmp/tt
  sed -i "s|ASSETS|/tmp/tt/run/assets|g" /tmp/tt/run/base.toml
fi
echo "set up: /tmp/site$([ -f "$B/tt.tar.xz" ] && echo ", /tmp/ttsite, /tmp/tt/run")"
