//! `lily-bench cost`: what Lily's layer adds a message over a hand-written lapin consumer, memory
//! a delivery in flight, shutdown latency and the hostile load, each measured in a child process
//! of `lily-bench-counting`. Method: `bench/README.md`.

pub mod consume;
pub mod hostile;
pub mod memory;
pub mod reader;
pub mod report;
pub mod shutdown;

use std::io::Read as _;
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use lily::consumer::Policy;
use lily::prelude::QueueKind;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::runtime::Runtime;

use crate::args::Common;
use crate::{broker_url, fresh_topology, median, publish};

/// Prefetch of the per-message cost runs (and concurrency of Lily's consumer).
pub const PREFETCH: u16 = 50;

/// Which consumer a child runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Contender {
    /// A hand-written lapin consumer that deserializes and ACKs each message the way Lily does
    /// (`Channel::basic_ack`, the frame queued, its write not awaited): the baseline.
    Raw,
    /// Lily's `Consumer` with a `Json<Order>` handler.
    Lily,
}

impl Contender {
    pub fn name(self) -> &'static str {
        match self {
            Self::Raw => "raw",
            Self::Lily => "lily",
        }
    }
}

/// The counting allocator's totals so far (zero unless the binary counts, as
/// `lily-bench-counting` does).
pub fn alloc_snapshot() -> stats_alloc::Stats {
    stats_alloc::INSTRUMENTED_SYSTEM.stats()
}

/// A tokio runtime: current-thread (repeatable counts) or multi-thread.
pub fn runtime(multi_thread: bool) -> Runtime {
    let mut builder = if multi_thread {
        tokio::runtime::Builder::new_multi_thread()
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    builder.enable_all().build().expect("tokio runtime")
}

/// What the orchestrator measures, and how much; a subcommand is one of its child processes.
/// To profile by hand: `valgrind --tool=callgrind lily-bench-counting cost run lily 20000 QUEUE`
/// on a queue holding 20 000 orders.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Options {
    #[command(subcommand)]
    child: Option<Child>,
    #[command(flatten)]
    common: Common,
    /// Messages of the long native runs.
    #[arg(long, default_value_t = 20_000)]
    n: usize,
    /// Messages of the short native runs (subtracted).
    #[arg(long, default_value_t = 2_000)]
    n0: usize,
    /// Messages of the long runs under valgrind (quick: 5 000).
    #[arg(
        long,
        default_value = "20000",
        default_value_if("quick", "true", Some("5000"))
    )]
    valgrind_n: usize,
    /// Messages of the short runs under valgrind (quick: 500).
    #[arg(
        long,
        default_value = "2000",
        default_value_if("quick", "true", Some("500"))
    )]
    valgrind_n0: usize,
    /// Rounds of the allocation counts (quick: 2).
    #[arg(long, default_value = "3", value_parser = crate::args::nonzero,
          default_value_if("quick", "true", Some("2")))]
    reps: usize,
    /// Deliveries held by the memory step.
    #[arg(long, default_value_t = 10_000)]
    in_flight: usize,
    /// Runs of the idle shutdown (quick: 3).
    #[arg(long, default_value = "5", value_parser = crate::args::nonzero,
          default_value_if("quick", "true", Some("3")))]
    shutdown_runs: usize,
    /// Messages of the hostile load.
    #[arg(long, default_value_t = hostile::N, value_parser = crate::args::nonzero)]
    hostile_n: usize,
    /// Prefetch (and concurrency) of the hostile load.
    #[arg(long, default_value_t = hostile::PREFETCH, value_parser = clap::value_parser!(u16).range(1..))]
    hostile_prefetch: u16,
    /// Steps to run: allocs, instructions, reader, memory, shutdown, hostile (default: all).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

