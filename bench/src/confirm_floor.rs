//! `lily-bench confirm-floor`: the broker's own publish-to-confirm latency, the floor under every
//! handoff path's tail. Method: `bench/README.md`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::report::Table;
use crate::run::HANDOFF_DELAY;
use crate::{body_512, broker_url, fresh_topology};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};
use lily::prelude::QueueKind;
use serde::Serialize;

/// The broker's publish-to-confirm latency, pipelined and batched.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// 6 s runs with 1 s of warm-up.
    #[arg(long)]
    quick: bool,
    /// Publish rates, messages a second.
    #[arg(long, value_delimiter = ',', default_value = "2400,4320")]
    rates: Vec<f64>,
    /// Confirm channels.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    channels: Vec<usize>,
    /// Seconds a run publishes.
    #[arg(
        long,
        default_value = "8",
        default_value_if("quick", "true", Some("6"))
    )]
    secs: u64,
    /// Seconds of warm-up, not timed.
    #[arg(
        long,
        default_value = "2",
        default_value_if("quick", "true", Some("1"))
    )]
    warmup: u64,
    /// Where the results go.
    #[arg(long, default_value = "target/bench")]
    out: std::path::PathBuf,
}

/// One pattern at one rate: publish-to-confirm latencies of the timed messages.
#[derive(Debug, Serialize)]
struct Row {
    pattern: &'static str,
    channels: usize,
    rate: f64,
    timed: usize,
    /// Publishes not confirmed as stored (nacked, returned or failed).
    unconfirmed: u64,
    p50_ms: f64,
    p99_ms: f64,
    p999_ms: f64,
    max_ms: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    #[serde(flatten)]
    meta: crate::Meta,
    secs: u64,
    warmup: u64,
    rows: Vec<Row>,
}

/// A publish in flight: when it was due (its latency's start) and whether it is timed.
type Timed = (Instant, bool);

/// Publishes at `rate` for `secs` into `bucket` with `pattern` on `channels` channels.
async fn time_confirms(
    url: &str,
    bucket: &str,
    pattern: &'static str,
    channels: usize,
    rate: f64,
    (secs, warmup): (u64, u64),
) -> Row {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect");
    let mut chans = Vec::new();
    for _ in 0..channels {
        let channel = connection.create_channel().await.expect("channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm.select");
        chans.push(channel);
    }
    let body = body_512();
    let latencies: Arc<Mutex<Vec<f64>>> = Arc::default();
    let unconfirmed: Arc<Mutex<u64>> = Arc::default();
    let batched = pattern == "batched";
    let (duration, warmup) = (Duration::from_secs(secs), Duration::from_secs(warmup));
    let mut owed: Vec<VecDeque<Timed>> = vec![VecDeque::new(); channels];
    let mut awaiting: Vec<Option<tokio::task::JoinHandle<()>>> =
        (0..channels).map(|_| None).collect();
    let mut done = Vec::new();
    let mut ticks = tokio::time::interval(Duration::from_millis(1));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let started = Instant::now();
    let (mut sent, mut turn) = (0_u64, 0_usize);
    loop {
        ticks.tick().await;
        let elapsed = started.elapsed().min(duration);
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let due = (rate * elapsed.as_secs_f64()) as u64;
        let now = Instant::now();
        for _ in sent..due {
            owed[turn % channels].push_back((now, elapsed >= warmup));
            turn += 1;
        }
        sent = due.max(sent);
        for (c, channel) in chans.iter().enumerate() {
            if batched && awaiting[c].as_ref().is_some_and(|h| !h.is_finished()) {
                continue;
            }
            let mut confirms = Vec::new();
            for (at, timed) in owed[c].drain(..) {
                let options = BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                };
                let properties = BasicProperties::default().with_delivery_mode(2);
                match channel
                    .basic_publish("".into(), bucket.into(), options, &body, properties)
                    .await
                {
                    Ok(confirm) => confirms.push((at, timed, confirm)),
                    Err(_) => *unconfirmed.lock().expect("lock") += 1,
                }
            }
            if confirms.is_empty() {
                continue;
            }
            let (latencies, unconfirmed) = (Arc::clone(&latencies), Arc::clone(&unconfirmed));
            // Confirms come in publish order, so awaiting them in turn times each when it came.
            let handle = tokio::spawn(async move {
                for (at, timed, confirm) in confirms {
                    let stored = matches!(confirm.await, Ok(Confirmation::Ack(None)));
                    let ms = at.elapsed().as_secs_f64() * 1000.0;
                    if !stored {
                        *unconfirmed.lock().expect("lock") += 1;
                    } else if timed {
                        latencies.lock().expect("lock").push(ms);
                    }
                }
            });
            if batched {
                awaiting[c] = Some(handle);
            } else {
                done.push(handle);
            }
        }
        if elapsed >= duration && owed.iter().all(VecDeque::is_empty) {
            break;
        }
    }
    for handle in done.into_iter().chain(awaiting.into_iter().flatten()) {
        handle.await.expect("confirm task");
    }
    let _ = connection.close(200, "done".into()).await;
    let mut l = std::mem::take(&mut *latencies.lock().expect("lock"));
    l.sort_by(f64::total_cmp);
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let q = |p: f64| {
        l.get(((l.len() as f64 * p) as usize).min(l.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN)
    };
    let unconfirmed = *unconfirmed.lock().expect("lock");
    Row {
        pattern,
        channels,
        rate,
        timed: l.len(),
        unconfirmed,
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        p999_ms: q(0.999),
        max_ms: l.last().copied().unwrap_or(f64::NAN),
    }
}

