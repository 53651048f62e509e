//! `lily-bench storm`: 100 % retryable failures for minutes, raw lapin against Lily.
//! Method: `bench/README.md`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use lily::prelude::{Consumer, ConsumerConfig, Json, Policy, QueueHandlerError, QueueKind, Router};
use tokio_util::sync::CancellationToken;

use crate::args::Common;
use crate::run::{Lily, backlog, unexpected};
use crate::storm::{
    Contender, MAX_ATTEMPTS, QUEUE, REASON, RETRY_DELAY, Results, StormRun, Summary, check, sample,
};
use crate::{Order, broker_url, raw, report};

/// Seconds at the start of a run left out of the rates and the RSS start and slope.
const WARMUP: u32 = 10;

/// Failure storm: raw lapin against Lily.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    common: Common,
    /// Seconds each contender consumes, above the warm-up (quick: 45).
    #[arg(long, default_value = "300", value_parser = clap::value_parser!(u32).range(i64::from(WARMUP) + 2..),
          default_value_if("quick", "true", Some("45")))]
    secs: u32,
    /// Messages published up front.
    #[arg(short = 'n', long, default_value = "40000", value_parser = crate::args::count::<u64>)]
    population: u64,
    /// Prefetch (and Lily's concurrency).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u16).range(1..))]
    prefetch: u16,
    /// Who runs, in order.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "raw,lily")]
    contenders: Vec<Contender>,
}

/// A consumer of `queue` (prefetch = concurrency) whose handler deserializes the order and
/// fails retryably, with attempts enough never to dead-letter during the run.
fn lily_consumer(url: &str, prefetch: u16) -> Consumer {
    let router = Router::new().route("order.placed", |Json(o): Json<Order>| async move {
        std::hint::black_box(o);
        Err::<(), _>(QueueHandlerError::retryable(REASON))
    });
    let policy = Policy::default().max_attempts(MAX_ATTEMPTS);
    let config = ConsumerConfig::new(QUEUE).prefetch(prefetch);
    let config = config.concurrency(usize::from(prefetch));
    let config = config.policy(policy.retry_delays([RETRY_DELAY]));
    Consumer::new(url, config, router)
}

/// One contender's storm on a fresh topology.
async fn storm(url: &str, args: &Args, who: Contender) -> StormRun {
    let topology = backlog(
        url,
        QUEUE,
        QueueKind::Classic,
        &[RETRY_DELAY],
        args.population,
    );
    let topology = topology.await;
    let bucket = topology.bucket(0).expect("a retry bucket").to_owned();
    let (series, failed, lily_totals) = match who {
        Contender::Raw => {
            let counters = Arc::new(raw::Counters::default());
            let stop = CancellationToken::new();
            let queues = (QUEUE.to_owned(), bucket.clone());
            let counted = Arc::clone(&counters);
            let storm = raw::storm(url.to_owned(), queues, args.prefetch, counted, stop.clone());
            let task = tokio::spawn(storm);
            let series = sample(url, QUEUE, args.secs, || {
                counters.handoffs.load(Ordering::Relaxed)
            })
            .await;
            stop.cancel();
            let _ = task.await;
            (series, counters.failed.load(Ordering::Relaxed), None)
        }
        Contender::Lily => {
            let lily = Lily::ready(lily_consumer(url, args.prefetch))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let series = sample(url, QUEUE, args.secs, || lily.stats.totals().retried).await;
            let totals = lily.stopped().await;
            (series, unexpected(&totals), Some(totals))
        }
    };
    // Let every copy in the bucket come back before counting.
    tokio::time::sleep(RETRY_DELAY + Duration::from_millis(1500)).await;
    let check = check::check(url, &topology, args.population).await;
    StormRun {
        contender: who,
        secs: args.secs,
        handoffs: series.iter().map(|s| s.handoffs).sum(),
        failed,
        summary: Summary::of(&series, WARMUP),
        check,
        lily_totals,
        series,
    }
}

/// Runs the benchmark.
pub async fn run(args: Args) {
    let url = broker_url();
    let mut results = Results {
        meta: crate::Meta::new("storm", &url, vec![crate::METHOD.into()]),
        population: args.population,
        prefetch: args.prefetch,
        retry_delay_secs: RETRY_DELAY.as_secs_f64(),
        secs: args.secs,
        warmup_secs: WARMUP,
        runs: Vec::new(),
        lily_over_raw: None,
    };
    println!(
        "Lily failure storm: {}; {} messages, {} s a contender",
        results.meta.broker, args.population, args.secs
    );
    let total = Instant::now();
    for &who in &args.contenders {
        let run = storm(&url, &args, who).await;
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
    let mean = |who| {
        let run = results.runs.iter().find(|r| r.contender == who);
        run.map(|r| r.summary.mean_rate)
    };
    results.lily_over_raw = mean(Contender::Lily)
        .zip(mean(Contender::Raw))
        .map(|(l, r)| l / r);
    results.meta.finish(total);
    let (markdown, chart) = (report::storm(&results), report::storm_chart(&results));
    report::write(&args.common.out, "storm", &results, &markdown, Some(&chart));
    println!("total {:.0} s", total.elapsed().as_secs_f64());
}
