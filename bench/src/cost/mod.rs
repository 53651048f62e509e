//! `lily-bench cost`: what Lily's layer adds per message over a hand-written lapin consumer,
//! memory per in-flight delivery, shutdown latency and the hostile load, each measured in a
//! child process. Method: `bench/README.md`.

pub mod consume;
pub mod hostile;
pub mod memory;
pub mod reader;
pub mod shutdown;

use std::io::{BufRead as _, BufReader, Read as _};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use lily::consumer::Policy;
use lily::prelude::QueueKind;
use serde_json::{Value, json};
use tokio::runtime::Runtime;

use crate::{body_512, broker_url, fresh_topology, median, publish};

/// Prefetch of the per-message cost runs (and concurrency of Lily's consumer).
pub const PREFETCH: u16 = 50;
/// Target for Lily's layer, instructions per message.
pub const TARGET_INSTRUCTIONS: f64 = 8000.0;
/// Target for Lily's layer, heap allocations per message.
pub const TARGET_ALLOCATIONS: f64 = 10.0;
/// Target for the shutdown of an idle consumer, milliseconds.
pub const TARGET_IDLE_SHUTDOWN_MS: f64 = 200.0;

/// Which consumer a child runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Contender {
    /// A hand-written lapin consumer that deserializes and acks each message the way Lily does:
    /// `Channel::basic_ack`, the frame queued and its socket write not awaited. The baseline of
    /// "Lily's layer".
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

/// The counting allocator's totals so far (all zero unless the binary installed
/// `stats_alloc::INSTRUMENTED_SYSTEM` as its global allocator, as `cost` does).
pub fn alloc_snapshot() -> stats_alloc::Stats {
    stats_alloc::INSTRUMENTED_SYSTEM.stats()
}

/// A tokio runtime: current-thread by default (repeatable counts), multi-thread when asked.
pub fn runtime(multi_thread: bool) -> Runtime {
    let mut builder = if multi_thread {
        tokio::runtime::Builder::new_multi_thread()
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    builder.enable_all().build().expect("tokio runtime")
}

/// `prepare N QUEUE`: a fresh classic queue (Lily's topology) holding `N` 512-byte orders.
fn prepare(args: &[String]) -> Result<Value, String> {
    let n: usize = args
        .first()
        .and_then(|a| a.parse().ok())
        .ok_or("usage: cost prepare N QUEUE")?;
    let queue = args.get(1).ok_or("missing QUEUE")?;
    let url = broker_url();
    runtime(false).block_on(async {
        fresh_topology(
            &url,
            queue,
            QueueKind::Classic,
            &Policy::default().retry_delays,
        )
        .await;
        publish(&url, queue, n, &body_512()).await;
    });
    Ok(json!({ "queue": queue, "published": n }))
}

/// What the orchestrator measures, and how much. A subcommand (`run-raw`, `run-lily`, `mem-raw`, `mem-lily`, `hostile-raw`, `hostile-lily`, `reader`, `prepare`) is
/// one of its child processes. To profile by hand:
/// `lily-bench cost prepare 20000 q && valgrind --tool=callgrind lily-bench-counting cost run-lily 20000 q`.
#[derive(clap::Args, Clone, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Options {
    #[command(subcommand)]
    child: Option<Child>,
    /// Messages of the long native runs.
    #[arg(long, default_value_t = 20_000)]
    pub n: usize,
    /// Messages of the short native runs (subtracted).
    #[arg(long, default_value_t = 2_000)]
    pub n0: usize,
    /// Messages of the long runs under valgrind.
    #[arg(
        long,
        default_value = "20000",
        default_value_if("quick", "true", Some("5000"))
    )]
    pub valgrind_n: usize,
    /// Messages of the short runs under valgrind.
    #[arg(
        long,
        default_value = "2000",
        default_value_if("quick", "true", Some("500"))
    )]
    pub valgrind_n0: usize,
    /// Rounds of the allocation counts.
    #[arg(long, default_value = "3", value_parser = crate::parse::nonzero,
          default_value_if("quick", "true", Some("2")))]
    pub reps: usize,
    /// 2 rounds, valgrind runs of 5 000 and 500, 3 shutdown runs.
    #[arg(long)]
    pub quick: bool,
    /// Deliveries held by the memory step.
    #[arg(long, default_value_t = 10_000)]
    pub in_flight: usize,
    /// Runs of the idle shutdown.
    #[arg(long, default_value = "5", value_parser = crate::parse::nonzero,
          default_value_if("quick", "true", Some("3")))]
    pub shutdown_runs: usize,
    /// Messages of the hostile load.
    #[arg(long, default_value_t = hostile::N, value_parser = crate::parse::nonzero)]
    pub hostile_n: usize,
    /// Prefetch of the hostile load.
    #[arg(long, default_value_t = hostile::PREFETCH, value_parser = clap::value_parser!(u16).range(1..))]
    pub hostile_prefetch: u16,
    /// Copies of each delivery the hostile bound allows for.
    #[arg(long, default_value_t = hostile::COPIES)]
    pub hostile_copies: u64,
    /// Steps to run: allocs, instructions, reader, memory, shutdown, hostile.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// An earlier `cost.json` whose measurements this run does not repeat are kept.
    #[arg(long)]
    pub merge: Option<PathBuf>,
}

