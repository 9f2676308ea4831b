#!/usr/bin/env bash
# One call after the README's first (bg.sh building): the GPU tests of the fact tiers and the
# injection on a random-weight model of the default model's KV shape (30 layers, 3 KV heads of 64;
# tools/make_random_gguf.py --preset tiny-llama --set n_layers=30 --set dim=192 --set n_heads=3
# --set n_kv_heads=3 --set n_vocab=2048 --set ffn_dim=256, carried as .dev/tm/smolshape.gguf),
# standing in for the default model where the call cannot carry it: every test here compares the
# GPU path against another path on the same weights, never against the default model's values.
set -u
. "$(dirname "$0")/common.sh"
cd /tmp/src
wait_for 500 /tmp/build.done
export IS_TEST_MODEL=/tmp/src/.dev/tm/smolshape.gguf
mkdir -p models && ln -sf "$IS_TEST_MODEL" models/SmolLM2-135M-Instruct.Q4_1.gguf
cd build-gpu
timeout 400 ctest -R "^(${TESTS:-test_fact_tiers_cuda|test_serve_tiers_cuda|test_inject_batch_cuda|test_cuda_ops})\$" \
  --output-on-failure -j4 --timeout 300 > "$OUT/tiers_test.log" 2>&1
st "ctest rc $?"
grep -E "Test +#|tests passed|FAILED|differ|ERROR|Assert|skipped" "$OUT/tiers_test.log" | head -40
