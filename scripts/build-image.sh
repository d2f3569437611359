#!/bin/sh
# Builds the stepbudget image from the repository's Dockerfile with no image registry at hand: the
# Python base is a Debian bookworm rootfs made here by mmdebstrap (from this machine's apt sources),
# imported by buildah as localhost/stepbudget-base:bookworm (made once, then reused).
#
#   sh scripts/build-image.sh [TAG]        # default localhost/stepbudget/stepbudget:dev
#
# Sandbox settings, each a no-op or harmless on a normal machine:
# - storage: containers-storage's default (overlay; it works on this project's VMs). Where overlay is
#   refused (inside a container), run with CONTAINERS_STORAGE_CONF pointing at a storage.conf that says
#   driver = "vfs" (slower, more disk; checked to work here too).
# - --isolation chroot: needs no user namespace or OCI runtime for the RUN steps.
# - the host's CA bundle is mounted over the base's during the RUN steps: where TLS to the package
#   index goes through a proxy with a local CA, pip in the build trusts what this machine trusts.
set -eu
TAG=${1:-localhost/stepbudget/stepbudget:dev}
BASE=localhost/stepbudget-base:bookworm
cd "$(dirname "$0")/.."

if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # python3-venv: the Dockerfile installs into a venv (Debian's python3 refuses pip outside one).
  mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$tmp/rootfs.tar"
  container=$(buildah from scratch)
  buildah add "$container" "$tmp/rootfs.tar" /
  buildah config --cmd /usr/bin/python3 "$container"
  buildah commit --rm "$container" "$BASE"
fi

buildah build --isolation chroot \
  --volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
  --build-arg PYTHON_IMAGE="$BASE" --tag "$TAG" .