/// A child process of the orchestrator: its name and arguments.
#[derive(clap::Subcommand, Clone, Debug)]
enum Child {
    #[command(external_subcommand)]
    Run(Vec<String>),
}

/// Entry point of `lily-bench cost`.
pub fn main(options: Options) -> ExitCode {
    let child = |result: Result<Value, String>| match result {
        Ok(value) => {
            println!("RESULT {value}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("cost child: {err}");
            ExitCode::FAILURE
        }
    };
    let Some(Child::Run(args)) = &options.child else {
        if options.n <= options.n0 || options.valgrind_n <= options.valgrind_n0 {
            eprintln!("cost: N must be larger than N0");
            return ExitCode::from(2);
        }
        return orchestrate(&options);
    };
    let rest = &args[1..];
    match args[0].as_str() {
        "run-raw" => child(consume::child(Contender::Raw, rest)),
        "run-lily" => child(consume::child(Contender::Lily, rest)),
        "mem-raw" => child(memory::child(Contender::Raw, rest)),
        "mem-lily" => child(memory::child(Contender::Lily, rest)),
        "hostile-raw" => child(hostile::child::child(Contender::Raw, rest)),
        "hostile-lily" => child(hostile::child::child(Contender::Lily, rest)),
        "prepare" => child(prepare(rest)),
        "reader" => child(reader::child(rest)),
        other => child(Err(format!("no child {other}"))),
    }
}

impl Options {
    fn wants(&self, what: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|w| w == what)
    }
}

/// Runs `command` (a child printing `RESULT {json}`), bounded by `limit`. Returns the result
/// and the child's stderr.
fn run_child(mut command: Command, limit: Duration) -> Result<(Value, String), String> {
    let shown = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn {shown}: {e}"))?;
    let mut stdout = child.stdout.take().ok_or("no stdout")?;
    let mut stderr = child.stderr.take().ok_or("no stderr")?;
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
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
    let out = out.join().unwrap_or_default();
    let err = err.join().unwrap_or_default();
    if !status.success() {
        return Err(format!("{shown} failed ({status}):\n{}", tail(&err, 20)));
    }
    let result = out
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .and_then(|j| serde_json::from_str(j).ok())
        .ok_or_else(|| format!("{shown} printed no RESULT line"))?;
    Ok((result, err))
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// One measurement of the orchestrator.
type Step = fn(&Bench) -> Result<Value, String>;

/// Everything the orchestrator shares with its steps.
struct Bench {
    rt: Runtime,
    url: String,
    exe: PathBuf,
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
            publish(&self.url, queue, n, &body_512()).await;
        });
    }

    fn consume_command(&self, program: &Path, who: Contender, n: usize, queue: &str) -> Command {
        let mut command = Command::new(program);
        command.env("LILY_AMQP_URL", &self.url);
        if program != self.exe {
            // valgrind: tool options come first, then the program.
            command.args(["--tool=callgrind", "--callgrind-out-file=/dev/null", "--"]);
            command.arg(&self.exe);
        }
        command
            .arg("cost")
            .arg(format!("run-{}", who.name()))
            .arg(n.to_string())
            .arg(queue);
        command
    }

    /// One native run: the whole-process allocation counters.
    fn native(&self, who: Contender, n: usize) -> Result<Value, String> {
        let queue = format!("lily-bench-cost-{}", who.name());
        self.queue_with(&queue, n);
        let (result, _) = run_child(
            self.consume_command(&self.exe, who, n, &queue),
            Duration::from_secs(300),
        )?;
        if result["handled"].as_u64() != Some(n as u64) {
            return Err(format!(
                "{} handled {} of {n}",
                who.name(),
                result["handled"]
            ));
        }
        Ok(result)
    }

    /// One run under callgrind: instructions collected over the whole process (all threads).
    fn callgrind(&self, who: Contender, n: usize) -> Result<(u64, Value), String> {
        let queue = format!("lily-bench-cost-vg-{}", who.name());
        self.queue_with(&queue, n);
        let started = Instant::now();
        let (result, stderr) = run_child(
            self.consume_command(Path::new("valgrind"), who, n, &queue),
            Duration::from_secs(1800),
        )?;
        let collected = stderr
            .lines()
            .find_map(|l| l.split("Collected :").nth(1))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| {
                format!(
                    "no `Collected` line in valgrind's output:\n{}",
                    tail(&stderr, 10)
                )
            })?;
        eprintln!(
            "cost: callgrind {} N={n}: {collected} instructions ({:.0} s)",
            who.name(),
            started.elapsed().as_secs_f64()
        );
        Ok((collected, result))
    }
}

