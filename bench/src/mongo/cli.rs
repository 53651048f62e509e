//! `lily-bench mongo`: Lily's MongoDB scope against a hand-written lapin + mongodb consumer.
//! Method: `bench/README.md`.

use std::sync::Arc;
use std::time::Instant;

use lily::prelude::{Policy, QueueKind};

use crate::args::Common;
use crate::mongo::{
    Case, CaseResult, Contender, ContenderResult, Counters, EVENTS, Load, QUEUE, Results, Run, db,
    lily_run, percentiles_ms, raw,
};
use crate::report::{self, rate};
use crate::run::backlog;
use crate::{CpuMeter, broker_url};

/// Lily's MongoDB scope against a hand-written driver transaction. Environment: `LILY_AMQP_URL`,
/// `LILY_MONGO_URL` (a replica set); `LILY_RABBIT_DIR` and `LILY_MONGO_DIR` add the nodes' CPU.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    common: Common,
    /// Messages of the scope and outbox cases (quick: 5 000; the hot-keys case: 5 000, quick
    /// 2 000).
    #[arg(short = 'n', long, default_value = "20000", value_parser = crate::args::count::<u64>,
          default_value_if("quick", "true", Some("5000")))]
    messages: u64,
    /// Repetitions (quick: 2).
    #[arg(short, long, default_value = "3", value_parser = clap::value_parser!(u32).range(1..),
          default_value_if("quick", "true", Some("2")))]
    reps: u32,
    /// Cases: scope, hot, outbox (concurrency 32, hot keys 8; prefetch twice that).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "scope,hot,outbox"
    )]
    cases: Vec<Case>,
    /// Who runs.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "raw,lily,lily-lease"
    )]
    contenders: Vec<Contender>,
}

/// One run, on a client of its own (no run inherits another's pool): fresh database and topology
/// holding `load.n` messages, the contender timed, the outcome checked by message id.
async fn run_once(url: &str, mongo_url: &str, load: &Load, who: Contender) -> Run {
    let client = &db::client(mongo_url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let database = db::fresh(client, load.case).await;
    let delays = &Policy::default().retry_delays;
    let topology = backlog(url, QUEUE, QueueKind::Classic, delays, load.n).await;
    if load.case == Case::Outbox {
        let inspector = lily_mq_testkit::Client::connect(url).await;
        inspector.delete(EVENTS).await;
        inspector.declare(EVENTS, false).await;
        inspector.close().await;
    }
    let counters = Arc::new(Counters::default());
    // Lily's scope (its index creation) is set up before the clock, like the raw client.
    let scope = if who.is_raw() {
        None
    } else {
        Some(lily_run::scope(client.clone(), who, &counters).await)
    };
    let ops_before = db::ops(client).await;
    let cpu = CpuMeter::start();
    let mut sample = match scope {
        None => raw::consume(url, load, database.clone(), Arc::clone(&counters)).await,
        Some(scope) => lily_run::consume(url, load, scope, Arc::clone(&counters)).await,
    };
    let mongod_cpu_us_per_msg = cpu.stop(&mut sample);
    let mongod_ops_per_msg = ops_before
        .zip(db::ops(client).await)
        .map(|(before, after)| db::per_message(&before, &after, load.n));
    let check = db::check(url, &database, &topology, load.case, who, load.n).await;
    sample.left_in_queue = check.work_queue_ready;
    let published_ms = match load.case {
        Case::Outbox if who.is_raw() => {
            percentiles_ms(&mut counters.published_us.lock().expect("latencies"))
        }
        Case::Outbox => percentiles_ms(&mut db::staged_to_sent_us(&database).await),
        _ => None,
    };
    Run {
        sample,
        mongod_cpu_us_per_msg,
        mongod_ops_per_msg,
        published_ms,
        observed: counters,
        check,
    }
}

/// Runs the benchmark.
pub async fn run(args: Args) {
    let mongo_url = std::env::var("LILY_MONGO_URL")
        .expect("LILY_MONGO_URL is unset: run the benchmarks through scripts/bench.sh");
    let client = db::client(&mongo_url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let url = broker_url();
    let mut results = Results {
        meta: crate::Meta::new("mongo", &url, vec![crate::METHOD.into()]),
        mongodb: db::server_version(&client).await,
        mongodb_url: db::redact(&mongo_url),
        queue_type: "classic",
        repetitions: args.reps,
        cases: Vec::new(),
    };
    let total = Instant::now();
    for &case in &args.cases {
        let (n, concurrency) = match case {
            Case::Scope | Case::Outbox => (args.messages, 32),
            Case::HotKeys if args.common.quick => (2000, 8),
            Case::HotKeys => (5000, 8),
        };
        let load = Load {
            case,
            concurrency,
            prefetch: 2 * concurrency as u16,
            n,
        };
        let mut runs: Vec<(Contender, Vec<Run>)> =
            args.contenders.iter().map(|&c| (c, Vec::new())).collect();
        for rep in 0..args.reps as usize {
            // Each repetition starts with the next contender, so none always runs first.
            for k in 0..runs.len() {
                let slot = (k + rep) % runs.len();
                let who = runs[slot].0;
                let r = run_once(&url, &mongo_url, &load, who).await;
                let checked = if r.check.passed {
                    "verified".to_owned()
                } else {
                    format!("CHECK FAILED: {:?}", r.check)
                };
                let (s, rep, reps, secs) = (&r.sample, rep + 1, args.reps, total.elapsed());
                eprintln!(
                    "  {} N {n} rep {rep}/{reps} {:<14} {:>7} msgs/s ({}/{} settled) {checked} [{:.0} s]",
                    case.name(),
                    who.name(),
                    rate(s.msgs_per_sec),
                    s.settled,
                    s.expected,
                    secs.as_secs_f64()
                );
                runs[slot].1.push(r);
            }
        }
        let raw: Vec<f64> = runs
            .iter()
            .find(|(who, _)| *who == Contender::Raw)
            .map(|(_, runs)| runs.iter().map(|r| r.sample.msgs_per_sec).collect())
            .unwrap_or_default();
        let contenders = runs
            .into_iter()
            .map(|(who, runs)| ContenderResult::new(case, who, runs, &raw))
            .collect();
        results.cases.push(CaseResult { load, contenders });
    }
    results.meta.finish(total);
    let (markdown, chart) = (report::mongo(&results), report::mongo_chart(&results));
    report::write(&args.common.out, "mongo", &results, &markdown, Some(&chart));
}
