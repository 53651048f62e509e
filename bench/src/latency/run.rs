//! One measurement: a contender's drain rate, or a contender under the paced load.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use lily::consumer::Stats;
use lily::prelude::{
    Consumer, ConsumerConfig, Json, Policy, QueueHandlerError, QueueKind, Router, Shutdown, Trigger,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::Order;
use crate::latency::pace::{Depth, publish_paced};
use crate::latency::raw_batch::{Counters, RawBatch};
use crate::latency::timer::{Sent, Sink, Sinks};
use crate::latency::{BACKLOG_SECS, Contender, KEPT_UP, Latencies, Path, Run};
use crate::throughput::{FAILURE_REASON, HANDOFF_DELAY, Sample, lily_run, run_limit};
use crate::{fresh_topology, publish};

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

impl Setup {
    /// The same set-up with paced runs of `run`, the first `warmup` of it not timed.
    pub fn shorter(&self, run: Duration, warmup: Duration) -> Self {
        Self {
            url: self.url.clone(),
            body: Arc::clone(&self.body),
            run,
            warmup,
            lily: self.lily.clone(),
        }
    }
}

/// A contender consuming.
enum Running {
    Lily {
        stats: Stats,
        shutdown: Shutdown,
        task: JoinHandle<()>,
        handoff: bool,
    },
    Raw {
        stop: CancellationToken,
        task: JoinHandle<()>,
        counters: Arc<Counters>,
        sink: Arc<Sink>,
    },
}

impl Running {
    /// Starts `who` on [`QUEUE`]; returns once it consumes (Lily: once it reports ready).
    async fn start(setup: &Setup, who: Contender, path: Path, prefetch: u16, bucket: &str) -> Self {
        match who {
            Contender::Lily => {
                let (router, policy) = match path {
                    Path::Success => (
                        Router::new().route("order.placed", |Json(o): Json<Order>| async move {
                            std::hint::black_box(o);
                            Ok(())
                        }),
                        Policy::default(),
                    ),
                    Path::Handoff => (
                        Router::new().route("order.placed", |Json(o): Json<Order>| async move {
                            std::hint::black_box(o);
                            Err::<(), _>(QueueHandlerError::retryable(FAILURE_REASON))
                        }),
                        lily_run::handoff_policy(),
                    ),
                };
                let config = ConsumerConfig::new(QUEUE)
                    .queue_kind(QueueKind::Classic)
                    .prefetch(prefetch)
                    .concurrency(usize::from(prefetch))
                    .policy(policy);
                let consumer = Consumer::new(setup.url.as_str(), config, router);
                let stats = consumer.stats();
                let shutdown = Shutdown::default();
                let run = consumer.run(shutdown.clone());
                let task = tokio::spawn(async move {
                    match run.await {
                        Ok(report) if report.exit_code() == 0 => {}
                        Ok(report) => {
                            eprintln!("  Lily shutdown report exit code {}", report.exit_code());
                        }
                        Err(err) => eprintln!("  Lily consumer failed: {err}"),
                    }
                });
                let deadline = Instant::now() + Duration::from_secs(20);
                while !stats.ready() && Instant::now() < deadline && !task.is_finished() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Self::Lily {
                    stats,
                    shutdown,
                    task,
                    handoff: path == Path::Handoff,
                }
            }
            Contender::RawBatch => {
                let bucket = (path == Path::Handoff).then_some(bucket);
                let raw = RawBatch::open(&setup.url, QUEUE, bucket, prefetch).await;
                let stop = CancellationToken::new();
                let counters = Arc::new(Counters::default());
                let sink = Arc::new(Sink::default());
                let task =
                    tokio::spawn(raw.run(stop.clone(), Arc::clone(&sink), Arc::clone(&counters)));
                Self::Raw {
                    stop,
                    task,
                    counters,
                    sink,
                }
            }
        }
    }

    /// Deliveries settled so far.
    fn settled(&self) -> u64 {
        match self {
            Self::Lily { stats, handoff, .. } => {
                let totals = stats.totals();
                if *handoff {
                    totals.retried
                } else {
                    totals.acked
                }
            }
            Self::Raw { counters, .. } => counters.settled.load(Ordering::Relaxed),
        }
    }

    fn finished(&self) -> bool {
        match self {
            Self::Lily { task, .. } | Self::Raw { task, .. } => task.is_finished(),
        }
    }

    /// Where this contender's latencies go.
    fn sink<'a>(&'a self, lily_sink: &'a Sink) -> &'a Sink {
        match self {
            Self::Lily { .. } => lily_sink,
            Self::Raw { sink, .. } => sink,
        }
    }

    /// The latencies recorded so far, emptying the record.
    fn take_latencies(&self, lily_sink: &Sink) -> Vec<(Instant, u32)> {
        match self {
            Self::Lily { .. } => lily_sink.take(),
            Self::Raw { sink, .. } => sink.take(),
        }
    }

    /// How long each copy took from its publish to its confirm so far (see
    /// [`Run::copy_confirms`]), emptying the record.
    fn take_copies(&self, lily_copies: &Sink) -> Vec<(Instant, u32)> {
        match self {
            Self::Lily { .. } => lily_copies.take(),
            Self::Raw { counters, .. } => counters.copies.take(),
        }
    }

    /// Stops the contender; returns the deliveries that ended otherwise than settled.
    async fn stop(self) -> u64 {
        match self {
            Self::Lily {
                stats,
                shutdown,
                task,
                ..
            } => {
                shutdown.trigger(Trigger::Api);
                let _ = task.await;
                let t = stats.totals();
                let other = t.requeued + t.dead_lettered + t.parked + t.unresolved;
                if other > 0 {
                    eprintln!("  Lily: unexpected outcomes {t:?}");
                }
                other
            }
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

fn delays(path: Path) -> Vec<Duration> {
    match path {
        Path::Success => lily_run::success_delays(),
        Path::Handoff => vec![HANDOFF_DELAY],
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
    let topology = fresh_topology(&setup.url, QUEUE, QueueKind::Classic, &delays(path)).await;
    let bucket = topology.bucket(0).expect("a retry bucket").to_owned();
    publish(
        &setup.url,
        QUEUE,
        usize::try_from(n).expect("fits"),
        &setup.body,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let running = Running::start(setup, who, path, prefetch, &bucket).await;
    let limit = run_limit(n);
    while running.settled() < n && started.elapsed() < limit && !running.finished() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let elapsed = started.elapsed();
    let settled = running.settled();
    let _ = running.take_latencies(&setup.lily.settled);
    running.stop().await;
    Sample::new(settled, n, elapsed)
}

/// `who` consuming while the paced publisher publishes at `rate` for the run's duration.
pub async fn paced(setup: &Setup, who: Contender, path: Path, prefetch: u16, rate: f64) -> Run {
    let topology = fresh_topology(&setup.url, QUEUE, QueueKind::Classic, &delays(path)).await;
    let bucket = topology.bucket(0).expect("a retry bucket").to_owned();
    let running = Running::start(setup, who, path, prefetch, &bucket).await;
    let _ = running.take_latencies(&setup.lily.settled);
    let depth = Arc::new(Depth::default());
    let stop_depth = CancellationToken::new();
    let watch = tokio::spawn(Arc::clone(&depth).watch(
        setup.url.clone(),
        QUEUE.to_owned(),
        stop_depth.clone(),
    ));
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let capacity = (rate * setup.run.as_secs_f64()) as usize + 1;
    let sent = Arc::new(Sent::new(capacity));
    running
        .sink(&setup.lily.settled)
        .starts_from(Arc::clone(&sent));
    let _ = running.take_copies(&setup.lily.copies);
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
    let ready_depth_at_end = depth.last.load(Ordering::Relaxed);
    let paced = publisher.await.expect("the paced publisher");
    let deadline = Instant::now() + DRAIN_LIMIT;
    while running.settled() < paced.published && Instant::now() < deadline && !running.finished() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let drain_secs = until.elapsed().as_secs_f64();
    let complete = running.settled() >= paced.published;
    stop_depth.cancel();
    let _ = watch.await;
    let latencies: Vec<u32> = running
        .take_latencies(&setup.lily.settled)
        .into_iter()
        .filter(|(published, _)| (from..until).contains(published))
        .map(|(_, us)| us)
        .collect();
    let copy_confirms = (path == Path::Handoff).then(|| {
        Latencies::of(
            running
                .take_copies(&setup.lily.copies)
                .into_iter()
                .filter(|(written, _)| (from..until).contains(written))
                .map(|(_, us)| us)
                .collect(),
        )
    });
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
        max_ready_depth: depth.max.load(Ordering::Relaxed),
        ready_depth_at_end,
        backlog_bounded: f64::from(ready_depth_at_end) <= BACKLOG_SECS * rate,
        drain_secs,
        complete,
        failed,
        latency: Latencies::of(latencies),
        copy_confirms,
    }
}
