#!/usr/bin/env bash
# A private RabbitMQ node on loopback for Lily's examples and tests.
#
#   scripts/rabbitmq.sh install          install Debian's rabbitmq-server when missing
#   scripts/rabbitmq.sh start DIR PORT   start a node with its data in DIR, AMQP on 127.0.0.1:PORT
#                                        (PORT+1 and PORT+2 serve Erlang distribution and epmd;
#                                        pick PORT below 32768, outside the ephemeral range)
#                                        (with LILY_RABBIT_TLS_DIR set, also AMQPS on PORT+3
#                                        using the certificates of scripts/tls.sh, requiring
#                                        a client certificate signed by its CA)
#   scripts/rabbitmq.sh stop DIR         stop the node started with DIR (by its PID)
#   scripts/rabbitmq.sh ctl DIR ARGS...  run rabbitmqctl against that node
#   scripts/rabbitmq.sh cluster-start DIR PORT
#                                        a three-node cluster: nodes in DIR/n1..n3, AMQP on
#                                        127.0.0.1:PORT, PORT+10 and PORT+20 (each node's
#                                        distribution port is its AMQP port + 1; the three share
#                                        epmd on PORT+2 and one private cookie)
#   scripts/rabbitmq.sh cluster-stop DIR stop the three nodes of that cluster (by their PIDs)
#   scripts/rabbitmq.sh kill DIR         kill -9 the node started with DIR (a crash); `start DIR
#                                        PORT` brings it back with its data
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
  # A cluster's nodes share one epmd (they find each other through it) and one cookie.
  export ERL_EPMD_PORT=${LILY_RABBIT_EPMD_PORT:-$((port + 2))}
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
  # A node brought back (after `kill`) keeps the epmd its cluster shares.
  if [ -z "${LILY_RABBIT_EPMD_PORT:-}" ] && [ -f "$dir/epmd_port" ]; then
    LILY_RABBIT_EPMD_PORT=$(cat "$dir/epmd_port")
  fi
  node_env "$dir" "$port"
  mkdir -p "$dir/mnesia" "$dir/log"
  echo "[]." >"$RABBITMQ_ENABLED_PLUGINS_FILE"
  # A node brought back keeps the advanced configuration it was started with.
  if [ -n "${LILY_RABBIT_ADVANCED:-}" ]; then
    echo "$LILY_RABBIT_ADVANCED" >"$RABBITMQ_ADVANCED_CONFIG_FILE"
  elif [ ! -f "$RABBITMQ_ADVANCED_CONFIG_FILE" ]; then
    echo "[]." >"$RABBITMQ_ADVANCED_CONFIG_FILE"
  fi
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
# Mutual TLS: a client must present a certificate this CA signed.
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = true
CONF
  fi
  echo "$port" >"$dir/port"
  echo "$ERL_EPMD_PORT" >"$dir/epmd_port"
  if [ -n "${LILY_RABBIT_COOKIE:-}" ]; then
    rm -f "$dir/.erlang.cookie"
    printf '%s' "$LILY_RABBIT_COOKIE" >"$dir/.erlang.cookie"
    chmod 400 "$dir/.erlang.cookie"
  fi
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

# The environment of the node already set up in DIR, with the epmd port it was started with.
known_env() {
  local dir=$1
  LILY_RABBIT_EPMD_PORT=$(cat "$dir/epmd_port" 2>/dev/null || echo $(($(cat "$dir/port") + 2))) \
    node_env "$dir" "$(cat "$dir/port")"
}

stop() {
  local dir=$1
  [ -f "$dir/port" ] || return 0
  known_env "$dir"
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
  known_env "$dir"
  "$RABBIT_BIN/rabbitmqctl" "$@"
}

# kill -9 of the node's Erlang VM: no clean stop, as a crash or an OOM kill looks.
kill_node() {
  local dir=$1 pid
  pid=$(cat "$dir/rabbit.pid" 2>/dev/null || true)
  [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true
  pid=$(cat "$dir/server.pid" 2>/dev/null || true)
  [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true
  # the node's port stays recorded: `start DIR PORT` brings it back with its data
}

cluster_start() {
  local dir port
  dir=$(mkdir -p "$1" && cd "$1" && pwd) port=$2
  install
  export LILY_RABBIT_EPMD_PORT=$((port + 2))
  # One private cookie for the three nodes and the CLI.
  export LILY_RABBIT_COOKIE="lily-cluster-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
  # At-least-once dead-lettering (the retry buckets back to the work queue) resends what a
  # leader change left unconfirmed after this long; RabbitMQ's default of 3 min stalls every
  # retry behind 32 such copies for that long (see the README, "Running on a cluster").
  export LILY_RABBIT_ADVANCED="[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 5000}]}]."
  local i pids=()
  for i in 1 2 3; do
    start "$dir/n$i" $((port + (i - 1) * 10)) &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i"; done
  local first="lily$port@localhost"
  for i in 2 3; do
    ctl "$dir/n$i" -q stop_app
    ctl "$dir/n$i" -q join_cluster "$first"
    ctl "$dir/n$i" -q start_app
  done
  ctl "$dir/n1" -q await_online_nodes 3
  echo "lily: three-node cluster ready on 127.0.0.1:$port, $((port + 10)), $((port + 20)) (data $dir)" >&2
}

cluster_stop() {
  local dir=$1 i
  for i in 3 2 1; do
    [ -d "$dir/n$i" ] && stop "$dir/n$i"
  done
  return 0
}

cmd=${1:-}
shift || true
case "$cmd" in
  install) install ;;
  start) start "$@" ;;
  stop) stop "$@" ;;
  ctl) ctl "$@" ;;
  kill) kill_node "$@" ;;
  cluster-start) cluster_start "$@" ;;
  cluster-stop) cluster_stop "$@" ;;
  *) sed -n '2,18p' "$0" >&2; exit 2 ;;
esac
