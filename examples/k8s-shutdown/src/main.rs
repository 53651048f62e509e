//! `k8s-shutdown`: a Lily service shaped for a Kubernetes pod.
//!
//! SIGTERM starts a graceful shutdown within `LILY_SHUTDOWN_BUDGET_MS` (default 25 000, under
//! the pod's 30 s `terminationGracePeriodSeconds`); a second SIGTERM or SIGINT forces it. The
//! shutdown report goes to the log, as JSON to stdout (or `LILY_REPORT_FILE`), and as a short
//! summary to `/dev/termination-log` (or `LILY_TERMINATION_LOG`) when that file exists. The exit
//! code is 0 when settlement is clean and 3 when anything is unresolved.
//!
//! Environment:
//!
//! | variable | meaning |
//! |---|---|
//! | `LILY_AMQP_URL` | broker URL (required) |
//! | `LILY_AMQP_ADDRESSES` | more nodes of the cluster, `host:port,host:port` |
//! | `LILY_QUEUE` | work queue, default `work` |
//! | `LILY_QUEUE_TYPE` | `classic` (default) or `quorum` |
//! | `LILY_PREFETCH` | prefetch and concurrency, default 50 |
//! | `LILY_SHUTDOWN_BUDGET_MS` | whole shutdown budget, default 25000 |
//! | `LILY_HEALTH_ADDR` | serve `/livez` and `/readyz` here, e.g. `0.0.0.0:8080` |
//! | `LILY_REPORT_FILE` | write the JSON report here instead of stdout |
//! | `LILY_TERMINATION_LOG` | termination message file, default `/dev/termination-log` |
//! | `WORK_MS` | how long each `work.item` takes, default 0 |
//! | `WORK_AFTER_CANCEL_MS` | when cancelled, finish after this long; unset: stop at once |
//! | `WORK_IGNORES_CANCEL` | `1`: ignore cancellation entirely (a badly behaved handler) |

use std::process::{ExitCode, Termination};
use std::time::Duration;

use lily::prelude::*;

/// How the handler behaves, from the environment.
#[derive(Clone, Copy)]
struct Work {
    duration: Duration,
    after_cancel: Option<Duration>,
    ignores_cancel: bool,
}

/// Processes `work.item`: takes `WORK_MS`, and on cancellation either stops at once with a
/// retryable failure, finishes after `WORK_AFTER_CANCEL_MS`, or ignores it.
async fn work_item(
    work: Work,
    Cancellation(cancel): Cancellation,
) -> Result<(), QueueHandlerError> {
    if work.ignores_cancel {
        tokio::time::sleep(work.duration).await;
        return Ok(());
    }
    tokio::select! {
        () = tokio::time::sleep(work.duration) => Ok(()),
        () = cancel.cancelled() => match work.after_cancel {
            Some(rest) => {
                tokio::time::sleep(rest).await;
                Ok(())
            }
            None => Err(QueueHandlerError::retryable("cancelled at shutdown")),
        },
    }
}

fn env_ms(name: &str) -> Result<Option<Duration>, String> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map(|ms| Some(Duration::from_millis(ms)))
            .map_err(|_| format!("{name} must be a number of milliseconds")),
        Err(_) => Ok(None),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    lily::logging::init("warn,lily_mq_rabbit=info");
    match run().await {
        Ok(report) => report.report(),
        Err(err) => {
            eprintln!("k8s-shutdown: {err}");
            ExitCode::from(1)
        }
    }
}

async fn run() -> Result<ShutdownReport, Box<dyn std::error::Error>> {
    let url = std::env::var("LILY_AMQP_URL").map_err(|_| "LILY_AMQP_URL is not set")?;
    let queue = std::env::var("LILY_QUEUE").unwrap_or_else(|_| "work".into());
    let prefetch: u16 = std::env::var("LILY_PREFETCH")
        .ok()
        .map(|v| v.parse())
        .transpose()
        .map_err(|_| "LILY_PREFETCH must be a number")?
        .unwrap_or(50);
    let budget = env_ms("LILY_SHUTDOWN_BUDGET_MS")?.unwrap_or(Duration::from_secs(25));
    let work = Work {
        duration: env_ms("WORK_MS")?.unwrap_or_default(),
        after_cancel: env_ms("WORK_AFTER_CANCEL_MS")?,
        ignores_cancel: std::env::var("WORK_IGNORES_CANCEL").is_ok_and(|v| v == "1"),
    };

    let router = Router::new().route("work.item", move |cancel: Cancellation| {
        work_item(work, cancel)
    });
    let addresses = std::env::var("LILY_AMQP_ADDRESSES").unwrap_or_default();
    let kind = match std::env::var("LILY_QUEUE_TYPE").as_deref() {
        Err(_) | Ok("classic") => QueueKind::Classic,
        Ok("quorum") => QueueKind::Quorum,
        Ok(_) => return Err("LILY_QUEUE_TYPE must be classic or quorum".into()),
    };
    let config = ConsumerConfig::new(&queue)
        .queue_kind(kind)
        .addresses(addresses.split(',').filter(|a| !a.trim().is_empty()))
        .prefetch(prefetch)
        .concurrency(usize::from(prefetch))
        .handler_timeout(Duration::from_secs(300))
        .shutdown_budget(ShutdownBudget::new(budget));
    let consumer = Consumer::new(url, config, router);

    if let Ok(addr) = std::env::var("LILY_HEALTH_ADDR") {
        let addr = addr
            .parse()
            .map_err(|_| "LILY_HEALTH_ADDR must be host:port")?;
        let (bound, _task) = lily::health::serve(addr, consumer.stats()).await?;
        eprintln!("k8s-shutdown: health on http://{bound}/livez and /readyz");
    }

    let mut sinks = ReportSinks::default();
    if let Ok(path) = std::env::var("LILY_REPORT_FILE") {
        sinks = sinks.json_file(path);
    }
    if let Ok(path) = std::env::var("LILY_TERMINATION_LOG") {
        sinks = sinks.termination_log(path);
    }
    Ok(consumer.run_until_signal(sinks).await?)
}
