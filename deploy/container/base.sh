#!/usr/bin/env bash
# The base image the Containerfile builds on, made here without a registry: a minimal Debian
# root filesystem with Python 3.11 (mmdebstrap, about 40 s), imported into podman.
#   deploy/container/base.sh [TAG]     (default localhost/specmesh-base:bookworm)
set -euo pipefail
tag="${1:-localhost/specmesh-base:bookworm}"
if podman image exists "$tag"; then
  echo "base image $tag: present"
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libgomp1 \
  --customize-hook='chroot "$1" apt-get clean' --customize-hook='rm -rf "$1"/var/lib/apt/lists/*' \
  bookworm "$work/rootfs.tar" "$mirror"
podman import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' "$work/rootfs.tar" "$tag"
echo "base image $tag: built"
