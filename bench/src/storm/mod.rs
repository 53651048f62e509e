//! The failure-storm benchmark: its contenders, samples, summary and the check by id after
//! each. Method: `bench/README.md`.

use std::time::{Duration, Instant};

use lily::consumer::Totals;
use lily::topology::Topology;
use lily_mq_testkit::Client;
use serde::Serialize;

pub mod cli;

/// The bucket's delay: short, so copies come back.
pub const RETRY_DELAY: Duration = Duration::from_secs(1);

/// The work queue (re-created for each contender).
pub const QUEUE: &str = "lily-bench-storm";

/// Lily's attempts: far more than a message cycles during a run, so nothing is dead-lettered.
pub const MAX_ATTEMPTS: u32 = 1_000_000;

/// Messages published up front.
pub const POPULATION: u64 = 40_000;

/// Prefetch (and Lily's concurrency).
pub const PREFETCH: u16 = 500;

/// Who runs the storm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Contender {
    /// Hand-written lapin, pipelined confirms (a task per delivery).
    Raw,
    /// Lily.
    Lily,
}

impl Contender {
    pub fn name(self) -> &'static str {
        if self == Self::Lily {
            "Lily"
        } else {
            "raw lapin"
        }
    }
}

/// Second `t` since the contender started: handoffs completed (copy confirmed, original ACKed)
/// during it, and at its end this process's `VmRSS` and the work queue's ready messages.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Second {
    pub t: u32,
    pub handoffs: u64,
    pub rss_bytes: u64,
    pub ready: Option<u32>,
}

/// What a run's series says: mean handoffs/s after the warm-up, over all of it and over its
/// first and last windows (60 s, or less in a short run), and `last_rate / first_rate`.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Summary {
    pub mean_rate: f64,
    pub window_secs: u32,
    pub first_rate: f64,
    pub last_rate: f64,
    pub flatness: f64,
    /// `VmRSS` at the end of the warm-up, the largest sampled, and the last, in MiB.
    pub rss_start_mib: f64,
    pub rss_max_mib: f64,
    pub rss_end_mib: f64,
    /// Least-squares slope of `VmRSS` after the warm-up, MiB per minute.
    pub rss_slope_mib_per_min: f64,
    /// Smallest ready depth of the work queue after the warm-up (0 means it ran dry).
    pub min_ready: Option<u32>,
}

const MIB: f64 = 1024.0 * 1024.0;

impl Summary {
    /// Summarises `series`, whose first `warmup` seconds are the warm-up.
    #[allow(clippy::cast_precision_loss)]
    pub fn of(series: &[Second], warmup: u32) -> Self {
        // Second `t` is `series[t - 1]`.
        let after = &series[series.len().min(warmup as usize)..];
        // NaN when empty.
        let mean =
            |xs: &[Second]| xs.iter().map(|s| s.handoffs as f64).sum::<f64>() / xs.len() as f64;
        let w = (after.len() / 2).clamp(1, 60);
        let first_rate = mean(&after[..w.min(after.len())]);
        let last_rate = mean(&after[after.len().saturating_sub(w)..]);
        let start = series.get(warmup as usize - 1).or_else(|| series.first());
        let start = start.map_or(0, |s| s.rss_bytes);
        let points: Vec<(f64, f64)> = after
            .iter()
            .map(|s| (f64::from(s.t) / 60.0, s.rss_bytes as f64 / MIB))
            .collect();
        Self {
            mean_rate: mean(after),
            window_secs: w as u32,
            first_rate,
            last_rate,
            flatness: last_rate / first_rate,
            rss_start_mib: start as f64 / MIB,
            rss_max_mib: series.iter().map(|s| s.rss_bytes).max().unwrap_or(0) as f64 / MIB,
            rss_end_mib: series.last().map_or(0, |s| s.rss_bytes) as f64 / MIB,
            rss_slope_mib_per_min: slope(&points),
            min_ready: after.iter().filter_map(|s| s.ready).min(),
        }
    }
}

/// Least-squares slope of `points` (NaN with fewer than two).
#[allow(clippy::cast_precision_loss)]
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return f64::NAN;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    sxy / sxx
}

