//! Lily's per-message cost over a hand-written lapin consumer, memory per in-flight delivery,
//! shutdown latency and peak memory under a hostile load, against the broker of
//! `scripts/bench.sh`:
//!
//! ```text
//! scripts/bench.sh cost [--n N] [--n0 N0] [--reps R] [--quick]
//!     [--only allocs,instructions,memory,shutdown,hostile] [--merge bench/results/cost.json]
//! ```
//!
//! Without a subcommand it publishes the messages, runs itself as a child process for every
//! measurement (under `valgrind --tool=callgrind` for instruction counts), prints a table and
//! writes `target/bench/cost.json` and `target/bench/cost.md`. The subcommands (`run-raw`,
//! `run-lily`, `mem-raw`, `mem-lily`, `hostile-raw`, `hostile-lily`) are those children; see
//! `lily_mq_bench::cost`.

use std::alloc::System;
use std::process::ExitCode;

use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};

/// Counts every heap allocation of the process (read back through `INSTRUMENTED_SYSTEM`).
#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

fn main() -> ExitCode {
    lily_mq_bench::cost::main()
}
