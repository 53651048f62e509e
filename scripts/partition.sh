#!/usr/bin/env bash
# Test hosts in network namespaces, for partitioning a RabbitMQ cluster, a MongoDB replica set
# and Lily on purpose.
#
#   scripts/partition.sh install         install nftables, the broker and mongod when missing
#   scripts/partition.sh up DIR          make the hosts and start a three-node cluster and a
#                                        three-member replica set on them
#   scripts/partition.sh down DIR        stop everything `up DIR` started and remove the hosts
#                                        (safe to run twice, and after a failed `up`)
#   scripts/partition.sh exec DIR HOST CMD...
#                                        run CMD on HOST (n1, n2, n3, m0, m1, m2 or lily): in
#                                        its network namespace, under its hostname
#   scripts/partition.sh ctl DIR NODE ARGS...
#                                        rabbitmqctl against NODE (n1, n2 or n3)
#   scripts/partition.sh cut DIR A B     drop every packet between hosts A and B, both ways
#   scripts/partition.sh loss DIR A B PCT
#                                        drop PCT % of the packets between A and B, at random
#   scripts/partition.sh isolate DIR A   cut A from every other host
#   scripts/partition.sh heal DIR        remove every cut and every loss
#   scripts/partition.sh restart DIR NODE
#                                        kill -9 NODE's VM and start it again with its data
#   scripts/partition.sh show DIR        the rules in force
#   scripts/partition.sh long DIR [TEST] the long runs: `up` with the default timers, the
#                                        partition tests (those whose name holds TEST, when
#                                        given) once per seed in LILY_PARTITION_SEEDS ("1 2 3"
#                                        unless set), each partition held 150 s, `down`
#
# Hosts: n1, n2, n3 (RabbitMQ nodes rabbit@n1 .. rabbit@n3, AMQP on port 5672 of 10.77.0.11 ..
# 10.77.0.13 and AMQPS on 5671, each node with a certificate of its own for its name and
# address, signed by a CA made for the hosts, DIR/ca.pem), m0, m1, m2 (the members of MongoDB
# replica set "lily", on port 27017 of 10.77.0.20 .. 10.77.0.22, data in DIR/m0 .. DIR/m2) and
# lily (10.77.0.100), where a test runs the process under test. Each host is a network namespace
# with its own hostname (a UTS namespace per command), its own epmd and its own /etc/hosts
# naming them all. They are joined through veth pairs to a bridge that lives in a namespace of
# its own, so the host machine sees none of the addresses and nothing is routed off it:
# the namespaces have no route but their /24. Cuts and losses are nftables rules on that bridge
# (family bridge, forward hook), so a cut is silent, as a pulled cable is: no reset, no ICMP.
#
# This is a cluster set-up of its own, not the loopback one of `scripts/rabbitmq.sh`: names are
# hostnames, every node listens on its own address on the standard ports, and the cluster runs
# `cluster_partition_handling = pause_minority` (on 3.10 and 4.0; RabbitMQ 4.3 removes the
# strategies, so a 4.3 cluster keeps serving quorum queues on the majority side only, which is
# what pause_minority gives them here too). Timers are lowered for the short runs and say so:
# `net_ticktime` LILY_PARTITION_TICKTIME (10 s unless set; RabbitMQ's default is 60) and the
# broker's AMQP heartbeat LILY_PARTITION_HEARTBEAT (5 s unless set; default 60). Set both to 60
# for a long run with the defaults. The replica set's `electionTimeoutMillis` is
# LILY_PARTITION_ELECTION_MS (1 000 unless set; mongod's default is 10 000) and its
# `transactionLifetimeLimitSeconds` LILY_PARTITION_TXN_LIFETIME_S (10 unless set; default 60):
# a transaction left open on a member cut from Lily holds its documents that long.
#
# Needs root (ip netns, veth, nft), iproute2, nftables (installed from Debian's packages when
# missing), the broker of `scripts/rabbitmq.sh install` and the mongod of
# `scripts/mongod.sh install`. LILY_RABBIT_VERSION picks the broker as it does there: 3.10 unless
# set, or 4.0 (each node chrooted into the 4.0 root, inside its host's namespace); `up` records
# it in DIR/version and the other commands follow it. The names of the namespaces are derived
# from DIR (lp<hash>-n1 ...), so runs in different directories never collide.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# The nodes' environment sets HOME (their cookie lives there); cargo and rustup need the user's.
USER_HOME=$HOME
SUBNET=10.77.0
HOSTS=(n1 n2 n3 m0 m1 m2 lily)
NODES=(n1 n2 n3)
MEMBERS=(m0 m1 m2)
TICKTIME=${LILY_PARTITION_TICKTIME:-10}
HEARTBEAT=${LILY_PARTITION_HEARTBEAT:-5}
ELECTION=${LILY_PARTITION_ELECTION_MS:-1000}
TXN_LIFETIME=${LILY_PARTITION_TXN_LIFETIME_S:-10}

