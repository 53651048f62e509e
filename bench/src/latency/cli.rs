//! `lily-bench latency`: settlement latency of Lily against raw-batch at 50 % and 90 % of the
//! maximum rate. Method: `bench/README.md`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::latency::run::{self, Setup};
use crate::latency::timer::{self, Sinks};
use crate::latency::{Case, Contender, LOADS, MaxRate, Path, Results, SUSTAIN_STEP, SUSTAIN_TRIES};
use crate::{body_512, broker_url, report};

/// Settlement latency of Lily against raw-batch.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Prefetch 500 only, 8 s cases with 2 s of warm-up, 20 000 messages, one round.
    #[arg(long)]
    quick: bool,
    /// Paths to measure.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "success,handoff"
    )]
    paths: Vec<Path>,
    /// Prefetch values.
    #[arg(long = "prefetch", value_delimiter = ',', default_value = "500,50",
          value_parser = clap::value_parser!(u16).range(1..),
          default_value_if("quick", "true", Some("500")))]
    prefetches: Vec<u16>,
    /// Seconds a paced run publishes.
    #[arg(long, default_value = "20", value_parser = crate::parse::positive,
          default_value_if("quick", "true", Some("8")))]
    secs: f64,
    /// Seconds of warm-up, not timed.
    #[arg(long, default_value = "3", value_parser = crate::parse::positive,
          default_value_if("quick", "true", Some("2")))]
    warmup: f64,
    /// Messages of each drain-rate run.
    #[arg(short = 'n', long, default_value = "60000", value_parser = crate::parse::count,
          default_value_if("quick", "true", Some("20000")))]
    messages: u64,
    /// The maximum rate of every case, instead of measuring it.
    #[arg(long, value_parser = crate::parse::positive)]
    max_rate: Option<f64>,
    /// Rounds of each case; the case reports the median round.
    #[arg(long, default_value = "3", value_parser = clap::value_parser!(u32).range(1..),
          default_value_if("quick", "true", Some("1")))]
    reps: u32,
    /// Where the results go.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
}

/// Runs the benchmark.
pub async fn run(args: Args) {
    assert!(
        args.warmup < args.secs,
        "--warmup must be shorter than --secs"
    );
    let lily = Sinks::default();
    timer::install(lily.clone());
    let url = broker_url();
    let body = body_512();
    let setup = Setup {
        url: url.clone(),
        body: body.clone().into(),
        run: Duration::from_secs_f64(args.secs),
        warmup: Duration::from_secs_f64(args.warmup),
        lily,
    };
    let mut results = Results {
        meta: crate::Meta::new("latency", &url, notes(&args)),
        max_rate_messages: if args.max_rate.is_some() {
            0
        } else {
            args.messages
        },
        run_secs: args.secs,
        warmup_secs: args.warmup,
        cases: Vec::new(),
    };
    println!(
        "Lily settlement-latency benchmark: {}; {:.0} s paced runs",
        results.meta.broker, args.secs
    );
    let total = Instant::now();
    let mut order = 0;
    for &path in &args.paths {
        for &prefetch in &args.prefetches {
            let max_rate = match args.max_rate {
                Some(used) => MaxRate {
                    used,
                    ..MaxRate::default()
                },
                None => max_rate(&setup, &args, path, prefetch, &total).await,
            };
            for load in LOADS {
                let target = (max_rate.used * load).round().max(1.0);
                let mut rounds = Vec::new();
                for round in 1..=args.reps {
                    let who = if order % 2 == 0 {
                        [Contender::RawBatch, Contender::Lily]
                    } else {
                        [Contender::Lily, Contender::RawBatch]
                    };
                    order += 1;
                    let mut runs = Vec::new();
                    for contender in who {
                        let result = run::paced(&setup, contender, path, prefetch, target).await;
                        eprintln!(
                            "  {} prefetch {prefetch} {:.0}% ({target:.0}/s) round {round}/{} {:<9} settled {:>7.0}/s p50 {:.2} p99 {:.2} p99.9 {:.2} ms{}, max depth {}{} [{:.0} s elapsed]",
                            path.name(),
                            load * 100.0,
                            args.reps,
                            contender.name(),
                            result.settled_per_sec,
                            f64::from(result.latency.p50_us) / 1000.0,
                            f64::from(result.latency.p99_us) / 1000.0,
                            f64::from(result.latency.p999_us) / 1000.0,
                            result.copy_confirms.map_or_else(String::new, |c| format!(
                                " (copy to confirm: p50 {:.2} p99 {:.2} ms)",
                                f64::from(c.p50_us) / 1000.0,
                                f64::from(c.p99_us) / 1000.0
                            )),
                            result.max_ready_depth,
                            if result.complete { "" } else { " (INCOMPLETE)" },
                            total.elapsed().as_secs_f64()
                        );
                        runs.push(result);
                    }
                    let (raw_batch, lily) = match who[0] {
                        Contender::RawBatch => (runs[0], runs[1]),
                        Contender::Lily => (runs[1], runs[0]),
                    };
                    rounds.push(Case::new(path, prefetch, load, max_rate, raw_batch, lily));
                }
                results.cases.push(Case::median(rounds));
            }
        }
    }
    results.meta.finish(total);
    let chart = report::latency_chart(&results);
    let markdown = report::latency(&results);
    report::write(&args.out, "latency", &results, &markdown, Some(&chart));
    println!("total {:.0} s", total.elapsed().as_secs_f64());
}

