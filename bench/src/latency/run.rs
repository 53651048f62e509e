//! One measurement: a contender's drain rate, or a contender under the paced load, and that
//! load's publisher.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};
use lily::prelude::QueueKind;
use lily::topology::Topology;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::latency::raw_batch::{self, Counters};
use crate::latency::timer::{self, COPIES, SETTLED};
use crate::latency::{Contender, KEPT_UP, Path, QUEUE, Run};
use crate::report::ms;
use crate::run::{Lily, backlog, run_limit, unexpected};
use crate::throughput::lily_run;
use crate::{Order, fresh_topology};

/// How long a run waits, after publishing stopped, for the backlog to be settled.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// What the runs of one path × prefetch share.
#[derive(Clone)]
pub struct Setup {
    pub url: String,
    pub path: Path,
    pub prefetch: u16,
    /// Publishing time of a paced run.
    pub run: Duration,
    /// The start of a paced run whose latencies are not kept.
    pub warmup: Duration,
    /// When the benchmark started (progress lines say the seconds since).
    pub started: Instant,
}

impl Setup {
    /// A progress line on stderr: the case, `what`, and the seconds since the benchmark started.
    pub fn progress(&self, what: &str) {
        let (path, secs) = (self.path.name(), self.started.elapsed().as_secs_f64());
        eprintln!("  {path} prefetch {} {what} [{secs:.0} s]", self.prefetch);
    }
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
        let (stop, task, counters) = raw_batch::start(url, bucket, prefetch).await;
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
pub async fn drain_rate(setup: &Setup, who: Contender, n: u64) -> f64 {
    let delays = setup.path.delays();
    let topology = backlog(&setup.url, QUEUE, QueueKind::Classic, &delays, n).await;
    let started = Instant::now();
    let running = Running::start(setup, who, &topology).await;
    let settled = running.settle(n, started + run_limit(n)).await;
    let rate = settled as f64 / started.elapsed().as_secs_f64();
    running.stop().await;
    let what = format!("drain rate {:<9} {rate:>8.0} msgs/s", who.name());
    setup.progress(&format!("{what}, complete {}", settled >= n));
    rate
}

/// `who` consuming while the paced publisher publishes at `rate` for the run's duration, with
/// its progress line after `what`.
pub async fn paced(setup: &Setup, who: Contender, rate: f64, what: &str) -> Run {
    let delays = setup.path.delays();
    let topology = fresh_topology(&setup.url, QUEUE, QueueKind::Classic, &delays).await;
    let running = Running::start(setup, who, &topology).await;
    // The sinks still hold records of earlier runs, all started before `from`: `take` leaves
    // them out.
    let sent = timer::stamp_slots((rate * setup.run.as_secs_f64()) as usize + 1);
    let started = Instant::now();
    let (url, duration) = (setup.url.clone(), setup.run);
    let publisher = tokio::spawn(async move { publish_paced(&url, rate, duration, &sent).await });
    let (from, until) = (started + setup.warmup, started + setup.run);
    tokio::time::sleep_until(from.into()).await;
    let settled_from = running.settled();
    tokio::time::sleep_until(until.into()).await;
    let settled_until = running.settled();
    let (published, unconfirmed, secs) = publisher.await.expect("the paced publisher");
    let drained = running
        .settle(published, Instant::now() + DRAIN_LIMIT)
        .await;
    let drain_secs = until.elapsed().as_secs_f64();
    let latency = SETTLED.take(from..until);
    let copy_confirms = (setup.path == Path::Handoff).then(|| COPIES.take(from..until));
    let failed = running.stop().await;
    let window = (setup.run - setup.warmup).as_secs_f64();
    let settled_per_sec = (settled_until - settled_from) as f64 / window;
    let publish_rate = published as f64 / secs;
    let run = Run {
        contender: who,
        target_rate: rate,
        published,
        unconfirmed,
        publish_rate,
        publisher_reached_target: publish_rate >= KEPT_UP * rate,
        settled_per_sec,
        kept_up: settled_per_sec >= KEPT_UP * publish_rate,
        drain_secs,
        complete: drained >= published,
        failed,
        latency,
        copy_confirms,
    };
    let copies = copy_confirms.map_or_else(String::new, |c| {
        let (p50, p99) = (ms(c.p50_us), ms(c.p99_us));
        format!(" (copy to confirm: p50 {p50} p99 {p99} ms)")
    });
    let flag = match (run.complete, run.sustained()) {
        (false, _) => " (INCOMPLETE)",
        (true, false) => " (not sustained)",
        (true, true) => "",
    };
    setup.progress(&format!(
        "{what} {:<9} published {:>7.0}/s settled {:>7.0}/s p50 {} p99 {} p99.9 {} ms{copies}{flag}",
        who.name(),
        publish_rate,
        settled_per_sec,
        ms(latency.p50_us),
        ms(latency.p99_us),
        ms(latency.p999_us),
    ));
    run
}

/// How often the publisher publishes what its schedule owes.
const TICK: Duration = Duration::from_millis(1);

/// The load: publishes `rate` 512-byte orders a second to [`QUEUE`] for `duration`, with ids
/// `p-{i}`, stamping each one's publish time in `sent_at[i]`, and waits for every confirm. Raw
/// lapin on a confirm channel, as cheap as a publisher gets: every [`TICK`] what its schedule
/// of `rate × elapsed` owes, back to back, the confirms awaited by a task of their own.
/// Returns the messages published (handed to the broker), the publishes not confirmed (failed,
/// nacked or returned) and the seconds from the first tick to the last publish.
///
/// # Panics
/// When the publisher cannot connect.
async fn publish_paced(
    url: &str,
    rate: f64,
    duration: Duration,
    sent_at: &[OnceLock<Instant>],
) -> (u64, u64, f64) {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect the paced publisher");
    let channel = crate::raw::confirm_channel(&connection).await;
    let (confirms, mut pending) = mpsc::unbounded_channel::<lapin::PublisherConfirm>();
    let awaiting = tokio::spawn(async move {
        let mut unconfirmed = 0;
        while let Some(confirm) = pending.recv().await {
            if !matches!(confirm.await, Ok(Confirmation::Ack(None))) {
                unconfirmed += 1;
            }
        }
        unconfirmed
    });
    let (body, mut failed) = (Order::body(), 0);
    let properties = BasicProperties::default()
        .with_type("order.placed".into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let started = Instant::now();
    let mut sent = 0;
    loop {
        ticks.tick().await;
        let elapsed = started.elapsed().min(duration);
        let due = (rate * elapsed.as_secs_f64()) as usize;
        let publishes: Vec<_> = (sent..due)
            .map(|i| {
                if let Some(slot) = sent_at.get(i) {
                    let _ = slot.set(Instant::now());
                }
                let properties = properties.clone().with_message_id(format!("p-{i}").into());
                let options = crate::raw::MANDATORY;
                channel.basic_publish("".into(), QUEUE.into(), options, &body, properties)
            })
            .collect();
        sent = due.max(sent);
        for published in futures_util::future::join_all(publishes).await {
            match published {
                Ok(confirm) => {
                    let _ = confirms.send(confirm);
                }
                Err(_) => failed += 1,
            }
        }
        if elapsed >= duration {
            break;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    drop(confirms);
    let unconfirmed = awaiting.await.unwrap_or(0) + failed;
    let _ = connection.close(200, "published".into()).await;
    (sent as u64, unconfirmed, secs)
}
