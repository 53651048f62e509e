#!/usr/bin/env bash
# The CPU regression gate (regress/): what Lily spends a message above a hand-written lapin
# consumer (instructions under valgrind's callgrind; task-clock and context switches from
# `perf stat`), against the baseline recorded in regress/baseline.json. No broker is needed: a
# scripted AMQP peer serves the same workload the same way on every run. Installs valgrind and
# perf (Debian's linux-perf) when missing and builds the gate (cargo's `gate` profile: release
# without debug info). About 20 s once built, twice that when a figure is measured again.
#
#   scripts/regress.sh            measure and compare; exits non-zero when a layer grew
#   scripts/regress.sh --record   measure and write the baselines (say why in CHANGELOG.md)
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v valgrind >/dev/null || need+=(valgrind)
perf stat -e task-clock true >/dev/null 2>&1 || need+=(linux-perf)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "lily: installing ${need[*]}" >&2
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi
perf stat -e task-clock,context-switches true >/dev/null 2>&1 || {
  echo "lily: \`perf stat\` cannot count task-clock here (see /proc/sys/kernel/perf_event_paranoid)" >&2
  exit 1
}
exec cargo run --profile gate --quiet --locked -p lily-mq-regress -- "$@"
