//! Memory per in-flight delivery. The children `mem-raw K QUEUE` and `mem-lily K QUEUE` consume
//! with prefetch (and, for Lily, concurrency) `K` on a multi-thread runtime and hold every
//! delivery:
//!
//! - raw: lapin deliveries kept unacked in a `Vec` (capacity reserved up front);
//! - Lily: a handler with no arguments that waits on a shared `CancellationToken`.
//!
//! Each child samples `VmRSS`/`VmHWM` from `/proc/self/status` and the live heap from the
//! counting allocator once idle (consuming, nothing in flight; prints `IDLE {...}`), then the
//! parent publishes `K` messages, and once `K` deliveries are held (`stats().in_flight() == K`
//! for Lily) it samples again and prints `RESULT {...}`, releases them and exits.

use std::future::poll_fn;
use std::io::Write as _;
use std::pin::Pin;
use std::time::{Duration, Instant};

use futures_core::Stream;
use lapin::options::{BasicAckOptions, BasicQosOptions};
use lily::prelude::{Consumer, ConsumerConfig, Router, Shutdown, Trigger};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::{Contender, alloc_snapshot};
use crate::broker_url;

/// How long to let the process settle before a sample.
pub(crate) const SETTLE: Duration = Duration::from_millis(500);

/// A memory sample of this process.
pub(crate) fn sample() -> Value {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = |key: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let heap = alloc_snapshot();
    json!({
        "rss_bytes": kb("VmRSS:") * 1024,
        "hwm_bytes": kb("VmHWM:") * 1024,
        "heap_live_bytes": heap.bytes_allocated.saturating_sub(heap.bytes_deallocated),
        "heap_live_blocks": heap.allocations.saturating_sub(heap.deallocations),
    })
}

pub(crate) fn announce(tag: &str, value: &Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{tag} {value}");
    let _ = out.flush();
}

/// Polls `done` until it holds, failing after `limit`.
pub(crate) async fn wait_for(
    what: &str,
    limit: Duration,
    mut done: impl FnMut() -> bool,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    while !done() {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}"));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

async fn lily(url: &str, queue: &str, k: usize) -> Result<Value, String> {
    let prefetch = u16::try_from(k).map_err(|_| "K must fit in a u16 prefetch")?;
    let gate = CancellationToken::new();
    let held = gate.clone();
    let router = Router::new().route("order.placed", move || {
        let held = held.clone();
        async move {
            held.cancelled().await;
            Ok(())
        }
    });
    let config = ConsumerConfig::new(queue).prefetch(prefetch).concurrency(k);
    let consumer = Consumer::new(url, config, router);
    let stats = consumer.stats();
    let shutdown = Shutdown::default();
    let run = tokio::spawn(consumer.run(shutdown.clone()));
    wait_for("Lily to consume", Duration::from_secs(60), || stats.ready()).await?;
    tokio::time::sleep(SETTLE).await;
    let idle = sample();
    announce("IDLE", &idle);
    wait_for("deliveries in flight", Duration::from_secs(300), || {
        stats.in_flight() >= k
    })
    .await?;
    tokio::time::sleep(SETTLE).await;
    let full = sample();
    let in_flight = stats.in_flight();
    gate.cancel();
    wait_for("ACKs", Duration::from_secs(120), || {
        stats.totals().acked >= k as u64
    })
    .await?;
    shutdown.trigger(Trigger::Api);
    let report = run
        .await
        .map_err(|e| format!("consumer task: {e}"))?
        .map_err(|e| format!("consumer: {e}"))?;
    Ok(json!({ "idle": idle, "full": full, "in_flight": in_flight, "acked": report.totals.acked }))
}

async fn raw(url: &str, queue: &str, k: usize) -> Result<Value, String> {
    let prefetch = u16::try_from(k).map_err(|_| "K must fit in a u16 prefetch")?;
    let e = |what: &'static str| move |err: lapin::Error| format!("{what}: {err}");
    let (connection, channel, mut consumer) = crate::raw::open(url, queue, prefetch, false).await?;
    let mut held = Vec::with_capacity(k);
    tokio::time::sleep(SETTLE).await;
    let idle = sample();
    announce("IDLE", &idle);
    while held.len() < k {
        let next = tokio::time::timeout(
            Duration::from_secs(300),
            poll_fn(|cx| Pin::new(&mut consumer).poll_next(cx)),
        )
        .await
        .map_err(|_| "timed out waiting for deliveries")?;
        held.push(next.ok_or("the consumer ended")?.map_err(e("delivery"))?);
    }
    tokio::time::sleep(SETTLE).await;
    let full = sample();
    let in_flight = held.len();
    for delivery in held {
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(e("ack"))?;
    }
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await
        .map_err(e("basic.qos"))?;
    let _ = channel.close(200, "done".into()).await;
    let _ = connection.close(200, "done".into()).await;
    Ok(json!({ "idle": idle, "full": full, "in_flight": in_flight, "acked": in_flight }))
}

/// Entry point of `mem-raw` / `mem-lily`: `K QUEUE`.
pub fn child(who: Contender, args: &[String]) -> Result<Value, String> {
    let k: usize = args
        .first()
        .and_then(|a| a.parse().ok())
        .ok_or("usage: cost mem-raw|mem-lily K QUEUE")?;
    let queue = args.get(1).ok_or("missing QUEUE")?;
    let url = broker_url();
    let rt = super::runtime(true);
    rt.block_on(async {
        match who {
            Contender::Raw => raw(&url, queue, k).await,
            Contender::Lily => lily(&url, queue, k).await,
        }
    })
}