/// Samples every second for `secs` seconds: the growth of `count`, `VmRSS` and the ready depth
/// of [`QUEUE`] (read on a connection of its own).
///
/// # Panics
/// When the broker cannot be reached.
pub async fn sample(url: &str, secs: u32, count: impl Fn() -> u64) -> Vec<Second> {
    use lapin::{Connection, ConnectionProperties};
    let connection = Connection::connect(url, ConnectionProperties::default()).await;
    let connection = connection.expect("connect the sampler");
    let channel = connection.create_channel().await.expect("channel");
    let started = Instant::now();
    let mut before = count();
    let mut series = Vec::with_capacity(secs as usize);
    for t in 1..=secs {
        tokio::time::sleep_until((started + Duration::from_secs(u64::from(t))).into()).await;
        let now = count();
        let rss_bytes = crate::cost::memory::Mem::now().rss_bytes;
        series.push(Second {
            t,
            handoffs: now.saturating_sub(before),
            rss_bytes,
            ready: crate::ready(&channel, QUEUE).await,
        });
        before = now;
    }
    let _ = connection.close(200, "sampled".into()).await;
    series
}

/// One contender's storm.
#[derive(Clone, Debug, Serialize)]
pub struct StormRun {
    pub contender: Contender,
    pub secs: u32,
    /// Handoffs completed during the run (the series' sum).
    pub handoffs: u64,
    /// Handoffs that failed (raw: copy not confirmed or ACK failed; Lily: requeued,
    /// dead-lettered, parked, unresolved).
    pub failed: u64,
    pub summary: Summary,
    pub check: Check,
    /// Lily's totals after shutdown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lily_totals: Option<Totals>,
    pub series: Vec<Second>,
}

/// Everything one storm measured.
#[derive(Debug, Serialize)]
pub struct Results {
    #[serde(flatten)]
    pub meta: crate::Meta,
    pub population: u64,
    pub prefetch: u16,
    pub retry_delay_secs: f64,
    pub secs: u32,
    pub warmup_secs: u32,
    pub runs: Vec<StormRun>,
    /// Lily's mean rate over raw's.
    pub lily_over_raw: Option<f64>,
}

/// What the queues held after a contender stopped.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Check {
    pub population: u64,
    /// Messages found in the work queue and in the bucket.
    pub in_work_queue: u64,
    pub in_bucket: u64,
    /// Ready messages in the DLQ and the parking lane (not drained).
    pub in_dead_letter_queue: Option<u32>,
    pub in_parking: Option<u32>,
    /// Population ids found nowhere; extra copies of population ids; ids not in it.
    pub missing: u64,
    pub duplicates: u64,
    pub strangers: u64,
    /// Every id exactly once, nothing else, DLQ and parking empty.
    pub ok: bool,
}

/// The evidence after a storm, read from outside the contender: drains the work queue and the
/// bucket of `topology` and counts them by message id (every id `m-0 … m-{POPULATION − 1}`
/// exactly once), and reads the depths of its DLQ and parking lane (both empty).
pub async fn check(url: &str, topology: &Topology) -> Check {
    let client = Client::connect(url).await;
    let mut ids = client
        .drain_ids(topology.bucket(0).expect("a retry bucket"))
        .await;
    let in_bucket = ids.values().sum::<usize>() as u64;
    let mut in_work_queue = 0;
    for (id, count) in client.drain_ids(topology.queue()).await {
        in_work_queue += count as u64;
        *ids.entry(id).or_insert(0) += count;
    }
    let in_dead_letter_queue = crate::depth(url, &topology.dead_letter_queue()).await;
    let in_parking = crate::depth(url, &topology.parking_queue()).await;
    let (mut missing, mut duplicates) = (0, 0);
    for i in 0..POPULATION {
        match ids.remove(&format!("m-{i}")) {
            None => missing += 1,
            Some(n) => duplicates += n as u64 - 1,
        }
    }
    let strangers = ids.values().sum::<usize>() as u64;
    let ok = missing + duplicates + strangers == 0
        && in_dead_letter_queue == Some(0)
        && in_parking == Some(0);
    Check {
        population: POPULATION,
        in_work_queue,
        in_bucket,
        in_dead_letter_queue,
        in_parking,
        missing,
        duplicates,
        strangers,
        ok,
    }
}