/// The child processes; each prints `RESULT {json}`.
#[derive(clap::Subcommand, Debug)]
enum Child {
    /// Consumes N orders from QUEUE; its allocations.
    Run {
        who: Contender,
        n: usize,
        queue: String,
    },
    /// Holds K deliveries from QUEUE (the parent publishes once it prints `IDLE`); its memory.
    Mem {
        who: Contender,
        k: usize,
        queue: String,
    },
    /// Drains the hostile load from QUEUE (`hostile::child`).
    Hostile {
        who: Contender,
        prefetch: u16,
        n: usize,
        queue: String,
    },
    /// Reads the frames of N of TOTAL deliveries through Lily's frame reader (or plainly).
    Reader {
        total: usize,
        n: usize,
        #[arg(long)]
        plain: bool,
    },
}

/// Heap allocations a message (median of the rounds).
#[derive(Debug, Serialize)]
pub struct Allocations {
    pub n: usize,
    pub n0: usize,
    pub rounds: usize,
    /// alloc + alloc_zeroed + realloc calls a message: raw, Lily, Lily − raw.
    pub raw: f64,
    pub lily: f64,
    pub lily_layer: f64,
    pub met: bool,
}

/// Instructions a message under callgrind (every thread of the child).
#[derive(Debug, Serialize)]
pub struct Instructions {
    pub n: usize,
    pub n0: usize,
    pub raw: f64,
    pub lily: f64,
    pub lily_layer: f64,
    pub met: bool,
}

/// Memory a delivery held, each contender's.
#[derive(Debug, Serialize)]
pub struct Memory {
    pub in_flight: usize,
    pub raw: memory::Held,
    pub lily: memory::Held,
}

/// Everything `cost` measured; a step that failed or did not run is absent.
#[derive(Debug, Serialize)]
pub struct Results {
    #[serde(flatten)]
    pub meta: crate::Meta,
    pub prefetch: u16,
    pub instructions: Option<Instructions>,
    /// The frame reader alone: instructions a message.
    pub reader: Option<f64>,
    pub allocations: Option<Allocations>,
    pub memory: Option<Memory>,
    pub shutdown: Option<shutdown::Idle>,
    pub hostile: Option<hostile::Hostile>,
    /// Steps that failed, and why.
    pub errors: Vec<String>,
}

/// Targets of Lily's layer: instructions and heap allocations a message; the idle shutdown in ms.
pub const TARGET_INSTRUCTIONS: f64 = 8000.0;
pub const TARGET_ALLOCATIONS: f64 = 10.0;
pub const TARGET_IDLE_SHUTDOWN_MS: f64 = 200.0;

