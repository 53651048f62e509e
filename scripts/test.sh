#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what is missing (rustfmt, clippy,
# rabbitmq-server, mongod), starts a private RabbitMQ node, a private three-node RabbitMQ
# cluster and a private MongoDB replica set on loopback, runs fmt, clippy, docs and all tests
# against them, and stops them.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo >/dev/null || { echo "lily: cargo not found; install Rust with rustup" >&2; exit 1; }
if command -v rustup >/dev/null; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi

PORT=${LILY_TEST_PORT:-25672}
DIR="$PWD/target/lily-rabbit-test"
TLS_DIR="$PWD/target/lily-tls-test"
scripts/rabbitmq.sh stop "$DIR" || true
rm -rf "$DIR" "$TLS_DIR"
# A throwaway local CA; both nodes also listen with TLS (RabbitMQ on PORT+3).
scripts/tls.sh "$TLS_DIR"
LILY_RABBIT_TLS_DIR="$TLS_DIR" scripts/rabbitmq.sh start "$DIR" "$PORT"
MONGO_PORT=${LILY_TEST_MONGO_PORT:-27517}
MONGO_DIR="$PWD/target/lily-mongod-test"
CLUSTER_PORT=${LILY_TEST_CLUSTER_PORT:-26672}
CLUSTER_DIR="$PWD/target/lily-rabbit-cluster-test"
trap 'scripts/mongod.sh stop "$MONGO_DIR" || true; scripts/rabbitmq.sh cluster-stop "$CLUSTER_DIR" || true; scripts/rabbitmq.sh stop "$DIR"' EXIT
# The cluster starts in the background while the checks below build and run.
scripts/rabbitmq.sh cluster-stop "$CLUSTER_DIR" || true
rm -rf "$CLUSTER_DIR"
scripts/rabbitmq.sh cluster-start "$CLUSTER_DIR" "$CLUSTER_PORT" &
CLUSTER_PID=$!
export LILY_AMQP_URL="amqp://guest:guest@127.0.0.1:$PORT/%2f"
export LILY_AMQPS_URL="amqps://guest:guest@127.0.0.1:$((PORT + 3))/%2f"
export LILY_RABBIT_DIR="$DIR"
export LILY_TLS_DIR="$TLS_DIR"

scripts/mongod.sh install
scripts/mongod.sh stop "$MONGO_DIR" || true
rm -rf "$MONGO_DIR"
# Authentication is on: the tests connect as an administrator whose password is new on each
# run, and the security tests make users with less. Abandoned transactions (a worker killed
# mid-transaction) are aborted after 10 s instead of 60 s, so the crash tests' redeliveries stop
# deferring sooner.
MONGO_ADMIN="lily-admin:$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
LILY_MONGOD_AUTH="$MONGO_ADMIN" LILY_MONGOD_TXN_LIFETIME_S=10 LILY_MONGOD_TLS_DIR="$TLS_DIR" \
  scripts/mongod.sh start "$MONGO_DIR" "$MONGO_PORT"
export LILY_MONGO_URL="mongodb://$MONGO_ADMIN@127.0.0.1:$MONGO_PORT/?replicaSet=lily&directConnection=true&authSource=admin"
# Mutual TLS: the client presents the certificate scripts/tls.sh signed.
export LILY_MONGO_TLS_URL="$LILY_MONGO_URL&tls=true&tlsCAFile=$TLS_DIR/ca.pem&tlsCertificateKeyFile=$TLS_DIR/client-combined.pem"
export LILY_MONGOD_DIR="$MONGO_DIR"
export LILY_CLUSTER_DIR="$CLUSTER_DIR"
export LILY_CLUSTER_PORT="$CLUSTER_PORT"

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The transport alone, without the features the workspace turns on (otel, testing, health).
cargo clippy -p lily-mq-rabbit --lib -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
wait "$CLUSTER_PID" || { echo "lily: the three-node cluster did not start" >&2; exit 1; }
cargo test --workspace
cargo test --manifest-path patches/amq-protocol-types/Cargo.toml --quiet
# A short coverage-guided fuzzing run of each target (cargo-afl, installed when missing): the
# seed corpora replay as regression tests, then AFL++ explores; any crash fails the suite.
scripts/fuzz.sh "${LILY_FUZZ_SECONDS:-15}"
