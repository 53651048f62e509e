//! `lily-bench throughput`: Lily against raw lapin contenders, the no-ack ceiling and
//! ruststream-lapin, taking turns run by run. Method: `bench/README.md`.

use std::path::PathBuf;
use std::time::Instant;

use crate::raw;
use crate::report;
use crate::throughput::{CaseResult, Results, Start};
use crate::throughput::{Contender, CpuMeter, HANDOFF_DELAY, Path, Sample, lily_run, peer};
use crate::{body_512, broker_url, depth, fresh_topology, kind_name, publish};
use lily::prelude::QueueKind;
use lily::topology::Topology;

/// Throughput of Lily against raw lapin contenders, taking turns run by run.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Messages a run.
    #[arg(short = 'n', long, default_value = "200000", value_parser = crate::parse::count,
          default_value_if("quick", "true", Some("20000")))]
    messages: u64,
    /// Repetitions of each case.
    #[arg(short, long, default_value = "3", value_parser = clap::value_parser!(u32).range(1..),
          default_value_if("quick", "true", Some("2")))]
    reps: u32,
    /// 20 000 messages, 2 repetitions, and only raw-batch, ceiling and Lily on the success path.
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
    /// Queue types.
    #[arg(long = "queues", value_delimiter = ',', default_value = "classic,quorum",
          value_parser = crate::parse::queue_kind)]
    kinds: Vec<QueueKind>,
    /// Prefetch values.
    #[arg(long = "prefetch", value_delimiter = ',', default_value = "50,500",
          value_parser = clap::value_parser!(u16).range(1..))]
    prefetches: Vec<u16>,
    /// Who runs, in order (default: each path's own list).
    #[arg(long, value_enum, value_delimiter = ',')]
    contenders: Vec<Contender>,
    /// Starts timed per contender and queue type (one message waiting).
    #[arg(long, default_value_t = 5)]
    start_reps: u32,
    /// Where the results go.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
}

impl Args {
    /// Who runs `path`, in order: the ones named, or the path's defaults.
    fn contenders(&self, path: Path) -> Vec<Contender> {
        if self.contenders.is_empty() {
            path.contenders(self.quick).to_vec()
        } else {
            let runs = |who: &&Contender| path.runs(**who);
            self.contenders.iter().filter(runs).copied().collect()
        }
    }
}

/// One run: fresh topology, N messages published, the contender timed, its leftovers checked.
async fn run_once(
    url: &str,
    body: &[u8],
    path: Path,
    kind: QueueKind,
    prefetch: u16,
    who: Contender,
    n: u64,
) -> Sample {
    let queue = format!("lily-bench-{}", kind_name(kind));
    let delays = match path {
        Path::Success => lily_run::success_delays(),
        Path::Handoff => vec![HANDOFF_DELAY],
    };
    let topology: Topology = fresh_topology(url, &queue, kind, &delays).await;
    let count = usize::try_from(n).expect("message count fits usize");
    publish(url, &queue, count, body).await;
    // Let the broker finish writing the batch before the clock starts.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let bucket = topology.bucket(0).expect("a retry bucket").to_owned();
    let cpu = CpuMeter::start();
    let mut sample = match (path, who) {
        (Path::Success, Contender::Lily) => lily_run::success(url, &queue, kind, prefetch, n).await,
        (Path::Success, Contender::Peer) => peer::success(url, &queue, kind, prefetch, n).await,
        (Path::Success, _) => raw::success(url, &queue, prefetch, n, who.settle()).await,
        (Path::Handoff, Contender::Raw) => raw::handoff(url, &queue, &bucket, prefetch, n).await,
        (Path::Handoff, Contender::RawBatch) => {
            raw::handoff_batch(url, &queue, &bucket, prefetch, n).await
        }
        (Path::Handoff, Contender::Lily) => lily_run::handoff(url, &queue, kind, prefetch, n).await,
        (Path::Handoff, _) => unreachable!("Path::runs admits only these on the handoff path"),
    };
    cpu.stop(&mut sample);
    // What each run must leave behind: an empty work queue, and N copies in the bucket.
    let left = depth(url, &queue).await;
    sample.left_in_queue = left;
    if left != Some(0) {
        eprintln!(
            "  warning: {queue} holds {left:?} ready messages after the {} run",
            who.name()
        );
    }
    if path == Path::Handoff {
        let copies = depth(url, &bucket).await;
        if copies.map(u64::from) != Some(n) {
            eprintln!(
                "  warning: {bucket} holds {copies:?} copies after the {} run, expected {n}",
                who.name()
            );
        }
    }
    sample
}

