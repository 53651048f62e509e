//! Shutdown latency of the `k8s-shutdown` example service: SIGTERM to process exit.
//!
//! For each run: a fresh classic queue, optionally `work.item` messages published first, then the
//! service starts (`LILY_QUEUE`, `LILY_PREFETCH`, `WORK_MS`); once its log says `consuming` and,
//! idle, 300 ms passed or, busy, the broker has no message left ready (all handed to the
//! consumer), SIGTERM is sent and the time until the process has exited is taken. The
//! number of deliveries in flight at the trigger is read from the `shutdown phase ... Draining
//! ... in_flight=N` log line, and the JSON report on stdout is kept.

use std::io::{BufRead as _, BufReader, Read as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use lily::consumer::Policy;
use lily::prelude::QueueKind;
use rustix::process::{Pid, Signal, kill_process};
use serde_json::{Value, json};
use tokio::runtime::Runtime;

use crate::{body_512, fresh_topology, median, publish_typed};

/// The binary under test, next to this one.
pub const SUBJECT: &str = "k8s-shutdown";

/// One case of the measurement.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub name: &'static str,
    pub prefetch: u16,
    pub work_ms: u64,
    /// Messages published before the service starts.
    pub backlog: usize,
    /// Time between `consuming` in the log and SIGTERM.
    pub settle: Duration,
    /// Send SIGTERM only once the broker has handed every published message to the consumer
    /// (a passive `queue.declare` reports none ready).
    pub wait_delivered: bool,
}

pub const IDLE: Case = Case {
    name: "idle",
    prefetch: 50,
    work_ms: 0,
    backlog: 0,
    settle: Duration::from_millis(300),
    wait_delivered: false,
};

pub const BUSY: Case = Case {
    name: "in_flight_1000",
    prefetch: 1000,
    work_ms: 50,
    backlog: 1000,
    settle: Duration::ZERO,
    wait_delivered: true,
};

/// Where `k8s-shutdown` should be: beside the running executable (`target/release/`).
pub fn subject() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let path = exe.with_file_name(SUBJECT);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} not found: build it first with `cargo build --release -p \
             lily-mq-example-k8s-shutdown` (scripts/bench.sh should build it before running cost)",
            path.display()
        ))
    }
}

/// Waits until `queue` has no ready message left: the broker handed them all to the consumer.
async fn all_delivered(url: &str, queue: &str) -> Result<(), String> {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| format!("channel: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let result = loop {
        let declared = channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| format!("passive queue.declare: {e}"));
        match declared {
            Ok(q) if q.message_count() == 0 => break Ok(()),
            Ok(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok(q) => {
                break Err(format!(
                    "{} messages still ready after 30 s",
                    q.message_count()
                ));
            }
            Err(err) => break Err(err),
        }
    };
    // Closing takes a round trip: leave it to run after SIGTERM is sent.
    tokio::spawn(async move {
        let _ = connection.close(200, "polled".into()).await;
    });
    result
}

