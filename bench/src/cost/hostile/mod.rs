//! Bounded memory under hostile load (`cost --only hostile`): `N` messages just under the
//! consumer's limits (some just over) drained at full prefetch, the peak RSS judged against a
//! stated bound and every id checked from outside. Method: `bench/README.md`.

pub mod child;
pub mod messages;

use std::io::Write as _;
use std::process::ChildStdin;
use std::time::{Duration, Instant};

use lapin::{Confirmation, Connection, ConnectionProperties};
use lily::consumer::{Limits, Policy};
use lily::prelude::QueueKind;
use lily::topology::Topology;
use lily_mq_testkit::Client;
use serde::Serialize;

use lily_mq_regress::consume::Who;

use self::child::Report;
use self::messages::{Class, Expected, index, message};
use super::{Bench, failed, spawn};
use crate::fresh_topology;

/// Messages a run.
pub const N: usize = 10_000;
/// Prefetch (and concurrency): over three times the top of the 100–300 range RabbitMQ's guide
/// recommends and 20 times Lily's default; the bound is linear in it.
pub const PREFETCH: u16 = 1_000;
/// Copies of one delivery the bound allows at once: the delivery and its decoded payload or
/// handoff copy.
const COPIES: u64 = 2;
/// lapin's frame buffers per connection: 32 frames of `frame_max` to read and as many to write.
const LAPIN_FRAME_BUFFERS: u64 = 2 * 32;
/// How long the queues must stay empty before the run counts as over (above the 1 s retry
/// delay, so a copy waiting in its bucket is seen there).
const QUIET: Duration = Duration::from_millis(1_500);

/// The limits in force: Lily's defaults with `max_body_bytes` at 64 KiB, so 10 000 messages stay
/// within a shared machine's disk.
pub fn limits() -> Limits {
    let mut limits = Limits::default();
    limits.max_body_bytes = 64 * 1024;
    limits
}

/// Two attempts, one retry bucket of 1 s.
pub fn policy() -> Policy {
    Policy::default()
        .max_attempts(2)
        .retry_delays([Duration::from_secs(1)])
}

/// The hostile load: both contenders, judged.
#[derive(Debug, Serialize)]
pub struct Hostile {
    pub n: usize,
    pub prefetch: u16,
    pub bound_formula: String,
    pub lily: Run,
    pub raw: Run,
    /// Lily's peak within the bound, and no message of either missing or left unsettled.
    pub met: bool,
    pub failures: Vec<String>,
}

/// One contender's run: its memory against the bound, its drain, and the evidence by id.
#[derive(Debug, Default, Serialize)]
pub struct Run {
    pub rss_idle_bytes: u64,
    /// The peak: `VmHWM`, or a sampled `VmRSS` where the kernel's lazily folded counters put
    /// that a few pages higher.
    pub hwm_bytes: u64,
    pub bound_bytes: u64,
    pub peak_over_bound: f64,
    pub msgs_per_s: f64,
    pub sent: usize,
    /// Ids found exactly once, settled (handled, or in the DLQ).
    pub settled: usize,
    pub missing: usize,
    /// Ids still in the work queue, a bucket or the parking lane.
    pub unsettled: usize,
    /// Settled ids not where their class says (Lily only: raw has no gate and never fails).
    pub unexpected: usize,
}

/// The hostile-load measurement: Lily, then raw lapin at the same prefetch.
pub(super) fn measure(b: &Bench) -> Result<Hostile, String> {
    let (lily, raw) = (run(b, Who::Lily)?, run(b, Who::Raw)?);
    let mut failures = Vec::new();
    for (who, r) in [("lily", &lily), ("raw", &raw)] {
        if r.missing + r.unsettled > 0 {
            failures.push(format!(
                "{who}: {} messages missing, {} left unsettled",
                r.missing, r.unsettled
            ));
        }
    }
    if lily.hwm_bytes > lily.bound_bytes {
        failures.push(format!(
            "lily: peak RSS {} bytes over the bound of {} bytes",
            lily.hwm_bytes, lily.bound_bytes
        ));
    }
    Ok(Hostile {
        n: N,
        prefetch: PREFETCH,
        bound_formula: format!(
            "idle RSS + connections x {LAPIN_FRAME_BUFFERS} x frame_max + prefetch x {COPIES} x (max_body_bytes + max_header_bytes)"
        ),
        lily,
        raw,
        met: failures.is_empty(),
        failures,
    })
}

/// One contender: a fresh topology, the child started and idle, the load published, the window
/// filled, the queue drained until quiet, then every queue drained by id.
#[allow(clippy::cast_precision_loss)]
fn run(b: &Bench, who: Who) -> Result<Run, String> {
    let name = who.name().to_lowercase();
    let queue = format!("lily-bench-cost-hostile-{name}");
    let retry = policy().retry_delays;
    let topology =
        b.rt.block_on(fresh_topology(&b.url, &queue, QueueKind::Classic, &retry));
    let mut command = b.child(false, &["hostile", &name, &queue]);
    let (mut child, mut lines) = spawn(&mut command)?;
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let driven = drive(b, &mut stdin, &mut lines, &topology);
    if driven.is_err() {
        let _ = child.kill();
    }
    let status = child.wait().map_err(|e| format!("wait: {e}"))?;
    let (report, frame_max) = driven?;
    if !status.success() {
        return Err(format!("hostile {name} exited with {status}"));
    }
    let (limits, connections) = (limits(), if who == Who::Lily { 2 } else { 1 });
    let (idle, hwm) = (report.idle_rss_bytes, report.peak_rss_bytes);
    let bound = idle
        + connections * LAPIN_FRAME_BUFFERS * frame_max
        + u64::from(PREFETCH) * COPIES * (limits.max_body_bytes + limits.max_header_bytes) as u64;
    let client = b.rt.block_on(Client::connect(&b.url));
    let r = Run {
        rss_idle_bytes: idle,
        hwm_bytes: hwm,
        bound_bytes: bound,
        peak_over_bound: hwm as f64 / bound as f64,
        msgs_per_s: N as f64 / report.drain_secs,
        ..b.rt.block_on(evidence(&client, &topology, &report, who))
    };
    eprintln!("cost: hostile {name}: {r:?}");
    Ok(r)
}

