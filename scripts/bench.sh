#!/usr/bin/env bash
# Lily's benchmarks against a private RabbitMQ node on loopback (not part of the test suite):
#
#   scripts/bench.sh [throughput|cost|cluster|all] [ARGS...]
#
# `cluster` also starts a private three-node cluster and compares it with the single node.
#
# Results go to target/bench/ (JSON, a table and an SVG chart). Absolute figures on a shared
# machine are noise: read the ratios, measured side by side in one run.
set -euo pipefail
cd "$(dirname "$0")/.."

what=${1:-all}
shift || true
PORT=${LILY_BENCH_PORT:-25692}
DIR="$PWD/target/lily-rabbit-bench"
scripts/rabbitmq.sh stop "$DIR" || true
rm -rf "$DIR"
scripts/rabbitmq.sh start "$DIR" "$PORT"
CLUSTER_DIR="$PWD/target/lily-rabbit-cluster-bench"
CLUSTER_PORT=${LILY_BENCH_CLUSTER_PORT:-26772}
trap 'scripts/rabbitmq.sh cluster-stop "$CLUSTER_DIR" || true; scripts/rabbitmq.sh stop "$DIR"' EXIT
export LILY_AMQP_URL="amqp://guest:guest@127.0.0.1:$PORT/%2f"
export LILY_RABBIT_DIR="$DIR"
mkdir -p target/bench

cargo build --release -p lily-mq-bench --bins -p lily-mq-example-k8s-shutdown
case "$what" in
  throughput) target/release/throughput "$@" ;;
  cost) target/release/cost "$@" ;;
  cluster)
    scripts/rabbitmq.sh cluster-stop "$CLUSTER_DIR" || true
    rm -rf "$CLUSTER_DIR"
    scripts/rabbitmq.sh cluster-start "$CLUSTER_DIR" "$CLUSTER_PORT"
    LILY_CLUSTER_URL="amqp://guest:guest@127.0.0.1:$CLUSTER_PORT/%2f" target/release/cluster "$@" ;;
  all) target/release/throughput "$@"; target/release/cost ;;
  *) sed -n '2,10p' "$0" >&2; exit 2 ;;
esac
