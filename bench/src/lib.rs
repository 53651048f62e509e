//! Shared pieces of Lily's benchmark programs: the broker URL, topology, publishing, the
//! 512-byte JSON payload and statistics.
//!
//! Run them through `scripts/bench.sh`, which starts a private RabbitMQ node on loopback.
#![allow(missing_docs, unreachable_pub)]

pub mod chart;
pub mod cli;
pub mod cluster;
pub mod confirm_floor;
pub mod cost;
pub mod latency;
pub mod mongo;
pub mod parse;
pub mod raw;
pub mod report;
pub mod run;
pub mod storm;

use std::time::Duration;

use lapin::options::QueueDeleteOptions;
use lapin::{Connection, ConnectionProperties};
use lily::prelude::{QueueKind, TopologyMode};
use lily::publish::{Destination, Outgoing, Publisher};
use lily::topology::Topology;
use serde::{Deserialize, Serialize};

/// The broker named by `LILY_AMQP_URL` (set by `scripts/bench.sh`).
///
/// # Panics
/// When it is unset.
pub fn broker_url() -> String {
    std::env::var("LILY_AMQP_URL")
        .expect("LILY_AMQP_URL is unset: run the benchmarks through scripts/bench.sh")
}

/// The payload every benchmark message carries: a 512-byte JSON order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Order {
    pub order_id: String,
    pub sku: String,
    pub quantity: u32,
    pub note: String,
}

/// A 512-byte JSON body.
pub fn body_512() -> Vec<u8> {
    let mut order = Order {
        order_id: "order-000000001".into(),
        sku: "SKU-42".into(),
        quantity: 3,
        note: String::new(),
    };
    let base = serde_json::to_vec(&order).expect("json").len();
    order.note = "x".repeat(512 - base);
    let body = serde_json::to_vec(&order).expect("json");
    assert_eq!(body.len(), 512);
    body
}

/// Queue type as text for reports.
pub fn kind_name(kind: QueueKind) -> &'static str {
    match kind {
        QueueKind::Classic => "classic",
        QueueKind::Quorum => "quorum",
    }
}

/// Deletes and re-declares `queue` with Lily's topology (same arguments for every contender).
///
/// Retried a few times: RabbitMQ 3.10's quorum-queue log writer has been seen to crash when a
/// busy quorum queue is deleted (`ra_log_segment_writer`, `enoent`), closing the channel of the
/// declare that follows; the node recovers within a second.
pub async fn fresh_topology(
    url: &str,
    queue: &str,
    kind: QueueKind,
    retry: &[Duration],
) -> Topology {
    let mut tries = 0;
    loop {
        tries += 1;
        match try_fresh_topology(url, queue, kind, retry).await {
            Ok(topology) => return topology,
            Err(err) if tries < 5 => {
                eprintln!("bench: fresh topology for {queue} failed ({err}); retrying");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Err(err) => panic!("declare topology for {queue}: {err}"),
        }
    }
}

async fn try_fresh_topology(
    url: &str,
    queue: &str,
    kind: QueueKind,
    retry: &[Duration],
) -> Result<Topology, String> {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| format!("channel: {e}"))?;
    // As the consumer declares it, with its default delivery limit.
    let topology = Topology::new(queue, kind, retry)
        .delivery_limit(lily::consumer::ConsumerConfig::new(queue).delivery_limit);
    let mut names = vec![
        queue.to_owned(),
        topology.dead_letter_queue(),
        topology.parking_queue(),
    ];
    names.extend(topology.buckets().map(|(n, _)| n.to_owned()));
    for name in names {
        let _ = channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let declared = topology
        .apply(&channel, TopologyMode::Declare)
        .await
        .map_err(|e| format!("declare: {e}"));
    let _ = connection.close(200, "declared".into()).await;
    declared.map(|_| topology)
}

/// Publishes `n` persistent copies of `body` (type `order.placed`, a message id each) through
/// [`Publisher`], in windows of 2 000 publishes in flight.
///
/// # Panics
/// When a publish is not confirmed.
pub async fn publish(url: &str, queue: &str, n: usize, body: &[u8]) {
    let publisher = Publisher::connect(url)
        .await
        .expect("connect the publisher");
    let to = Destination::queue(queue);
    for window in (0..n).collect::<Vec<_>>().chunks(2000) {
        let messages = window.iter().map(|i| {
            Outgoing::bytes(
                "order.placed",
                &format!("m-{i}"),
                "application/json",
                body.to_vec(),
            )
        });
        let published = publisher.publish_all(&to, messages).await;
        if let Some(failed) = published.iter().find(|p| !p.is_confirmed()) {
            panic!("a benchmark publish was not confirmed: {failed:?}");
        }
    }
    publisher.close().await;
}

/// Ready messages in `queue` (a passive declare on `channel`), or `None` if it cannot be read.
pub async fn ready(channel: &lapin::Channel, queue: &str) -> Option<u32> {
    let passive = lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let declared = channel.queue_declare(queue.into(), passive, Default::default());
    declared.await.ok().map(|q| q.message_count())
}

/// [`ready`] on a connection of its own.
pub async fn depth(url: &str, queue: &str) -> Option<u32> {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .ok()?;
    let depth = match connection.create_channel().await {
        Ok(channel) => ready(&channel, queue).await,
        Err(_) => None,
    };
    let _ = connection.close(200, "depth".into()).await;
    depth
}

/// `scheme://host:port/vhost` without credentials.
pub fn redact(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("amqp", url));
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{rest}")
}

/// Median of `values` (sorted in place).
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

pub mod throughput;

/// The note every report ends with: where its method is written down.
pub const METHOD: &str = "How this program measures: bench/README.md. The machine is shared: \
                          read the ratios, measured side by side, not the absolute figures.";

/// What every program's results open with: the conditions of the run.
#[derive(Debug, Serialize)]
pub struct Meta {
    pub benchmark: &'static str,
    pub broker: String,
    pub broker_url: String,
    pub message_bytes: usize,
    pub cpus: usize,
    pub started_at_unix: u64,
    /// `git describe --always --dirty` of the tree the benchmark ran in.
    pub lily_revision: String,
    /// 1-minute load average when the run started and when it ended (the machine is shared).
    pub load_average: [Option<f64>; 2],
    pub wall_secs: f64,
    pub notes: Vec<String>,
}

impl Meta {
    /// The conditions at the start of `benchmark` against the broker at `url`.
    pub fn new(benchmark: &'static str, url: &str, notes: Vec<String>) -> Self {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        Self {
            benchmark,
            broker: throughput::broker_version(),
            broker_url: redact(url),
            message_bytes: body_512().len(),
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            started_at_unix: now.map_or(0, |d| d.as_secs()),
            lily_revision: throughput::revision(),
            load_average: [throughput::load_average(), None],
            wall_secs: 0.0,
            notes,
        }
    }

    /// Records the load average at the end, and the time since `started`.
    pub fn finish(&mut self, started: std::time::Instant) {
        self.load_average[1] = throughput::load_average();
        self.wall_secs = started.elapsed().as_secs_f64();
    }
}
