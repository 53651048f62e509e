#!/usr/bin/env bash
# Runs the orders example end to end against a private RabbitMQ node.
#
#   scripts/demo.sh
#
# Starts a node on 127.0.0.1:25682 with its data under target/lily-rabbit-demo (installing
# rabbitmq-server from Debian packages when missing), runs `orders demo` against it, and stops
# the node on exit. The exit code is the demo's: 0 when every expected outcome was seen.
set -euo pipefail

cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
  echo "demo: cargo not found on PATH; install Rust with rustup (https://rustup.rs) and retry" >&2
  exit 1
fi

DATA_DIR="$PWD/target/lily-rabbit-demo"
PORT=25682

cleanup() {
  scripts/rabbitmq.sh stop "$DATA_DIR" || true
}
trap cleanup EXIT

# A node left running by an interrupted earlier run is stopped first (a no-op otherwise).
scripts/rabbitmq.sh stop "$DATA_DIR"
scripts/rabbitmq.sh start "$DATA_DIR" "$PORT"

export LILY_AMQP_URL="amqp://guest:guest@127.0.0.1:$PORT/%2f"
cargo run --release -p lily-mq-example-orders -- demo
