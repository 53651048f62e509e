//! `lily-bench throughput`: Lily against raw lapin contenders, the no-ack ceiling and
//! ruststream-lapin, taking turns run by run. Method: `bench/README.md`.

use std::time::Instant;

use clap::ValueEnum as _;
use lily::prelude::QueueKind;

use crate::args::Common;
use crate::raw::{self, Settle};
use crate::report::{fixed, rate};
use crate::run::{Sample, backlog, in_turn};
use crate::throughput::{CaseResult, Contender, Path, Results, Start, lily_run, peer};
use crate::{CpuMeter, broker_url, depth, kind_name, median};

/// Throughput of Lily against raw lapin contenders, taking turns run by run.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    common: Common,
    /// Messages a run (quick: 20 000).
    #[arg(short = 'n', long, default_value = "200000", value_parser = crate::args::count::<u64>,
          default_value_if("quick", "true", Some("20000")))]
    messages: u64,
    /// Repetitions of each case (quick: 2).
    #[arg(short, long, default_value = "3", value_parser = clap::value_parser!(u32).range(1..),
          default_value_if("quick", "true", Some("2")))]
    reps: u32,
    /// Paths to measure.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "success,handoff"
    )]
    paths: Vec<Path>,
    /// Queue types.
    #[arg(long = "queues", value_delimiter = ',', default_value = "classic,quorum",
          value_parser = crate::args::queue_kind)]
    kinds: Vec<QueueKind>,
    /// Prefetch values.
    #[arg(long = "prefetch", value_delimiter = ',', default_value = "50,500",
          value_parser = clap::value_parser!(u16).range(1..))]
    prefetches: Vec<u16>,
    /// Who runs, in order (default: each path's own list; quick: raw-batch, ceiling and Lily).
    #[arg(long, value_enum, value_delimiter = ',')]
    contenders: Vec<Contender>,
    /// Starts timed per contender and queue type (one message waiting).
    #[arg(long, default_value_t = 5)]
    start_reps: u32,
}

impl Args {
    /// Who runs `path`, in order: the ones named that can (the handoff path has no ceiling and
    /// no peer), or the path's defaults, the bars first; a quick run leaves out the old
    /// success-path baselines (raw lapin awaiting each ACK, ruststream-lapin).
    fn contenders(&self, path: Path) -> Vec<Contender> {
        use Contender::{Ceiling, Lily, Peer, Raw, RawBatch, RawBatchAgain};
        if self.contenders.is_empty() {
            let defaults: &[Contender] = match (path, self.common.quick) {
                (Path::Success, false) => &[RawBatch, Ceiling, Lily, RawBatchAgain, Raw, Peer],
                (Path::Success, true) => &[RawBatch, Ceiling, Lily],
                (Path::Handoff, false) => &[RawBatch, Raw, Lily, RawBatchAgain],
                (Path::Handoff, true) => &[RawBatch, Raw, Lily],
            };
            return defaults.to_vec();
        }
        let runs = |who| path == Path::Success || !matches!(who, Ceiling | Peer);
        self.contenders
            .iter()
            .copied()
            .filter(|&who| runs(who))
            .collect()
    }
}

/// One run: a fresh topology holding `n` messages, `who` timed draining it, its leftovers
/// checked.
pub async fn run_once(
    url: &str,
    path: Path,
    kind: QueueKind,
    prefetch: u16,
    who: Contender,
    n: u64,
) -> Sample {
    let queue = format!("lily-bench-{}", kind_name(kind));
    let topology = backlog(url, &queue, kind, &path.delays(), n).await;
    let bucket = topology.bucket(0).expect("a retry bucket").to_owned();
    let cpu = CpuMeter::start();
    let mut sample = match (path, who) {
        (_, Contender::Lily) => lily_run::run(url, &queue, kind, prefetch, n, path).await,
        (_, Contender::Peer) => peer::success(url, &queue, kind, prefetch, n).await,
        (Path::Success, Contender::Raw) => {
            raw::success(url, &queue, prefetch, n, Settle::Each).await
        }
        (Path::Success, Contender::Ceiling) => {
            raw::success(url, &queue, prefetch, n, Settle::NoAck).await
        }
        (Path::Success, _) => raw::success(url, &queue, prefetch, n, Settle::Batch).await,
        (Path::Handoff, Contender::Raw) => raw::handoff(url, &queue, &bucket, prefetch, n).await,
        (Path::Handoff, _) => raw::handoff_batch(url, &queue, &bucket, prefetch, n).await,
    };
    cpu.stop(&mut sample);
    sample.left_in_queue = depth(url, &queue).await;
    let copies = match path {
        Path::Handoff => depth(url, &bucket).await.map(u64::from),
        Path::Success => Some(n),
    };
    if sample.left_in_queue != Some(0) || copies != Some(n) {
        eprintln!(
            "  warning: after the {} run, {queue} holds {:?} ready, the bucket {copies:?} of {n} copies",
            who.name(),
            sample.left_in_queue
        );
    }
    sample
}

