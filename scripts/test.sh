#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what is missing (rustfmt, clippy,
# rabbitmq-server 3.10 and 4.0, mongod), runs fmt, clippy and the docs, then every test against
# RabbitMQ 3.10 and every test that talks to a broker against RabbitMQ 4.0, the two side by side.
# Each version gets its own private servers on loopback: a node, a three-node cluster, a
# single-member MongoDB replica set and a three-member one (the failover tests and the soak
# kill and step down its primary), all stopped at the end; and, for the partition tests, a
# three-node 3.10 cluster, a three-member MongoDB replica set and the test's process on hosts in
# network namespaces of their own (scripts/partition.sh, root). It also packages the
# crates meant for the registry and builds and runs an application outside the workspace
# against those packages (outside/, tests/outside.rs). Last, the CPU regression gate
# (scripts/regress.sh) and a short fuzzing run of each target.
#
#   LILY_TEST_VERSIONS="3.10"   run against one version only (a quicker loop; CI runs both)
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo >/dev/null || { echo "lily: cargo not found; install Rust with rustup" >&2; exit 1; }
# Each phase's start, in minutes since the run began: where a slow run spent its time.
phase() { printf 'lily: [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }
if command -v rustup >/dev/null; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi

# One build from scratch, so no incremental state: it would add about 3 GB to the 6 GB the
# build takes (measured on a clean clone, 2026-12-06); with the fuzzing build and the servers'
# data the whole run needs about 12 GB. A run that fills the disk dies in the linker: say so first.
export CARGO_INCREMENTAL=0
mkdir -p target
free_kb=$(df -Pk target | awk 'NR == 2 { print $4 }')
if [ "${free_kb:-0}" -lt $((12 * 1024 * 1024)) ]; then
  echo "lily: only $((free_kb / 1024 / 1024)) GB free under target/; the suite needs about 12 GB (a clean build and the servers' data)" >&2
fi

VERSIONS=${LILY_TEST_VERSIONS:-3.10 4.0}
BASE=${LILY_TEST_PORT:-25672}
CLUSTER_BASE=${LILY_TEST_CLUSTER_PORT:-26672}
MONGO_BASE=${LILY_TEST_MONGO_PORT:-27517}
TLS_DIR="$PWD/target/lily-tls-test"
# Authentication is on: the tests connect as an administrator whose password is new on each
# run, and the security tests make users with less.
MONGO_ADMIN="lily-admin:$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"

# The servers of one version: the first version on the base ports, the next 100 above.
offset() { case "$1" in 3.10) echo 0 ;; 4.0) echo 100 ;; *) echo "lily: no such version $1" >&2; return 1 ;; esac; }
dir_of() { echo "$PWD/target/lily-test-$1"; }

# Exports what the tests read to find the servers of version $1.
use_servers() {
  local d port cluster mongo set
  d=$(dir_of "$1")
  port=$((BASE + $(offset "$1")))
  cluster=$((CLUSTER_BASE + $(offset "$1")))
  mongo=$((MONGO_BASE + $(offset "$1")))
  set=$((mongo + 10))
  export LILY_AMQP_URL="amqp://guest:guest@127.0.0.1:$port/%2f"
  export LILY_AMQPS_URL="amqps://guest:guest@127.0.0.1:$((port + 3))/%2f"
  export LILY_RABBIT_DIR="$d/rabbit"
  export LILY_TLS_DIR="$TLS_DIR"
  export LILY_CLUSTER_DIR="$d/cluster"
  export LILY_CLUSTER_PORT="$cluster"
  export LILY_MONGOD_DIR="$d/mongod"
  export LILY_MONGO_URL="mongodb://$MONGO_ADMIN@127.0.0.1:$mongo/?replicaSet=lily&directConnection=true&authSource=admin"
  # The three-member set, reached as a replica set (no directConnection): clients follow
  # its elections.
  export LILY_MONGOD_SET_DIR="$d/mongod-set"
  export LILY_MONGO_SET_URL="mongodb://$MONGO_ADMIN@127.0.0.1:$set,127.0.0.1:$((set + 1)),127.0.0.1:$((set + 2))/?replicaSet=lily&authSource=admin"
  # Mutual TLS: the client presents the certificate scripts/tls.sh signed.
  export LILY_MONGO_TLS_URL="$LILY_MONGO_URL&tls=true&tlsCAFile=$TLS_DIR/ca.pem&tlsCertificateKeyFile=$TLS_DIR/client-combined.pem"
}

