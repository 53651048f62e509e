//! `lily-bench` with a global allocator that counts every heap allocation, for `cost`
//! (`lily-bench cost` re-executes itself here). The other programs run in `lily-bench`, whose
//! allocator counts nothing, so counting costs their measurements nothing.

use std::alloc::System;

use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};

/// Counts every heap allocation of the process (read back through `INSTRUMENTED_SYSTEM`).
#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

fn main() -> std::process::ExitCode {
    lily_mq_bench::cli::main(true)
}
