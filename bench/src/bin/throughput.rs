//! Throughput of Lily against a hand-written lapin consumer and ruststream-lapin, side by side on
//! one broker, alternating the contenders run by run and reporting medians.
//!
//! ```text
//! scripts/bench.sh throughput [--messages N] [--reps R] [--quick]
//!                             [--paths success,handoff] [--queues classic,quorum]
//!                             [--prefetch 50,500] [--contenders raw,lily,peer[,raw-tasks]] [--out DIR]
//! ```
//!
//! - Success path: N 512-byte JSON messages deserialized and ACKed by (a) raw lapin, one delivery
//!   after the other, ACK awaited; (b) a Lily handler doing the same work (concurrency =
//!   prefetch); (c) the same handler in ruststream-lapin (a pool of prefetch workers).
//! - Handoff path: every message fails once: (a) raw lapin publishes the retry copy (mandatory,
//!   persistent, awaiting its own confirm on one confirm channel, pipelined across deliveries)
//!   then ACKs; (b) Lily hands it off to its retry bucket. The bucket delays 10 minutes so the
//!   copies stay parked.
//!
//! Each run re-creates the topology, publishes N messages (not timed), then times from consumer
//! start until N are settled. Results go to `target/bench/throughput.{json,md,svg}`.

use std::path::PathBuf;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use lily::prelude::QueueKind;
use lily::rabbit::Topology;
use lily_mq_bench::throughput::report::{self, CaseResult, Results};
use lily_mq_bench::throughput::{
    Contender, CpuMeter, HANDOFF_DELAY, Path, Sample, broker_version, depth, lily_run,
    load_average, peer, raw, revision,
};
use lily_mq_bench::{body_512, broker_url, fresh_topology, kind_name, publish};

struct Args {
    messages: u64,
    reps: u32,
    paths: Vec<Path>,
    kinds: Vec<QueueKind>,
    prefetches: Vec<u16>,
    contenders: Vec<Contender>,
    out: PathBuf,
}

const USAGE: &str = "usage: throughput [--messages N] [--reps R] [--quick] \
    [--paths success,handoff] [--queues classic,quorum] [--prefetch 50,500] [--contenders raw,lily,peer[,raw-tasks]] [--out DIR]";

fn parse_args() -> Args {
    let mut args = Args {
        messages: 200_000,
        reps: 3,
        paths: vec![Path::Success, Path::Handoff],
        kinds: vec![QueueKind::Classic, QueueKind::Quorum],
        prefetches: vec![50, 500],
        contenders: vec![Contender::Raw, Contender::Lily, Contender::Peer],
        out: PathBuf::from("target/bench"),
    };
    let mut explicit = (false, false);
    let mut quick = false;
    let mut it = std::env::args().skip(1);
    let fail = |msg: String| -> ! {
        eprintln!("{msg}\n{USAGE}");
        std::process::exit(2)
    };
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| fail(format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--messages" | "-n" => {
                args.messages = value()
                    .replace('_', "")
                    .parse()
                    .unwrap_or_else(|e| fail(format!("--messages: {e}")));
                explicit.0 = true;
            }
            "--reps" | "-r" => {
                args.reps = value()
                    .parse()
                    .unwrap_or_else(|e| fail(format!("--reps: {e}")));
                explicit.1 = true;
            }
            "--quick" => quick = true,
            "--paths" => {
                args.paths = value()
                    .split(',')
                    .map(|p| match p {
                        "success" => Path::Success,
                        "handoff" => Path::Handoff,
                        other => fail(format!("unknown path {other}")),
                    })
                    .collect();
            }
            "--queues" => {
                args.kinds = value()
                    .split(',')
                    .map(|q| match q {
                        "classic" => QueueKind::Classic,
                        "quorum" => QueueKind::Quorum,
                        other => fail(format!("unknown queue type {other}")),
                    })
                    .collect();
            }
            "--prefetch" => {
                args.prefetches = value()
                    .split(',')
                    .map(|p| match p.parse::<u16>() {
                        Ok(p) if p > 0 => p,
                        _ => fail(format!("bad prefetch {p}")),
                    })
                    .collect();
            }
            "--contenders" => {
                args.contenders = value()
                    .split(',')
                    .map(|c| match c {
                        "raw" => Contender::Raw,
                        "lily" => Contender::Lily,
                        "peer" => Contender::Peer,
                        "raw-tasks" => Contender::RawConcurrent,
                        other => fail(format!("unknown contender {other}")),
                    })
                    .collect();
            }
            "--out" => args.out = PathBuf::from(value()),
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => fail(format!("unknown argument {other}")),
        }
    }
    if quick {
        if !explicit.0 {
            args.messages = 20_000;
        }
        if !explicit.1 {
            args.reps = 2;
        }
    }
    if args.messages == 0 || args.reps == 0 {
        fail("--messages and --reps must be above zero".into());
    }
    args
}

