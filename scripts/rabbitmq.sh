#!/usr/bin/env bash
# A private RabbitMQ node on loopback for Lily's examples and tests.
#
#   scripts/rabbitmq.sh install          install Debian's rabbitmq-server when missing
#   scripts/rabbitmq.sh start DIR PORT   start a node with its data in DIR, AMQP on 127.0.0.1:PORT
#                                        (PORT+1 and PORT+2 serve Erlang distribution and epmd;
#                                        pick PORT below 32768, outside the ephemeral range)
#                                        (with LILY_RABBIT_TLS_DIR set, also AMQPS on PORT+3
#                                        using the certificates of scripts/tls.sh)
#   scripts/rabbitmq.sh stop DIR         stop the node started with DIR (by its PID)
#   scripts/rabbitmq.sh ctl DIR ARGS...  run rabbitmqctl against that node
#
# Each node has its own data directory, AMQP port, distribution port, epmd port and Erlang
# cookie, so it never touches another node on the machine. Nothing listens beyond 127.0.0.1.
set -euo pipefail

RABBIT_BIN=/usr/lib/rabbitmq/bin

install() {
  if [ -x "$RABBIT_BIN/rabbitmq-server" ]; then return 0; fi
  echo "lily: installing rabbitmq-server from Debian packages" >&2
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  # policy-rc.d keeps the package from starting the system-wide node: Lily runs its own.
  $sudo env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq --no-install-recommends \
    rabbitmq-server >&2
}

node_env() {
  local dir=$1 port=$2
  export HOME="$dir" # the Erlang cookie lives here, private to this node
  export RABBITMQ_NODENAME="lily$port@localhost"
  export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
  export RABBITMQ_NODE_PORT="$port"
  export RABBITMQ_DIST_PORT=$((port + 1))
  export ERL_EPMD_ADDRESS=127.0.0.1
  export ERL_EPMD_PORT=$((port + 2))
  export RABBITMQ_MNESIA_BASE="$dir/mnesia"
  export RABBITMQ_LOG_BASE="$dir/log"
  export RABBITMQ_PID_FILE="$dir/rabbit.pid"
  export RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins"
  export RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf"
  export RABBITMQ_ADVANCED_CONFIG_FILE="$dir/advanced.config"
}

start() {
  local dir port
  dir=$(mkdir -p "$1" && cd "$1" && pwd) port=$2
  install
  node_env "$dir" "$port"
  mkdir -p "$dir/mnesia" "$dir/log"
  echo "[]." >"$RABBITMQ_ENABLED_PLUGINS_FILE"
  echo "[]." >"$RABBITMQ_ADVANCED_CONFIG_FILE"
  cat >"$RABBITMQ_CONFIG_FILE" <<CONF
listeners.tcp.default = 127.0.0.1:$port
loopback_users = none
log.console = false
log.file.level = warning
# the machine is shared: do not let a full disk elsewhere block publishers in tests
disk_free_limit.absolute = 50MB
CONF
  if [ -n "${LILY_RABBIT_TLS_DIR:-}" ]; then
    # An AMQPS listener on PORT+3 besides the plain one, with the given certificates.
    cat >>"$RABBITMQ_CONFIG_FILE" <<CONF
listeners.ssl.default = 127.0.0.1:$((port + 3))
ssl_options.cacertfile = $LILY_RABBIT_TLS_DIR/ca.pem
ssl_options.certfile = $LILY_RABBIT_TLS_DIR/server.pem
ssl_options.keyfile = $LILY_RABBIT_TLS_DIR/server.key
ssl_options.verify = verify_none
ssl_options.fail_if_no_peer_cert = false
CONF
  fi
  echo "$port" >"$dir/port"
  "$RABBIT_BIN/rabbitmq-server" >"$dir/log/stdout.log" 2>&1 &
  echo $! >"$dir/server.pid"
  # wait for the node and its AMQP listener
  local i
  for i in $(seq 1 120); do
    if "$RABBIT_BIN/rabbitmqctl" -q await_startup >/dev/null 2>&1; then
      echo "lily: rabbitmq node $RABBITMQ_NODENAME ready on 127.0.0.1:$port (data $dir)" >&2
      return 0
    fi
    if ! kill -0 "$(cat "$dir/server.pid")" 2>/dev/null; then
      echo "lily: rabbitmq-server exited; see $dir/log" >&2
      tail -n 30 "$dir/log/stdout.log" >&2 || true
      return 1
    fi
    sleep 1
  done
  echo "lily: rabbitmq node did not start within 120s; see $dir/log" >&2
  return 1
}

stop() {
  local dir=$1
  [ -f "$dir/port" ] || return 0
  node_env "$dir" "$(cat "$dir/port")"
  "$RABBIT_BIN/rabbitmqctl" -q stop >/dev/null 2>&1 || true
  local pid
  for f in server.pid rabbit.pid; do
    pid=$(cat "$dir/$f" 2>/dev/null || true)
    [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
  done
  # the node's own epmd, started on its private port
  local epmd
  epmd=$(ls /usr/lib/erlang/erts-*/bin/epmd 2>/dev/null | head -n 1)
  [ -n "$epmd" ] && "$epmd" -port "$ERL_EPMD_PORT" -kill >/dev/null 2>&1 || true
  rm -f "$dir/port"
}

ctl() {
  local dir=$1
  shift
  node_env "$dir" "$(cat "$dir/port")"
  "$RABBIT_BIN/rabbitmqctl" "$@"
}

cmd=${1:-}
shift || true
case "$cmd" in
  install) install ;;
  start) start "$@" ;;
  stop) stop "$@" ;;
  ctl) ctl "$@" ;;
  *) sed -n '2,9p' "$0" >&2; exit 2 ;;
esac