fn per_message(big: f64, small: f64, n: usize, n0: usize) -> f64 {
    (big - small) / (n - n0) as f64
}

fn field(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

/// Heap allocations per message, native runs.
fn allocations(b: &Bench) -> Result<Value, String> {
    let (n, n0) = (b.options.n, b.options.n0);
    let keys = ["allocations", "reallocations", "bytes_allocated"];
    let mut rounds = Vec::new();
    for rep in 0..b.options.reps {
        let mut per = serde_json::Map::new();
        for who in [Contender::Raw, Contender::Lily] {
            let big = b.native(who, n)?;
            let small = b.native(who, n0)?;
            let mut m = serde_json::Map::new();
            for key in keys {
                m.insert(
                    key.into(),
                    json!(per_message(field(&big, key), field(&small, key), n, n0)),
                );
            }
            m.insert(
                "msgs_per_s".into(),
                json!(n as f64 / field(&big, "elapsed_ms") * 1e3),
            );
            per.insert(who.name().into(), Value::Object(m));
        }
        let mut layer = serde_json::Map::new();
        for key in keys {
            layer.insert(
                key.into(),
                json!(field(&per["lily"], key) - field(&per["raw"], key)),
            );
        }
        per.insert("lily_layer".into(), Value::Object(layer));
        eprintln!(
            "cost: allocations round {}: {}",
            rep + 1,
            Value::Object(per.clone())
        );
        rounds.push(Value::Object(per));
    }
    let med = |who: &str, key: &str| {
        let mut v: Vec<f64> = rounds.iter().map(|r| field(&r[who], key)).collect();
        median(&mut v)
    };
    let summary = |who: &str| {
        json!({
            "allocations": med(who, "allocations"),
            "reallocations": med(who, "reallocations"),
            "allocation_calls": med(who, "allocations") + med(who, "reallocations"),
            "bytes_allocated": med(who, "bytes_allocated"),
        })
    };
    let layer = summary("lily_layer");
    let calls = field(&layer, "allocation_calls");
    Ok(json!({
        "method": format!(
            "counting global allocator (stats_alloc) over the whole child process; per message = \
             (A(N) - A(N0)) / (N - N0) with N = {n}, N0 = {n0}; Lily's layer = Lily - raw (both \
             queue ACKs on the channel); median of {} rounds; allocation_calls = alloc + \
             alloc_zeroed + realloc",
            b.options.reps
        ),
        "n": n,
        "n0": n0,
        "reps": b.options.reps,
        "raw": summary("raw"),
        "lily": summary("lily"),
        "lily_layer": layer,
        "target": TARGET_ALLOCATIONS,
        "met": calls <= TARGET_ALLOCATIONS,
        "rounds": rounds,
    }))
}

/// Instructions per message of Lily's frame reader alone ([`reader`]), under callgrind: two
/// runs that build the same frames and read N or N0 deliveries' worth. Its share of Lily's
/// layer is judged against the `instructions` step of the same run, when it ran.
fn reader_instructions(b: &Bench) -> Result<Value, String> {
    let (n, n0) = (b.options.valgrind_n, b.options.valgrind_n0);
    let collected = |k: usize, how: &str| -> Result<u64, String> {
        let mut command = Command::new("valgrind");
        command
            .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
            .arg(&b.exe)
            .args(["cost", "reader", &n.to_string(), &k.to_string(), how]);
        let (_, stderr) = run_child(command, Duration::from_secs(600))?;
        stderr
            .lines()
            .find_map(|l| l.split("Collected :").nth(1))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| format!("no `Collected` line:\n{}", tail(&stderr, 10)))
    };
    let through = per_message(
        collected(n, "sanitized")? as f64,
        collected(n0, "sanitized")? as f64,
        n,
        n0,
    );
    let plain = per_message(
        collected(n, "plain")? as f64,
        collected(n0, "plain")? as f64,
        n,
        n0,
    );
    let per = through - plain;
    eprintln!("cost: the frame reader: {per:.0} instructions a message");
    Ok(json!({
        "method": format!(
            "valgrind --tool=callgrind; the frames of {n} deliveries built in every run, those of \
             N = {n} or N0 = {n0} read in 128 KiB reads through Sanitizing and, as the baseline \
             (what lapin's own socket read costs anyway), without it; per message = \
             (I(N) - I(N0)) / (N - N0), rewriter minus baseline. callgrind counts a `rep movsb` \
             copy one instruction per byte: the reader's extra copy of each frame weighs more \
             here than in cycles"
        ),
        "through": through,
        "plain": plain,
        "per_message": per,
        "target_share_of_lily": 0.05,
    }))
}

