#!/usr/bin/env bash
# Runs a command beside a throwaway PostgreSQL server: initdb in a temporary
# directory, the server on a Unix socket in it only (no TCP port, so runs
# beside each other never collide), the command with IS_PG_URL set to a
# libpq URL of the database, then the server stopped and the directory
# removed, whatever the command did. Exits with the command's status, or 77
# (ctest's "skipped") with the reason when the PostgreSQL server binaries
# are not installed (Debian: postgresql).
#
# initdb refuses to run as root, so as root the cluster belongs to an
# unprivileged user (IS_PG_USER, default nobody) and both initdb and the
# server run as that user through runuser; as anyone else they run as the
# caller. The database role is always "inferscale" (trust auth on the socket).
#
# Usage: scripts/pg_temp.sh COMMAND [ARGS...]
set -u
if [ $# -lt 1 ]; then
  echo "usage: $0 COMMAND [ARGS...]  (runs COMMAND with IS_PG_URL set)" >&2
  exit 2
fi

find_bin() {
  local b
  b=$(command -v "$1" 2>/dev/null) && { echo "$b"; return 0; }
  for b in /usr/lib/postgresql/*/bin/"$1"; do
    [ -x "$b" ] && { echo "$b"; return 0; }
  done
  return 1
}
INITDB=$(find_bin initdb) || { echo "skip: PostgreSQL's initdb not found (apt-get install postgresql)"; exit 77; }
PGBIN=$(dirname "$INITDB")
PG_CTL="$PGBIN/pg_ctl"
[ -x "$PG_CTL" ] || PG_CTL=$(find_bin pg_ctl) || { echo "skip: pg_ctl not found"; exit 77; }

DIR=$(mktemp -d "${TMPDIR:-/tmp}/is-pg.XXXXXX") || exit 1
AS=()
if [ "$(id -u)" -eq 0 ]; then
  RUNAS=${IS_PG_USER:-nobody}
  command -v runuser >/dev/null || { echo "skip: running as root and runuser is missing"; rm -rf "$DIR"; exit 77; }
  chown "$RUNAS" "$DIR" || { rm -rf "$DIR"; exit 1; }
  AS=(runuser -u "$RUNAS" --)
fi
chmod 700 "$DIR"

cleanup() {
  "${AS[@]}" "$PG_CTL" -D "$DIR/data" -m immediate stop >/dev/null 2>&1
  rm -rf "$DIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if ! "${AS[@]}" "$INITDB" -D "$DIR/data" -U inferscale -A trust -E UTF8 --locale=C.UTF-8 \
     >"$DIR/initdb.log" 2>&1; then
  echo "pg_temp: initdb failed:" >&2
  cat "$DIR/initdb.log" >&2
  exit 1
fi
# fsync stays on: the tests check durability, not speed.
if ! "${AS[@]}" "$PG_CTL" -D "$DIR/data" -l "$DIR/server.log" -w -t 60 \
     -o "-c listen_addresses='' -c unix_socket_directories='$DIR' -c max_connections=50" start \
     >/dev/null 2>&1; then
  echo "pg_temp: the server did not start:" >&2
  cat "$DIR/server.log" >&2
  exit 1
fi
export IS_PG_URL="postgresql://inferscale@/postgres?host=$DIR"
export IS_PG_DIR="$DIR"
"$@"
