//! Benchmark program `cost` (see scripts/bench.sh).

fn main() {}