/// One SIGTERM-to-exit measurement.
fn once(rt: &Runtime, url: &str, exe: &Path, case: Case, queue: &str) -> Result<Value, String> {
    rt.block_on(async {
        fresh_topology(
            url,
            queue,
            QueueKind::Classic,
            &Policy::default().retry_delays,
        )
        .await;
        if case.backlog > 0 {
            // `work.item` is the type `k8s-shutdown` routes.
            publish_typed(url, queue, case.backlog, &body_512(), "work.item").await;
        }
    });
    let mut child = Command::new(exe)
        .env("LILY_AMQP_URL", url)
        .env("LILY_QUEUE", queue)
        .env("LILY_PREFETCH", case.prefetch.to_string())
        .env("WORK_MS", case.work_ms.to_string())
        .env("LILY_SHUTDOWN_BUDGET_MS", "25000")
        .env("RUST_LOG", "warn,lily_mq_rabbit=info")
        .env_remove("LILY_HEALTH_ADDR")
        .env_remove("LILY_REPORT_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", exe.display()))?;
    let pid = Pid::from_child(&child);
    let mut stdout = child.stdout.take().ok_or("no stdout")?;
    let stderr = child.stderr.take().ok_or("no stderr")?;
    let out_reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let (line_tx, line_rx) = mpsc::channel::<String>();
    let err_reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = line_tx.send(line);
        }
    });
    let mut log = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let started = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match line_rx.recv_timeout(left) {
            Ok(line) => {
                let hit = line.contains("consuming");
                log.push(line);
                if hit {
                    break Ok(());
                }
            }
            Err(_) => break Err("the service did not log `consuming` within 60 s"),
        }
    };
    if let Err(err) = started {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("{err}; its log:\n{}", log.join("\n")));
    }
    std::thread::sleep(case.settle);
    if case.wait_delivered {
        let ready = rt.block_on(all_delivered(url, queue));
        if let Err(err) = ready {
            let _ = child.kill();
            let _ = child.wait();
            return Err(err);
        }
    }

    // A watchdog: the budget (25 s) bounds the shutdown; past 60 s the process is killed.
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if done_rx.recv_timeout(Duration::from_secs(60)).is_err() {
            let _ = kill_process(pid, Signal::KILL);
        }
    });
    let t0 = Instant::now();
    kill_process(pid, Signal::TERM).map_err(|e| format!("kill -TERM: {e}"))?;
    let status = child.wait().map_err(|e| format!("wait: {e}"))?;
    let latency = t0.elapsed();
    let _ = done_tx.send(());
    let _ = watchdog.join();
    let _ = err_reader.join();
    log.extend(line_rx.try_iter());
    let report_text = out_reader.join().unwrap_or_default();
    let report: Value = serde_json::from_str(report_text.trim()).unwrap_or(Value::Null);
    let in_flight = log
        .iter()
        .find(|l| l.contains("shutdown phase") && l.contains("Draining"))
        .and_then(|l| l.split("in_flight=").nth(1))
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse::<u64>().ok());
    Ok(json!({
        "latency_ms": latency.as_secs_f64() * 1e3,
        "exit_code": status.code(),
        "in_flight_at_sigterm": in_flight,
        "report_budget_used_ms": report.get("budget_used_ms"),
        "report_clean": report.get("clean"),
        "report_acked": report.pointer("/totals/acked"),
    }))
}

/// `runs` measurements of `case`; the median latency and every run.
pub fn measure(
    rt: &Runtime,
    url: &str,
    exe: &Path,
    case: Case,
    runs: usize,
) -> Result<Value, String> {
    let queue = format!("lily-bench-cost-shutdown-{}", case.name);
    let mut all = Vec::new();
    for i in 0..runs {
        let run = once(rt, url, exe, case, &queue)?;
        eprintln!(
            "cost: shutdown {} run {}: {:.1} ms (in flight at SIGTERM: {}, exit {})",
            case.name,
            i + 1,
            run["latency_ms"].as_f64().unwrap_or(f64::NAN),
            run["in_flight_at_sigterm"],
            run["exit_code"],
        );
        all.push(run);
    }
    let mut latencies: Vec<f64> = all
        .iter()
        .filter_map(|r| r["latency_ms"].as_f64())
        .collect();
    let mut in_flight: Vec<f64> = all
        .iter()
        .filter_map(|r| r["in_flight_at_sigterm"].as_f64())
        .collect();
    Ok(json!({
        "prefetch": case.prefetch,
        "work_ms": case.work_ms,
        "backlog": case.backlog,
        "runs": runs,
        "median_ms": median(&mut latencies),
        "median_in_flight_at_sigterm": median(&mut in_flight),
        "all_exits_clean": all.iter().all(|r| r["exit_code"] == json!(0)),
        "each": all,
    }))
}
