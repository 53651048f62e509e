//! `lily-bench latency`: settlement latency of Lily against raw-batch at 50 % and 90 % of the
//! maximum rate. Method: `bench/README.md`.

use std::time::{Duration, Instant};

use crate::args::Common;
use crate::latency::run::{self, Setup};
use crate::latency::timer;
use crate::latency::{Case, Contender, LOADS, MaxRate, Path, Results, SUSTAIN_STEP, SUSTAIN_TRIES};
use crate::{broker_url, report};

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
    /// The maximum rate of every case, instead of measuring it.
    #[arg(long, value_parser = crate::args::positive)]
    max_rate: Option<f64>,
    /// Rounds of each case; the case reports the median round (quick: 1).
    #[arg(long, default_value = "3", value_parser = clap::value_parser!(u32).range(1..),
          default_value_if("quick", "true", Some("1")))]
    reps: u32,
}

/// Runs the benchmark: prefetch 500 and 50, paced runs of 20 s whose first 3 s are not timed,
/// drain rates of 60 000 messages (quick: prefetch 500, 8 s, 2 s, 20 000).
pub async fn run(args: Args) {
    let (prefetches, secs, warmup, messages): (&[u16], _, _, _) = if args.common.quick {
        (&[500], 8.0, 2.0, 20_000)
    } else {
        (&[500, 50], 20.0, 3.0, 60_000)
    };
    timer::install();
    let url = broker_url();
    let mut notes = vec![crate::METHOD.to_owned()];
    if let Some(rate) = args.max_rate {
        notes.push(format!(
            "The maximum rate was given: {rate:.0} msg/s for every case."
        ));
    }
    let mut results = Results {
        meta: crate::Meta::new("latency", &url, notes),
        max_rate_messages: args.max_rate.map_or(messages, |_| 0),
        run_secs: secs,
        warmup_secs: warmup,
        cases: Vec::new(),
    };
    let started = Instant::now();
    // Who runs first alternates round by round, across cases too.
    let mut turn = [Contender::RawBatch, Contender::Lily];
    for &path in &args.paths {
        for &prefetch in prefetches {
            let setup = Setup {
                url: url.clone(),
                path,
                prefetch,
                run: Duration::from_secs_f64(secs),
                warmup: Duration::from_secs_f64(warmup),
                started,
            };
            let max_rate = match args.max_rate {
                Some(used) => MaxRate {
                    used,
                    ..MaxRate::default()
                },
                None => max_rate(&setup, messages).await,
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
                        runs.push(run::paced(&setup, who, target, &what).await);
                    }
                    turn.reverse();
                    runs.sort_by_key(|r| r.contender);
                    rounds.push([runs[0], runs[1]]);
                }
                let case = Case::median(path, prefetch, load, max_rate, rounds);
                results.cases.push(case);
            }
        }
    }
    results.meta.finish(started);
    let (md, chart) = (report::latency(&results), report::latency_chart(&results));
    report::write(&args.common.out, "latency", &results, &md, Some(&chart));
}

/// The maximum rate of the setup's path and prefetch: each contender's drain rate with nothing
/// publishing, then what each settles while the paced publisher offers the higher of the two
/// (in runs of half a case's length: that rate only says where the search starts), then the
/// first rate from the lower of those down that both sustain.
async fn max_rate(setup: &Setup, messages: u64) -> MaxRate {
    let who = [Contender::Lily, Contender::RawBatch];
    let mut drained = [0.0; 2];
    for (rate, who) in drained.iter_mut().zip(who) {
        *rate = run::drain_rate(setup, who, messages).await;
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
        *rate = run::paced(&overload, who, offered, &what)
            .await
            .settled_per_sec;
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
            sustained = run::paced(setup, who, used, &what).await.sustained();
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
