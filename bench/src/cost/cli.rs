//! `lily-bench cost`: its command line, the child processes it runs, and the steps in order.
//! Method: `bench/README.md`.

use std::process::ExitCode;
use std::time::Instant;

use lily_mq_regress::consume::{Who, drain, handled};
use serde::Serialize;

use crate::args::Common;
use crate::cost::{
    Bench, IN_FLIGHT, N, QUICK_VALGRIND_N, Results, allocations, hostile, instructions, memory,
    reader, reader_instructions, shutdown,
};
use crate::{broker_url, runtime};

/// What the orchestrator measures; a subcommand is one of its child processes. To profile:
/// `LILY_BENCH_CALLGRIND_DIR` and `LILY_BENCH_WRAP` (`bench/README.md`).
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    child: Option<Child>,
    #[command(flatten)]
    common: Common,
    /// Rounds of the allocation counts (quick: 2).
    #[arg(long, default_value = "3", value_parser = crate::args::count::<usize>,
          default_value_if("quick", "true", Some("2")))]
    reps: usize,
    /// Steps to run: allocs, instructions, reader, memory, shutdown, hostile (default: all).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

/// The child processes, each running the regression gate's raw lapin or Lily consumer (`WHO`);
/// each prints `RESULT {json}`.
#[derive(clap::Subcommand, Debug)]
enum Child {
    /// Consumes N orders from QUEUE; its handled count and heap allocation calls.
    Run { who: Who, n: u64, queue: String },
    /// Holds K deliveries from QUEUE (the parent publishes once it prints `IDLE`); its memory.
    Mem { who: Who, k: usize, queue: String },
    /// Drains the hostile load from QUEUE (`hostile::child`).
    Hostile { who: Who, queue: String },
    /// Reads the frames of N of TOTAL deliveries through Lily's frame reader (or plainly).
    Reader {
        total: usize,
        n: usize,
        #[arg(long)]
        plain: bool,
    },
}

/// Entry point of `lily-bench cost` (in `lily-bench-counting`).
pub fn main(mut options: Args) -> ExitCode {
    let url = broker_url();
    let result = match options.child.take() {
        None => return orchestrate(options),
        // The `run` child consumes exactly `n` pre-published orders on a current-thread runtime,
        // closes, and counts the whole process.
        Some(Child::Run { who, n, queue }) => runtime(false)
            .block_on(drain(who, &url, &queue, n))
            .map(|()| {
                let stats = stats_alloc::INSTRUMENTED_SYSTEM.stats();
                json((handled(), stats.allocations + stats.reallocations))
            }),
        Some(Child::Mem { who, k, queue }) => memory::child(who, k, &url, &queue).map(json),
        Some(Child::Hostile { who, queue }) => hostile::child::child(who, &url, &queue).map(json),
        Some(Child::Reader { total, n, plain }) => reader::child(total, n, plain).map(json),
    };
    match result {
        Ok(value) => println!("RESULT {value}"),
        Err(err) => {
            eprintln!("cost child: {err}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

fn json(value: impl Serialize) -> String {
    serde_json::to_string(&value).expect("json")
}

/// Runs step `name` when `--only` names it (or is empty); its failure goes to `errors`.
fn step<T>(
    only: &[String],
    errors: &mut Vec<String>,
    name: &str,
    run: impl FnOnce() -> Result<T, String>,
) -> Option<T> {
    if !only.is_empty() && !only.iter().any(|w| w == name) {
        return None;
    }
    eprintln!("cost: measuring {name}");
    run()
        .map_err(|err| errors.push(format!("{name}: {err}")))
        .ok()
}

fn orchestrate(options: Args) -> ExitCode {
    let url = broker_url();
    let meta = crate::Meta::new("cost", &url, vec![crate::METHOD.into()]);
    let quick = options.common.quick;
    let b = Bench {
        rt: runtime(true),
        url,
        reps: options.reps,
        valgrind_n: if quick { QUICK_VALGRIND_N } else { N },
    };
    let (mut errors, started, only) = (Vec::new(), Instant::now(), &options.only);
    let idle_runs = if quick { 3 } else { 5 };
    let mut r = Results {
        meta,
        prefetch: lily_mq_regress::consume::PREFETCH,
        instructions: step(only, &mut errors, "instructions", || instructions(&b)),
        reader: step(only, &mut errors, "reader", || reader_instructions(&b)),
        allocations: step(only, &mut errors, "allocs", || allocations(&b)),
        memory: step(only, &mut errors, "memory", || {
            memory::measure(&b, IN_FLIGHT)
        }),
        shutdown: step(only, &mut errors, "shutdown", || {
            shutdown::measure(&b.rt, &b.url, idle_runs)
        }),
        hostile: step(only, &mut errors, "hostile", || hostile::measure(&b)),
        errors: Vec::new(),
    };
    r.errors = errors;
    // The hostile load states a bound: over it, or a message missing, fails the run.
    if let Some(h) = r.hostile.as_ref().filter(|h| !h.met) {
        r.errors.push(format!("hostile: {}", h.failures.join("; ")));
    }
    r.meta.finish(started);
    let markdown = crate::report::cost(&r);
    crate::report::write(&options.common.out, "cost", &r, &markdown, None);
    if r.errors.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
