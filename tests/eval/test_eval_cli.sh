#!/usr/bin/env bash
# test_eval_cli: `inferscale eval locomo` as a user runs it, on one LoCoMo
# conversation: --skip and --limit choose the questions (rows keep their
# numbers), retrieval saved and loaded, and the teacher-forced rows of the
# chosen questions only. Exits 77 (skipped) without the default model, the
# embedder or LoCoMo.
#   test_eval_cli.sh SOURCE_DIR INFERSCALE
set -euo pipefail
src=$1
bin=$2
model=$src/models/SmolLM2-135M-Instruct.Q4_1.gguf
emb=$src/models/all-MiniLM-L6-v2
data=$src/../shared/data/locomo
for need in "$model" "$emb" "$data/26.json"; do
  if [ ! -e "$need" ]; then
    echo "SKIP: $need is missing"
    exit 77
  fi
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# Questions 4 and 5 of conversation 26: retrieval for those two only.
"$bin" eval locomo -m "$model" --embedder "$emb" --data-dir "$data" --conv 26 --skip 4 --limit 6 \
  --retrieve-only --k 3 -t 1 --save-retrieval "$tmp/r.tsv" --out "$tmp/r.csv" > "$tmp/r.log" 2>&1 \
  || { cat "$tmp/r.log"; fail "retrieve-only run"; }
got=$(cut -f2 "$tmp/r.tsv" | tr '\n' ' ')
[ "$got" = "4 5 " ] || fail "retrieval saved for questions '$got', want '4 5 '"
grep -q "questions 5-6" "$tmp/r.log" || fail "the summary does not name questions 5-6"

# The same two, scored from the saved retrieval without the embedder.
"$bin" eval locomo -m "$model" --data-dir "$data" --conv 26 --skip 4 --limit 6 \
  --load-retrieval "$tmp/r.tsv" --k 3 -t 1 --nll --no-generate --modes kv0 \
  --store "$tmp/store" --out "$tmp/n.csv" > "$tmp/n.log" 2>&1 \
  || { cat "$tmp/n.log"; fail "scoring run"; }
qs=$(tail -n +2 "$tmp/n.csv.nll.csv" | cut -d, -f2 | sort -u | tr '\n' ' ')
modes=$(tail -n +2 "$tmp/n.csv.nll.csv" | cut -d, -f4 | sort -u | tr '\n' ' ')
[ -n "$qs" ] || fail "no scored rows"
for q in $qs; do
  [ "$q" = 4 ] || [ "$q" = 5 ] || fail "a row for question $q"
done
[ "$modes" = "kv0 off prompt " ] || fail "modes '$modes', want kv0, off and prompt"

# A skip past the end leaves nothing to do, and says so without failing.
"$bin" eval locomo -m "$model" --data-dir "$data" --conv 26 --skip 100000 \
  --load-retrieval "$tmp/r.tsv" --k 3 -t 1 --nll --no-generate --modes kv0 \
  --store "$tmp/store" --out "$tmp/e.csv" > "$tmp/e.log" 2>&1 \
  || { cat "$tmp/e.log"; fail "a skip past the end failed"; }
[ "$(tail -n +2 "$tmp/e.csv.nll.csv" | wc -l)" = 0 ] || fail "rows after a skip past the end"
echo "PASS: test_eval_cli (questions $qs)"
