#!/usr/bin/env bash
# Lily's benchmarks against a private RabbitMQ node on loopback (not part of the test suite):
#
#   scripts/bench.sh [throughput|latency|storm|mongo|cost|cluster|all] [ARGS...]
#
# `mongo` also starts a private MongoDB replica set; `cluster` a private three-node cluster,
# compared with the single node. `all` runs throughput, latency, storm, mongo and cost,
# passing ARGS (such as --quick) to each; `scripts/bench.sh all --quick` takes about 15 minutes.
#
# Each is a subcommand of one program, `lily-bench` (`target/release/lily-bench --help`; `cost`
# runs in `lily-bench-counting`, the same program counting its heap allocations).
# Results go to target/bench/ (JSON and a markdown report, also printed, and an SVG chart for
# throughput, latency, storm and mongo); bench/README.md says how each program measures. Absolute figures on a shared machine are noise: read the ratios,
# measured side by side in one run.
set -euo pipefail
cd "$(dirname "$0")/.."

what=${1:-all}
shift || true
PORT=${LILY_BENCH_PORT:-25692}
# LILY_BENCH_DATA: where the private servers keep their data (two checkouts running benchmarks at
# once need their own, besides their own ports).
DATA=${LILY_BENCH_DATA:-$PWD/target}
DIR="$DATA/lily-rabbit-bench"
scripts/rabbitmq.sh stop "$DIR" || true
rm -rf "$DIR"
scripts/rabbitmq.sh start "$DIR" "$PORT"
CLUSTER_DIR="$DATA/lily-rabbit-cluster-bench"
CLUSTER_PORT=${LILY_BENCH_CLUSTER_PORT:-26772}
MONGO_DIR="$DATA/lily-mongod-bench"
MONGO_PORT=${LILY_BENCH_MONGO_PORT:-27537}
trap 'scripts/mongod.sh stop "$MONGO_DIR" || true; scripts/rabbitmq.sh cluster-stop "$CLUSTER_DIR" || true; scripts/rabbitmq.sh stop "$DIR"' EXIT
# LILY_BENCH_HOLDING_POLICY=1: on RabbitMQ before 4.0, the node gets the policies the guide gives
# users there (docs/src/delivery.md, "Holding queues on RabbitMQ before 4.0"): the holding
# queues version 2 and lazy, every other queue version 2. Without it, RabbitMQ's defaults.
if [ -n "${LILY_BENCH_HOLDING_POLICY:-}" ] && [[ "$(scripts/rabbitmq.sh version "$DIR")" == 3.* ]]; then
  scripts/rabbitmq.sh ctl "$DIR" set_policy --apply-to queues lily-queue-version '.*' \
    '{"queue-version":2}' >/dev/null
  scripts/rabbitmq.sh ctl "$DIR" set_policy --apply-to queues --priority 1 lily-holding-queues \
    '\.(retry\..+|dlq|parking)$' '{"queue-version":2,"queue-mode":"lazy"}' >/dev/null
  echo "lily: holding queues version 2 and lazy, every other queue version 2 (by policy)"
fi
export LILY_AMQP_URL="amqp://guest:guest@127.0.0.1:$PORT/%2f"
export LILY_RABBIT_DIR="$DIR"
mkdir -p target/bench

mongo() {
  scripts/mongod.sh install
  scripts/mongod.sh stop "$MONGO_DIR" || true
  rm -rf "$MONGO_DIR"
  scripts/mongod.sh start "$MONGO_DIR" "$MONGO_PORT"
  LILY_MONGO_URL="mongodb://127.0.0.1:$MONGO_PORT/?replicaSet=lily&directConnection=true" \
    LILY_MONGO_DIR="$MONGO_DIR" target/release/lily-bench mongo "$@"
  scripts/mongod.sh stop "$MONGO_DIR"
}

cargo build --release -p lily-mq-bench --bins -p lily-mq-example-k8s-shutdown
case "$what" in
  throughput | latency | storm | cost) target/release/lily-bench "$what" "$@" ;;
  mongo) mongo "$@" ;;
  cluster)
    scripts/rabbitmq.sh cluster-stop "$CLUSTER_DIR" || true
    rm -rf "$CLUSTER_DIR"
    scripts/rabbitmq.sh cluster-start "$CLUSTER_DIR" "$CLUSTER_PORT"
    LILY_CLUSTER_URL="amqp://guest:guest@127.0.0.1:$CLUSTER_PORT/%2f" target/release/lily-bench cluster "$@" ;;
  all)
    started=$SECONDS
    for program in throughput latency storm; do
      target/release/lily-bench "$program" "$@"
    done
    mongo "$@"
    target/release/lily-bench cost "$@"
    echo "lily: all benchmarks in $((SECONDS - started)) s" ;;
  *) sed -n '2,15p' "$0" >&2; exit 2 ;;
esac
