//! Lily contenders: a handler doing the same work, settled by Lily.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lily::prelude::{
    Consumer, ConsumerConfig, Json, Policy, QueueHandlerError, QueueKind, Router, Shutdown, Trigger,
};

use tokio::sync::Notify;

use crate::Order;
use crate::throughput::{FAILURE_REASON, FirstDelivery, HANDOFF_DELAY, Sample, run_limit};

/// How often the totals are polled once the handler has been called for every message.
const SETTLED_POLL: Duration = Duration::from_micros(50);

/// Retry delays of the success path (Lily's default policy): its topology is the same for every
/// contender.
pub fn success_delays() -> Vec<Duration> {
    Policy::default().retry_delays
}

/// The policy of the handoff path: one retry, parked for [`HANDOFF_DELAY`].
pub fn handoff_policy() -> Policy {
    Policy::default()
        .max_attempts(2)
        .retry_delays([HANDOFF_DELAY])
}

fn config(queue: &str, kind: QueueKind, prefetch: u16, policy: Policy) -> ConsumerConfig {
    ConsumerConfig::new(queue)
        .queue_kind(kind)
        .prefetch(prefetch)
        .concurrency(usize::from(prefetch))
        .policy(policy)
}

/// Consumes `n` messages with a handler that deserializes and succeeds.
pub async fn success(url: &str, queue: &str, kind: QueueKind, prefetch: u16, n: u64) -> Sample {
    let progress = Arc::new(Progress::new(n));
    let seen = Arc::clone(&progress);
    let router = Router::new().route("order.placed", move |Json(o): Json<Order>| {
        seen.handled();
        async move {
            std::hint::black_box(o);
            Ok(())
        }
    });
    let consumer = Consumer::new(
        url,
        config(queue, kind, prefetch, Policy::default()),
        router,
    );
    measure(consumer, n, false, &progress).await
}

/// Consumes `n` messages with a handler that deserializes and fails retryably: Lily hands each
/// off to the retry bucket (confirmed) and ACKs it.
pub async fn handoff(url: &str, queue: &str, kind: QueueKind, prefetch: u16, n: u64) -> Sample {
    let progress = Arc::new(Progress::new(n));
    let seen = Arc::clone(&progress);
    let router = Router::new().route("order.placed", move |Json(o): Json<Order>| {
        seen.handled();
        async move {
            std::hint::black_box(o);
            Err::<(), _>(QueueHandlerError::retryable(FAILURE_REASON))
        }
    });
    let consumer = Consumer::new(url, config(queue, kind, prefetch, handoff_policy()), router);
    measure(consumer, n, true, &progress).await
}

/// What the handler reports to the run: when the first delivery reached it, and when it has
/// been called for every message, so the run need not poll Lily's totals until then.
struct Progress {
    first: FirstDelivery,
    calls: AtomicU64,
    target: u64,
    all_called: Notify,
}

impl Progress {
    fn new(target: u64) -> Self {
        Self {
            first: FirstDelivery::new(),
            calls: AtomicU64::new(0),
            target,
            all_called: Notify::new(),
        }
    }

    /// Called by the handler for each delivery.
    fn handled(&self) {
        self.first.get_or_init(Instant::now);
        if self.calls.fetch_add(1, Ordering::Relaxed) + 1 == self.target {
            self.all_called.notify_one();
        }
    }
}

/// Runs `consumer` until it has settled `n` messages. The totals are polled only once the
/// handler has been called `n` times (polling them all along would cost Lily's run wake-ups
/// that no other contender pays), then every [`SETTLED_POLL`] on a thread of its own: tokio's
/// timer rounds a wait up to a whole millisecond, which the run's time would count, while the
/// raw contenders stop their clocks the moment their last ACK is written.
async fn measure(consumer: Consumer, n: u64, retried: bool, progress: &Progress) -> Sample {
    let stats = consumer.stats();
    let shutdown = Shutdown::default();
    let started = Instant::now();
    let run = tokio::spawn(consumer.run(shutdown.clone()));
    let limit = run_limit(n);
    let settled = move |stats: &lily::consumer::Stats| {
        let totals = stats.totals();
        if retried {
            totals.retried
        } else {
            totals.acked
        }
    };
    while started.elapsed() < limit && !run.is_finished() {
        tokio::select! {
            () = progress.all_called.notified() => break,
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    let polled = stats.clone();
    let ended = run.abort_handle();
    let _ = tokio::task::spawn_blocking(move || {
        while settled(&polled) < n && started.elapsed() < limit && !ended.is_finished() {
            std::thread::sleep(SETTLED_POLL);
        }
    })
    .await;
    let elapsed = started.elapsed();
    let count = settled(&stats);
    shutdown.trigger(Trigger::Api);
    match run.await {
        Ok(Ok(report)) if report.exit_code() == 0 => {}
        Ok(Ok(report)) => eprintln!("Lily shutdown report exit code {}", report.exit_code()),
        Ok(Err(err)) => eprintln!("Lily consumer failed: {err}"),
        Err(err) => eprintln!("Lily consumer task: {err}"),
    }
    let totals = stats.totals();
    let other = totals.requeued + totals.dead_lettered + totals.parked + totals.unresolved;
    if std::env::var_os("LILY_BENCH_DEBUG").is_some() {
        eprintln!("Lily totals after shutdown: {totals:?}");
    }
    if other > 0 {
        eprintln!("Lily: unexpected outcomes {totals:?}");
    }
    Sample::new(count, n, elapsed).first_seen(started, &progress.first)
}
