//! One measurement: a contender's drain rate, or a contender under the paced load.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use lily::prelude::QueueKind;
use lily::topology::Topology;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::fresh_topology;
use crate::latency::pace::publish_paced;
use crate::latency::raw_batch::{Counters, RawBatch};
use crate::latency::timer::{Sent, Sink, Sinks};
use crate::latency::{Contender, KEPT_UP, Latencies, Path, Run};
use crate::run::{Lily, Sample, backlog, run_limit, unexpected};
use crate::throughput::lily_run;

/// The work queue every run uses (re-created each time).
pub const QUEUE: &str = "lily-bench-latency";

/// How long a run waits, after publishing stopped, for the backlog to be settled.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// What the runs of one path × prefetch share.
#[derive(Clone)]
pub struct Setup {
    pub url: String,
    pub body: Arc<[u8]>,
    pub path: Path,
    pub prefetch: u16,
    /// Publishing time of a paced run.
    pub run: Duration,
    /// The start of a paced run whose latencies are not kept.
    pub warmup: Duration,
    /// Where both contenders' latencies go (Lily's through the timing layer).
    pub sinks: Sinks,
    /// When the benchmark started (progress lines say the seconds since).
    pub started: Instant,
}

/// A contender consuming: Lily, or raw-batch (its stop, task and counters).
enum Running {
    Lily(Lily, Path),
    Raw(CancellationToken, JoinHandle<()>, Arc<Counters>),
}

impl Running {
    /// Starts `who` on [`QUEUE`] of `topology`; returns once it consumes.
    async fn start(setup: &Setup, who: Contender, topology: &Topology) -> Self {
        let (url, path, prefetch) = (&setup.url, setup.path, setup.prefetch);
        if who == Contender::Lily {
            let consumer = lily_run::consumer(url, QUEUE, QueueKind::Classic, prefetch, path, None);
            let lily = Lily::ready(consumer)
                .await
                .unwrap_or_else(|err| panic!("{err}"));
            return Self::Lily(lily, path);
        }
        let bucket = (path == Path::Handoff).then(|| topology.bucket(0).expect("a bucket"));
        let raw = RawBatch::open(url, QUEUE, bucket, prefetch, setup.sinks.clone()).await;
        let (stop, counters) = (CancellationToken::new(), Arc::clone(&raw.counters));
        let task = tokio::spawn(raw.run(stop.clone()));
        Self::Raw(stop, task, counters)
    }

    /// Deliveries settled so far.
    fn settled(&self) -> u64 {
        match self {
            Self::Lily(lily, Path::Success) => lily.stats.totals().acked,
            Self::Lily(lily, Path::Handoff) => lily.stats.totals().retried,
            Self::Raw(.., counters) => counters.settled.load(Ordering::Relaxed),
        }
    }

    /// Waits until `n` deliveries are settled, the contender stopped or `deadline` passed;
    /// returns the deliveries settled.
    async fn settle(&self, n: u64, deadline: Instant) -> u64 {
        let finished = || match self {
            Self::Lily(lily, _) => lily.finished(),
            Self::Raw(_, task, _) => task.is_finished(),
        };
        while self.settled() < n && Instant::now() < deadline && !finished() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.settled()
    }

    /// Stops the contender; returns the deliveries that ended otherwise than settled.
    async fn stop(self) -> u64 {
        match self {
            Self::Lily(lily, _) => unexpected(&lily.stopped().await),
            Self::Raw(stop, task, counters) => {
                stop.cancel();
                let _ = task.await;
                counters.failed.load(Ordering::Relaxed)
            }
        }
    }
}

/// The drain rate of `who`: `n` messages published first, then timed from consumer start
/// (connect included) until all are settled.
pub async fn drain_rate(setup: &Setup, who: Contender, n: u64) -> Sample {
    let delays = setup.path.delays();
    let topology = backlog(&setup.url, QUEUE, QueueKind::Classic, &delays, n).await;
    let started = Instant::now();
    let running = Running::start(setup, who, &topology).await;
    let settled = running.settle(n, started + run_limit(n)).await;
    let elapsed = started.elapsed();
    running.stop().await;
    Sample::new(settled, n, elapsed)
}

/// `who` consuming while the paced publisher publishes at `rate` for the run's duration.
pub async fn paced(setup: &Setup, who: Contender, rate: f64) -> Run {
    let delays = setup.path.delays();
    let topology = fresh_topology(&setup.url, QUEUE, QueueKind::Classic, &delays).await;
    let running = Running::start(setup, who, &topology).await;
    let Sinks { settled, copies } = &setup.sinks;
    let _ = (settled.take(), copies.take());
    let sent = Arc::new(Sent::new((rate * setup.run.as_secs_f64()) as usize + 1));
    settled.starts_from(Arc::clone(&sent));
    let started = Instant::now();
    let (url, body, duration) = (setup.url.clone(), Arc::clone(&setup.body), setup.run);
    let publisher =
        tokio::spawn(async move { publish_paced(&url, QUEUE, rate, duration, body, &sent).await });
    let (from, until) = (started + setup.warmup, started + setup.run);
    tokio::time::sleep_until(from.into()).await;
    let settled_from = running.settled();
    tokio::time::sleep_until(until.into()).await;
    let settled_until = running.settled();
    let paced = publisher.await.expect("the paced publisher");
    let drained = running
        .settle(paced.published, Instant::now() + DRAIN_LIMIT)
        .await;
    let drain_secs = until.elapsed().as_secs_f64();
    let timed = |sink: &Sink| {
        let kept = sink
            .take()
            .into_iter()
            .filter(|(at, _)| (from..until).contains(at));
        Latencies::of(kept.map(|(_, us)| us).collect())
    };
    let latency = timed(settled);
    let copy_confirms = (setup.path == Path::Handoff).then(|| timed(copies));
    let failed = running.stop().await;
    let window = (setup.run - setup.warmup).as_secs_f64();
    let settled_per_sec = (settled_until - settled_from) as f64 / window;
    let publish_rate = paced.published as f64 / paced.secs;
    Run {
        contender: who,
        target_rate: rate,
        published: paced.published,
        unconfirmed: paced.unconfirmed,
        publish_rate,
        publisher_reached_target: publish_rate >= KEPT_UP * rate,
        settled_per_sec,
        kept_up: settled_per_sec >= KEPT_UP * publish_rate,
        drain_secs,
        complete: drained >= paced.published,
        failed,
        latency,
        copy_confirms,
    }
}
