//! `lily-bench mongo`: Lily's MongoDB scope against a hand-written lapin + mongodb consumer.
//! Method: `bench/README.md`.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::cli::Common;
use crate::mongo::{Case, Contender, Counters, Load, Run, db, lily_run, raw, verify};
use crate::mongo::{CaseResult, ContenderResult, Results};
use crate::report::{self, rate};
use crate::run::backlog;
use crate::throughput::CpuMeter;
use crate::{broker_url, cpu_secs};
use lily::prelude::{Policy, QueueKind};

const QUEUE: &str = "lily-bench-mongo";

/// Lily's MongoDB scope against a hand-written driver transaction. Environment:
/// `LILY_AMQP_URL`, `LILY_MONGO_URL` (a replica set), optional `LILY_RABBIT_DIR` and
/// `LILY_MONGO_DIR` for the nodes' CPU.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    common: Common,
    /// Messages of the scope case (quick: 5 000).
    #[arg(short = 'n', long, default_value = "20000", value_parser = crate::cli::count,
          default_value_if("quick", "true", Some("5000")))]
    messages: u64,
    /// Messages of the hot-keys case (quick: 2 000).
    #[arg(long, default_value = "5000", value_parser = crate::cli::count,
          default_value_if("quick", "true", Some("2000")))]
    hot_messages: u64,
    /// Repetitions (quick: 2).
    #[arg(short, long, default_value = "3", value_parser = clap::value_parser!(u32).range(1..),
          default_value_if("quick", "true", Some("2")))]
    reps: u32,
    /// Concurrency of the scope case.
    #[arg(long, default_value_t = 32, value_parser = crate::cli::nonzero)]
    concurrency: usize,
    /// Prefetch of every case (default: twice its concurrency).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    prefetch: Option<u16>,
    /// Concurrency of the hot-keys case.
    #[arg(long, default_value_t = 8, value_parser = crate::cli::nonzero)]
    hot_concurrency: usize,
    /// Cases: scope, hot.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "scope,hot")]
    cases: Vec<Case>,
    /// Who runs: raw, lily, lily-lease.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "raw,lily,lily-lease"
    )]
    contenders: Vec<Contender>,
}

/// Prefetch of a case: `--prefetch`, or twice the concurrency.
fn prefetch(args: &Args, concurrency: usize) -> u16 {
    args.prefetch
        .unwrap_or_else(|| u16::try_from(concurrency * 2).unwrap_or(u16::MAX))
}

struct Setup<'a> {
    url: &'a str,
    mongo_url: &'a str,
}

/// One run: fresh topology and database, N messages published, the contender timed, the
/// outcome checked by message id.
async fn run_once(
    setup: &Setup<'_>,
    case: Case,
    who: Contender,
    n: u64,
    concurrency: usize,
    prefetch: u16,
) -> Run {
    let url = setup.url;
    let client = db::client(setup.mongo_url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let database = db::fresh(&client, case).await;
    let topology = backlog(
        url,
        QUEUE,
        QueueKind::Classic,
        &Policy::default().retry_delays,
        n,
    )
    .await;
    let counters = std::sync::Arc::new(Counters::default());
    // Lily's scope (its index creation) is set up before the clock, like the raw client.
    let scope = match who {
        Contender::Raw => None,
        Contender::LilyLease | Contender::Lily => {
            Some(lily_run::scope(client.clone(), who, &counters).await)
        }
    };
    let load = Load {
        url,
        queue: QUEUE,
        case,
        concurrency,
        prefetch,
        n,
    };
    let ops_before = db::Ops::read(&client).await;
    let mongod = db::mongod_pid();
    let mongod_before = mongod.and_then(|p| cpu_secs(Some(p)));
    let cpu = CpuMeter::start();
    let (mut sample, lily_totals) = match scope {
        None => (
            raw::consume(&load, client.clone(), counters.clone()).await,
            None,
        ),
        Some(scope) => {
            let (sample, totals) = lily_run::consume(&load, scope, counters.clone()).await;
            (sample, Some(totals))
        }
    };
    cpu.stop(&mut sample);
    #[allow(clippy::cast_precision_loss)]
    let mongod_cpu_us_per_msg = match (mongod_before, mongod.and_then(|p| cpu_secs(Some(p)))) {
        (Some(b), Some(a)) if sample.settled > 0 => Some((a - b) * 1e6 / sample.settled as f64),
        _ => None,
    };
    let ops_after = db::Ops::read(&client).await;
    let mongod_ops_per_msg = match (ops_before, ops_after) {
        (Some(b), Some(a)) => Some(b.per_message(&a, n)),
        _ => None,
    };
    let check = verify::check(url, &database, &topology, QUEUE, case, who, n).await;
    sample.left_in_queue = check.work_queue_ready;
    Run {
        sample,
        mongod_cpu_us_per_msg,
        mongod_ops_per_msg,
        observed: counters.snapshot(),
        lily_totals,
        check,
    }
}

/// One line about a run: its rate, tries and CPU, and what the check found when it failed.
fn describe(run: &Run) -> String {
    let (s, o) = (&run.sample, &run.observed);
    #[allow(clippy::cast_precision_loss)]
    let per = |v: &std::sync::atomic::AtomicU64| {
        v.load(Ordering::Relaxed) as f64 / s.expected.max(1) as f64
    };
    let opt = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.0}"));
    let mut line = format!(
        "{:>7} msgs/s ({:.2} s, {}/{} settled) tries/msg {:.2} conflicts/msg {:.2} cpu µs/msg \
         client {} mongod {} broker {}",
        rate(s.msgs_per_sec),
        s.secs,
        s.settled,
        s.expected,
        per(&o.attempts),
        per(&o.conflicts),
        opt(s.client_cpu_us_per_msg),
        opt(run.mongod_cpu_us_per_msg),
        opt(s.broker_cpu_us_per_msg),
    );
    if let Some(t) = run.lily_totals.as_ref().filter(|t| t.acked != s.expected) {
        line += &format!(" Lily totals {t:?}");
    }
    if run.check.passed {
        line + " verified"
    } else {
        line + &format!(" CHECK FAILED: {:?}", run.check)
    }
}

