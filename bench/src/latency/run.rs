//! One measurement: a contender's drain rate, or a contender under the paced load.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use lily::prelude::QueueKind;
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

/// What every run shares.
pub struct Setup {
    pub url: String,
    pub body: Arc<[u8]>,
    /// Publishing time of a paced run.
    pub run: Duration,
    /// The start of a paced run whose latencies are not kept.
    pub warmup: Duration,
    /// Where Lily's timing layer writes.
    pub lily: Sinks,
}

/// A contender consuming: Lily (timed by the layer of [`Setup::lily`]) or raw-batch.
enum Running {
    Lily(Lily, Path),
    Raw {
        stop: CancellationToken,
        task: JoinHandle<()>,
        counters: Arc<Counters>,
        sink: Arc<Sink>,
    },
}

impl Running {
    /// Starts `who` on [`QUEUE`]; returns once it consumes.
    async fn start(setup: &Setup, who: Contender, path: Path, prefetch: u16, bucket: &str) -> Self {
        if who == Contender::Lily {
            let consumer =
                lily_run::consumer(&setup.url, QUEUE, QueueKind::Classic, prefetch, path, None);
            return match Lily::ready(consumer).await {
                Ok(lily) => Self::Lily(lily, path),
                Err(err) => panic!("{err}"),
            };
        }
        let bucket = (path == Path::Handoff).then_some(bucket);
        let raw = RawBatch::open(&setup.url, QUEUE, bucket, prefetch).await;
        let (stop, counters, sink) = (
            CancellationToken::new(),
            Arc::new(Counters::default()),
            Arc::new(Sink::default()),
        );
        let task = tokio::spawn(raw.run(stop.clone(), Arc::clone(&sink), Arc::clone(&counters)));
        Self::Raw {
            stop,
            task,
            counters,
            sink,
        }
    }

    /// Deliveries settled so far.
    fn settled(&self) -> u64 {
        match self {
            Self::Lily(lily, Path::Success) => lily.stats.totals().acked,
            Self::Lily(lily, Path::Handoff) => lily.stats.totals().retried,
            Self::Raw { counters, .. } => counters.settled.load(Ordering::Relaxed),
        }
    }

    fn finished(&self) -> bool {
        match self {
            Self::Lily(lily, _) => lily.finished(),
            Self::Raw { task, .. } => task.is_finished(),
        }
    }

    /// Where this contender's settlement latencies and copy confirms go.
    fn sinks<'a>(&'a self, lily: &'a Sinks) -> (&'a Sink, &'a Sink) {
        match self {
            Self::Lily(..) => (&lily.settled, &lily.copies),
            Self::Raw { sink, counters, .. } => (sink, &counters.copies),
        }
    }

    /// Stops the contender; returns the deliveries that ended otherwise than settled.
    async fn stop(self) -> u64 {
        match self {
            Self::Lily(lily, _) => unexpected(&lily.stopped().await),
            Self::Raw {
                stop,
                task,
                counters,
                ..
            } => {
                stop.cancel();
                let _ = task.await;
                counters.failed.load(Ordering::Relaxed)
            }
        }
    }
}

/// The drain rate of `who`: `n` messages published first, then timed from consumer start
/// (connect included) until all are settled.
pub async fn drain_rate(
    setup: &Setup,
    who: Contender,
    path: Path,
    prefetch: u16,
    n: u64,
) -> Sample {
    let topology = backlog(&setup.url, QUEUE, QueueKind::Classic, &path.delays(), n).await;
    let started = Instant::now();
    let running = Running::start(
        setup,
        who,
        path,
        prefetch,
        topology.bucket(0).expect("a bucket"),
    )
    .await;
    let limit = run_limit(n);
    while running.settled() < n && started.elapsed() < limit && !running.finished() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (elapsed, settled) = (started.elapsed(), running.settled());
    let _ = running.sinks(&setup.lily).0.take();
    running.stop().await;
    Sample::new(settled, n, elapsed)
}

/// `who` consuming while the paced publisher publishes at `rate` for the run's duration.
pub async fn paced(setup: &Setup, who: Contender, path: Path, prefetch: u16, rate: f64) -> Run {
    let topology = fresh_topology(&setup.url, QUEUE, QueueKind::Classic, &path.delays()).await;
    let running = Running::start(
        setup,
        who,
        path,
        prefetch,
        topology.bucket(0).expect("a bucket"),
    )
    .await;
    let (settled_sink, copies) = running.sinks(&setup.lily);
    let _ = settled_sink.take();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let capacity = (rate * setup.run.as_secs_f64()) as usize + 1;
    let sent = Arc::new(Sent::new(capacity));
    settled_sink.starts_from(Arc::clone(&sent));
    let _ = copies.take();
    let started = Instant::now();
    let (url, body, duration) = (setup.url.clone(), Arc::clone(&setup.body), setup.run);
    let publisher =
        tokio::spawn(
            async move { publish_paced(&url, QUEUE, rate, duration, body, "p", &sent).await },
        );
    let from = started + setup.warmup;
    let until = started + setup.run;
    tokio::time::sleep_until(from.into()).await;
    let settled_from = running.settled();
    tokio::time::sleep_until(until.into()).await;
    let settled_until = running.settled();
    let paced = publisher.await.expect("the paced publisher");
    let deadline = Instant::now() + DRAIN_LIMIT;
    while running.settled() < paced.published && Instant::now() < deadline && !running.finished() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let drain_secs = until.elapsed().as_secs_f64();
    let complete = running.settled() >= paced.published;
    let timed = |sink: &Sink| {
        let kept = sink
            .take()
            .into_iter()
            .filter(|(at, _)| (from..until).contains(at));
        Latencies::of(kept.map(|(_, us)| us).collect())
    };
    let latency = timed(settled_sink);
    let copy_confirms = (path == Path::Handoff).then(|| timed(copies));
    let failed = running.stop().await;
    let window = (setup.run - setup.warmup).as_secs_f64();
    #[allow(clippy::cast_precision_loss)]
    let settled_per_sec = (settled_until - settled_from) as f64 / window;
    #[allow(clippy::cast_precision_loss)]
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
        complete,
        failed,
        latency,
        copy_confirms,
    }
}
