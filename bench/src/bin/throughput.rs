//! Benchmark program `throughput` (see scripts/bench.sh).

fn main() {}
