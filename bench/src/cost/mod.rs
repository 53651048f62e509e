//! `lily-bench cost`: what Lily's layer adds a message over a hand-written lapin consumer, memory
//! a delivery in flight, shutdown latency and the hostile load, each measured in a child process
//! of `lily-bench-counting`. Method: `bench/README.md`.

pub mod cli;
pub mod hostile;
pub mod memory;
pub mod reader;
pub mod shutdown;

use std::io::{BufRead as _, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use lapin::options::BasicQosOptions;
use lapin::{Channel, Connection};
use lily::consumer::Policy;
use lily::prelude::QueueKind;
use lily_mq_regress::collected;
use lily_mq_regress::consume::Who;
use rustix::process::{Pid, Signal, kill_process};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::runtime::Runtime;

/// The children's lapin errors read as the raw contenders' do.
pub(crate) use crate::raw::failed;
use crate::{fresh_topology, median, publish};

/// Messages of the long and the short (subtracted) runs, native and under valgrind; quick
/// under valgrind.
pub const N: [usize; 2] = [20_000, 2_000];
pub const QUICK_VALGRIND_N: [usize; 2] = [5_000, 500];
/// Deliveries held by the memory step.
pub const IN_FLIGHT: usize = 10_000;
/// Targets of Lily's layer: instructions and heap allocations a message; the idle shutdown in ms.
pub const TARGET_INSTRUCTIONS: f64 = 8000.0;
pub const TARGET_ALLOCATIONS: f64 = 10.0;
pub const TARGET_IDLE_SHUTDOWN_MS: f64 = 200.0;

/// Ends a raw consumer: a `basic.qos` round trip proves the broker processed the ACKs (Lily does
/// the same before closing), then the channel and the connection close.
async fn close_raw(connection: Connection, channel: Channel, prefetch: u16) -> Result<(), String> {
    let qos = channel.basic_qos(prefetch, BasicQosOptions::default());
    qos.await.map_err(failed("basic.qos"))?;
    let _ = channel.close(200, "done".into()).await;
    let _ = connection.close(200, "done".into()).await;
    Ok(())
}

/// A cost a message: raw, Lily, and Lily's layer (Lily − raw) against its target. Heap
/// allocations count alloc + alloc_zeroed + realloc calls (the median of the rounds);
/// instructions, every thread of the child under callgrind.
#[derive(Debug, Serialize)]
pub struct PerMessage {
    pub n: usize,
    pub n0: usize,
    pub raw: f64,
    pub lily: f64,
    pub lily_layer: f64,
    pub met: bool,
}

impl PerMessage {
    /// Lily's layer over raw, judged against `target`.
    fn new([n, n0]: [usize; 2], [raw, lily]: [f64; 2], target: f64) -> Self {
        Self {
            n,
            n0,
            raw,
            lily,
            lily_layer: lily - raw,
            met: lily - raw <= target,
        }
    }
}

/// Everything `cost` measured; a step that failed or did not run is absent.
#[derive(Debug, Serialize)]
pub struct Results {
    #[serde(flatten)]
    pub meta: crate::Meta,
    pub prefetch: u16,
    pub instructions: Option<PerMessage>,
    /// The frame reader alone: instructions a message.
    pub reader: Option<f64>,
    pub allocations: Option<PerMessage>,
    pub memory: Option<memory::Memory>,
    pub shutdown: Option<shutdown::Idle>,
    pub hostile: Option<hostile::Hostile>,
    /// Steps that failed, and why.
    pub errors: Vec<String>,
}

/// The value of a child's `RESULT` line.
pub fn result<T: DeserializeOwned>(line: &str) -> Option<T> {
    serde_json::from_str(line.strip_prefix("RESULT ")?).ok()
}

/// Starts `command` talking over its stdin and stdout, its stderr ours: the child and its
/// stdout's lines.
fn spawn(
    command: &mut Command,
) -> Result<(std::process::Child, impl Iterator<Item = String>), String> {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("spawn {command:?}: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    Ok((child, BufReader::new(stdout).lines().map_while(Result::ok)))
}

/// Runs `command` (a child printing `RESULT {json}`) to its end, bounded by `limit`: its result
/// and its stderr.
fn run_child<T: DeserializeOwned>(
    mut command: Command,
    limit: Duration,
) -> Result<(T, String), String> {
    let shown = format!("{command:?}");
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn {shown}: {e}"))?;
    let (pid, (tx, rx)) = (Pid::from_child(&child), mpsc::channel());
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    let Ok(output) = rx.recv_timeout(limit) else {
        let _ = kill_process(pid, Signal::KILL);
        return Err(format!("{shown} did not finish within {limit:?}"));
    };
    let output = output.map_err(|e| format!("wait: {e}"))?;
    let err = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() {
        let lines: Vec<&str> = err.lines().collect();
        let tail = lines[lines.len().saturating_sub(20)..].join("\n");
        return Err(format!("{shown} failed ({}):\n{tail}", output.status));
    }
    let value = String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(result);
    Ok((value.ok_or(format!("{shown} printed no RESULT line"))?, err))
}

/// `(run(N) - run(N0)) / (N - N0)`: a run's per-message cost, its fixed costs cancelled.
#[allow(clippy::cast_precision_loss)]
fn per_message(
    [n, n0]: [usize; 2],
    mut run: impl FnMut(usize) -> Result<f64, String>,
) -> Result<f64, String> {
    let big = run(n)?;
    Ok((big - run(n0)?) / (n - n0) as f64)
}

/// Everything the orchestrator shares with its steps.
pub struct Bench {
    pub rt: Runtime,
    pub url: String,
    /// Rounds of the allocation counts.
    pub reps: usize,
    /// Messages of the runs under callgrind.
    pub valgrind_n: [usize; 2],
}

impl Bench {
    /// A fresh classic queue (Lily's topology) holding `n` 512-byte orders.
    fn queue_with(&self, queue: &str, n: usize) {
        self.rt.block_on(async {
            let retry = Policy::default().retry_delays;
            fresh_topology(&self.url, queue, QueueKind::Classic, &retry).await;
            publish(&self.url, queue, n).await;
        });
    }

    /// This program as `cost CHILD ARGS…`, under valgrind's callgrind when asked, else under
    /// `LILY_BENCH_WRAP` when set; callgrind's profile goes to `LILY_BENCH_CALLGRIND_DIR`.
    fn child(&self, callgrind: bool, args: &[&str]) -> Command {
        let exe = std::env::current_exe().expect("current_exe");
        let mut words: Vec<String> = if callgrind {
            let out = std::env::var("LILY_BENCH_CALLGRIND_DIR")
                .map_or_else(|_| "/dev/null".into(), |dir| format!("{dir}/callgrind.%p"));
            let out = format!("--callgrind-out-file={out}");
            vec!["valgrind".into(), "--tool=callgrind".into(), out]
        } else {
            let wrap = std::env::var("LILY_BENCH_WRAP").unwrap_or_default();
            wrap.split_whitespace().map(str::to_owned).collect()
        };
        words.push(exe.to_string_lossy().into_owned());
        let mut command = Command::new(&words[0]);
        command.args(&words[1..]).env("LILY_AMQP_URL", &self.url);
        command.arg("cost").args(args);
        command
    }

    /// One `run` child of `who` over `n` orders: its heap allocation calls, and its stderr.
    fn consume(&self, who: Who, n: usize, callgrind: bool) -> Result<(f64, String), String> {
        let name = who.name().to_lowercase();
        let queue = format!("lily-bench-cost-{name}");
        self.queue_with(&queue, n);
        let limit = Duration::from_secs(if callgrind { 1800 } else { 300 });
        let args = ["run", &name, &n.to_string(), &queue];
        let ((handled, calls), stderr): ((usize, usize), _) =
            run_child(self.child(callgrind, &args), limit)?;
        if handled != n {
            return Err(format!("{name} handled {handled} of {n}"));
        }
        #[allow(clippy::cast_precision_loss)]
        Ok((calls as f64, stderr))
    }
}

/// Heap allocations a message, native runs: the median of `--reps` rounds.
pub fn allocations(b: &Bench) -> Result<PerMessage, String> {
    let mut rounds = [Vec::new(), Vec::new()];
    for round in 1..=b.reps {
        for (who, per) in [Who::Raw, Who::Lily].into_iter().zip(&mut rounds) {
            let x = per_message(N, |n| Ok(b.consume(who, n, false)?.0))?;
            eprintln!(
                "cost: allocations round {round}: {} {x:.2} a message",
                who.name()
            );
            per.push(x);
        }
    }
    let medians = rounds.map(|mut r| median(&mut r));
    Ok(PerMessage::new(N, medians, TARGET_ALLOCATIONS))
}

/// Instructions a message under callgrind, on tokio's current-thread runtime.
pub fn instructions(b: &Bench) -> Result<PerMessage, String> {
    let n = b.valgrind_n;
    let per = |who| per_message(n, |k| collected(&b.consume(who, k, true)?.1));
    let both = [per(Who::Raw)?, per(Who::Lily)?];
    Ok(PerMessage::new(n, both, TARGET_INSTRUCTIONS))
}

/// Instructions a message of Lily's frame reader alone, under callgrind: the frames of N or N0
/// deliveries read through it, minus the same frames read plainly.
pub fn reader_instructions(b: &Bench) -> Result<f64, String> {
    let n = b.valgrind_n;
    let total = n[0].to_string();
    let per = |plain: bool| {
        per_message(n, |k| {
            let k = k.to_string();
            let mut args = vec!["reader", &total, &k];
            args.extend(plain.then_some("--plain"));
            let limit = Duration::from_secs(600);
            let (_, stderr): (usize, _) = run_child(b.child(true, &args), limit)?;
            collected(&stderr)
        })
    };
    Ok(per(false)? - per(true)?)
}