address() {
  case "$1" in
    n1) echo "$SUBNET.11" ;;
    n2) echo "$SUBNET.12" ;;
    n3) echo "$SUBNET.13" ;;
    m0) echo "$SUBNET.20" ;;
    m1) echo "$SUBNET.21" ;;
    m2) echo "$SUBNET.22" ;;
    lily) echo "$SUBNET.100" ;;
    *) echo "lily: no host '$1' (n1, n2, n3, m0, m1, m2, lily)" >&2; return 2 ;;
  esac
}

# The namespaces' prefix for DIR: short (interface names hold 15 bytes) and DIR's own.
prefix() {
  echo "lp$(printf '%s' "$1" | sha1sum | cut -c1-6)"
}

# Installs what the hosts need (nftables, the broker, mongod) when missing: run it before starting
# anything else that installs packages (apt takes one installer at a time).
need() {
  [ "$(id -u)" -eq 0 ] || { echo "lily: partition hosts need root (ip netns, nft)" >&2; return 1; }
  command -v ip >/dev/null || { echo "lily: iproute2's ip is missing" >&2; return 1; }
  if ! command -v nft >/dev/null; then
    echo "lily: installing nftables from Debian packages" >&2
    env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nftables >&2
  fi
  "$ROOT/scripts/rabbitmq.sh" install
  "$ROOT/scripts/mongod.sh" install
}

# Runs CMD in HOST's namespace under its hostname, with its /etc/hosts (ip netns exec binds
# /etc/netns/NS/hosts over /etc/hosts).
on() {
  local dir=$1 host=$2
  shift 2
  ip netns exec "$(prefix "$dir")-$host" unshare --uts -- /bin/sh -c 'hostname "$0"; exec "$@"' "$host" "$@"
}

# The broker version of the hosts in DIR (`up` records it). Inside a host's namespace /etc/hosts
# is the host's own (ip netns exec binds it), which a 4.0 node's root is given too.
version_of() {
  cat "$1/version" 2>/dev/null || echo 3.10
}

# The bridge's namespace runs nft.
bridge_nft() {
  ip netns exec "$(prefix "$1")-br" nft "${@:2}"
}

make_hosts() {
  local dir=$1 p host ns
  p=$(prefix "$dir")
  echo "$p" >"$dir/prefix"
  ip netns add "$p-br"
  ip -n "$p-br" link add br0 type bridge
  ip -n "$p-br" link set br0 up
  ip -n "$p-br" link set lo up
  for host in "${HOSTS[@]}"; do
    ns="$p-$host"
    ip netns add "$ns"
    mkdir -p "/etc/netns/$ns"
    {
      echo "127.0.0.1 localhost"
      for h in "${HOSTS[@]}"; do echo "$(address "$h") $h"; done
    } >"/etc/netns/$ns/hosts"
    ip link add "$p-$host" netns "$p-br" type veth peer name eth0 netns "$ns"
    ip -n "$p-br" link set "$p-$host" master br0 up
    ip -n "$ns" addr add "$(address "$host")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    echo "$ns" >>"$dir/namespaces"
  done
  bridge_nft "$dir" add table bridge lily
  bridge_nft "$dir" add chain bridge lily forward '{ type filter hook forward priority 0; policy accept; }'
}