fn contenders(path: Path) -> &'static [Contender] {
    match path {
        Path::Success => &[
            Contender::Raw,
            Contender::Lily,
            Contender::Peer,
            Contender::RawConcurrent,
        ],
        Path::Handoff => &[Contender::Raw, Contender::Lily],
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
    if std::env::var_os("LILY_BENCH_DEBUG").is_some() {
        eprintln!("  starting {} (pid {})", who.name(), std::process::id());
    }
    let cpu = CpuMeter::start();
    let mut sample = match (path, who) {
        (Path::Success, Contender::Raw) => raw::success(url, &queue, prefetch, n).await,
        (Path::Success, Contender::Lily) => lily_run::success(url, &queue, kind, prefetch, n).await,
        (Path::Success, Contender::Peer) => peer::success(url, &queue, kind, prefetch, n).await,
        (Path::Success, Contender::RawConcurrent) => {
            raw::success_concurrent(url, &queue, prefetch, n).await
        }
        (Path::Handoff, Contender::RawConcurrent) => unreachable!("success path only"),
        (Path::Handoff, Contender::Raw) => raw::handoff(url, &queue, &bucket, prefetch, n).await,
        (Path::Handoff, Contender::Lily) => lily_run::handoff(url, &queue, kind, prefetch, n).await,
        (Path::Handoff, Contender::Peer) => unreachable!("the peer runs the success path only"),
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

#[tokio::main]
async fn main() {
    let args = parse_args();
    let url = broker_url();
    let body = body_512();
    let started_at_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut results = Results {
        benchmark: "throughput",
        broker: broker_version(),
        broker_url: redact(&url),
        message_bytes: body.len(),
        messages_per_run: args.messages,
        repetitions: args.reps,
        cpus: std::thread::available_parallelism().map_or(1, usize::from),
        started_at_unix,
        lily_revision: revision(),
        load_average: [load_average(), None],
        wall_secs: 0.0,
        notes: vec![
            "Time runs from consumer start (connect included) until N messages are settled; \
             publishing the N messages before each run is not timed."
                .into(),
            "raw lapin (success): one delivery at a time, serde_json::from_slice then ack().await. \
             Lily: concurrency = prefetch. ruststream-lapin: Workers::pool(prefetch), broker and \
             queue prefetch set, no topology declared."
                .into(),
            "ruststream-lapin is counted by an AtomicU64 bumped in its handler, which precedes \
             that message's ACK: its figures are slightly favourable to it (up to prefetch \
             messages unACKed when the clock stops). raw lapin counts written ACKs, Lily its \
             ledger totals (acked / retried), polled every 1 ms."
                .into(),
            "Handoff path: retry bucket of 10 min (copies stay parked); Lily policy \
             max_attempts 2; raw lapin spawns a task per delivery that publishes the copy \
             (mandatory, persistent, Lily's 8 failure headers) on one confirm channel, awaits \
             its own confirm (a returned message fails) and then ACKs."
                .into(),
            "Every contender consumes the same queue, declared with Lily's topology arguments; \
             the machine is shared, so read the ratios, not the absolute figures."
                .into(),
        ],
        cases: Vec::new(),
    };
    println!(
        "Lily throughput benchmark: {}; {} messages a run, {} repetition(s)",
        results.broker, args.messages, args.reps
    );
    let total = Instant::now();
    for &path in &args.paths {
        for &kind in &args.kinds {
            for &prefetch in &args.prefetches {
                let mut samples: [Vec<Sample>; 4] = Default::default();
                for rep in 1..=args.reps {
                    for &who in contenders(path)
                        .iter()
                        .filter(|c| args.contenders.contains(c))
                    {
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
                        samples[who as usize].push(sample);
                    }
                }
                let [raw, lily, peer, raw_tasks] = samples;
                let mut case = CaseResult::new(path, kind_name(kind), prefetch, raw, lily, peer);
                case.add_raw_tasks(raw_tasks);
                eprintln!(
                    "  => {} {} prefetch {prefetch}: Lily/raw {:.3}{}",
                    path.name(),
                    kind_name(kind),
                    case.lily_over_raw,
                    case.lily_over_peer
                        .map_or_else(String::new, |r| format!(", Lily/peer {r:.3}")),
                );
                results.cases.push(case);
            }
        }
    }
    for (who, pick) in [
        (Contender::Raw, 0),
        (Contender::Lily, 1),
        (Contender::Peer, 2),
    ] {
        let left: Vec<u32> = results
            .cases
            .iter()
            .flat_map(|c| match pick {
                0 => &c.raw,
                1 => &c.lily,
                _ => &c.peer,
            })
            .filter_map(|s| s.left_in_queue)
            .filter(|&l| l > 0)
            .collect();
        if !left.is_empty() {
            results.notes.push(format!(
                "{} left messages ready in the work queue after {} run(s) ({:?}): deliveries it had \
                 counted were not ACKed when it shut down, so the broker requeued them.",
                who.name(),
                left.len(),
                left
            ));
        }
    }
    results.load_average[1] = load_average();
    results.wall_secs = total.elapsed().as_secs_f64();
    println!();
    print!("{}", report::human(&results));
    std::fs::create_dir_all(&args.out).expect("create the output directory");
    let json = serde_json::to_string_pretty(&results).expect("json");
    let files = [
        ("throughput.json", json + "\n"),
        ("throughput.md", report::markdown(&results)),
        ("throughput.svg", report::svg(&results)),
    ];
    for (name, text) in files {
        let file = args.out.join(name);
        std::fs::write(&file, text).expect("write results");
        println!("wrote {}", file.display());
    }
    println!("total {:.0} s", total.elapsed().as_secs_f64());
}

/// `scheme://host:port/vhost` without credentials.
fn redact(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("amqp", url));
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{rest}")
}
