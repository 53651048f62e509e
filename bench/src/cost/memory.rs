//! Memory a delivery in flight: the `mem` child consumes with prefetch (and Lily's concurrency)
//! `K` and holds every delivery (raw: lapin deliveries unACKed in a `Vec`; Lily: a handler with no
//! argument waiting on a shared `CancellationToken`), sampling itself idle and with `K` held.

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::Stdio;
use std::time::{Duration, Instant};

use lapin::options::{BasicAckOptions, BasicQosOptions};
use lily::prelude::{Consumer, ConsumerConfig, Router};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::{Bench, Contender, alloc_snapshot};
use crate::run::Lily;
use crate::{body_512, broker_url, publish};

/// How long to let the process settle before a sample.
pub(crate) const SETTLE: Duration = Duration::from_millis(500);

/// A memory sample of this process: `VmRSS`, `VmHWM` and the live heap.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
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
        let heap = alloc_snapshot();
        Self {
            rss_bytes: kb("VmRSS:"),
            hwm_bytes: kb("VmHWM:"),
            heap_live_bytes: heap.bytes_allocated.saturating_sub(heap.bytes_deallocated),
        }
    }
}

/// Prints `TAG {json}` for the parent.
pub(crate) fn announce(tag: &str, value: &impl Serialize) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{tag} {}", serde_json::to_string(value).expect("json"));
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

/// What a `mem` child saw: idle, and with `in_flight` deliveries held.
#[derive(Debug, Serialize, Deserialize)]
pub struct Sampled {
    idle: Mem,
    full: Mem,
    in_flight: usize,
}

/// One contender's memory, per delivery held.
#[derive(Debug, Serialize)]
pub struct Held {
    pub rss_idle_bytes: u64,
    pub rss_per_delivery: f64,
    pub heap_per_delivery: f64,
}

/// Runs the `mem` child of `who` over a queue the parent fills once the child is idle.
#[allow(clippy::cast_precision_loss)]
pub fn measure(b: &Bench, who: Contender, k: usize) -> Result<Held, String> {
    let queue = format!("lily-bench-cost-mem-{}", who.name());
    b.queue_with(&queue, 0);
    let mut child = b.child(false, &["mem", who.name(), &k.to_string(), &queue]);
    let mut child = child
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("spawn mem: {e}"))?;
    let mut sampled = None;
    for line in BufReader::new(child.stdout.take().ok_or("no stdout")?)
        .lines()
        .map_while(Result::ok)
    {
        if line.starts_with("IDLE") {
            b.rt.block_on(publish(&b.url, &queue, k, &body_512()));
        }
        sampled = sampled.or_else(|| super::result::<Sampled>(&line));
    }
    let status = child.wait().map_err(|e| format!("wait: {e}"))?;
    let s = sampled
        .filter(|_| status.success())
        .ok_or_else(|| format!("mem {} failed ({status})", who.name()))?;
    let per = |full: f64, idle: f64| (full - idle) / s.in_flight as f64;
    let held = Held {
        rss_idle_bytes: s.idle.rss_bytes,
        rss_per_delivery: per(s.full.rss_bytes as f64, s.idle.rss_bytes as f64),
        heap_per_delivery: per(s.full.heap_live_bytes as f64, s.idle.heap_live_bytes as f64),
    };
    eprintln!("cost: memory {}: {held:?}", who.name());
    Ok(held)
}

async fn lily(url: &str, queue: &str, k: usize) -> Result<Sampled, String> {
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
    let lily = Lily::ready(Consumer::new(
        url,
        ConsumerConfig::new(queue).prefetch(prefetch).concurrency(k),
        router,
    ))
    .await?;
    tokio::time::sleep(SETTLE).await;
    let idle = Mem::now();
    announce("IDLE", &idle);
    wait_for("deliveries in flight", Duration::from_secs(300), || {
        lily.stats.in_flight() >= k
    })
    .await?;
    tokio::time::sleep(SETTLE).await;
    let (full, in_flight) = (Mem::now(), lily.stats.in_flight());
    gate.cancel();
    wait_for("ACKs", Duration::from_secs(120), || {
        lily.stats.totals().acked >= k as u64
    })
    .await?;
    lily.stop().await?;
    Ok(Sampled {
        idle,
        full,
        in_flight,
    })
}

async fn raw(url: &str, queue: &str, k: usize) -> Result<Sampled, String> {
    let prefetch = u16::try_from(k).map_err(|_| "K must fit in a u16 prefetch")?;
    let e = |what: &'static str| move |err: lapin::Error| format!("{what}: {err}");
    let (connection, channel, mut consumer) = crate::raw::open(url, queue, prefetch, false).await?;
    let mut held = Vec::with_capacity(k);
    tokio::time::sleep(SETTLE).await;
    let idle = Mem::now();
    announce("IDLE", &idle);
    while held.len() < k {
        let next =
            tokio::time::timeout(Duration::from_secs(300), crate::raw::next(&mut consumer)).await;
        held.push(
            next.map_err(|_| "timed out waiting for deliveries")?
                .ok_or("the consumer ended")?
                .map_err(e("delivery"))?,
        );
    }
    tokio::time::sleep(SETTLE).await;
    let (full, in_flight) = (Mem::now(), held.len());
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
    Ok(Sampled {
        idle,
        full,
        in_flight,
    })
}

/// The `mem` child: holds `k` deliveries of `queue`, on a multi-thread runtime.
pub fn child(who: Contender, k: usize, queue: &str) -> Result<Sampled, String> {
    let url = broker_url();
    super::runtime(true).block_on(async {
        match who {
            Contender::Raw => raw(&url, queue, k).await,
            Contender::Lily => lily(&url, queue, k).await,
        }
    })
}