# One node's environment: data in DIR/NODE, named rabbit@NODE, on its own address.
node_env() {
  local dir=$1 node=$2
  export HOME="$dir/$node"
  export RABBITMQ_NODENAME="rabbit@$node"
  export RABBITMQ_MNESIA_BASE="$dir/$node/mnesia" RABBITMQ_LOG_BASE="$dir/$node/log"
  export RABBITMQ_PID_FILE="$dir/$node/rabbit.pid"
  export RABBITMQ_ENABLED_PLUGINS_FILE="$dir/$node/enabled_plugins"
  export RABBITMQ_CONFIG_FILE="$dir/$node/rabbitmq.conf"
  export RABBITMQ_ADVANCED_CONFIG_FILE="$dir/$node/advanced.config"
}

# A CA of the hosts' own (DIR/ca.pem) and for each node a certificate of its own name and
# address, in DIR/NODE/tls: a client that moves from node to node checks each one's.
certificates() {
  local dir=$1 node tls
  command -v openssl >/dev/null || { echo "lily: openssl is missing (scripts/tls.sh installs it)" >&2; return 1; }
  mkdir -p "$dir/ca"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=lily-partition-ca" \
    -keyout "$dir/ca/ca.key" -out "$dir/ca.pem" 2>/dev/null
  for node in "${NODES[@]}"; do
    tls="$dir/$node/tls"
    mkdir -p "$tls"
    openssl req -newkey rsa:2048 -nodes -subj "/CN=$node" -keyout "$tls/key.pem" -out "$tls/req.csr" 2>/dev/null
    printf 'subjectAltName=DNS:%s,IP:%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
      "$node" "$(address "$node")" >"$tls/ext"
    openssl x509 -req -in "$tls/req.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca/ca.key" -CAcreateserial \
      -days 2 -extfile "$tls/ext" -out "$tls/cert.pem" 2>/dev/null
    cp "$dir/ca.pem" "$tls/ca.pem"
    rm -f "$tls/req.csr" "$tls/ext"
    chmod 600 "$tls/key.pem"
  done
}

start_node() {
  local dir=$1 node=$2 cookie=$3
  mkdir -p "$dir/$node/mnesia" "$dir/$node/log"
  node_env "$dir" "$node"
  echo "[]." >"$RABBITMQ_ENABLED_PLUGINS_FILE"
  cat >"$RABBITMQ_CONFIG_FILE" <<CONF
listeners.tcp.default = $(address "$node"):5672
loopback_users = none
log.console = false
log.file.level = warning
disk_free_limit.absolute = 50MB
cluster_partition_handling = pause_minority
heartbeat = $HEARTBEAT
listeners.ssl.default = $(address "$node"):5671
ssl_options.cacertfile = $HOME/tls/ca.pem
ssl_options.certfile = $HOME/tls/cert.pem
ssl_options.keyfile = $HOME/tls/key.pem
ssl_options.verify = verify_none
ssl_options.fail_if_no_peer_cert = false
CONF
  echo "[{kernel, [{net_ticktime, $TICKTIME}]}, {rabbit, [{dead_letter_worker_publisher_confirm_timeout, 5000}]}]." \
    >"$RABBITMQ_ADVANCED_CONFIG_FILE"
  rm -f "$HOME/.erlang.cookie"
  printf '%s' "$cookie" >"$HOME/.erlang.cookie"
  chmod 400 "$HOME/.erlang.cookie"
  on "$dir" "$node" env ERL_EPMD_ADDRESS="$(address "$node")" LILY_RABBIT_VERSION="$(version_of "$dir")" \
    LILY_RABBIT_HOSTS=/etc/hosts "$ROOT/scripts/rabbitmq.sh" run rabbitmq-server \
    >"$dir/$node/log/stdout.log" 2>&1 &
  echo $! >"$dir/$node/server.pid"
}

