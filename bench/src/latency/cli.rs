//! `lily-bench latency`: settlement latency of Lily against raw-batch at 50 % and 90 % of the
//! maximum rate. Method: `bench/README.md`.

use std::time::{Duration, Instant};

use crate::args::Common;
use crate::latency::run::{self, Setup};
use crate::latency::timer::{self, Sinks};
use crate::latency::{
    Case, Contender, LOADS, MaxRate, Path, Results, Run, SUSTAIN_STEP, SUSTAIN_TRIES,
};
use crate::{Order, broker_url, report};

/// Settlement latency of Lily against raw-batch.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    common: Common,
    /// Paths to measure.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "success,handoff"
    )]
    paths: Vec<Path>,
    /// Prefetch values (quick: 500).
    #[arg(long = "prefetch", value_delimiter = ',', default_value = "500,50",
          value_parser = clap::value_parser!(u16).range(1..),
          default_value_if("quick", "true", Some("500")))]
    prefetches: Vec<u16>,
    /// Seconds a paced run publishes (quick: 8).
    #[arg(long, default_value = "20", value_parser = crate::args::positive,
          default_value_if("quick", "true", Some("8")))]
    secs: f64,
    /// Seconds of warm-up, not timed (quick: 2).
    #[arg(long, default_value = "3", value_parser = crate::args::positive,
          default_value_if("quick", "true", Some("2")))]
    warmup: f64,
    /// Messages of each drain-rate run (quick: 20 000).
    #[arg(short = 'n', long, default_value = "60000", value_parser = crate::args::count::<u64>,
          default_value_if("quick", "true", Some("20000")))]
    messages: u64,
    /// The maximum rate of every case, instead of measuring it.
    #[arg(long, value_parser = crate::args::positive)]
    max_rate: Option<f64>,
    /// Rounds of each case; the case reports the median round (quick: 1).
    #[arg(long, default_value = "3", value_parser = clap::value_parser!(u32).range(1..),
          default_value_if("quick", "true", Some("1")))]
    reps: u32,
}

/// `1.23`: µs as ms.
fn ms(us: u32) -> f64 {
    f64::from(us) / 1000.0
}

/// Runs the benchmark.
pub async fn run(args: Args) {
    assert!(
        args.warmup < args.secs,
        "--warmup must be shorter than --secs"
    );
    let sinks = Sinks::default();
    timer::install(sinks.clone());
    let url = broker_url();
    let mut notes = vec![crate::METHOD.to_owned()];
    if let Some(rate) = args.max_rate {
        notes.push(format!(
            "The maximum rate was given: {rate:.0} msg/s for every case."
        ));
    }
    let mut results = Results {
        meta: crate::Meta::new("latency", &url, notes),
        max_rate_messages: args.max_rate.map_or(args.messages, |_| 0),
        run_secs: args.secs,
        warmup_secs: args.warmup,
        cases: Vec::new(),
    };
    let started = Instant::now();
    // Who runs first alternates round by round, across cases too.
    let mut turn = [Contender::RawBatch, Contender::Lily];
    for &path in &args.paths {
        for &prefetch in &args.prefetches {
            let setup = Setup {
                url: url.clone(),
                body: Order::body().into(),
                path,
                prefetch,
                run: Duration::from_secs_f64(args.secs),
                warmup: Duration::from_secs_f64(args.warmup),
                sinks: sinks.clone(),
                started,
            };
            let max_rate = match args.max_rate {
                Some(used) => MaxRate {
                    used,
                    ..MaxRate::default()
                },
                None => max_rate(&setup, args.messages).await,
            };
            for load in LOADS {
                let target = (max_rate.used * load).round().max(1.0);
                let mut rounds = Vec::new();
                for round in 1..=args.reps {
                    let what = format!(
                        "{:.0}% ({target:.0}/s) round {round}/{}",
                        load * 100.0,
                        args.reps
                    );
                    let mut runs = Vec::new();
                    for who in turn {
                        runs.push(paced(&setup, who, target, &what).await);
                    }
                    turn.reverse();
                    runs.sort_by_key(|r| r.contender);
                    rounds.push(Case::new(path, prefetch, load, max_rate, runs[0], runs[1]));
                }
                results.cases.push(Case::median(rounds));
            }
        }
    }
    results.meta.finish(started);
    let (md, chart) = (report::latency(&results), report::latency_chart(&results));
    report::write(&args.common.out, "latency", &results, &md, Some(&chart));
}

