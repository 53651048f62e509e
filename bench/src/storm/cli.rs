//! `lily-bench storm`: 100 % retryable failures for minutes, raw lapin against Lily.
//! Method: `bench/README.md`.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::raw;
use crate::report;
use crate::storm::{
    Contender, QUEUE, RETRY_DELAY, Results, StormRun, Summary, check, lily, sample,
};
use crate::{body_512, broker_url, fresh_topology, publish};
use ::lily::prelude::{QueueKind, Trigger};
use tokio_util::sync::CancellationToken;

/// Seconds at the start of a run left out of the rates and the RSS start and slope.
const WARMUP: u32 = 10;

/// Failure storm: raw lapin against Lily.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// 45 s a contender.
    #[arg(long)]
    quick: bool,
    /// Seconds each contender consumes (above the warm-up).
    #[arg(long, default_value = "300", value_parser = clap::value_parser!(u32).range(i64::from(WARMUP) + 2..),
          default_value_if("quick", "true", Some("45")))]
    secs: u32,
    /// Messages published up front.
    #[arg(short = 'n', long, default_value = "40000", value_parser = crate::parse::count)]
    population: u64,
    /// Prefetch (and Lily's concurrency).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u16).range(1..))]
    prefetch: u16,
    /// Who runs, in order.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "raw,lily")]
    contenders: Vec<Contender>,
    /// Where the results go.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
}

/// One contender's storm on a fresh topology.
async fn storm(url: &str, body: &[u8], args: &Args, who: Contender) -> StormRun {
    let topology = fresh_topology(url, QUEUE, QueueKind::Classic, &[RETRY_DELAY]).await;
    let bucket = topology.bucket(0).expect("a retry bucket").to_owned();
    let count = usize::try_from(args.population).expect("population fits usize");
    publish(url, QUEUE, count, body).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (series, failed, lily_totals) = match who {
        Contender::Raw => {
            let counters = Arc::new(raw::Counters::default());
            let stop = CancellationToken::new();
            let task = tokio::spawn(raw::storm(
                url.to_owned(),
                QUEUE.to_owned(),
                bucket.clone(),
                args.prefetch,
                Arc::clone(&counters),
                stop.clone(),
            ));
            let series = sample(url, QUEUE, args.secs, || {
                counters.handoffs.load(Ordering::Relaxed)
            })
            .await;
            stop.cancel();
            let _ = task.await;
            (series, counters.failed.load(Ordering::Relaxed), None)
        }
        Contender::Lily => {
            let (consumer, shutdown) = lily::consumer(url, QUEUE, args.prefetch);
            let stats = consumer.stats();
            let task = tokio::spawn(consumer.run(shutdown.clone()));
            let deadline = Instant::now() + lily::READY_LIMIT;
            while !stats.ready() && Instant::now() < deadline && !task.is_finished() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let series = sample(url, QUEUE, args.secs, || stats.totals().retried).await;
            shutdown.trigger(Trigger::Api);
            match task.await {
                Ok(Ok(report)) if report.exit_code() == 0 => {}
                Ok(Ok(report)) => {
                    eprintln!("  Lily shutdown report exit code {}", report.exit_code())
                }
                Ok(Err(err)) => eprintln!("  Lily consumer failed: {err}"),
                Err(err) => eprintln!("  Lily consumer task: {err}"),
            }
            let t = stats.totals();
            let other = t.requeued + t.dead_lettered + t.parked + t.unresolved;
            (series, other, Some(t))
        }
    };
    // Let every copy in the bucket come back before counting.
    tokio::time::sleep(RETRY_DELAY + Duration::from_millis(1500)).await;
    let check = check::check(
        url,
        QUEUE,
        &bucket,
        &topology.dead_letter_queue(),
        &topology.parking_queue(),
        args.population,
    )
    .await;
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
    let body = body_512();
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
        let run = storm(&url, &body, &args, who).await;
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
        results
            .runs
            .iter()
            .find(|r| r.contender == who)
            .map(|r| r.summary.mean_rate)
    };
    results.lily_over_raw = mean(Contender::Lily)
        .zip(mean(Contender::Raw))
        .map(|(l, r)| l / r);
    results.meta.finish(total);
    let chart = report::storm_chart(&results);
    let markdown = report::storm(&results);
    report::write(&args.out, "storm", &results, &markdown, Some(&chart));
    println!("total {:.0} s", total.elapsed().as_secs_f64());
}
