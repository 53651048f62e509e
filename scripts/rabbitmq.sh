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
#   scripts/rabbitmq.sh version DIR      the RabbitMQ version of the node set up in DIR
#   scripts/rabbitmq.sh run PROGRAM ARGS...
#                                        run one of the broker's programs (rabbitmq-server,
#                                        rabbitmqctl ...) of LILY_RABBIT_VERSION with the caller's
#                                        node environment (HOME, RABBITMQ_*, ERL_EPMD_*): the
#                                        partition hosts start their nodes with it. For 4.0,
#                                        LILY_RABBIT_HOSTS names a hosts file whose lines the
#                                        root's /etc/hosts gets too
#
# LILY_RABBIT_VERSION picks the broker for `install`, `start` and `cluster-start`: 3.10 (the
# default: Debian 12's rabbitmq-server, installed with apt) or 4.0 (Debian 13's, with Erlang 27,
# in a root of its own under target/rabbitmq-4.0, built once with debootstrap, about 370 MB).
# A node remembers its version: `stop`, `ctl`, `kill` and a restart use it.
#
# Each node has its own data directory, AMQP port, distribution port, epmd port and Erlang
# cookie, so it never touches another node on the machine. Nothing listens beyond 127.0.0.1.
# A 4.0 node runs in a mount namespace of its own, chrooted into the 4.0 root, which sees its
# data directory at the same path as the host does; the mounts end with its last process.
set -euo pipefail

ROOT4="$(cd "$(dirname "$0")/.." && pwd)/target/rabbitmq-4.0/root"
VERSION=${LILY_RABBIT_VERSION:-3.10}

# The broker binaries of VERSION, as the host sees them.
rabbit_bin() {
  case "$VERSION" in
    3.10) echo /usr/lib/rabbitmq/bin ;;
    4.0) echo "$ROOT4/usr/lib/rabbitmq/bin" ;;
    *) echo "lily: LILY_RABBIT_VERSION must be 3.10 or 4.0, not '$VERSION'" >&2; return 2 ;;
  esac
}

install() {
  rabbit_bin >/dev/null
  if [ "$VERSION" = 4.0 ]; then install_root; return; fi
  if [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then return 0; fi
  echo "lily: installing rabbitmq-server from Debian packages" >&2
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  # policy-rc.d keeps the package from starting the system-wide node: Lily runs its own.
  $sudo env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq --no-install-recommends \
    rabbitmq-server >&2
}

# The 4.0 root: Debian 13's rabbitmq-server and Erlang 27, made with debootstrap into a
# directory beside it and moved into place once complete. Its version is checked, not pinned:
# a Debian point release may bring 4.0.6, but never another minor version.
install_root() {
  local dir version
  dir=$(dirname "$ROOT4")
  if [ ! -x "$ROOT4/usr/lib/rabbitmq/bin/rabbitmq-server" ]; then
    [ "$(id -u)" -eq 0 ] || { echo "lily: building the RabbitMQ 4.0 root needs root (debootstrap, chroot)" >&2; return 1; }
    if ! command -v debootstrap >/dev/null; then
      echo "lily: installing debootstrap from Debian packages" >&2
      env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
      env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >&2
    fi
    echo "lily: building the RabbitMQ 4.0 root in $ROOT4 (Debian 13 packages, once)" >&2
    mkdir -p "$dir"
    rm -rf "$dir/root.partial"
    debootstrap --variant=minbase --include=rabbitmq-server trixie "$dir/root.partial" \
      >"$dir/debootstrap.log" 2>&1 || {
      echo "lily: debootstrap failed; see $dir/debootstrap.log" >&2
      tail -n 20 "$dir/debootstrap.log" >&2
      return 1
    }
    chroot "$dir/root.partial" dpkg-query -W -f '${Version}' rabbitmq-server >"$dir/version"
    mv "$dir/root.partial" "$ROOT4"
  fi
  version=$(cat "$dir/version")
  case "$version" in
    4.0.*) ;;
    *) echo "lily: the 4.0 root holds rabbitmq-server $version, not 4.0.x; remove $dir to rebuild" >&2; return 1 ;;
  esac
}

# Runs a command of the 4.0 root (a path inside it) with the node environment node_env set,
# and nothing else of the host's: in a private mount namespace, with /proc (the broker's memory
# and disk monitors read it) and the node's directory mounted at the same paths inside. The
# root's /etc/hosts is shown with the machine's own name added: 4.0 looks that name up now and
# then while it opens connections, and where no file names it the lookup goes to DNS, which on
# a machine that cannot reach one stalls every connection being opened for the resolver's 5 s
# timeout (seen here once per 250 or so connections opened). The lines of LILY_RABBIT_HOSTS, when
# set, come before that name: the partition hosts name each other there.
in_root() {
  local vars=(PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 LC_ALL=C.UTF-8) name
  for name in HOME ERL_EPMD_ADDRESS ERL_EPMD_PORT $(compgen -e | grep '^RABBITMQ_'); do
    [ -z "${!name+set}" ] || vars+=("$name=${!name}")
  done
  unshare --mount --propagation private -- /bin/sh -c '
    root=$1 dir=$2 extra=$3; shift 3
    mount -t proc proc "$root/proc"
    mkdir -p "$root$dir" && mount --bind "$dir" "$root$dir"
    hosts=$(mktemp)
    { cat "$root/etc/hosts"; [ -z "$extra" ] || cat "$extra"; echo "127.0.0.1 $(hostname)"; } >"$hosts"
    mount --bind "$hosts" "$root/etc/hosts" && rm "$hosts"
    exec chroot "$root" /usr/bin/env -i "$@"' sh "$ROOT4" "$HOME" "${LILY_RABBIT_HOSTS:-}" "${vars[@]}" "$@"
}