/// A progress line on stderr: the case, `what`, and the seconds since the benchmark started.
fn progress(setup: &Setup, what: &str) {
    let (path, secs) = (setup.path.name(), setup.started.elapsed().as_secs_f64());
    eprintln!("  {path} prefetch {} {what} [{secs:.0} s]", setup.prefetch);
}

/// `who` under the paced load at `rate`, with its progress line after `what`.
async fn paced(setup: &Setup, who: Contender, rate: f64, what: &str) -> Run {
    let r = run::paced(setup, who, rate).await;
    let copies = r.copy_confirms.map_or_else(String::new, |c| {
        format!(
            " (copy to confirm: p50 {:.2} p99 {:.2} ms)",
            ms(c.p50_us),
            ms(c.p99_us)
        )
    });
    let flag = match (r.complete, r.sustained()) {
        (false, _) => " (INCOMPLETE)",
        (true, false) => " (not sustained)",
        (true, true) => "",
    };
    let l = r.latency;
    progress(
        setup,
        &format!(
            "{what} {:<9} published {:>7.0}/s settled {:>7.0}/s p50 {:.2} p99 {:.2} p99.9 {:.2} ms{copies}{flag}",
            who.name(),
            r.publish_rate,
            r.settled_per_sec,
            ms(l.p50_us),
            ms(l.p99_us),
            ms(l.p999_us),
        ),
    );
    r
}

/// The maximum rate of the setup's path and prefetch: each contender's drain rate with nothing
/// publishing, then what each settles while the paced publisher offers the higher of the two
/// (in runs of half a case's length: that rate only says where the search starts), then the
/// first rate from the lower of those down that both sustain.
async fn max_rate(setup: &Setup, messages: u64) -> MaxRate {
    let who = [Contender::Lily, Contender::RawBatch];
    let mut drained = [0.0; 2];
    for (rate, who) in drained.iter_mut().zip(who) {
        let s = run::drain_rate(setup, who, messages).await;
        *rate = s.msgs_per_sec;
        let what = format!("drain rate {:<9} {rate:>8.0} msgs/s", who.name());
        progress(setup, &format!("{what}, complete {}", s.complete));
    }
    let offered = drained[0].max(drained[1]).round().max(1.0);
    let overload = Setup {
        run: setup.run / 2,
        warmup: setup.warmup / 2,
        ..setup.clone()
    };
    let mut loaded = [0.0; 2];
    for (rate, who) in loaded.iter_mut().zip(who) {
        let what = format!("max rate ({offered:.0}/s offered)");
        *rate = paced(&overload, who, offered, &what).await.settled_per_sec;
    }
    let under_load = loaded[0].min(loaded[1]).round().max(1.0);
    // From `under_load` × SUSTAIN_STEP down by that factor, each rate checked in runs as long as
    // a case's (shorter ones let both sustain a rate whose 90 % Lily then fell behind at); a rate
    // Lily does not sustain is not tried on raw-batch.
    let (mut used, mut tries, mut sustained) = (under_load, 0, false);
    while !sustained && tries < SUSTAIN_TRIES {
        tries += 1;
        used = (used * SUSTAIN_STEP).round().max(1.0);
        for who in who {
            let what = format!("sustained at {used:.0}/s?");
            sustained = paced(setup, who, used, &what).await.sustained();
            if !sustained {
                break;
            }
        }
    }
    MaxRate {
        lily: Some(drained[0]),
        raw_batch: Some(drained[1]),
        offered: Some(offered),
        lily_loaded: Some(loaded[0]),
        raw_batch_loaded: Some(loaded[1]),
        under_load: Some(under_load),
        tries: Some(tries),
        sustained: Some(sustained),
        used,
    }
}
