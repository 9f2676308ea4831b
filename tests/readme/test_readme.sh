#!/usr/bin/env bash
# The README's set-up and example commands, run as written from a fresh clone.
#
#   tests/readme/test_readme.sh REPO_DIR [PYTHON_WITH_MEM0AI]
#
# Clones REPO_DIR (its committed HEAD) into a temporary folder, links the
# models and ../shared in (setup.sh would fetch the models; the Debian
# packages are assumed installed, as setup.sh leaves them), runs
# scripts/setup.sh (idempotent: nothing to do then), builds the CLI as
# scripts/demo.sh does, and then the README's blocks marked
# "<!-- test_readme: run -->" (each line a command; `serve` is started in
# the background on a free port instead of 8080), "<!-- test_readme:
# client -->" (run with bash; no response may be an error) and
# "<!-- test_readme: python -->" (run when the mem0ai package is importable,
# else reported as not run). Then checks that the example user has
# memories, and that the clone's `git status` is clean: every data
# directory the examples write is ignored.
#
# Exit status 77 (skipped) when the models or LoCoMo are missing.
set -euo pipefail
SRC=$(cd "${1:?usage: test_readme.sh REPO_DIR [PYTHON_WITH_MEM0AI]}" && pwd)
[ -f "$SRC/models/SmolLM2-135M-Instruct.Q4_1.gguf" ] || { echo "SKIP: no default model in $SRC/models"; exit 77; }
PY_MEM0=""
[ -n "${2:-}" ] && [ -x "$2" ] && PY_MEM0=$(cd "$(dirname "$2")" && pwd)/$(basename "$2") # a venv python: not resolved
SHARED=$(cd "$SRC/.." && pwd)/shared
[ -f "$SHARED/data/locomo/26.json" ] || { echo "SKIP: $SHARED/data/locomo/26.json not found"; exit 77; }

T=$(mktemp -d)
pid=""
cleanup() {
  [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  rm -rf "$T"
}
trap cleanup EXIT
git clone -q "$SRC" "$T/repo"
ln -s "$(readlink -f "$SRC/models")" "$T/repo/models"
ln -s "$SHARED" "$T/shared"
cd "$T/repo"
echo "fresh clone of $(git log --oneline -1) in $T/repo"

# The README's blocks: prints the lines of every block after a marker.
blocks() {
  awk -v want="<!-- test_readme: $1 -->" '
    $0 == want { armed = 1; next }
    armed && /^```/ { if (inblock) { inblock = 0; armed = 0 } else inblock = 1; next }
    inblock { print }' README.md
}
[ -n "$(blocks run)" ] && [ -n "$(blocks client)" ] || { echo "FAIL: README has no marked blocks"; exit 1; }

# Set-up, as scripts/demo.sh does it (ccache, when installed, makes the build of a clone cheap).
bash scripts/setup.sh >/dev/null
if command -v ccache >/dev/null; then export CMAKE_C_COMPILER_LAUNCHER=ccache CCACHE_BASEDIR=$T CCACHE_NOHASHDIR=1; fi
t0=$(date +%s)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DIS_CUDA=OFF >/dev/null
cmake --build build -j"$(nproc)" --target inferscale-cli >/dev/null
echo "built in $(( $(date +%s) - t0 )) s"

PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
B="http://127.0.0.1:$PORT"
while IFS= read -r line; do
  [ -z "$line" ] && continue
  cmd=${line//--port 8080/--port $PORT}
  if [[ "$cmd" == *" serve "* ]]; then
    echo "+ $cmd &"
    # exec: $! is the server itself (SIGTERM stops it cleanly; a background
    # job of a script ignores SIGINT, Ctrl-C's signal).
    eval "exec $cmd --quiet" 2>"$T/serve.log" &
    pid=$!
    for _ in $(seq 1 240); do curl -sf "$B/health" >/dev/null && break; sleep 0.5; done
    curl -sf "$B/health" >/dev/null || { echo "FAIL: the server did not start"; cat "$T/serve.log"; exit 1; }
  else
    echo "+ $cmd"
    eval "$cmd"
  fi
done < <(blocks run)
[ -n "$pid" ] || { echo "FAIL: the run block started no server"; exit 1; }

blocks client | sed "s|localhost:8080|127.0.0.1:$PORT|g" > "$T/client.sh"
echo "+ the client block ($(grep -c curl "$T/client.sh") requests)"
out=$(bash -e "$T/client.sh")
echo "$out" | cut -c1-300
if echo "$out" | grep -q '"error"'; then echo "FAIL: a README request answered an error"; exit 1; fi

# A python with mem0ai: the one test_mem0_client installs (argument 2), else the system's.
PY=${PY_MEM0:-python3}
if "$PY" -c 'import mem0' 2>/dev/null; then
  blocks python | sed "s|localhost:8080|127.0.0.1:$PORT|g" > "$T/example.py"
  echo "+ the python block ($PY)"
  pyout=$(MEM0_TELEMETRY=False HOME=$T "$PY" "$T/example.py")
  echo "$pyout" | cut -c1-300
  echo "$pyout" | grep -q "adoption" || { echo "FAIL: the python block's search found nothing"; exit 1; }
else
  echo "note: the python block was not run (the mem0ai package is not installed here; test_mem0_client runs the client)"
fi

# The user the examples ask about has memories, in the tenant of --no-auth.
n=$(curl -s "$B/v1/memories/?user_id=caroline" | python3 -c 'import json, sys; print(len(json.load(sys.stdin)["results"]))')
[ "$n" -gt 0 ] || { echo "FAIL: user caroline has no memories"; exit 1; }
hits=$(curl -s "$B/v1/memories/search/" -d '{"query": "adoption", "user_id": "caroline", "top_k": 3}' |
  python3 -c 'import json, sys; print(len(json.load(sys.stdin)["results"]))')
[ "$hits" -eq 3 ] || { echo "FAIL: the README's search found $hits memories"; exit 1; }
echo "caroline: $n memories"

kill -TERM "$pid"; wait "$pid" || { echo "FAIL: the server did not stop cleanly"; cat "$T/serve.log"; exit 1; }
pid=""
dirty=$(git status --porcelain)
[ -z "$dirty" ] || { echo "FAIL: the examples left files git does not ignore:"; echo "$dirty"; exit 1; }
echo "PASS"
