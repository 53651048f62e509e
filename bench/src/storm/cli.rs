//! `lily-bench storm`: 100 % retryable failures for minutes, raw lapin against Lily.
//! Method: `bench/README.md`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use lily::prelude::{Consumer, ConsumerConfig, Json, Policy, QueueHandlerError, QueueKind, Router};
use tokio_util::sync::CancellationToken;

use crate::args::Common;
use crate::run::{Lily, STORM_REASON, backlog, unexpected};
use crate::storm::{
    Contender, MAX_ATTEMPTS, POPULATION, PREFETCH, QUEUE, RETRY_DELAY, Results, StormRun, Summary,
    check, sample,
};
use crate::{Order, broker_url, raw, report};

/// Seconds at the start of a run left out of the rates and the RSS start and slope.
const WARMUP: u32 = 10;

/// Failure storm: raw lapin against Lily.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    common: Common,
}

/// A consumer of `queue` (prefetch = concurrency) whose handler deserializes the order and
/// fails retryably, with attempts enough never to dead-letter during the run.
fn lily_consumer(url: &str) -> Consumer {
    let router = Router::new().route("order.placed", |Json(o): Json<Order>| async move {
        std::hint::black_box(o);
        Err::<(), _>(QueueHandlerError::retryable(STORM_REASON))
    });
    let policy = Policy::default().max_attempts(MAX_ATTEMPTS);
    let config = ConsumerConfig::new(QUEUE).prefetch(PREFETCH);
    let config = config.concurrency(usize::from(PREFETCH));
    let config = config.policy(policy.retry_delays([RETRY_DELAY]));
    Consumer::new(url, config, router)
}

/// One contender's storm of `secs` seconds on a fresh topology.
async fn storm(url: &str, secs: u32, who: Contender) -> StormRun {
    let delays = [RETRY_DELAY];
    let topology = backlog(url, QUEUE, QueueKind::Classic, &delays, POPULATION).await;
    let bucket = topology.bucket(0).expect("a retry bucket").to_owned();
    let (series, failed, lily_totals) = match who {
        Contender::Raw => {
            let counters = Arc::new(raw::Counters::default());
            let stop = CancellationToken::new();
            let (queues, counted) = ((QUEUE.to_owned(), bucket), Arc::clone(&counters));
            let storm = raw::storm(url.to_owned(), queues, PREFETCH, counted, stop.clone());
            let task = tokio::spawn(storm);
            let series = sample(url, secs, || counters.handoffs.load(Ordering::Relaxed)).await;
            stop.cancel();
            let _ = task.await;
            (series, counters.failed.load(Ordering::Relaxed), None)
        }
        Contender::Lily => {
            let lily = Lily::ready(lily_consumer(url))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let series = sample(url, secs, || lily.stats.totals().retried).await;
            let totals = lily.stopped().await;
            (series, unexpected(&totals), Some(totals))
        }
    };
    // Let every copy in the bucket come back before counting.
    tokio::time::sleep(RETRY_DELAY + Duration::from_millis(1500)).await;
    let check = check(url, &topology).await;
    StormRun {
        contender: who,
        secs,
        handoffs: series.iter().map(|s| s.handoffs).sum(),
        failed,
        summary: Summary::of(&series, WARMUP),
        check,
        lily_totals,
        series,
    }
}

/// Runs the benchmark: raw lapin, then Lily, each for 300 s (quick: 45).
pub async fn run(args: Args) {
    let secs = if args.common.quick { 45 } else { 300 };
    let url = broker_url();
    let mut results = Results {
        meta: crate::Meta::new("storm", &url, vec![crate::METHOD.into()]),
        population: POPULATION,
        prefetch: PREFETCH,
        retry_delay_secs: RETRY_DELAY.as_secs_f64(),
        secs,
        warmup_secs: WARMUP,
        runs: Vec::new(),
        lily_over_raw: None,
    };
    let total = Instant::now();
    for who in [Contender::Raw, Contender::Lily] {
        let run = storm(&url, secs, who).await;
        eprintln!(
            "  {}: mean {:.0} handoffs/s, flatness {:.3}, RSS {:.1} → {:.1} MiB ({:+.2} MiB/min), ids {} [{:.0} s elapsed]",
            who.name(),
            run.summary.mean_rate,
            run.summary.flatness,
            run.summary.rss_start_mib,
            run.summary.rss_end_mib,
            run.summary.rss_slope_mib_per_min,
            if run.check.ok { "ok" } else { "FAILED" },
            total.elapsed().as_secs_f64()
        );
        results.runs.push(run);
    }
    let [raw, lily] = [0, 1].map(|i| results.runs[i].summary.mean_rate);
    results.lily_over_raw = Some(lily / raw);
    results.meta.finish(total);
    let (markdown, chart) = (report::storm(&results), report::storm_chart(&results));
    report::write(&args.common.out, "storm", &results, &markdown, Some(&chart));
}
