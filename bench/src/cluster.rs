//! `lily-bench cluster`: Lily and raw lapin on a three-node cluster beside one node.
//! Method: `bench/README.md`.

use std::path::PathBuf;
use std::time::Instant;

use crate::throughput::{HANDOFF_DELAY, Path, Sample, lily_run};
use crate::{body_512, broker_url, fresh_topology, median, publish};
use lily::prelude::QueueKind;
use serde::Serialize;

use crate::raw::{self, Settle};
use crate::report::Table;

/// Lily and raw lapin on a three-node cluster against the single node, side by side.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Messages per run.
    #[arg(short = 'n', long, default_value = "50000", value_parser = crate::parse::count,
          default_value_if("quick", "true", Some("20000")))]
    messages: u64,
    /// Repetitions of each case.
    #[arg(short, long, default_value = "3", value_parser = clap::value_parser!(u32).range(1..),
          default_value_if("quick", "true", Some("2")))]
    reps: u32,
    /// Prefetch of every consumer.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u16).range(1..))]
    prefetch: u16,
    /// 20 000 messages and 2 repetitions.
    #[arg(long)]
    quick: bool,
    /// Where the JSON and the table go.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
}

/// One path's medians, in messages a second.
#[derive(Serialize)]
struct Case {
    path: &'static str,
    single_raw: f64,
    single_lily: f64,
    cluster_raw: f64,
    cluster_lily: f64,
    /// Lily on the cluster over Lily on the single node.
    lily_cluster_over_single: f64,
    /// Lily over raw lapin on the cluster.
    lily_over_raw_on_cluster: f64,
    /// Lily over raw lapin on the single node.
    lily_over_raw_on_single: f64,
    incomplete_runs: usize,
}

#[derive(Serialize)]
struct Results {
    #[serde(flatten)]
    meta: crate::Meta,
    queue_type: &'static str,
    prefetch: u16,
    messages_per_run: u64,
    repetitions: u32,
    cases: Vec<Case>,
}

async fn run_once(url: &str, path: Path, lily: bool, prefetch: u16, n: u64) -> Sample {
    let queue = "lily-bench-cluster";
    let delays = match path {
        Path::Success => lily_run::success_delays(),
        Path::Handoff => vec![HANDOFF_DELAY],
    };
    let topology = fresh_topology(url, queue, QueueKind::Quorum, &delays).await;
    let count = usize::try_from(n).expect("message count fits usize");
    publish(url, queue, count, &body_512()).await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let bucket = topology.bucket(0).expect("a retry bucket").to_owned();
    match (path, lily) {
        (Path::Success, false) => raw::success(url, queue, prefetch, n, Settle::Each).await,
        (Path::Success, true) => {
            lily_run::success(url, queue, QueueKind::Quorum, prefetch, n).await
        }
        (Path::Handoff, false) => raw::handoff(url, queue, &bucket, prefetch, n).await,
        (Path::Handoff, true) => {
            lily_run::handoff(url, queue, QueueKind::Quorum, prefetch, n).await
        }
    }
}

/// Runs the benchmark.
pub async fn run(args: Args) {
    let single = broker_url();
    let cluster = std::env::var("LILY_CLUSTER_URL")
        .expect("LILY_CLUSTER_URL is unset: run it through scripts/bench.sh cluster");
    let started = Instant::now();
    println!(
        "Lily on a three-node cluster beside one node: quorum queues, prefetch {}, {} messages a \
         run, {} repetition(s)",
        args.prefetch, args.messages, args.reps
    );
    let mut cases = Vec::new();
    for path in [Path::Success, Path::Handoff] {
        // single raw, single lily, cluster raw, cluster lily
        let mut rates: [Vec<f64>; 4] = Default::default();
        let mut incomplete = 0;
        for rep in 1..=args.reps {
            for (slot, (url, lily)) in [
                (&single, false),
                (&single, true),
                (&cluster, false),
                (&cluster, true),
            ]
            .into_iter()
            .enumerate()
            {
                let sample = run_once(url, path, lily, args.prefetch, args.messages).await;
                incomplete += usize::from(!sample.complete);
                eprintln!(
                    "  {} rep {rep}/{} {:<7} {:<4} {:>8.0} msgs/s ({:.2} s){}",
                    path.name(),
                    args.reps,
                    if slot < 2 { "single" } else { "cluster" },
                    if lily { "lily" } else { "raw" },
                    sample.msgs_per_sec,
                    sample.secs,
                    if sample.complete { "" } else { ", INCOMPLETE" },
                );
                rates[slot].push(sample.msgs_per_sec);
            }
        }
        let [mut sr, mut sl, mut cr, mut cl] = rates;
        let (sr, sl, cr, cl) = (
            median(&mut sr),
            median(&mut sl),
            median(&mut cr),
            median(&mut cl),
        );
        cases.push(Case {
            path: path.name(),
            single_raw: sr,
            single_lily: sl,
            cluster_raw: cr,
            cluster_lily: cl,
            lily_cluster_over_single: cl / sl,
            lily_over_raw_on_cluster: cl / cr,
            lily_over_raw_on_single: sl / sr,
            incomplete_runs: incomplete,
        });
    }
    let mut meta = crate::Meta::new("cluster", &single, vec![crate::METHOD.into()]);
    meta.finish(started);
    let results = Results {
        meta,
        queue_type: "quorum",
        prefetch: args.prefetch,
        messages_per_run: args.messages,
        repetitions: args.reps,
        cases,
    };
    let head = [
        "path",
        "one node: raw",
        "one node: Lily",
        "cluster: raw",
        "cluster: Lily",
        "Lily cluster / one node",
        "Lily / raw, cluster",
        "Lily / raw, one node",
    ];
    let mut table = Table::new(&head, 1);
    for c in &results.cases {
        let mut cells = vec![c.path.to_owned()];
        cells.extend(
            [c.single_raw, c.single_lily, c.cluster_raw, c.cluster_lily].map(|v| format!("{v:.0}")),
        );
        let ratios = [
            c.lily_cluster_over_single,
            c.lily_over_raw_on_cluster,
            c.lily_over_raw_on_single,
        ];
        cells.extend(ratios.map(|v| format!("{v:.2}")));
        table.row(&cells);
    }
    let conditions = format!(
        "Quorum queues, prefetch {}, {} persistent messages a run, medians of {} repetitions \
         (msg/s); the three nodes share this machine's cores with the client",
        results.prefetch, results.messages_per_run, results.repetitions
    );
    let title = "Lily on a three-node cluster beside one node";
    let markdown = crate::report::opening(title, &results.meta, &conditions) + &table.end();
    crate::report::write(&args.out, "cluster", &results, &markdown, None);
}
