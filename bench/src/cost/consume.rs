//! The `run` child: consumes exactly `N` pre-published orders (prefetch 50) with raw lapin or
//! Lily, closes, and reports what the counting allocator saw over the whole process. Handled
//! messages are counted in a static atomic and Lily's child waits on a static `Notify` rather
//! than polling, so time (dilated under valgrind) adds no work a message.

use std::future::{Future as _, poll_fn};
use std::hint::black_box;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_core::Stream;
use lapin::Channel;
use lapin::options::BasicAckOptions;
use lily::prelude::{Consumer, ConsumerConfig, Json, QueueHandlerError, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use super::{Contender, PREFETCH, alloc_snapshot, close_raw, failed, runtime};
use crate::run::Lily;
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
    let lily = Lily::ready(Consumer::new(url, config, router)).await?;
    if n > 0 {
        DONE.notified().await;
    }
    // The last handler returned; its ACK follows within microseconds.
    while lily.stats.totals().acked < n as u64 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let report = lily.stop().await?;
    if report.totals.acked != n as u64 || !report.clean {
        return Err(format!(
            "expected {n} clean ACKs, the report says {:?} (clean: {})",
            report.totals, report.clean
        ));
    }
    Ok(())
}

async fn raw(url: &str, queue: &str, n: usize) -> Result<(), String> {
    let (connection, channel, mut consumer) = crate::raw::open(url, queue, PREFETCH, false).await?;
    for _ in 0..n {
        let next = poll_fn(|cx| Pin::new(&mut consumer).poll_next(cx)).await;
        let delivery = next
            .ok_or("the consumer ended")?
            .map_err(failed("delivery"))?;
        let order: Order =
            serde_json::from_slice(&delivery.data).map_err(|err| format!("json: {err}"))?;
        black_box(&order);
        handled();
        queue_ack(&channel, delivery.delivery_tag).map_err(failed("ack"))?;
    }
    close_raw(connection, channel, PREFETCH).await
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

/// What a `run` child counted over its whole process.
#[derive(Debug, Serialize, Deserialize)]
pub struct Counted {
    pub handled: usize,
    pub allocations: usize,
    pub reallocations: usize,
    pub bytes_allocated: usize,
}

/// The `run` child: consumes `n` orders from `queue` on a current-thread runtime.
pub fn child(who: Contender, n: usize, queue: &str) -> Result<Counted, String> {
    let (url, rt) = (broker_url(), runtime(false));
    rt.block_on(async {
        match who {
            Contender::Raw => raw(&url, queue, n).await,
            Contender::Lily => lily(&url, queue, n).await,
        }
    })?;
    let stats = alloc_snapshot();
    drop(rt);
    Ok(Counted {
        handled: HANDLED.load(Ordering::Relaxed),
        allocations: stats.allocations,
        reallocations: stats.reallocations,
        bytes_allocated: stats.bytes_allocated,
    })
}
