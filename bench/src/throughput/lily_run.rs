//! The Lily contender: a handler doing the raw contenders' work, settled by Lily.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lily::prelude::{ConsumerConfig, Json, Policy, QueueHandlerError, QueueKind, Router};
use tokio::sync::Notify;

use crate::Order;
use crate::run::{FAILURE_REASON, FirstDelivery, Lily, Sample, handoff_policy, run_limit};
use crate::throughput::Path;

/// How often the totals are polled once the handler has been called for every message.
const SETTLED_POLL: Duration = Duration::from_micros(50);

/// A consumer of `queue` (concurrency = prefetch) whose handler deserializes the order and
/// succeeds (success path) or fails retryably (handoff path), telling `progress`.
pub fn consumer(
    url: &str,
    queue: &str,
    kind: QueueKind,
    prefetch: u16,
    path: Path,
    progress: Option<Arc<Progress>>,
) -> lily::consumer::Consumer {
    let fails = path == Path::Handoff;
    let router = Router::new().route("order.placed", move |Json(o): Json<Order>| {
        if let Some(progress) = &progress {
            progress.handled();
        }
        async move {
            std::hint::black_box(o);
            if fails {
                return Err(QueueHandlerError::retryable(FAILURE_REASON));
            }
            Ok(())
        }
    });
    let policy = if fails {
        handoff_policy()
    } else {
        Policy::default()
    };
    let config = ConsumerConfig::new(queue)
        .queue_kind(kind)
        .prefetch(prefetch);
    let config = config.concurrency(usize::from(prefetch)).policy(policy);
    lily::consumer::Consumer::new(url, config, router)
}

/// What the handler tells the run: its first delivery, and when it has been called for every
/// message, so the run need not poll Lily's totals until then.
#[derive(Default)]
pub struct Progress {
    first: FirstDelivery,
    calls: AtomicU64,
    target: u64,
    all_called: Notify,
}

impl Progress {
    fn handled(&self) {
        self.first.get_or_init(Instant::now);
        if self.calls.fetch_add(1, Ordering::Relaxed) + 1 == self.target {
            self.all_called.notify_one();
        }
    }
}

/// Runs Lily until it has settled `n` messages. The totals are polled only once the handler has
/// been called `n` times (polling all along would cost Lily wake-ups no other contender pays),
/// then every `SETTLED_POLL` on a thread of its own: tokio's timer rounds a wait up to a whole
/// millisecond, while the raw contenders stop their clocks at their last ACK.
pub async fn run(
    url: &str,
    queue: &str,
    kind: QueueKind,
    prefetch: u16,
    n: u64,
    path: Path,
) -> Sample {
    let progress = Arc::new(Progress {
        target: n,
        ..Progress::default()
    });
    let started = Instant::now();
    let watched = Some(Arc::clone(&progress));
    let lily = Lily::start(consumer(url, queue, kind, prefetch, path, watched));
    let limit = run_limit(n);
    while started.elapsed() < limit && !lily.finished() {
        tokio::select! {
            () = progress.all_called.notified() => break,
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    let settled = move |stats: &lily::consumer::Stats| match path {
        Path::Success => stats.totals().acked,
        Path::Handoff => stats.totals().retried,
    };
    let polled = lily.stats.clone();
    let _ = tokio::task::spawn_blocking(move || {
        while settled(&polled) < n && started.elapsed() < limit {
            std::thread::sleep(SETTLED_POLL);
        }
    })
    .await;
    let elapsed = started.elapsed();
    let count = settled(&lily.stats);
    lily.stopped().await;
    Sample::new(count, n, elapsed).first_seen(started, &progress.first)
}