/// Instructions per message under callgrind, on tokio's current-thread runtime (the steadier,
/// stricter baseline).
fn instructions(b: &Bench) -> Result<Value, String> {
    let (n, n0) = (b.options.valgrind_n, b.options.valgrind_n0);
    let valgrind = Command::new("valgrind").arg("--version").output();
    if !valgrind.is_ok_and(|o| o.status.success()) {
        return Err("valgrind is not installed (apt-get install valgrind)".into());
    }
    let per = |who| -> Result<f64, String> {
        let (big, _) = b.callgrind(who, n)?;
        let (small, _) = b.callgrind(who, n0)?;
        Ok(per_message(big as f64, small as f64, n, n0))
    };
    let (raw, lily) = (per(Contender::Raw)?, per(Contender::Lily)?);
    Ok(json!({
        "method": format!(
            "valgrind --tool=callgrind, `Collected` instructions of the whole child process (all \
             threads, lapin's I/O thread included), tokio current-thread runtime; per message = \
             (I(N) - I(N0)) / (N - N0) with N = {n}, N0 = {n0}; Lily's layer = Lily - raw (both \
             queue ACKs on the channel)"
        ),
        "n": n,
        "n0": n0,
        "raw": raw,
        "lily": lily,
        "lily_layer": lily - raw,
        "target": TARGET_INSTRUCTIONS,
        "met": lily - raw <= TARGET_INSTRUCTIONS,
    }))
}

/// One memory child: waits for `IDLE`, publishes `k` messages, reads `RESULT`.
fn memory_child(b: &Bench, who: Contender, k: usize) -> Result<Value, String> {
    let queue = format!("lily-bench-cost-mem-{}", who.name());
    b.queue_with(&queue, 0);
    let mut child = Command::new(&b.exe)
        .env("LILY_AMQP_URL", &b.url)
        .arg("cost")
        .arg(format!("mem-{}", who.name()))
        .arg(k.to_string())
        .arg(&queue)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("spawn mem-{}: {e}", who.name()))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut result = None;
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        if line.starts_with("IDLE ") {
            b.rt.block_on(publish(&b.url, &queue, k, &body_512()));
        } else if let Some(json) = line.strip_prefix("RESULT ") {
            result = serde_json::from_str::<Value>(json).ok();
        }
    }
    let status = child.wait().map_err(|e| format!("wait: {e}"))?;
    match result {
        Some(r) if status.success() => Ok(r),
        _ => Err(format!("mem-{} failed ({status})", who.name())),
    }
}

/// Memory per in-flight delivery.
fn memory(b: &Bench) -> Result<Value, String> {
    let k = b.options.in_flight;
    let mut out = serde_json::Map::new();
    for who in [Contender::Raw, Contender::Lily] {
        let r = memory_child(b, who, k)?;
        let delta = |key: &str| {
            (r["full"][key].as_f64().unwrap_or(f64::NAN)
                - r["idle"][key].as_f64().unwrap_or(f64::NAN))
                / k as f64
        };
        let summary = json!({
            "rss_idle_bytes": r["idle"]["rss_bytes"],
            "rss_in_flight_bytes": r["full"]["rss_bytes"],
            "hwm_bytes": r["full"]["hwm_bytes"],
            "rss_per_delivery": delta("rss_bytes"),
            "heap_per_delivery": delta("heap_live_bytes"),
            "heap_blocks_per_delivery": delta("heap_live_blocks"),
            "in_flight": r["in_flight"],
        });
        eprintln!("cost: memory {}: {summary}", who.name());
        out.insert(who.name().into(), summary);
    }
    let d = |who: &str, key: &str| out[who][key].as_f64().unwrap_or(f64::NAN);
    let extra = json!({
        "rss_per_delivery": d("lily", "rss_per_delivery") - d("raw", "rss_per_delivery"),
        "heap_per_delivery": d("lily", "heap_per_delivery") - d("raw", "heap_per_delivery"),
        "heap_blocks_per_delivery": d("lily", "heap_blocks_per_delivery") - d("raw", "heap_blocks_per_delivery"),
    });
    let beyond_body = json!({
        "rss_per_delivery": d("lily", "rss_per_delivery") - 512.0,
        "heap_per_delivery": d("lily", "heap_per_delivery") - 512.0,
    });
    Ok(json!({
        "method": format!(
            "child process per contender, multi-thread runtime, prefetch = concurrency = {k}; \
             VmRSS (/proc/self/status) and live heap (counting allocator) sampled idle \
             (consuming, nothing in flight) and with {k} deliveries held; per delivery = \
             (in flight - idle) / {k}. raw holds lapin deliveries unacked in a Vec; Lily's \
             handler takes no argument and waits on a shared CancellationToken"
        ),
        "in_flight": k,
        "raw": out["raw"],
        "lily": out["lily"],
        "lily_extra_over_raw": extra,
        "lily_beyond_512_byte_body": beyond_body,
    }))
}