/// The maximum rate of `path` at `prefetch`: each contender's drain rate with nothing
/// publishing, then what each settles while the paced publisher offers the higher of the two,
/// then the highest rate from the lower of those down that both sustain.
async fn max_rate(
    setup: &Setup,
    args: &Args,
    path: Path,
    prefetch: u16,
    total: &Instant,
) -> MaxRate {
    let contenders = [Contender::Lily, Contender::RawBatch];
    let mut drained = [0.0; 2];
    for (slot, who) in drained.iter_mut().zip(contenders) {
        let sample = run::drain_rate(setup, who, path, prefetch, args.messages).await;
        eprintln!(
            "  drain rate {} prefetch {prefetch} {:<9} {:>8.0} msgs/s{} [{:.0} s elapsed]",
            path.name(),
            who.name(),
            sample.msgs_per_sec,
            if sample.complete { "" } else { " (INCOMPLETE)" },
            total.elapsed().as_secs_f64()
        );
        *slot = sample.msgs_per_sec;
    }
    let offered = drained[0].max(drained[1]).round().max(1.0);
    // Half a case's length: the rate settled under overload only says where the search for a
    // sustained rate starts.
    let overload = setup.shorter(setup.run / 2, setup.warmup / 2);
    let mut loaded = [0.0; 2];
    for (slot, who) in loaded.iter_mut().zip(contenders) {
        let run = run::paced(&overload, who, path, prefetch, offered).await;
        eprintln!(
            "  max rate {} prefetch {prefetch} {:<9} {:>8.0} msgs/s settled, {:.0} published, with {offered:.0}/s offered [{:.0} s elapsed]",
            path.name(),
            who.name(),
            run.settled_per_sec,
            run.publish_rate,
            total.elapsed().as_secs_f64()
        );
        *slot = run.settled_per_sec;
    }
    let under_load = loaded[0].min(loaded[1]).round().max(1.0);
    let (used, tries, sustained) = sustained_rate(setup, path, prefetch, under_load, total).await;
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

/// The first rate from `from` × [`SUSTAIN_STEP`] down, by that factor, that both contenders
/// sustain in a paced run each as long as a case's; the rates tried; and whether the last was
/// sustained (it is used even if not). Lily is checked first, and a rate one contender did not
/// sustain is not tried on the other. A shorter run is not enough: in 4 s runs both sustained
/// a rate whose 90 % Lily then fell behind in an 8 s run.
async fn sustained_rate(
    setup: &Setup,
    path: Path,
    prefetch: u16,
    from: f64,
    total: &Instant,
) -> (f64, u32, bool) {
    let mut rate = from;
    let mut tries = 0;
    loop {
        tries += 1;
        rate = (rate * SUSTAIN_STEP).round().max(1.0);
        let mut sustained = true;
        for who in [Contender::Lily, Contender::RawBatch] {
            let run = run::paced(setup, who, path, prefetch, rate).await;
            sustained = run.sustained();
            eprintln!(
                "  sustained {} prefetch {prefetch} {:<9} at {rate:.0}/s: {} (published {:.0}/s, settled {:.0}/s) [{:.0} s elapsed]",
                path.name(),
                who.name(),
                if sustained { "yes" } else { "no" },
                run.publish_rate,
                run.settled_per_sec,
                total.elapsed().as_secs_f64()
            );
            if !sustained {
                break;
            }
        }
        if sustained || tries == SUSTAIN_TRIES {
            return (rate, tries, sustained);
        }
    }
}

fn notes(args: &Args) -> Vec<String> {
    let mut notes = vec![crate::METHOD.to_owned()];
    if let Some(rate) = args.max_rate {
        notes.push(format!(
            "The maximum rate was given: {rate:.0} msg/s for every case."
        ));
    }
    notes
}