stop_servers() {
  local d
  d=$(dir_of "$1")
  scripts/mongod.sh stop "$d/mongod" || true
  scripts/mongod.sh stop-set "$d/mongod-set" || true
  scripts/rabbitmq.sh cluster-stop "$d/cluster" || true
  scripts/rabbitmq.sh stop "$d/rabbit" || true
}

# Starts the servers of version $1; the RabbitMQ nodes in parallel with each other.
start_servers() (
  local version=$1 d port
  d=$(dir_of "$version")
  port=$((BASE + $(offset "$version")))
  export LILY_RABBIT_VERSION=$version
  scripts/rabbitmq.sh install
  # The node also listens with TLS (on PORT+3).
  LILY_RABBIT_TLS_DIR="$TLS_DIR" scripts/rabbitmq.sh start "$d/rabbit" "$port" &
  local node=$!
  scripts/rabbitmq.sh cluster-start "$d/cluster" $((CLUSTER_BASE + $(offset "$version")))
  wait "$node"
)

# The partition tests' hosts: a three-node RabbitMQ 3.10 cluster, a three-member replica set and
# the test's process in network namespaces of their own (scripts/partition.sh; root).
PARTITION_DIR="$PWD/target/lily-test-partition"
BUILDS=""
trap 'for v in $VERSIONS; do stop_servers "$v"; done; scripts/partition.sh down "$PARTITION_DIR" || true; [ -z "$BUILDS" ] || kill "$BUILDS" 2>/dev/null || true' EXIT
for v in $VERSIONS; do
  stop_servers "$v"
  rm -rf "$(dir_of "$v")"
  mkdir -p "$(dir_of "$v")"
done
rm -rf "$TLS_DIR"
# nftables, the 3.10 broker and mongod for the partition hosts, before the servers below start
# (apt takes one installer at a time).
phase "installing and starting the servers"
scripts/partition.sh install
# A throwaway local CA for the brokers' and mongod's TLS listeners.
scripts/tls.sh "$TLS_DIR"
declare -A STARTING
for v in $VERSIONS; do
  start_servers "$v" >"target/lily-test-start-$v.log" 2>&1 &
  STARTING[$v]=$!
done

scripts/partition.sh down "$PARTITION_DIR" 2>/dev/null || true
rm -rf "$PARTITION_DIR"
scripts/partition.sh up "$PARTITION_DIR" >target/lily-test-partition.log 2>&1 &
PARTITION_HOSTS=$!

scripts/mongod.sh install
# Abandoned transactions (a worker killed mid-transaction) are aborted after 10 s instead of
# 60 s, so the crash tests' redeliveries stop deferring sooner. The three-member sets elect a
# new primary after 1 s without one instead of 10 s (electionTimeoutMillis), so a failover
# takes about 2 s; the guide gives the figures at the default too.
export LILY_MONGOD_AUTH="$MONGO_ADMIN" LILY_MONGOD_TLS_DIR="$TLS_DIR" LILY_MONGOD_TXN_LIFETIME_S=10
declare -A SETS
for v in $VERSIONS; do
  LILY_MONGOD_ELECTION_TIMEOUT_MS=1000 scripts/mongod.sh start-set "$(dir_of "$v")/mongod-set" \
    $((MONGO_BASE + 10 + $(offset "$v"))) >"target/lily-test-mongod-set-$v.log" 2>&1 &
  SETS[$v]=$!
  scripts/mongod.sh start "$(dir_of "$v")/mongod" $((MONGO_BASE + $(offset "$v")))
done
for v in $VERSIONS; do
  if ! wait "${SETS[$v]}"; then
    echo "lily: the three-member MongoDB replica set for RabbitMQ $v did not start:" >&2
    cat "target/lily-test-mongod-set-$v.log" >&2
    exit 1
  fi
done
unset LILY_MONGOD_AUTH LILY_MONGOD_TLS_DIR LILY_MONGOD_TXN_LIFETIME_S

phase "fmt, clippy, docs and the book"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The transport alone, without the features the workspace turns on (otel, testing, health).
cargo clippy -p lily-mq-rabbit --lib -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features --quiet
# The guide (docs/, an mdBook). Its code samples are a workspace member, docs/samples, built
# by clippy above and tested with the rest.
scripts/book.sh
phase "the facade's features, the packages and the test build"
# The facade builds with no feature, each feature alone, and all of them.
for feature in "" health mongo testing otel logging "health mongo testing otel logging"; do
  cargo check -p lily-mq --quiet --no-default-features --features "$feature"
