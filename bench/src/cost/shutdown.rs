//! Shutdown latency of the idle `k8s-shutdown` example service: on a fresh classic queue,
//! SIGTERM [`SETTLE`] after its log says `consuming`, to the process's exit.

use std::io::{BufRead as _, BufReader, Read as _};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use lily::consumer::Policy;
use lily::prelude::QueueKind;
use rustix::process::{Pid, Signal, kill_process};
use serde::Serialize;
use serde_json::Value;
use tokio::runtime::Runtime;

use crate::{fresh_topology, median};

/// Time between `consuming` in the log and SIGTERM.
pub const SETTLE: Duration = Duration::from_millis(300);

/// One SIGTERM-to-exit measurement: milliseconds, and whether it exited 0 with a clean report.
fn once(rt: &Runtime, url: &str, exe: &Path, queue: &str) -> Result<(f64, bool), String> {
    let retry = Policy::default().retry_delays;
    rt.block_on(fresh_topology(url, queue, QueueKind::Classic, &retry));
    let mut child = Command::new(exe)
        .env("LILY_AMQP_URL", url)
        .env("LILY_QUEUE", queue)
        .env("LILY_PREFETCH", "50")
        .env("WORK_MS", "0")
        .env("RUST_LOG", "warn,lily_mq_rabbit=info")
        .env_remove("LILY_HEALTH_ADDR")
        .env_remove("LILY_REPORT_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", exe.display()))?;
    // A watchdog: past two minutes (to `consuming`, then to its exit) the service is killed,
    // as it is at once when this returns early.
    let (pid, (done_tx, done_rx)) = (Pid::from_child(&child), mpsc::channel::<()>());
    std::thread::spawn(move || {
        if done_rx.recv_timeout(Duration::from_secs(120)).is_err() {
            let _ = kill_process(pid, Signal::KILL);
        }
    });
    let stderr = BufReader::new(child.stderr.take().ok_or("no stderr")?);
    let (mut lines, mut log) = (stderr.lines().map_while(Result::ok), Vec::new());
    while !log.last().is_some_and(|l: &String| l.contains("consuming")) {
        let Some(line) = lines.next() else {
            drop(done_tx);
            let _ = child.wait();
            let log = log.join("\n");
            return Err(format!(
                "the service ended before `consuming`; its log:\n{log}"
            ));
        };
        log.push(line);
    }
    // The rest of its log, read to its end so that the service never blocks on it.
    std::thread::spawn(move || lines.for_each(drop));
    std::thread::sleep(SETTLE);
    let t0 = Instant::now();
    kill_process(pid, Signal::TERM).map_err(|e| format!("kill -TERM: {e}"))?;
    let status = child.wait().map_err(|e| format!("wait: {e}"))?;
    let latency = t0.elapsed();
    let _ = done_tx.send(());
    // Its shutdown report, printed on stdout as it exits.
    let mut report = String::new();
    if let Some(mut out) = child.stdout.take() {
        let _ = out.read_to_string(&mut report);
    }
    let clean = serde_json::from_str(report.trim()).is_ok_and(|r: Value| r["clean"] == true);
    Ok((latency.as_secs_f64() * 1e3, status.success() && clean))
}

/// The idle service's shutdowns.
#[derive(Debug, Serialize)]
pub struct Idle {
    pub runs: usize,
    pub median_ms: f64,
    pub all_exits_clean: bool,
    pub met: bool,
}

/// `runs` measurements of the idle service.
pub fn measure(rt: &Runtime, url: &str, runs: usize) -> Result<Idle, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let exe = exe.with_file_name("k8s-shutdown");
    if !exe.is_file() {
        return Err(format!(
            "{} not found: build it first with `cargo build --release -p \
             lily-mq-example-k8s-shutdown` (scripts/bench.sh builds it)",
            exe.display()
        ));
    }
    let (mut latencies, mut all_exits_clean) = (Vec::new(), true);
    for i in 0..runs {
        let (ms, clean) = once(rt, url, &exe, "lily-bench-cost-shutdown")?;
        eprintln!("cost: shutdown run {}: {ms:.1} ms, clean {clean}", i + 1);
        latencies.push(ms);
        all_exits_clean &= clean;
    }
    let median_ms = median(&mut latencies);
    Ok(Idle {
        runs,
        median_ms,
        all_exits_clean,
        met: median_ms < super::TARGET_IDLE_SHUTDOWN_MS,
    })
}