fn markdown(report: &Report) -> String {
    let conditions = format!(
        "Paced runs of {} s, the first {} s not timed",
        report.secs, report.warmup
    );
    let title = "The broker's confirm latency: the floor under the handoff tail";
    let head = "pattern|channels|rate msg/s|timed|unconfirmed|p50 ms|p99 ms|p99.9 ms|max ms";
    let mut table = Table::new(head, 1);
    for r in &report.rows {
        let mut cells = vec![r.pattern.to_owned(), r.channels.to_string()];
        cells.extend([
            format!("{:.0}", r.rate),
            r.timed.to_string(),
            r.unconfirmed.to_string(),
        ]);
        cells.extend([r.p50_ms, r.p99_ms, r.p999_ms, r.max_ms].map(|v| format!("{v:.2}")));
        table.row(&cells);
    }
    let mut md = crate::report::opening(title, &report.meta, &conditions) + &table.end();
    for note in &report.meta.notes {
        md += &format!("- {note}\n");
    }
    md
}

/// Runs the benchmark.
pub async fn run(args: Args) {
    assert!(
        args.warmup < args.secs,
        "--warmup must be shorter than --secs"
    );
    let url = broker_url();
    let started = Instant::now();
    let topology = fresh_topology(
        &url,
        "lily-bench-confirm-floor",
        QueueKind::Classic,
        &[HANDOFF_DELAY],
    )
    .await;
    let bucket = topology.bucket(0).expect("a retry bucket").to_owned();
    let mut rows = Vec::new();
    for &rate in &args.rates {
        for &channels in &args.channels {
            for pattern in ["pipelined", "batched"] {
                let row = time_confirms(
                    &url,
                    &bucket,
                    pattern,
                    channels,
                    rate,
                    (args.secs, args.warmup),
                )
                .await;
                eprintln!(
                    "  {pattern:9} {channels} channel(s) {rate:.0}/s: p50 {:.2} p99 {:.2} p99.9 {:.2} ms ({} timed, {} unconfirmed)",
                    row.p50_ms, row.p99_ms, row.p999_ms, row.timed, row.unconfirmed
                );
                rows.push(row);
            }
        }
    }
    let mut meta = crate::Meta::new("confirm-floor", &url, vec![crate::METHOD.into()]);
    meta.finish(started);
    let report = Report {
        meta,
        secs: args.secs,
        warmup: args.warmup,
        rows,
    };
    crate::report::write(
        &args.out,
        "confirm-floor",
        &report,
        &markdown(&report),
        None,
    );
}