done
# The crates meant for the registry, packaged and verified: each builds from its .crate, the
# others it needs coming from cargo's temporary registry. Then an application outside the
# workspace is built against those packages (tests/outside.rs runs it against the broker).
# Cargo unpacks the packages of its temporary registry under CARGO_HOME and reuses what it
# unpacked for the same version: a copy left by an earlier run would be verified in place of
# today's sources. It also takes what it built from a registry as fresh for as long as the
# version is the same, so an earlier run's build of these packages (in target/debug, where the
# verification builds) would be linked instead of today's: their fingerprints go too (the
# workspace's own builds of the five crates among them, rebuilt by the next step).
rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/lily-mq-*-0.1.0
find target/debug/.fingerprint -maxdepth 1 -regextype posix-extended \
  -regex '.*/lily-mq-(core-|rabbit-|mongo-|cli-)?[0-9a-f]{16}' -exec rm -rf {} + 2>/dev/null || true
cargo package --quiet -p lily-mq-core -p lily-mq-rabbit -p lily-mq-mongo -p lily-mq -p lily-mq-cli
cargo test --workspace --no-run --quiet
CARGO_TARGET_DIR="$PWD/target" cargo build --quiet --locked --manifest-path outside/Cargo.toml
for v in $VERSIONS; do
  if ! wait "${STARTING[$v]}"; then
    echo "lily: the RabbitMQ $v servers did not start:" >&2
    cat "target/lily-test-start-$v.log" >&2
    exit 1
  fi
  grep '^lily: ' "target/lily-test-start-$v.log" >&2 || true
done

phase "the tests on RabbitMQ ${VERSIONS// / and }"
# The first version runs everything; each other version, side by side with it, runs every
# integration test (the broker-facing ones; the unit tests and doctests need no broker).
first=${VERSIONS%% *}
declare -A RUNNING
for v in $VERSIONS; do
  [ "$v" = "$first" ] && continue
  (use_servers "$v" && exec cargo test --workspace --test '*') >"target/lily-test-$v.log" 2>&1 &
  RUNNING[$v]=$!
done
status=0
(use_servers "$first" && cargo test --workspace) || status=$?
for v in "${!RUNNING[@]}"; do
  if wait "${RUNNING[$v]}"; then
    echo "lily: RabbitMQ $v: $(grep -c '^test result: ok' "target/lily-test-$v.log") test binaries passed" >&2
  else
    echo "lily: the tests against RabbitMQ $v failed (target/lily-test-$v.log):" >&2
    { grep -q '^failures:' "target/lily-test-$v.log" && sed -n '/^failures:/,$p' "target/lily-test-$v.log"; } >&2 ||
      tail -n 60 "target/lily-test-$v.log" >&2
    status=1
  fi
done
[ "$status" -eq 0 ] || exit "$status"

phase "the partition tests"
# Meanwhile, on the cores the partition tests leave idle, the CPU regression gate builds, then
# cargo-afl, AFL++ and the fuzzing targets.
(nice -n 19 cargo build --profile gate --quiet --locked -p lily-mq-regress &&
  FUZZ_BUILD_ONLY=1 FUZZ_NICE=19 nice -n 19 scripts/fuzz.sh) >target/lily-test-builds.log 2>&1 &
BUILDS=$!
# Partitions (about 5 minutes, on RabbitMQ 3.10 and mongod 6.0 with lowered timers: net_ticktime
# 10 s, the broker's heartbeat 5 s, electionTimeoutMillis 1 s): the cluster, the replica set and
# Lily cut apart on purpose, every confirmed order checked by id. The long runs, with the
# default timers, are `scripts/partition.sh long DIR`.
if ! wait "$PARTITION_HOSTS"; then
  echo "lily: the partition hosts did not start:" >&2
  cat target/lily-test-partition.log >&2
  exit 1
fi
# Selected from the whole workspace, so that it links against the build above: `-p` would
# resolve other features and build its dependencies again.
LILY_PARTITION_DIR="$PARTITION_DIR" cargo test --workspace --test partition -- --ignored

# The CPU regression gate (about 20 s): Lily's instructions, CPU time and context switches a
# message over a hand-written lapin consumer, against regress/baseline.json.
phase "the CPU regression gate"
if ! wait "$BUILDS"; then
  echo "lily: the CPU regression gate or the fuzzing targets did not build:" >&2
  tail -n 60 target/lily-test-builds.log >&2
  exit 1
fi
BUILDS=""
scripts/regress.sh

# A short coverage-guided fuzzing run of each target (cargo-afl, installed when missing): the
# seed corpora replay as regression tests, then AFL++ explores; any crash fails the suite.
phase "fuzzing"
scripts/fuzz.sh "${LILY_FUZZ_SECONDS:-15}"
phase "done"
