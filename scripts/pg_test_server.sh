#!/usr/bin/env bash
# A throwaway PostgreSQL server for the PostgreSQL store's tests (and for trying the backend).
#
#   eval "$(bash scripts/pg_test_server.sh start)"   # prints: export MEMORYOS_GPU_TEST_PG_URL=...
#   bash scripts/pg_test_server.sh url               # the URL of the running server
#   bash scripts/pg_test_server.sh stop              # stop it and delete its data directory
#
# The cluster lives in $MEMORYOS_GPU_PG_DIR (default: a directory under $TMPDIR named after the
# user), listens on 127.0.0.1 only, on a free port, with trust authentication and fsync off:
# fast and disposable, never a server to keep data in. Installs PostgreSQL with apt-get when
# no initdb is found (root on Debian/Ubuntu). As root the server runs as the `postgres` OS user
# (PostgreSQL refuses to run as root). Messages go to stderr; only the env line to stdout.
set -euo pipefail

DIR=${MEMORYOS_GPU_PG_DIR:-${TMPDIR:-/tmp}/memoryos-gpu-pg-$(id -u)}
DB=memoryos_test
PGUSER_NAME=memoryos

log() { echo "pg_test_server: $*" >&2; }

find_bin() {
  if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
    dirname "$(readlink -f "$(command -v initdb)")"
    return
  fi
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$d" ] && [ -x "$d/initdb" ]; then
    echo "$d"
  fi
}

install_pg() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    log "PostgreSQL (initdb, pg_ctl) not found; install it (e.g. apt-get install postgresql)"
    exit 1
  fi
  log "installing PostgreSQL with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq postgresql >&2
}

# Run a command as the server's OS user (postgres when we are root).
as_owner() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

free_port() {
  python3 - <<'PY'
import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
PY
}

url() {
  echo "postgresql://${PGUSER_NAME}@127.0.0.1:$(cat "$DIR/port")/${DB}"
}

running() {
  [ -f "$DIR/port" ] && [ -n "$BIN" ] && as_owner "$BIN/pg_ctl" -D "$DIR/data" status >/dev/null 2>&1
}

start() {
  if [ -z "$BIN" ]; then
    install_pg
    BIN=$(find_bin)
    [ -n "$BIN" ] || { log "initdb still not found after installing PostgreSQL"; exit 1; }
  fi
  if running; then
    log "already running in $DIR"
    echo "export MEMORYOS_GPU_TEST_PG_URL=$(url)"
    return
  fi
  if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
    useradd --system --no-create-home --shell /usr/sbin/nologin postgres
  fi
  rm -rf "$DIR"
  mkdir -p "$DIR/data"
  chmod 700 "$DIR" "$DIR/data"
  if [ "$(id -u)" = 0 ]; then
    chown -R postgres: "$DIR"
  fi
  as_owner "$BIN/initdb" -D "$DIR/data" -U "$PGUSER_NAME" --auth=trust -E UTF8 \
    --locale=C.UTF-8 >"$DIR/initdb.log" 2>&1 ||
    as_owner "$BIN/initdb" -D "$DIR/data" -U "$PGUSER_NAME" --auth=trust -E UTF8 \
      --locale=C >"$DIR/initdb.log" 2>&1 || { cat "$DIR/initdb.log" >&2; exit 1; }
  local port
  port=$(free_port)
  echo "$port" >"$DIR/port"
  # fsync off / no full page writes: a test server, nothing here must survive a power cut
  as_owner "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/server.log" -w -t 60 start \
    -o "-h 127.0.0.1 -p $port -k $DIR -c fsync=off -c synchronous_commit=off \
        -c full_page_writes=off -c max_connections=200" >&2 ||
    { cat "$DIR/server.log" >&2; exit 1; }
  as_owner "$BIN/createdb" -h 127.0.0.1 -p "$port" -U "$PGUSER_NAME" "$DB"
  log "running in $DIR on 127.0.0.1:$port"
  echo "export MEMORYOS_GPU_TEST_PG_URL=$(url)"
}

stop() {
  if running; then
    as_owner "$BIN/pg_ctl" -D "$DIR/data" -m fast -w stop >&2 || true
  fi
  rm -rf "$DIR"
}

BIN=$(find_bin)
case "${1:-}" in
  start) start ;;
  stop) stop ;;
  url) running && url || { log "not running"; exit 1; } ;;
  *)
    echo "usage: $0 start|stop|url" >&2
    exit 2
    ;;
esac
