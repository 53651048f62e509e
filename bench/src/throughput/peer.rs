//! The peer: the same success path through ruststream-lapin.
//!
//! The handler deserializes the order (ruststream's JSON codec) and returns `ack`; it bumps a
//! counter first, so the count a run waits for precedes that message's ACK frame.

use std::num::{NonZeroU16, NonZeroUsize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use lily::prelude::QueueKind;
use ruststream_lapin::prelude::*;

use crate::Order;
use crate::run::Sample;
use crate::throughput::POLL;

/// Handled by the peer in the current run.
static HANDLED: AtomicU64 = AtomicU64::new(0);

#[subscriber("lily-bench-peer")]
async fn place(order: &Order) -> HandlerOutcome {
    std::hint::black_box(order);
    HANDLED.fetch_add(1, Ordering::Relaxed);
    HandlerOutcome::ack()
}

/// Consumes `n` messages from `queue` with ruststream-lapin: broker prefetch `prefetch`, a pool of
/// `prefetch` workers (Lily's concurrency), no topology declared.
pub async fn success(url: &str, queue: &str, kind: QueueKind, prefetch: u16, n: u64) -> Sample {
    HANDLED.store(0, Ordering::Relaxed);
    let window = NonZeroU16::new(prefetch).expect("prefetch above zero");
    let workers = NonZeroUsize::from(window);
    let broker = LapinBroker::new(url.to_owned()).prefetch(window);
    let name = queue.to_owned();
    let app =
        RustStream::new(AppInfo::new("lily-bench-peer", "0.1.0")).with_broker(
            broker,
            |b| match kind {
                QueueKind::Classic => b.include_router(
                    Router::new()
                        .include(place.map_source(move |_| RabbitQueue::new(name).prefetch(window)))
                        .workers(Workers::pool(workers)),
                ),
                QueueKind::Quorum => b.include_router(
                    Router::new()
                        .include(
                            place
                                .map_source(move |_| RabbitQuorumQueue::new(name).prefetch(window)),
                        )
                        .workers(Workers::pool(workers)),
                ),
            },
        );
    let started = Instant::now();
    let running = app.start().await.expect("peer starts");
    let limit = crate::run::run_limit(n);
    while HANDLED.load(Ordering::Relaxed) < n && started.elapsed() <= limit {
        tokio::time::sleep(POLL).await;
    }
    let elapsed = started.elapsed();
    let settled = HANDLED.load(Ordering::Relaxed);
    if let Err(err) = running.shutdown().await {
        eprintln!("peer shutdown: {err}");
    }
    Sample::new(settled, n, elapsed)
}