/// Entry point of `lily-bench cost` (in `lily-bench-counting`).
pub fn main(mut options: Options) -> ExitCode {
    let result = match options.child.take() {
        None => return orchestrate(options),
        Some(Child::Run { who, n, queue }) => consume::child(who, n, &queue).map(json),
        Some(Child::Mem { who, k, queue }) => memory::child(who, k, &queue).map(json),
        Some(Child::Hostile {
            who,
            prefetch,
            n,
            queue,
        }) => hostile::child::child(who, prefetch, n, &queue).map(json),
        Some(Child::Reader { total, n, plain }) => reader::child(total, n, plain).map(json),
    };
    match result {
        Ok(value) => {
            println!("RESULT {value}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("cost child: {err}");
            ExitCode::FAILURE
        }
    }
}

fn json(value: impl Serialize) -> String {
    serde_json::to_string(&value).expect("json")
}

/// The value of a child's `RESULT` line.
pub fn result<T: DeserializeOwned>(line: &str) -> Option<T> {
    serde_json::from_str(line.strip_prefix("RESULT ")?).ok()
}

/// Runs `command` (a child printing `RESULT {json}`) to its end, bounded by `limit`: its result
/// and its stderr.
fn run_child<T: DeserializeOwned>(
    mut command: Command,
    limit: Duration,
) -> Result<(T, String), String> {
    let shown = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn {shown}: {e}"))?;
    let read = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let out = read(Box::new(child.stdout.take().ok_or("no stdout")?));
    let err = read(Box::new(child.stderr.take().ok_or("no stderr")?));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("wait: {e}"))? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{shown} did not finish within {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    let tail: Vec<&str> = err.lines().rev().take(20).collect();
    if !status.success() {
        return Err(format!(
            "{shown} failed ({status}):\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    let value = out
        .lines()
        .find_map(result)
        .ok_or_else(|| format!("{shown} printed no RESULT line"))?;
    Ok((value, err))
}

/// The instructions valgrind's callgrind collected over a child's run, from its stderr.
fn collected(stderr: &str) -> Result<f64, String> {
    let total = stderr
        .lines()
        .find_map(|l| l.split("Collected :").nth(1)?.trim().parse().ok());
    total.ok_or_else(|| "no `Collected` line in valgrind's output".into())
}

/// `(big - small) / (n - n0)`: a run's per-message cost, its fixed costs cancelled.
#[allow(clippy::cast_precision_loss)]
fn per_message(big: f64, small: f64, n: usize, n0: usize) -> f64 {
    (big - small) / (n - n0) as f64
}

/// Everything the orchestrator shares with its steps.
pub struct Bench {
    rt: Runtime,
    url: String,
    exe: std::path::PathBuf,
    options: Options,
}

impl Bench {
    /// A fresh classic queue (Lily's topology) holding `n` 512-byte orders.
    fn queue_with(&self, queue: &str, n: usize) {
        self.rt.block_on(async {
            fresh_topology(
                &self.url,
                queue,
                QueueKind::Classic,
                &Policy::default().retry_delays,
            )
            .await;
            publish(&self.url, queue, n, &crate::body_512()).await;
        });
    }

    /// This program as `cost CHILD ARGS…`, under valgrind's callgrind when asked.
    fn child(&self, callgrind: bool, args: &[&str]) -> Command {
        let mut command = Command::new(if callgrind {
            Path::new("valgrind")
        } else {
            &self.exe
        });
        if callgrind {
            command
                .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
                .arg(&self.exe);
        }
        command
            .env("LILY_AMQP_URL", &self.url)
            .arg("cost")
            .args(args);
        command
    }

    /// One consume run of `who` over `n` orders: its allocations, or its instructions.
    fn consume(
        &self,
        who: Contender,
        n: usize,
        callgrind: bool,
    ) -> Result<(consume::Counted, f64), String> {
        let queue = format!("lily-bench-cost-{}", who.name());
        self.queue_with(&queue, n);
        let limit = Duration::from_secs(if callgrind { 1800 } else { 300 });
        let (counted, stderr): (consume::Counted, _) = run_child(
            self.child(callgrind, &["run", who.name(), &n.to_string(), &queue]),
            limit,
        )?;
        if counted.handled != n {
            return Err(format!("{} handled {} of {n}", who.name(), counted.handled));
        }
        let instructions = if callgrind {
            collected(&stderr)?
        } else {
            f64::NAN
        };
        Ok((counted, instructions))
    }
}

/// Heap allocations a message, native runs.
#[allow(clippy::cast_precision_loss)]
fn allocations(b: &Bench) -> Result<Allocations, String> {
    let (n, n0) = (b.options.n, b.options.n0);
    let mut rounds = [Vec::new(), Vec::new()];
    for round in 0..b.options.reps {
        for (who, per) in [Contender::Raw, Contender::Lily]
            .into_iter()
            .zip(&mut rounds)
        {
            let calls = |c: consume::Counted| (c.allocations + c.reallocations) as f64;
            let (big, small) = (b.consume(who, n, false)?.0, b.consume(who, n0, false)?.0);
            per.push(per_message(calls(big), calls(small), n, n0));
            eprintln!(
                "cost: allocations round {}: {} {:.2} a message",
                round + 1,
                who.name(),
                per.last().unwrap_or(&f64::NAN)
            );
        }
    }
    let [raw, lily] = rounds.map(|mut r| median(&mut r));
    Ok(Allocations {
        n,
        n0,
        rounds: b.options.reps,
        raw,
        lily,
        lily_layer: lily - raw,
        met: lily - raw <= TARGET_ALLOCATIONS,
    })
}

/// Instructions a message under callgrind, on tokio's current-thread runtime.
fn instructions(b: &Bench) -> Result<Instructions, String> {
    let (n, n0) = (b.options.valgrind_n, b.options.valgrind_n0);
    let per = |who| -> Result<f64, String> {
        Ok(per_message(
            b.consume(who, n, true)?.1,
            b.consume(who, n0, true)?.1,
            n,
            n0,
        ))
    };
    let (raw, lily) = (per(Contender::Raw)?, per(Contender::Lily)?);
    Ok(Instructions {
        n,
        n0,
        raw,
        lily,
        lily_layer: lily - raw,
        met: lily - raw <= TARGET_INSTRUCTIONS,
    })
}

/// Instructions a message of Lily's frame reader alone, under callgrind: the frames of N or N0
/// deliveries read through it, minus the same frames read plainly.
fn reader_instructions(b: &Bench) -> Result<f64, String> {
    let (n, n0) = (b.options.valgrind_n, b.options.valgrind_n0);
    let run = |k: usize, plain: bool| -> Result<f64, String> {
        let (k, total) = (k.to_string(), n.to_string());
        let mut args = vec!["reader", total.as_str(), k.as_str()];
        args.extend(plain.then_some("--plain"));
        let (_, stderr): (serde_json::Value, _) =
            run_child(b.child(true, &args), Duration::from_secs(600))?;
        collected(&stderr)
    };
    let through = per_message(run(n, false)?, run(n0, false)?, n, n0);
    Ok(through - per_message(run(n, true)?, run(n0, true)?, n, n0))
}

/// Memory a delivery in flight.
fn memory(b: &Bench) -> Result<Memory, String> {
    let k = b.options.in_flight;
    let held = |who: Contender| memory::measure(b, who, k);
    Ok(Memory {
        in_flight: k,
        raw: held(Contender::Raw)?,
        lily: held(Contender::Lily)?,
    })
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

fn orchestrate(options: Options) -> ExitCode {
    if options.n <= options.n0 || options.valgrind_n <= options.valgrind_n0 {
        eprintln!("cost: N must be larger than N0");
        return ExitCode::from(2);
    }
    let url = broker_url();
    let meta = crate::Meta::new("cost", &url, vec![crate::METHOD.into()]);
    let b = Bench {
        rt: runtime(true),
        url,
        exe: std::env::current_exe().expect("current_exe"),
        options,
    };
    let (mut errors, started) = (Vec::new(), Instant::now());
    let (only, e) = (&b.options.only, &mut errors);
    let instructions = step(only, e, "instructions", || instructions(&b));
    let reader = step(only, e, "reader", || reader_instructions(&b));
    let allocations = step(only, e, "allocs", || allocations(&b));
    let memory = step(only, e, "memory", || memory(&b));
    let shutdown = step(only, e, "shutdown", || {
        shutdown::measure(&b.rt, &b.url, b.options.shutdown_runs)
    });
    let hostile = step(only, e, "hostile", || hostile::measure(&b));
    // The hostile load states a bound: over it, or a message missing, fails the run.
    if let Some(h) = hostile.as_ref().filter(|h| !h.met) {
        errors.push(format!("hostile: {}", h.failures.join("; ")));
    }
    let mut r = Results {
        meta,
        prefetch: PREFETCH,
        instructions,
        reader,
        allocations,
        memory,
        shutdown,
        hostile,
        errors,
    };
    r.meta.finish(started);
    crate::report::write(
        &b.options.common.out,
        "cost",
        &r,
        &report::markdown(&r),
        None,
    );
    if r.errors.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