/// Runs the benchmark.
pub async fn run(args: Args) {
    let url = broker_url();
    let mut results = Results {
        meta: crate::Meta::new("throughput", &url, vec![crate::METHOD.into()]),
        messages_per_run: args.messages,
        repetitions: args.reps,
        cases: Vec::new(),
        starts: Vec::new(),
    };
    println!(
        "Lily throughput benchmark: {}; {} messages a run, {} repetition(s)",
        results.meta.broker, args.messages, args.reps
    );
    let total = Instant::now();
    for &path in &args.paths {
        let who = args.contenders(path);
        for &kind in &args.kinds {
            for &prefetch in &args.prefetches {
                let mut samples = vec![Vec::new(); who.len()];
                for rep in 1..=args.reps {
                    for at in in_turn(who.len(), rep) {
                        let s = run_once(&url, path, kind, prefetch, who[at], args.messages).await;
                        eprintln!(
                            "  {} {} prefetch {prefetch} rep {rep}/{} {:<16} {:>10} msgs/s ({:.2} s{}) cpu µs/msg client {} broker {} [{:.0} s]",
                            path.name(),
                            kind_name(kind),
                            args.reps,
                            who[at].name(),
                            rate(s.msgs_per_sec),
                            s.secs,
                            if s.complete { "" } else { ", INCOMPLETE" },
                            fixed(s.client_cpu_us_per_msg, 1),
                            fixed(s.broker_cpu_us_per_msg, 1),
                            total.elapsed().as_secs_f64(),
                        );
                        samples[at].push(s);
                    }
                }
                let samples = who.iter().copied().zip(samples).collect();
                let case = CaseResult::new(path, kind_name(kind), prefetch, samples);
                results.cases.push(case);
            }
        }
    }
    if args.paths.contains(&Path::Success) && args.start_reps > 0 {
        let prefetch = args.prefetches.first().copied().unwrap_or(50);
        let who = args.contenders(Path::Success);
        for &kind in &args.kinds {
            let mut samples = vec![Vec::new(); who.len()];
            for rep in 1..=args.start_reps {
                for at in in_turn(who.len(), rep) {
                    let s = run_once(&url, Path::Success, kind, prefetch, who[at], 1).await;
                    samples[at].push(s);
                }
            }
            for (&contender, runs) in who.iter().zip(samples) {
                let ms: Vec<f64> = runs.iter().map(|s| s.secs * 1000.0).collect();
                let median_ms = median(&mut ms.clone());
                eprintln!(
                    "  start {} {:<16} {median_ms:.1} ms (median of {})",
                    kind_name(kind),
                    contender.name(),
                    runs.len()
                );
                results.starts.push(Start {
                    queue_type: kind_name(kind),
                    contender,
                    ms,
                    median_ms,
                });
            }
        }
    }
    for &who in Contender::value_variants() {
        let runs = results.cases.iter().filter_map(|c| c.runs(who));
        let left: Vec<u32> = runs
            .flat_map(|r| &r.samples)
            .filter_map(|s| s.left_in_queue.filter(|&l| l > 0))
            .collect();
        if !left.is_empty() {
            results.meta.notes.push(format!(
                "{} left messages ready in the work queue after {} run(s) ({left:?}): deliveries it had counted were not ACKed when it shut down, so the broker requeued them.",
                who.name(), left.len()
            ));
        }
    }
    results.meta.finish(total);
    let (markdown, chart) = (
        crate::report::throughput(&results),
        crate::report::throughput_chart(&results),
    );
    crate::report::write(
        &args.common.out,
        "throughput",
        &results,
        &markdown,
        Some(&chart),
    );
}