/// Shutdown latency of an idle `k8s-shutdown`.
fn shutdown_latency(b: &Bench) -> Result<Value, String> {
    let subject = shutdown::subject()?;
    let runs = b.options.shutdown_runs;
    let idle = shutdown::measure(&b.rt, &b.url, &subject, runs)?;
    let idle_ms = field(&idle, "median_ms");
    Ok(json!({
        "method": format!(
            "examples/k8s-shutdown as a child (SIGTERM handled by Shutdown::listen_for_signals); \
             SIGTERM sent {} ms after its log says `consuming`; time from kill(2) until the \
             process has exited (waitpid); median of {runs} runs",
            shutdown::SETTLE.as_millis()
        ),
        "idle": idle,
        "target_idle_ms": TARGET_IDLE_SHUTDOWN_MS,
        "met": idle_ms < TARGET_IDLE_SHUTDOWN_MS,
    }))
}

fn orchestrate(options: &Options) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(err) => {
            eprintln!("cost: current_exe: {err}");
            return ExitCode::FAILURE;
        }
    };
    let b = Bench {
        rt: runtime(true),
        url: broker_url(),
        exe,
        options: options.clone(),
    };
    let earlier = options.merge.as_ref().map(|path| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|text| serde_json::from_str::<Value>(&text).ok())
            .unwrap_or_else(|| {
                eprintln!(
                    "cost: --merge {}: no cost.json there; not merging",
                    path.display()
                );
                Value::Null
            })
    });
    let mut results = json!({
        "schema": "lily.bench.cost.v1",
        "broker": crate::throughput::broker_version(),
        "queue_type": "classic",
        "prefetch": PREFETCH,
        "message_bytes": body_512().len(),
        "message": "JSON order, type order.placed, persistent, with message_id",
        "runtime": "tokio current-thread",
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
    });
    if let Some(Value::Object(earlier)) = earlier {
        for (key, value) in earlier {
            if results.get(&key).is_none() {
                results[key] = value;
            }
        }
    }
    let mut failed = Vec::new();
    let steps: [(&str, Step); 6] = [
        ("allocations", allocations),
        ("instructions", instructions),
        ("reader", reader_instructions),
        ("memory", memory),
        ("shutdown", shutdown_latency),
        ("hostile", hostile::measure),
    ];
    for (name, step) in steps {
        let short = if name == "allocations" {
            "allocs"
        } else {
            name
        };
        if !(options.wants(name) || options.wants(short)) {
            continue;
        }
        eprintln!("cost: measuring {name}");
        let started = Instant::now();
        match step(&b) {
            // The hostile load states a bound: over it, or a message missing, fails the run.
            Ok(value) if value["fail"].as_array().is_some_and(|f| !f.is_empty()) => {
                eprintln!("cost: {name} FAIL: {}", value["fail"]);
                results[name] = value;
                failed.push(name);
            }
            Ok(value) => results[name] = value,
            Err(err) => {
                eprintln!("cost: {name} failed: {err}");
                results[name] = json!({ "error": err });
                failed.push(name);
            }
        }
        eprintln!("cost: {name} took {:.0} s", started.elapsed().as_secs_f64());
    }
    let dir = b
        .exe
        .parent()
        .and_then(Path::parent)
        .map_or_else(|| PathBuf::from("target"), Path::to_path_buf)
        .join("bench");
    crate::report::write(&dir, "cost", &results, &crate::report::cost(&results), None);
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("cost: failed or not measured: {}", failed.join(", "));
        ExitCode::FAILURE
    }
}
