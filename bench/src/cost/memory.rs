//! Memory a delivery in flight: the `mem` child consumes with prefetch (and Lily's concurrency)
//! `K` and holds every delivery (raw: lapin deliveries unACKed in a `Vec`; Lily: a handler with no
//! argument waiting on a shared `CancellationToken`), sampling itself idle and with `K` held.

use std::time::{Duration, Instant};

use lily::prelude::{Consumer, ConsumerConfig, Router};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::{Bench, close_raw, failed, spawn};
use crate::publish;
use crate::run::Lily;
use lily_mq_regress::consume::{Who, queue_ack};

/// How long to let the process settle before a sample.
pub(crate) const SETTLE: Duration = Duration::from_millis(500);

/// A memory sample of this process: `VmRSS`, `VmHWM` and the live heap.
#[derive(Clone, Copy, Debug, Default)]
pub struct Mem {
    pub rss_bytes: u64,
    pub hwm_bytes: u64,
    pub heap_live_bytes: usize,
}

impl Mem {
    pub fn now() -> Self {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let kb = |key: &str| -> u64 {
            let value = status
                .lines()
                .find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok());
            value.unwrap_or(0) * 1024
        };
        let heap = stats_alloc::INSTRUMENTED_SYSTEM.stats();
        Self {
            rss_bytes: kb("VmRSS:"),
            hwm_bytes: kb("VmHWM:"),
            heap_live_bytes: heap.bytes_allocated.saturating_sub(heap.bytes_deallocated),
        }
    }
}

/// Lets the process settle, samples it and tells the parent (`IDLE`): the idle sample.
pub(crate) async fn idle() -> Mem {
    tokio::time::sleep(SETTLE).await;
    let idle = Mem::now();
    println!("IDLE");
    idle
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

/// One contender's memory, per delivery held: what its `mem` child measured.
#[derive(Debug, Serialize, Deserialize)]
pub struct Held {
    pub rss_idle_bytes: u64,
    pub rss_per_delivery: f64,
    pub heap_per_delivery: f64,
}

/// Memory a delivery held, each contender's.
#[derive(Debug, Serialize)]
pub struct Memory {
    pub in_flight: usize,
    pub raw: Held,
    pub lily: Held,
}

/// Both contenders' memory with `k` deliveries held.
pub fn measure(b: &Bench, k: usize) -> Result<Memory, String> {
    Ok(Memory {
        in_flight: k,
        raw: held(b, Who::Raw, k)?,
        lily: held(b, Who::Lily, k)?,
    })
}

/// Runs the `mem` child of `who` over a queue the parent fills once the child is idle.
fn held(b: &Bench, who: Who, k: usize) -> Result<Held, String> {
    let name = who.name().to_lowercase();
    let queue = format!("lily-bench-cost-mem-{name}");
    b.queue_with(&queue, 0);
    let mut command = b.child(false, &["mem", &name, &k.to_string(), &queue]);
    let (mut child, lines) = spawn(&mut command)?;
    let mut held = None;
    for line in lines {
        if line.starts_with("IDLE") {
            b.rt.block_on(publish(&b.url, &queue, k));
        }
        held = held.or_else(|| super::result::<Held>(&line));
    }
    let status = child.wait().map_err(|e| format!("wait: {e}"))?;
    let held = held.filter(|_| status.success());
    let held = held.ok_or_else(|| format!("mem {name} failed ({status})"))?;
    eprintln!("cost: memory {name}: {held:?}");
    Ok(held)
}

async fn lily(url: &str, queue: &str, prefetch: u16, k: usize) -> Result<[Mem; 2], String> {
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
    let lily = Lily::ready(Consumer::new(url, config, router)).await?;
    let idle = idle().await;
    let held = || lily.stats.in_flight() >= k;
    wait_for("deliveries in flight", Duration::from_secs(300), held).await?;
    tokio::time::sleep(SETTLE).await;
    let full = Mem::now();
    gate.cancel();
    let acked = || lily.stats.totals().acked >= k as u64;
    wait_for("ACKs", Duration::from_secs(120), acked).await?;
    lily.stop().await?;
    Ok([idle, full])
}

async fn raw(url: &str, queue: &str, prefetch: u16, k: usize) -> Result<[Mem; 2], String> {
    let (connection, channel, mut consumer) = crate::raw::open(url, queue, prefetch, false).await?;
    let mut held = Vec::with_capacity(k);
    let idle = idle().await;
    while held.len() < k {
        let next = tokio::time::timeout(Duration::from_secs(300), crate::raw::next(&mut consumer));
        let next = next.await.map_err(|_| "timed out waiting for deliveries")?;
        held.push(
            next.ok_or("the consumer ended")?
                .map_err(failed("delivery"))?,
        );
    }
    tokio::time::sleep(SETTLE).await;
    let full = Mem::now();
    for delivery in held {
        queue_ack(&channel, delivery.delivery_tag).map_err(failed("ack"))?;
    }
    close_raw(connection, channel, prefetch).await?;
    Ok([idle, full])
}

/// The `mem` child: holds `k` deliveries of `queue` (its prefetch), on a multi-thread runtime;
/// the difference of its samples over them.
#[allow(clippy::cast_precision_loss)]
pub fn child(who: Who, k: usize, url: &str, queue: &str) -> Result<Held, String> {
    let prefetch = u16::try_from(k).map_err(|_| "K must fit in a u16 prefetch")?;
    let [idle, full] = crate::runtime(true).block_on(async {
        match who {
            Who::Raw => raw(url, queue, prefetch, k).await,
            Who::Lily => lily(url, queue, prefetch, k).await,
        }
    })?;
    let per = |full: f64, idle: f64| (full - idle) / k as f64;
    Ok(Held {
        rss_idle_bytes: idle.rss_bytes,
        rss_per_delivery: per(full.rss_bytes as f64, idle.rss_bytes as f64),
        heap_per_delivery: per(full.heap_live_bytes as f64, idle.heap_live_bytes as f64),
    })
}
