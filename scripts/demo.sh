#!/usr/bin/env bash
# The main job on the default model: sets up, builds, loads a demo user's
# memory and serves the HTTP API (OpenAI-compatible chat with memory,
# Mem0-style memory routes) on http://127.0.0.1:$PORT, printing example
# curl commands first. Ctrl-C stops the server cleanly.
#
# The memory: the facts of LoCoMo conversation 26 (../shared/data/locomo,
# the 7 conversations of the benchmark kept beside this repository), one
# user per speaker: "caroline" and "melanie", tenant "default" (the tenant
# of --no-auth). Ingest stores text and embeddings (seconds); the server
# encodes a user's facts' KV at the first chat that needs them (one batch,
# then injected in that chat). Without that folder a few facts
# of the same kind are loaded for "caroline" instead.
#
# Usage: scripts/demo.sh            set up, build, serve (foreground)
#        scripts/demo.sh --smoke    the same, but run the example requests
#                                   against it and stop (exit status 0 if
#                                   all succeeded)
# Environment: PORT (default 8080), DEMO_DATA (default demo-data/),
#              BUILD_DIR (default build/).
set -euo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
PORT=${PORT:-8080}
DATA=${DEMO_DATA:-demo-data}
BUILD=${BUILD_DIR:-build}
CLI=$BUILD/tools/inferscale

bash scripts/setup.sh
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target inferscale-cli >/dev/null

LOCOMO=../shared/data/locomo/26.json
if [ -f "$LOCOMO" ]; then
  # Resumable: facts already in $DATA are skipped.
  # Defaults: tenant "default" (that of serve --no-auth), one user per speaker.
  "$CLI" ingest locomo "$LOCOMO" --data "$DATA" --no-kv
else
  echo "demo: $LOCOMO not found; loading a few demo facts for user 'caroline' instead"
  facts=$(mktemp)
  cat > "$facts" <<'EOF'
{"text": "Caroline went to an LGBTQ support group and found it powerful"}
{"text": "Caroline is researching adoption agencies"}
{"text": "Caroline wants to work in counseling and mental health"}
{"text": "Caroline moved from Sweden four years ago"}
{"text": "Caroline's friend Melanie paints and runs a pottery class"}
EOF
  "$CLI" ingest facts "$facts" --user caroline --data "$DATA" --tenant default --no-kv
  rm -f "$facts"
fi

B="http://127.0.0.1:$PORT"
cat <<EOF

== InferScale is starting on $B (model: models/SmolLM2-135M-Instruct.Q4_1.gguf, memory: $DATA)
Try, from another terminal:

  # chat as user 'caroline': her facts are retrieved (k=5) and injected as KV
  curl -s $B/v1/chat/completions -d '{"user": "caroline", "max_tokens": 48, "temperature": 0,
    "memory": {"k": 5}, "messages": [{"role": "user", "content": "What did Caroline research?"}]}'

  # the same in prompt mode (facts prefilled as text), and streamed (server-sent events)
  curl -s $B/v1/chat/completions -d '{"user": "caroline", "memory": {"mode": "prompt"},
    "max_tokens": 48, "messages": [{"role": "user", "content": "Where did Caroline move from?"}]}'
  curl -sN $B/v1/chat/completions -d '{"user": "caroline", "stream": true, "max_tokens": 48,
    "messages": [{"role": "user", "content": "What does Caroline want to do for work?"}]}'

  # memories (Mem0's REST shapes): search, add, list
  curl -s $B/v1/memories/search/ -d '{"query": "adoption", "user_id": "caroline", "top_k": 3}'
  curl -s $B/v1/memories/ -d '{"user_id": "caroline", "facts": ["Caroline adopted a cat named Oscar"]}'
  curl -s "$B/v1/memories/?user_id=caroline"

  # or Mem0's own Python client, unmodified (pip install mem0ai; any key with --no-auth)
  python3 -c 'from mem0 import MemoryClient; m = MemoryClient(api_key="local", host="$B");
print(m.search("adoption", filters={"user_id": "caroline"}, top_k=3))'

  curl -s $B/health; curl -s $B/metrics | grep inferscale_ttft

Clients with an API key file instead of --no-auth: see README.md (Serving).
Ctrl-C stops the server.

EOF

if [ "$SMOKE" = 1 ]; then
  "$CLI" serve --data "$DATA" --no-auth --port "$PORT" --quiet &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 1 120); do curl -sf "$B/health" >/dev/null && break; sleep 0.5; done
  set -x
  curl -sf "$B/v1/chat/completions" -d '{"user": "caroline", "max_tokens": 24, "temperature": 0,
    "memory": {"k": 5}, "messages": [{"role": "user", "content": "What did Caroline research?"}]}'
  curl -sfN "$B/v1/chat/completions" -d '{"user": "caroline", "stream": true, "max_tokens": 16,
    "messages": [{"role": "user", "content": "What does Caroline want to do for work?"}]}'
  curl -sf "$B/v1/memories/search/" -d '{"query": "adoption", "user_id": "caroline", "top_k": 3}'
  curl -sf "$B/health"
  set +x
  kill -INT $pid
  wait $pid
  trap - EXIT
  echo "demo: smoke run passed"
  exit 0
fi
exec "$CLI" serve --data "$DATA" --no-auth --port "$PORT"
