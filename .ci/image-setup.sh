#!/usr/bin/env bash
# CI's container engine and local base image, for tests/e2e/test_image_build.py (marker `image`).
#
# No registry can be reached here, so nothing is pulled: the engine comes from Debian (daemonless
# podman/buildah; docker.io's daemon would set the iptables FORWARD policy to DROP and cut the Slurm
# tests' network-namespace nodes off from each other), and the base image is made with debootstrap
# and imported. The base carries what a site adds to its own base image: the host's extra CA
# certificates (the package index may sit behind a proxy with its own CA) and pip settings. The CPU
# torch wheel is not baked in: the build mounts the host's wheel directory (DSKIT_WHEELS, read-only).
#
# Idempotent: a second run reuses the packages, the configuration and the base image.
# Usage: .ci/image-setup.sh            (as root; prints the base image's name on its last line)
set -euo pipefail

BASE=${DSKIT_CI_BASE:-localhost/dskit-ci-base:bookworm}
SUITE=bookworm
MIRROR=${DSKIT_DEBIAN_MIRROR:-http://deb.debian.org/debian}

need=()
for tool in podman buildah runc debootstrap; do
  command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
done
if [ "${#need[@]}" -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    podman buildah runc debootstrap uidmap >/dev/null
fi

# runc, not crun (crun fails on this machine's cgroup setup); default ulimits at or below what the
# sandbox allows (measured: podman run's own defaults are refused, nofile above 20000 and nproc of
# 96365 too; 20000 and 32768 work); the kernel's overlay storage (vfs copies the whole tree for every
# layer: two CPU image builds took 49 GB of disk with it).
mkdir -p /etc/containers/containers.conf.d
cat >/etc/containers/containers.conf.d/50-dskit-ci.conf <<'EOF'
# written by dskit's .ci/image-setup.sh
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
EOF
if [ ! -e /etc/containers/storage.conf ] || grep -q "dskit's .ci/image-setup.sh" /etc/containers/storage.conf; then
  cat >/etc/containers/storage.conf <<'EOF'
# written by dskit's .ci/image-setup.sh
[storage]
driver = "overlay"
runroot = "/run/containers/storage"
graphroot = "/var/lib/containers/storage"
EOF
fi

if podman image exists "$BASE"; then
  echo "$BASE"
  exit 0
fi

root=$(mktemp -d /var/tmp/dskit-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
# what python:3.12-slim has: python3 with venv and headers (DeepSpeed compiles against them); TLS roots
debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
  "$SUITE" "$root" "$MIRROR" >/dev/null
# the host's extra CAs (a proxy in front of the package index may use its own)
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
fi
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
# pip uses its own CA bundle unless told otherwise; the build mounts the host's wheels at /opt/wheels
tar -C "$root" -c . | podman import \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV PIP_FIND_LINKS=/opt/wheels' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' \
  - "$BASE" >/dev/null
echo "$BASE"
