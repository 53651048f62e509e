//! What every contender's run shares: its sample, its time limit, when its first delivery came,
//! and the retry copies' headers and failure reason.

use std::time::{Duration, Instant};

use serde::Serialize;

/// Longest a run may take before it is given up: 60 s plus 1 ms a message.
pub fn run_limit(n: u64) -> Duration {
    Duration::from_secs(60) + Duration::from_millis(n)
}

/// One measured run.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Sample {
    /// Messages settled when the clock stopped.
    pub settled: u64,
    /// Messages the run waited for.
    pub expected: u64,
    /// Seconds from consumer start until `expected` were settled (or the run gave up).
    pub secs: f64,
    /// `settled / secs`.
    pub msgs_per_sec: f64,
    /// All `expected` messages were settled.
    pub complete: bool,
    /// CPU of this process (every thread) per settled message, connect to close, in µs.
    pub client_cpu_us_per_msg: Option<f64>,
    /// CPU of the broker's Erlang VM per settled message over the same window, in µs.
    pub broker_cpu_us_per_msg: Option<f64>,
    /// Ready messages left in the work queue after the contender stopped (should be 0; more
    /// means deliveries counted as settled were requeued when it closed).
    pub left_in_queue: Option<u32>,
    /// Seconds from consumer start until the first delivery reached the contender's own code
    /// (its loop, or Lily's handler): connect, topology and consume, the start.
    pub first_delivery_secs: Option<f64>,
    /// `settled` over the seconds from the first delivery on: the steady rate, the start left
    /// out (it is measured on its own, see `report::Start`).
    pub steady_msgs_per_sec: Option<f64>,
}

impl Sample {
    pub fn new(settled: u64, expected: u64, elapsed: Duration) -> Self {
        let secs = elapsed.as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let msgs_per_sec = if secs > 0.0 {
            settled as f64 / secs
        } else {
            0.0
        };
        Self {
            settled,
            expected,
            secs,
            msgs_per_sec,
            complete: settled >= expected,
            client_cpu_us_per_msg: None,
            broker_cpu_us_per_msg: None,
            left_in_queue: None,
            first_delivery_secs: None,
            steady_msgs_per_sec: None,
        }
    }

    /// Adds when the first delivery of a run that started at `started` was seen, and the steady
    /// rate from then on.
    pub fn first_seen(mut self, started: Instant, first: &FirstDelivery) -> Self {
        let Some(&first) = first.get() else {
            return self;
        };
        let before = first.saturating_duration_since(started).as_secs_f64();
        let after = self.secs - before;
        self.first_delivery_secs = Some(before);
        #[allow(clippy::cast_precision_loss)]
        if after > 0.0 {
            self.steady_msgs_per_sec = Some(self.settled as f64 / after);
        }
        self
    }
}

/// When a run's first delivery reached the contender's own code; every contender sets it the
/// same way, `get_or_init(Instant::now)` for each delivery.
pub type FirstDelivery = std::sync::OnceLock<Instant>;

/// Headers of a retry copy (Lily's names; the raw contender writes the same set).
pub mod copy_headers {
    pub const ATTEMPT: &str = "x-lily-attempt";
    pub const FIRST_FAILURE_AT: &str = "x-lily-first-failure-at";
    pub const LAST_FAILURE_AT: &str = "x-lily-last-failure-at";
    pub const FAILURE_KIND: &str = "x-lily-failure-kind";
    pub const REASON: &str = "x-lily-reason";
    pub const SOURCE_QUEUE: &str = "x-lily-source-queue";
    pub const ORIGINAL_EXCHANGE: &str = "x-lily-original-exchange";
    pub const ORIGINAL_ROUTING_KEY: &str = "x-lily-original-routing-key";
}

/// The reason every handoff-path handler fails with.
pub const FAILURE_REASON: &str = "bench: every message fails once";
