#!/usr/bin/env bash
# Coverage-guided fuzzing of Lily's core with cargo-afl (AFL++), on the stable toolchain.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Defaults: 20 s for each of the targets gate, headers, codec, machine, lane and frames
# (fuzz/src/bin/).
# Installs cargo-afl when missing, builds AFL++ when it is not built yet, builds the targets
# instrumented, replays their seed corpora (fuzz/seeds/<target>/: each seed is also a regression
# test), then runs AFL++ on each target in turn, headless, for SECONDS_PER_TARGET. Prints one
# line per target and writes target/fuzz-out/summary.json; a target's findings are under
# target/fuzz-out/<target>/default/. Exits non-zero when a seed fails, a target cannot run, or
# AFL++ saved a crash (an invariant broken or a panic); the crashing inputs' paths are printed.
# Replay one with the instrumented binary: target/fuzz/release/<target> < <path>. Hangs are
# reported, not failed on: on a loaded machine AFL++ may count a slow run as one.
#
# Environment: FUZZ_NICE (nice level of the fuzzer, default 0); FUZZ_BUILD_ONLY=1 stops once
# cargo-afl, AFL++ and the targets are built (the test command builds them while its partition
# tests run).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

AFL_VERSION=0.18.2
ALL_TARGETS=(gate headers codec machine lane frames)
SECONDS_PER_TARGET=${1:-20}
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=("${ALL_TARGETS[@]}")
case $SECONDS_PER_TARGET in
  '' | *[!0-9]*) echo "fuzz: SECONDS_PER_TARGET must be a number of seconds" >&2; exit 2 ;;
esac
for t in "${TARGETS[@]}"; do
  [ -f "fuzz/src/bin/$t.rs" ] && [ -d "fuzz/seeds/$t" ] || {
    echo "fuzz: unknown target '$t' (targets: ${ALL_TARGETS[*]})" >&2
    exit 2
  }
done

command -v cargo >/dev/null || { echo "fuzz: cargo not found; install Rust with rustup" >&2; exit 1; }
if [ "$(cargo afl --version 2>/dev/null | awk '{print $2}')" != "$AFL_VERSION" ]; then
  echo "fuzz: installing cargo-afl $AFL_VERSION"
  cargo install cargo-afl --locked --version "$AFL_VERSION"
fi
# AFL++ is built once per toolchain, under the XDG data directory.
RUSTC_RELEASE=$(rustc -V | awk '{print $2}')
AFL_DATA=${XDG_DATA_HOME:-$HOME/.local/share}/afl.rs
if ! compgen -G "$AFL_DATA/rustc-$RUSTC_RELEASE-*/afl.rs-$AFL_VERSION/afl/bin/afl-fuzz" >/dev/null; then
  echo "fuzz: building AFL++ (cargo afl config --build)"
  cargo afl config --build
fi

export CARGO_TARGET_DIR="$ROOT/target/fuzz"
BIN="$CARGO_TARGET_DIR/release"
OUT="$ROOT/target/fuzz-out"
mkdir -p "$OUT"
build_args=()
for t in "${TARGETS[@]}"; do build_args+=(--bin "$t"); done
echo "fuzz: building ${TARGETS[*]} (cargo afl build --release)"
(cd fuzz && cargo afl build --release --locked "${build_args[@]}")
[ "${FUZZ_BUILD_ONLY:-0}" = 1 ] && exit 0

# Headless, time-bounded, and indifferent to the machine: a core_pattern that pipes to a
# handler, a CPU governor, cores busy with other work, running as root.
export AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1
export AFL_NO_AFFINITY=1 AFL_FAST_CAL=1
NICE=${FUZZ_NICE:-0}

stat_of() { # stat_of FILE KEY
  awk -F' *: *' -v k="$2" '$1 == k { print $2 }' "$1"
}

failed=0
rows=()
for t in "${TARGETS[@]}"; do
  seeds=(fuzz/seeds/"$t"/*)
  for seed in "${seeds[@]}"; do
    if ! "$BIN/$t" <"$seed" >/dev/null 2>"$OUT/$t.seed-failure.log"; then
      echo "fuzz: $t: seed $seed fails (see $OUT/$t.seed-failure.log)" >&2
      failed=1
    fi
  done
  rm -f "$OUT/$t.seed-failure.log"

  dir="$OUT/$t"
  rm -rf "$dir"
  status=ok
  if ! timeout $((SECONDS_PER_TARGET + 300)) nice -n "$NICE" \
    cargo afl fuzz -V "$SECONDS_PER_TARGET" -i "fuzz/seeds/$t" -o "$dir" "$BIN/$t" \
    >"$OUT/$t.log" 2>&1; then
    status=failed
  fi
  stats="$dir/default/fuzzer_stats"
  if [ ! -f "$stats" ]; then
    echo "fuzz: $t did not run; the end of $OUT/$t.log:" >&2
    tail -n 20 "$OUT/$t.log" >&2
    failed=1
    rows+=("{\"target\":\"$t\",\"status\":\"failed\"}")
    continue
  fi
  execs=$(stat_of "$stats" execs_done)
  rate=$(stat_of "$stats" execs_per_sec)
  run_time=$(stat_of "$stats" run_time)
  corpus=$(stat_of "$stats" corpus_count)
  crashes=$(stat_of "$stats" saved_crashes)
  hangs=$(stat_of "$stats" saved_hangs)
  stability=$(stat_of "$stats" stability)
  crash_files=()
  for f in "$dir"/default/crashes/id:*; do
    [ -e "$f" ] && crash_files+=("$f")
  done
  if [ "$crashes" != 0 ] || [ ${#crash_files[@]} -gt 0 ]; then
    status=crashed
  fi
  [ "$status" = ok ] || failed=1
  printf '%-8s %-7s %12s execs %9s/s %5ss  corpus %3s -> %-5s crashes %s  hangs %s  stability %s\n' \
    "$t" "$status" "$execs" "$rate" "$run_time" "${#seeds[@]}" "$corpus" "$crashes" "$hangs" "$stability"
  for f in "${crash_files[@]}"; do echo "  crash: $f"; done
  if [ "$status" = failed ]; then
    echo "fuzz: $t: afl-fuzz failed; the end of $OUT/$t.log:" >&2
    tail -n 20 "$OUT/$t.log" >&2
  fi
  paths=""
  for f in "${crash_files[@]}"; do paths+="${paths:+,}\"$f\""; done
  rows+=("$(printf '{"target":"%s","status":"%s","execs_done":%s,"execs_per_sec":%s,"run_time_s":%s,"corpus_seeds":%s,"corpus_count":%s,"saved_crashes":%s,"saved_hangs":%s,"stability":"%s","crashes":[%s]}' \
    "$t" "$status" "$execs" "$rate" "$run_time" "${#seeds[@]}" "$corpus" "$crashes" "$hangs" "$stability" "$paths")")
done

{
  printf '{"seconds_per_target":%s,"cargo_afl":"%s","ok":%s,"targets":[' \
    "$SECONDS_PER_TARGET" "$AFL_VERSION" "$([ $failed = 0 ] && echo true || echo false)"
  (IFS=,; printf '%s' "${rows[*]}")
  printf ']}\n'
} >"$OUT/summary.json"
echo "fuzz: summary in $OUT/summary.json"
exit $failed