# Runs one of the broker's programs (rabbitmq-server, rabbitmqctl, ...) of the node's version.
run() {
  local program=$1
  shift
  if [ "$VERSION" = 4.0 ]; then
    in_root "/usr/lib/rabbitmq/bin/$program" "$@"
  else
    "/usr/lib/rabbitmq/bin/$program" "$@"
  fi
}

# Stops the epmd on PORT (a node's epmd outlives it).
kill_epmd() {
  local epmd
  if [ "$VERSION" = 4.0 ]; then
    epmd=$(ls "$ROOT4"/usr/lib/erlang/erts-*/bin/epmd 2>/dev/null | head -n 1)
  else
    epmd=$(ls /usr/lib/erlang/erts-*/bin/epmd 2>/dev/null | head -n 1)
  fi
  [ -n "$epmd" ] && "$epmd" -port "$1" -kill >/dev/null 2>&1 || true
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
  # The command-line tools' own distribution ports: private too (the default range is shared).
  export RABBITMQ_CTL_DIST_PORT_MIN=$((port + 4)) RABBITMQ_CTL_DIST_PORT_MAX=$((port + 9))
}

start() {
  local dir port
  dir=$(mkdir -p "$1" && cd "$1" && pwd) port=$2
  # A node brought back keeps its version.
  if [ -z "${LILY_RABBIT_VERSION:-}" ] && [ -f "$dir/version" ]; then VERSION=$(cat "$dir/version"); fi
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
  if [ "$VERSION" = 4.0 ]; then
    # Lily uses no deprecated feature: a 4.x operator may turn every one off.
    cat >>"$RABBITMQ_CONFIG_FILE" <<CONF
deprecated_features.permit.transient_nonexcl_queues = false
deprecated_features.permit.global_qos = false
deprecated_features.permit.ram_node_type = false
deprecated_features.permit.queue_master_locator = false
CONF
  fi
  if [ -n "${LILY_RABBIT_TLS_DIR:-}" ]; then
    # The node reads its own copy (a 4.0 node sees only its directory).
    mkdir -p "$dir/tls"
    cp "$LILY_RABBIT_TLS_DIR/ca.pem" "$LILY_RABBIT_TLS_DIR/server.pem" "$LILY_RABBIT_TLS_DIR/server.key" "$dir/tls/"
    # An AMQPS listener on PORT+3 besides the plain one, with the given certificates.
    cat >>"$RABBITMQ_CONFIG_FILE" <<CONF
listeners.ssl.default = 127.0.0.1:$((port + 3))
ssl_options.cacertfile = $dir/tls/ca.pem
ssl_options.certfile = $dir/tls/server.pem
ssl_options.keyfile = $dir/tls/server.key
# Mutual TLS: a client must present a certificate this CA signed.
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = true
CONF
  fi
  echo "$port" >"$dir/port"
  echo "$ERL_EPMD_PORT" >"$dir/epmd_port"
  echo "$VERSION" >"$dir/version"
  if [ -n "${LILY_RABBIT_COOKIE:-}" ]; then
    rm -f "$dir/.erlang.cookie"
    printf '%s' "$LILY_RABBIT_COOKIE" >"$dir/.erlang.cookie"
    chmod 400 "$dir/.erlang.cookie"
  fi
  run rabbitmq-server >"$dir/log/stdout.log" 2>&1 &
  echo $! >"$dir/server.pid"
  # wait for the node and its AMQP listener
  local i
  for i in $(seq 1 120); do
    if run rabbitmqctl -q await_startup >/dev/null 2>&1; then
      echo "lily: rabbitmq $VERSION node $RABBITMQ_NODENAME ready on 127.0.0.1:$port (data $dir)" >&2
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
  VERSION=$(cat "$dir/version" 2>/dev/null || echo 3.10)
  LILY_RABBIT_EPMD_PORT=$(cat "$dir/epmd_port" 2>/dev/null || echo $(($(cat "$dir/port") + 2))) \
    node_env "$dir" "$(cat "$dir/port")"
}

stop() {
  local dir=$1
  [ -f "$dir/port" ] || return 0
  known_env "$dir"
  run rabbitmqctl -q stop >/dev/null 2>&1 || true
  local pid
  for f in server.pid rabbit.pid; do
    pid=$(cat "$dir/$f" 2>/dev/null || true)
    [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
  done
  # the node's own epmd, started on its private port
  kill_epmd "$ERL_EPMD_PORT"
  rm -f "$dir/port"
}

ctl() {
  local dir=$1
  shift
  known_env "$dir"
  run rabbitmqctl "$@"
}

version() {
  local dir=$1
  known_env "$dir"
  run rabbitmqctl -q version
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
  # retry behind 32 such copies for that long (see the guide, "Running on a cluster").
  export LILY_RABBIT_ADVANCED="[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 5000}]}]."
  local i pids=()
  for i in 1 2 3; do
    start "$dir/n$i" $((port + (i - 1) * 10)) &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i"; done
  local first="lily$port@localhost"
  local tries
  for i in 2 3; do
    ctl "$dir/n$i" -q stop_app
    ctl "$dir/n$i" -q join_cluster "$first"
    # On a loaded machine a 4.0 node that just joined can fail its first start: its
    # deprecated-feature check reads Mnesia before the tables are there.
    tries=1
    until ctl "$dir/n$i" -q start_app; do
      [ "$tries" -lt 3 ] || return 1
      tries=$((tries + 1))
      echo "lily: n$i did not start after joining the cluster; again in 2 s" >&2
      sleep 2
    done
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
  version) version "$@" ;;
  run) run "$@" ;;
  *) sed -n '2,37p' "$0" >&2; exit 2 ;;
esac