/// Runs the benchmark.
pub async fn run(args: Args) {
    let mongo_url = db::mongo_url().unwrap_or_else(|e| {
        eprintln!("mongo: {e}");
        std::process::exit(2)
    });
    let url = broker_url();
    let probe = db::client(&mongo_url).await.unwrap_or_else(|e| {
        eprintln!("mongo: {e}");
        std::process::exit(2)
    });
    let mongodb = db::server_version(&probe).await;
    drop(probe);
    let setup = Setup {
        url: &url,
        mongo_url: &mongo_url,
    };
    let mut results = Results {
        meta: crate::Meta::new("mongo", &url, vec![crate::METHOD.into()]),
        mongodb,
        mongodb_url: db::redact(&mongo_url),
        queue_type: "classic",
        repetitions: args.reps,
        cases: Vec::new(),
    };
    println!(
        "Lily Mongo scope benchmark: {} and {}; {} repetition(s)",
        results.meta.broker, results.mongodb, args.reps
    );
    let total = Instant::now();
    for &case in &args.cases {
        let (n, concurrency) = match case {
            Case::Scope => (args.messages, args.concurrency),
            Case::HotKeys => (args.hot_messages, args.hot_concurrency),
        };
        let prefetch = prefetch(&args, concurrency);
        let mut runs: Vec<(Contender, Vec<Run>)> =
            args.contenders.iter().map(|&c| (c, Vec::new())).collect();
        for rep in 1..=args.reps {
            // Alternate the order too, so no contender always runs first on a cold node.
            let len = runs.len();
            for k in 0..len {
                let slot = (k + usize::try_from(rep - 1).unwrap_or(0)) % len;
                let who = runs[slot].0;
                let run = run_once(&setup, case, who, n, concurrency, prefetch).await;
                eprintln!(
                    "  {} N {n} concurrency {concurrency} prefetch {prefetch} rep {rep}/{} {:<16} {} [{:.0} s elapsed]",
                    case.name(),
                    args.reps,
                    who.name(),
                    describe(&run),
                    total.elapsed().as_secs_f64()
                );
                runs[slot].1.push(run);
            }
        }
        let contenders = runs
            .into_iter()
            .map(|(who, runs)| ContenderResult::new(who, runs))
            .collect();
        results
            .cases
            .push(CaseResult::new(case, n, concurrency, prefetch, contenders));
    }
    results.meta.finish(total);
    let chart = report::mongo_chart(&results);
    let markdown = report::mongo(&results);
    report::write(&args.common.out, "mongo", &results, &markdown, Some(&chart));
    println!("total {:.0} s", total.elapsed().as_secs_f64());
}