# The replica set "lily" on m0 .. m2, each member bound to its host's address; initiated and
# awaited from the host lily, as a client there sees it.
start_members() {
  local dir=$1 member members=() pids=()
  for member in "${MEMBERS[@]}"; do
    rm -rf "${dir:?}/$member"
    on "$dir" "$member" env LILY_MONGOD_BIND="$(address "$member")" \
      LILY_MONGOD_TXN_LIFETIME_S="$TXN_LIFETIME" "$ROOT/scripts/mongod.sh" launch "$dir/$member" 27017
    members+=("$(address "$member"):27017")
    pids+=("$(cat "$dir/$member/mongod.pid")")
  done
  local IFS=,
  on "$dir" lily env LILY_MONGOD_ELECTION_TIMEOUT_MS="$ELECTION" \
    "$ROOT/scripts/mongod.sh" await-set "${members[*]}" "${pids[*]}" 60
}

ctl() {
  local dir=$1 node=$2
  shift 2
  node_env "$dir" "$node"
  on "$dir" "$node" env LILY_RABBIT_VERSION="$(version_of "$dir")" LILY_RABBIT_HOSTS=/etc/hosts \
    "$ROOT/scripts/rabbitmq.sh" run rabbitmqctl -n "rabbit@$node" "$@"
}

await_node() {
  local dir=$1 node=$2 i
  for i in $(seq 1 120); do
    if ctl "$dir" "$node" -q await_startup >/dev/null 2>&1; then return 0; fi
    if ! kill -0 "$(cat "$dir/$node/server.pid")" 2>/dev/null; then
      echo "lily: rabbit@$node exited; see $dir/$node/log" >&2
      tail -n 30 "$dir/$node/log/stdout.log" >&2 || true
      return 1
    fi
    sleep 1
  done
  echo "lily: rabbit@$node did not start within 120 s; see $dir/$node/log" >&2
  return 1
}

up() {
  local dir cookie node
  dir=$(mkdir -p "$1" && cd "$1" && pwd)
  need
  down "$dir" 2>/dev/null || true
  rm -rf "${dir:?}/n1" "${dir:?}/n2" "${dir:?}/n3"
  # A failed set-up leaves nothing behind.
  # shellcheck disable=SC2064
  trap "down '$dir'" ERR
  make_hosts "$dir"
  echo "${LILY_RABBIT_VERSION:-3.10}" >"$dir/version"
  certificates "$dir"
  cookie="lily-partition-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
  for node in "${NODES[@]}"; do start_node "$dir" "$node" "$cookie"; done
  for node in "${NODES[@]}"; do await_node "$dir" "$node"; done
  for node in n2 n3; do
    ctl "$dir" "$node" -q stop_app
    ctl "$dir" "$node" -q join_cluster rabbit@n1
    ctl "$dir" "$node" -q start_app
  done
  ctl "$dir" n1 -q await_online_nodes 3
  start_members "$dir"
  echo "$HEARTBEAT" >"$dir/heartbeat"
  echo "$TICKTIME" >"$dir/ticktime"
  echo "$ELECTION" >"$dir/election_ms"
  trap - ERR
  echo "lily: three-node RabbitMQ $(version_of "$dir") cluster rabbit@n1..n3 on $SUBNET.11-13:5672 (net_ticktime ${TICKTIME} s, heartbeat ${HEARTBEAT} s) and replica set lily on $SUBNET.20-22:27017 (electionTimeoutMillis $ELECTION) in namespaces $(prefix "$dir")-* (data $dir)" >&2
}

