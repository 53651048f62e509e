//! What every program's runs share: the harness (fresh topology, backlog published), the Lily
//! consumer started and stopped, the sample of a timed drain, and the handoff path's policy.

use std::time::{Duration, Instant};

use lily::consumer::{Consumer, Policy, Stats, Totals};
use lily::prelude::{QueueKind, Shutdown, Trigger};
use lily::shutdown::ShutdownReport;
use lily::topology::Topology;
use serde::Serialize;
use tokio::task::JoinHandle;

use crate::{fresh_topology, publish};

/// Longest a run may take before it is given up: 60 s plus 1 ms a message.
pub fn run_limit(n: u64) -> Duration {
    Duration::from_secs(60) + Duration::from_millis(n)
}

/// Retry delay of the handoff path: long, so the copies stay parked in the bucket.
pub const HANDOFF_DELAY: Duration = Duration::from_secs(600);

/// The reason every handoff-path handler fails with.
pub const FAILURE_REASON: &str = "bench: every message fails once";

/// The reason every storm handler fails with, every attempt.
pub const STORM_REASON: &str = "bench: every attempt fails (storm)";

/// The policy of the handoff path: one retry, parked for [`HANDOFF_DELAY`].
pub fn handoff_policy() -> Policy {
    Policy::default()
        .max_attempts(2)
        .retry_delays([HANDOFF_DELAY])
}

/// A fresh topology for `queue` holding a backlog of `n` 512-byte orders, the broker given half
/// a second to write it before a clock starts.
pub async fn backlog(
    url: &str,
    queue: &str,
    kind: QueueKind,
    delays: &[Duration],
    n: u64,
) -> Topology {
    let topology = fresh_topology(url, queue, kind, delays).await;
    let n = usize::try_from(n).expect("message count fits usize");
    publish(url, queue, n).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    topology
}

/// The order in which `n` contenders run in repetition `rep` (from 1): as given in odd ones,
/// reversed in even ones, so drifting noise weighs on each alike.
pub fn in_turn(n: usize, rep: u32) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if rep.is_multiple_of(2) {
        order.reverse();
    }
    order
}

/// A Lily consumer running on a task of its own.
pub struct Lily {
    pub stats: Stats,
    shutdown: Shutdown,
    task: JoinHandle<Result<ShutdownReport, lily::Error>>,
}

impl Lily {
    /// Starts `consumer`.
    pub fn start(consumer: Consumer) -> Self {
        let (stats, shutdown) = (consumer.stats(), Shutdown::default());
        let task = tokio::spawn(consumer.run(shutdown.clone()));
        Self {
            stats,
            shutdown,
            task,
        }
    }

    /// Starts `consumer` and waits (up to a minute) until it consumes.
    ///
    /// # Errors
    /// When it stopped or took longer.
    pub async fn ready(consumer: Consumer) -> Result<Self, String> {
        let lily = Self::start(consumer);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !lily.stats.ready() {
            if lily.finished() || Instant::now() > deadline {
                return Err("Lily's consumer did not start consuming".into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(lily)
    }

    pub fn finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Shuts it down and returns its report; says so on stderr when it did not end cleanly or
    /// a delivery ended otherwise than ACKed or handed off.
    ///
    /// # Errors
    /// When the consumer failed.
    pub async fn stop(self) -> Result<ShutdownReport, String> {
        self.shutdown.trigger(Trigger::Api);
        let report = match self.task.await {
            Ok(Ok(report)) => report,
            Ok(Err(err)) => return Err(format!("Lily consumer failed: {err}")),
            Err(err) => return Err(format!("Lily consumer task: {err}")),
        };
        if report.exit_code() != 0 || unexpected(&report.totals) > 0 {
            eprintln!(
                "  Lily: exit code {}, totals {:?}",
                report.exit_code(),
                report.totals
            );
        }
        Ok(report)
    }

    /// [`Self::stop`], logging a failure; Lily's totals.
    pub async fn stopped(self) -> Totals {
        let stats = self.stats.clone();
        if let Err(err) = self.stop().await {
            eprintln!("  {err}");
        }
        stats.totals()
    }
}

/// Deliveries that ended otherwise than ACKed or handed off.
pub fn unexpected(t: &Totals) -> u64 {
    t.requeued + t.dead_lettered + t.parked + t.unresolved
}

/// One measured run.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Sample {
    /// Messages settled when the clock stopped, of `expected`.
    pub settled: u64,
    pub expected: u64,
    /// Seconds from consumer start until `expected` were settled (or the run gave up).
    pub secs: f64,
    pub msgs_per_sec: f64,
    pub complete: bool,
    /// CPU of this process and of the broker's VM per settled message, in µs.
    pub client_cpu_us_per_msg: Option<f64>,
    pub broker_cpu_us_per_msg: Option<f64>,
    /// Ready messages left in the work queue after the contender stopped (should be 0).
    pub left_in_queue: Option<u32>,
    /// Seconds until the first delivery reached the contender's own code (its start).
    pub first_delivery_secs: Option<f64>,
    /// `settled` over the seconds from the first delivery on.
    pub steady_msgs_per_sec: Option<f64>,
}

impl Sample {
    #[allow(clippy::cast_precision_loss)]
    pub fn new(settled: u64, expected: u64, elapsed: Duration) -> Self {
        let secs = elapsed.as_secs_f64();
        let rate = settled as f64 / secs;
        Self {
            settled,
            expected,
            secs,
            msgs_per_sec: if rate.is_finite() { rate } else { 0.0 },
            complete: settled >= expected,
            ..Self::default()
        }
    }

    /// Adds when the first delivery of a run that started at `started` was seen, and the steady
    /// rate from then on.
    #[allow(clippy::cast_precision_loss)]
    pub fn first_seen(mut self, started: Instant, first: &FirstDelivery) -> Self {
        if let Some(&first) = first.get() {
            let before = first.saturating_duration_since(started).as_secs_f64();
            self.first_delivery_secs = Some(before);
            let after = self.secs - before;
            self.steady_msgs_per_sec = (after > 0.0).then(|| self.settled as f64 / after);
        }
        self
    }
}

/// When a run's first delivery reached the contender's own code (`get_or_init(Instant::now)`).
pub type FirstDelivery = std::sync::OnceLock<Instant>;

#[cfg(test)]
mod tests {
    use super::in_turn;

    #[test]
    fn every_other_repetition_runs_the_contenders_in_reverse() {
        assert_eq!(in_turn(3, 1), [0, 1, 2]);
        assert_eq!(in_turn(3, 2), [2, 1, 0]);
        assert_eq!(in_turn(3, 3), [0, 1, 2]);
        assert_eq!(in_turn(1, 2), [0]);
    }
}
