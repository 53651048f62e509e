//! `lily-bench cluster`: Lily and raw lapin on a three-node cluster beside one node, each run of
//! the throughput benchmark's (`throughput::cli::run_once`). Method: `bench/README.md`.

use std::time::Instant;

use lily::prelude::QueueKind;
use serde::Serialize;

use crate::args::Common;
use crate::report::{Table, opening, row, write};
use crate::throughput::cli::run_once;
use crate::throughput::{Contender, Path};
use crate::{broker_url, median};

/// Lily and raw lapin on a three-node cluster (`LILY_CLUSTER_URL`) against the single node:
/// quorum queues, prefetch 50, 50 000 messages a run, 3 repetitions (quick: 20 000 and 2).
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    common: Common,
}

/// Prefetch of every consumer.
const PREFETCH: u16 = 50;

/// One path's medians in msg/s: one node raw, Lily; cluster raw, Lily; and Lily's ratios.
#[derive(Serialize)]
struct Case {
    path: &'static str,
    single_raw: f64,
    single_lily: f64,
    cluster_raw: f64,
    cluster_lily: f64,
    lily_cluster_over_single: f64,
    lily_over_raw_on_cluster: f64,
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

/// Runs the benchmark.
pub async fn run(args: Args) {
    let single = broker_url();
    let cluster = std::env::var("LILY_CLUSTER_URL")
        .expect("LILY_CLUSTER_URL is unset: run it through scripts/bench.sh cluster");
    let (messages, reps) = if args.common.quick {
        (20_000, 2)
    } else {
        (50_000, 3)
    };
    let started = Instant::now();
    let mut cases = Vec::new();
    for path in [Path::Success, Path::Handoff] {
        let turns = [
            (&single, Contender::Raw),
            (&single, Contender::Lily),
            (&cluster, Contender::Raw),
            (&cluster, Contender::Lily),
        ];
        let mut rates: [Vec<f64>; 4] = Default::default();
        let mut incomplete_runs = 0;
        for rep in 1..=reps {
            for (slot, (url, who)) in turns.into_iter().enumerate() {
                let s = run_once(url, path, QueueKind::Quorum, PREFETCH, who, messages).await;
                let node = if slot < 2 { "single" } else { "cluster" };
                eprintln!(
                    "  {} rep {rep}/{} {node:<7} {:<9} {:>8.0} msgs/s ({:.2} s)",
                    path.name(),
                    reps,
                    who.name(),
                    s.msgs_per_sec,
                    s.secs
                );
                incomplete_runs += usize::from(!s.complete);
                rates[slot].push(s.msgs_per_sec);
            }
        }
        let [sr, sl, cr, cl] = rates.map(|mut r| median(&mut r));
        cases.push(Case {
            path: path.name(),
            single_raw: sr,
            single_lily: sl,
            cluster_raw: cr,
            cluster_lily: cl,
            lily_cluster_over_single: cl / sl,
            lily_over_raw_on_cluster: cl / cr,
            lily_over_raw_on_single: sl / sr,
            incomplete_runs,
        });
    }
    let mut meta = crate::Meta::new("cluster", &single, vec![crate::METHOD.into()]);
    meta.finish(started);
    let r = Results {
        meta,
        queue_type: "quorum",
        prefetch: PREFETCH,
        messages_per_run: messages,
        repetitions: reps,
        cases,
    };
    let head = "path|one node: raw|one node: Lily|cluster: raw|cluster: Lily|Lily cluster / one node|Lily / raw, cluster|Lily / raw, one node";
    let mut table = Table::new(head, 1);
    for c in &r.cases {
        let (rate, ratio) = (|v: f64| format!("{v:.0}"), |v: f64| format!("{v:.2}"));
        row!(table; c.path, rate(c.single_raw), rate(c.single_lily), rate(c.cluster_raw), rate(c.cluster_lily), ratio(c.lily_cluster_over_single), ratio(c.lily_over_raw_on_cluster), ratio(c.lily_over_raw_on_single));
    }
    let conditions = format!(
        "Quorum queues, prefetch {}, {} persistent messages a run, medians of {} repetitions (msg/s); the three nodes share this machine's cores with the client",
        r.prefetch, r.messages_per_run, r.repetitions
    );
    let markdown = opening(
        "Lily on a three-node cluster beside one node",
        &r.meta,
        &conditions,
    ) + &table.end();
    write(&args.common.out, "cluster", &r, &markdown, None);
}