down() {
  local dir=$1 p node pid ns
  p=$(prefix "$dir")
  for node in "${NODES[@]}" "${MEMBERS[@]}"; do
    for f in rabbit.pid server.pid mongod.pid; do
      pid=$(cat "$dir/$node/$f" 2>/dev/null || true)
      [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true
    done
  done
  # Whatever still runs in the namespaces (epmd, a test's process) ends with them.
  for ns in $(ip netns list | awk '{print $1}' | grep "^$p-" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  rm -f "$dir/namespaces"
}

# kill -9 of NODE's VM, then a start with its data and the cluster's cookie: what an operator
# does to a node that stays paused after a partition heals.
restart() {
  local dir=$1 node=$2 pid f cookie
  for f in rabbit.pid server.pid; do
    pid=$(cat "$dir/$node/$f" 2>/dev/null || true)
    [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true
  done
  cookie=$(cat "$dir/$node/.erlang.cookie")
  # The timers `up` started the cluster with: a node whose net_ticktime differs from its peers'
  # is refused by them.
  TICKTIME=$(cat "$dir/ticktime") HEARTBEAT=$(cat "$dir/heartbeat") start_node "$dir" "$node" "$cookie"
  await_node "$dir" "$node"
}

# The rule's match for packets between A and B, both ways.
between() {
  local a b
  a=$(address "$1") b=$(address "$2")
  echo "ip saddr { $a, $b } ip daddr { $a, $b }"
}

cut_between() {
  local dir=$1 a=$2 b=$3
  # shellcheck disable=SC2046
  bridge_nft "$dir" add rule bridge lily forward $(between "$a" "$b") drop comment "\"cut $a $b\""
}

loss() {
  local dir=$1 a=$2 b=$3 pct=$4
  # shellcheck disable=SC2046
  bridge_nft "$dir" add rule bridge lily forward $(between "$a" "$b") numgen random mod 100 '<' "$pct" drop \
    comment "\"loss $a $b $pct%\""
}

isolate() {
  local dir=$1 a=$2 h
  for h in "${HOSTS[@]}"; do
    [ "$h" = "$a" ] || cut_between "$dir" "$a" "$h"
  done
}

heal() {
  bridge_nft "$1" flush chain bridge lily forward
}

show() {
  bridge_nft "$1" list chain bridge lily forward
}

# The long runs: the cluster with RabbitMQ's default timers (net_ticktime and heartbeat 60 s)
# and the replica set with mongod's (electionTimeoutMillis 10 s, transactions' lifetime 60 s),
# each partition held 150 s (a silent link takes up to 120 s to notice), one run of the
# partition test per seed; the hosts are removed at the end, also on failure.
long() {
  local dir seed filter=${2:-}
  dir=$(mkdir -p "$1" && cd "$1" && pwd)
  # shellcheck disable=SC2064
  trap "down '$dir'" EXIT
  TICKTIME=60 HEARTBEAT=60 ELECTION=10000 TXN_LIFETIME=60 up "$dir"
  for seed in ${LILY_PARTITION_SEEDS:-1 2 3}; do
    echo "lily: long partition run, seed $seed" >&2
    (cd "$ROOT" && HOME="$USER_HOME" LILY_PARTITION_DIR="$dir" LILY_PARTITION_SEED="$seed" LILY_PARTITION_HOLD_S=150 \
      cargo test -p lily-mq-e2e --test partition -- --ignored --nocapture "$filter")
  done
}

cmd=${1:-}
shift || true
case "$cmd" in
  install) need ;;
  up) up "$@" ;;
  long) long "$@" ;;
  down) down "$(cd "$1" 2>/dev/null && pwd || echo "$1")" ;;
  exec) dir=$(cd "$1" && pwd); host=$2; shift 2; on "$dir" "$host" "$@" ;;
  ctl) dir=$(cd "$1" && pwd); shift; ctl "$dir" "$@" ;;
  cut) cut_between "$(cd "$1" && pwd)" "$2" "$3" ;;
  loss) loss "$(cd "$1" && pwd)" "$2" "$3" "$4" ;;
  isolate) isolate "$(cd "$1" && pwd)" "$2" ;;
  heal) heal "$(cd "$1" && pwd)" ;;
  restart) restart "$(cd "$1" && pwd)" "$2" ;;
  show) show "$(cd "$1" && pwd)" ;;
  *) sed -n '2,56p' "$0" >&2; exit 2 ;;
esac