/// The order in which `n` contenders run in repetition `rep` (from 1): as given in odd ones,
/// reversed in even ones (A B C, C B A, ...). Machine noise that drifts during a case then
/// weighs on every contender alike over each pair of repetitions, not on whoever runs last.
fn in_turn(n: usize, rep: u32) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if rep.is_multiple_of(2) {
        order.reverse();
    }
    order
}

/// Runs the benchmark.
pub async fn run(args: Args) {
    let url = broker_url();
    let body = body_512();
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
        for &kind in &args.kinds {
            for &prefetch in &args.prefetches {
                let who_runs = args.contenders(path);
                let mut samples: Vec<(Contender, Vec<Sample>)> =
                    who_runs.iter().map(|&w| (w, Vec::new())).collect();
                for rep in 1..=args.reps {
                    for at in in_turn(samples.len(), rep) {
                        let (who, runs) = &mut samples[at];
                        let who = *who;
                        let sample =
                            run_once(&url, &body, path, kind, prefetch, who, args.messages).await;
                        eprintln!(
                            "  {} {} prefetch {prefetch} rep {rep}/{} {:<16} {:>10} msgs/s ({:.2} s{}) cpu µs/msg client {} broker {} [{:.0} s elapsed]",
                            path.name(),
                            kind_name(kind),
                            args.reps,
                            who.name(),
                            report::rate(sample.msgs_per_sec),
                            sample.secs,
                            if sample.complete {
                                String::new()
                            } else {
                                format!(", INCOMPLETE {}/{}", sample.settled, sample.expected)
                            },
                            sample
                                .client_cpu_us_per_msg
                                .map_or_else(|| "-".into(), |v| format!("{v:.1}")),
                            sample
                                .broker_cpu_us_per_msg
                                .map_or_else(|| "-".into(), |v| format!("{v:.1}")),
                            total.elapsed().as_secs_f64(),
                        );
                        runs.push(sample);
                    }
                }
                let case = CaseResult::new(path, kind_name(kind), prefetch, samples);
                let ratios: Vec<String> = case
                    .lily_over
                    .iter()
                    .map(|r| format!("Lily / {} {:.3}", r.over.name(), r.value))
                    .collect();
                eprintln!(
                    "  => {} {} prefetch {prefetch}: {}",
                    path.name(),
                    kind_name(kind),
                    ratios.join(", ")
                );
                results.cases.push(case);
            }
        }
    }
    if args.paths.contains(&Path::Success) && args.start_reps > 0 {
        let prefetch = args.prefetches.first().copied().unwrap_or(50);
        for &kind in &args.kinds {
            let who_runs = args.contenders(Path::Success);
            let mut samples: Vec<Vec<Sample>> = who_runs.iter().map(|_| Vec::new()).collect();
            for rep in 1..=args.start_reps {
                for at in in_turn(who_runs.len(), rep) {
                    let who = who_runs[at];
                    let start = run_once(&url, &body, Path::Success, kind, prefetch, who, 1).await;
                    samples[at].push(start);
                }
            }
            for (&who, runs) in who_runs.iter().zip(&samples) {
                let start = Start::new(kind_name(kind), who, runs);
                eprintln!(
                    "  start {} {:<16} {:.1} ms (median of {})",
                    kind_name(kind),
                    who.name(),
                    start.median_ms,
                    runs.len()
                );
                results.starts.push(start);
            }
        }
    }
    for who in Contender::ALL {
        let left: Vec<u32> = results
            .cases
            .iter()
            .filter_map(|c| c.runs(who))
            .flat_map(|r| &r.samples)
            .filter_map(|s| s.left_in_queue)
            .filter(|&l| l > 0)
            .collect();
        if !left.is_empty() {
            results.meta.notes.push(format!(
                "{} left messages ready in the work queue after {} run(s) ({:?}): deliveries it had \
                 counted were not ACKed when it shut down, so the broker requeued them.",
                who.name(),
                left.len(),
                left
            ));
        }
    }
    results.meta.finish(total);
    let chart = report::throughput_chart(&results);
    let markdown = report::throughput(&results);
    report::write(&args.out, "throughput", &results, &markdown, Some(&chart));
    println!("total {:.0} s", total.elapsed().as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::in_turn;

    #[test]
    fn every_other_repetition_runs_the_contenders_in_reverse() {
        assert_eq!(in_turn(3, 1), [0, 1, 2]);
        assert_eq!(in_turn(3, 2), [2, 1, 0]);
        assert_eq!(in_turn(3, 3), [0, 1, 2]);
        assert_eq!(in_turn(1, 2), [0]);
    }
}
