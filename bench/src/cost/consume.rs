//! The children `run-raw N QUEUE` and `run-lily N QUEUE`: consume exactly `N` pre-published
//! 512-byte JSON orders (prefetch 50), close and print what the counting allocator saw over the
//! whole process.
//!
//! - raw: a hand-written lapin consumer: `basic.qos`, `basic.consume`, then for each delivery
//!   deserialize the `Order` and `basic.ack` it the way Lily does (`Channel::basic_ack`, the
//!   frame queued, its socket write not awaited); at the end a `basic.qos` round trip proves
//!   the ACKs were processed (as Lily does), then channel and connection close.
//! - Lily: `Consumer::run` with a `Router` whose handler takes `Json<Order>` and returns `Ok`;
//!   when `N` deliveries are acked, `Shutdown::trigger(Trigger::Api)`.
//!
//! Both count handled messages in a static atomic, and the Lily child waits on a static `Notify`
//! rather than polling, so that time (dilated under valgrind) adds no per-message work.

use std::future::{Future as _, poll_fn};
use std::hint::black_box;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use futures_core::Stream;
use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicQosOptions};
use lily::prelude::{Consumer, ConsumerConfig, Json, QueueHandlerError, Router, Shutdown, Trigger};
use tokio::sync::Notify;

use super::{Contender, PREFETCH, alloc_snapshot, runtime};
use crate::{Order, broker_url};

static HANDLED: AtomicUsize = AtomicUsize::new(0);
static TARGET: AtomicUsize = AtomicUsize::new(usize::MAX);
static DONE: Notify = Notify::const_new();

fn handled() {
    if HANDLED.fetch_add(1, Ordering::Relaxed) + 1 == TARGET.load(Ordering::Relaxed) {
        DONE.notify_one();
    }
}

/// Lily's handler: the typed order, nothing else.
async fn place(Json(order): Json<Order>) -> Result<(), QueueHandlerError> {
    black_box(&order);
    handled();
    Ok(())
}

async fn lily(url: &str, queue: &str, n: usize) -> Result<(), String> {
    TARGET.store(n, Ordering::Relaxed);
    let router = Router::new().route("order.placed", place);
    let config = ConsumerConfig::new(queue)
        .prefetch(PREFETCH)
        .concurrency(usize::from(PREFETCH));
    let consumer = Consumer::new(url, config, router);
    let stats = consumer.stats();
    let shutdown = Shutdown::default();
    let run = tokio::spawn(consumer.run(shutdown.clone()));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !stats.ready() {
        if run.is_finished() || Instant::now() > deadline {
            return Err("Lily's consumer did not start consuming".into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    if n > 0 {
        DONE.notified().await;
    }
    // The last handler returned; its ACK follows within microseconds.
    while stats.totals().acked < n as u64 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    shutdown.trigger(Trigger::Api);
    let report = run
        .await
        .map_err(|e| format!("consumer task: {e}"))?
        .map_err(|e| format!("consumer: {e}"))?;
    if report.totals.acked != n as u64 || !report.clean {
        return Err(format!(
            "expected {n} clean ACKs, the report says {:?} (clean: {})",
            report.totals, report.clean
        ));
    }
    Ok(())
}

async fn raw(url: &str, queue: &str, n: usize) -> Result<(), String> {
    let e = |what: &'static str| move |err: lapin::Error| format!("{what}: {err}");
    let (connection, channel, mut consumer) = crate::raw::open(url, queue, PREFETCH, false).await?;
    for _ in 0..n {
        let delivery = poll_fn(|cx| Pin::new(&mut consumer).poll_next(cx))
            .await
            .ok_or("the consumer ended")?
            .map_err(e("delivery"))?;
        let order: Order =
            serde_json::from_slice(&delivery.data).map_err(|err| format!("json: {err}"))?;
        black_box(&order);
        handled();
        queue_ack(&channel, delivery.delivery_tag).map_err(e("ack"))?;
    }
    // A round trip proves the broker processed the ACKs (Lily does the same before closing).
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await
        .map_err(e("basic.qos"))?;
    let _ = channel.close(200, "done".into()).await;
    let _ = connection.close(200, "done".into()).await;
    Ok(())
}

/// Queues the ACK frame on `channel` (one poll of `basic_ack`) without awaiting its write; the
/// final `basic.qos` round trip proves it, as in Lily.
pub(crate) fn queue_ack(channel: &Channel, tag: u64) -> lapin::Result<()> {
    let ack = pin!(channel.basic_ack(tag, BasicAckOptions::default()));
    match ack.poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Err(err)) => Err(err),
        _ => Ok(()),
    }
}

/// Entry point of `run-raw` / `run-lily`: `N QUEUE`.
pub fn child(who: Contender, args: &[String]) -> Result<serde_json::Value, String> {
    let n: usize = args
        .first()
        .and_then(|a| a.parse().ok())
        .ok_or("usage: cost run-raw|run-lily N QUEUE")?;
    let queue = args.get(1).ok_or("missing QUEUE")?;
    let url = broker_url();
    let rt = runtime(false);
    let started = Instant::now();
    rt.block_on(async {
        match who {
            Contender::Raw => raw(&url, queue, n).await,
            Contender::Lily => lily(&url, queue, n).await,
        }
    })?;
    let elapsed = started.elapsed();
    let stats = alloc_snapshot();
    drop(rt);
    Ok(serde_json::json!({
        "contender": who.name(),
        "n": n,
        "handled": HANDLED.load(Ordering::Relaxed),
        "allocations": stats.allocations,
        "reallocations": stats.reallocations,
        "bytes_allocated": stats.bytes_allocated,
        "elapsed_ms": elapsed.as_secs_f64() * 1e3,
    }))
}