/// The parent's side of the child's run, up to its report: returns it with `frame_max`.
fn drive(
    b: &Bench,
    stdin: &mut ChildStdin,
    lines: &mut impl Iterator<Item = String>,
    topology: &Topology,
) -> Result<(Report, u64), String> {
    let mut wait = |tag: &str| {
        lines
            .find(|l| l.starts_with(tag))
            .ok_or_else(|| format!("the child exited before {tag}"))
    };
    let mut tell = |command: &str| {
        writeln!(stdin, "{command}")
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("write {command}: {e}"))
    };
    wait("IDLE")?;
    let frame_max = b.rt.block_on(publish(&b.url, topology.queue()))?;
    tell("GO")?;
    wait("FULL")?;
    let client = b.rt.block_on(Client::connect(&b.url));
    let mut lanes = vec![topology.queue().to_owned()];
    lanes.extend(topology.buckets().map(|(name, _)| name.to_owned()));
    let (started, mut quiet_since) = (Instant::now(), None);
    while quiet_since.is_none_or(|q: Instant| q.elapsed() < QUIET) {
        std::thread::sleep(Duration::from_millis(200));
        let mut depth = 0;
        for lane in &lanes {
            depth += b.rt.block_on(client.depth(lane));
        }
        quiet_since = (depth == 0).then(|| quiet_since.unwrap_or_else(Instant::now));
        if started.elapsed() > Duration::from_secs(900) {
            return Err(format!(
                "the queues did not empty within 900 s ({depth} ready)"
            ));
        }
    }
    tell("STOP")?;
    let report = lines
        .find_map(|l| super::result::<Report>(&l))
        .ok_or("the child printed no RESULT")?;
    Ok((report, frame_max))
}

/// Publishes the `N` messages to `queue` with confirms, 256 awaiting theirs at once; the
/// negotiated `frame_max`.
async fn publish(url: &str, queue: &str) -> Result<u64, String> {
    let connection = Connection::connect(url, ConnectionProperties::default()).await;
    let connection = connection.map_err(failed("connect"))?;
    let channel = crate::raw::confirm_channel(&connection).await;
    let (limits, mut pending) = (limits(), std::collections::VecDeque::new());
    let confirmed = |i: usize, confirmation: lapin::Result<Confirmation>| match confirmation {
        Ok(Confirmation::Ack(None)) => Ok(()),
        other => Err(format!("publish of message {i} not confirmed: {other:?}")),
    };
    for i in 0..N {
        let (_, body, properties) = message(i, N, &limits);
        let (exchange, options) = ("".into(), crate::raw::MANDATORY);
        let publish = channel.basic_publish(exchange, queue.into(), options, &body, properties);
        pending.push_back((i, publish.await.map_err(failed("publish"))?));
        if pending.len() >= 256
            && let Some((i, confirm)) = pending.pop_front()
        {
            confirmed(i, confirm.await)?;
        }
    }
    for (i, confirm) in pending {
        confirmed(i, confirm.await)?;
    }
    let frame_max = u64::from(connection.configuration().frame_max());
    let _ = connection.close(200, "published".into()).await;
    Ok(frame_max)
}

/// Drains every queue of `topology` by message id (bodies measured, never printed) and judges
/// each id: the handler's record of its successes, each DLQ copy's failure kind, and anything
/// left in the other queues.
async fn evidence(client: &Client, topology: &Topology, report: &Report, who: Who) -> Run {
    let n = report.ok.len();
    // Where each id ended: handled on an attempt (as often as the handler's record says),
    // dead-lettered with a kind, or left in another queue (`None`).
    let handled = |i: usize| Some(Expected::Handled(report.attempt[i]));
    let mut found: Vec<Vec<_>> = (0..n)
        .map(|i| vec![handled(i); report.ok[i] as usize])
        .collect();
    let mut lanes = vec![topology.queue().to_owned(), topology.parking_queue()];
    lanes.extend(topology.buckets().map(|(name, _)| name.to_owned()));
    lanes.push(topology.dead_letter_queue());
    for (lane, queue) in lanes.iter().enumerate() {
        while let Some(message) = client.take(queue, Duration::ZERO).await {
            let properties = &message.delivery.properties;
            let i = properties
                .message_id()
                .as_ref()
                .and_then(|id| index(id.as_str()));
            if let Some(places) = i.and_then(|i| found.get_mut(i)) {
                let kind = || Expected::DeadLettered(messages::failure_kind(properties));
                places.push((lane == lanes.len() - 1).then(kind));
            }
        }
    }
    let mut r = Run {
        sent: n,
        ..Run::default()
    };
    for (i, places) in found.iter().enumerate() {
        match places.as_slice() {
            [] => r.missing += 1,
            _ if places.contains(&None) => r.unsettled += 1,
            [Some(place)] => {
                r.settled += 1;
                let class = Class::of(i, n);
                r.unexpected += usize::from(who == Who::Lily && *place != class.expected());
            }
            _ => r.unexpected += 1,
        }
    }
    r
}
