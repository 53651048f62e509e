//! `lily-regress`: the CPU regression gate of the test command.
//!
//! A hand-written lapin consumer and Lily's consumer drain the same fixed workload from a
//! scripted peer ([`lily_mq_regress::peer`]), each in a child process, and the gate fails when
//! Lily's layer (what Lily spends a message above the hand-written consumer) has grown past the
//! recorded baseline by more than that figure's threshold:
//!
//! - instructions a message, every thread of the child, under valgrind's callgrind;
//! - task-clock and context switches a message, from `perf stat`, from the least count of each
//!   run over interleaved rounds (callgrind counts neither wake-ups nor system calls).
//!
//! A figure over its limit is measured once more and fails the gate only if it is over again.
//!
//! Each figure is per message from two runs of different sizes, `(big − small) / (N − N0)`, so
//! start-up and shutdown cancel out. The baseline and its thresholds are in
//! `regress/baseline.json`; `--record` rewrites the baselines (never the thresholds), to be done
//! on purpose with the reason in the CHANGELOG.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use serde::{Deserialize, Serialize};

use lily_mq_regress::collected;
use lily_mq_regress::consume::{self, Who};
use lily_mq_regress::peer::Peer;

/// Messages of the long and the short (subtracted) runs under callgrind.
const CALLGRIND_N: [u64; 2] = [20_000, 2_000];
/// The same for the runs under `perf stat`.
const PERF_N: [u64; 2] = [60_000, 6_000];
/// Longest a child may take (under valgrind it runs about 50 times slower).
const CHILD_LIMIT: Duration = Duration::from_secs(300);

#[derive(Parser, Debug)]
#[command(about = "Fails when Lily's CPU a message over a hand-written lapin consumer grows")]
struct Cli {
    #[command(subcommand)]
    child: Option<Child>,
    /// Write the measured layers as the new baselines (thresholds stay); say why in the
    /// CHANGELOG.
    #[arg(long)]
    record: bool,
    /// A/A: the hand-written consumer in both places, so the "layer" shows the measurement's
    /// own spread (what each threshold must stay above).
    #[arg(long, conflicts_with = "record")]
    aa: bool,
    /// Interleaved rounds of the `perf stat` runs.
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// Keep each callgrind profile as `DIR/callgrind.<pid>`, for
    /// `bench/tools/callgrind_layers.py DIR` (where Lily's layer goes, part by part).
    #[arg(long, value_name = "DIR")]
    callgrind_dir: Option<PathBuf>,
    /// The baseline file.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/baseline.json"))]
    baseline: PathBuf,
}

#[derive(clap::Subcommand, Debug)]
enum Child {
    /// Drains N orders from the peer at URL with WHO (a measured child).
    Consume { who: Who, n: u64, url: String },
}

/// A gated figure: Lily's layer when the baseline was recorded, and how far above it a measured
/// layer may go.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct Gated {
    layer: f64,
    threshold: f64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Baseline {
    /// Why the baselines are what they are (the commit and the change that set them).
    why: String,
    instructions: Gated,
    task_clock_ns: Gated,
    context_switches: Gated,
}

/// One figure of every run: by consumer (the baseline first), by run size (the long run first),
/// one count a round.
struct Measured {
    name: &'static str,
    sizes: [u64; 2],
    runs: [[Vec<f64>; 2]; 2],
}

impl Measured {
    fn new(name: &'static str, sizes: [u64; 2]) -> Self {
        Self {
            name,
            sizes,
            runs: Default::default(),
        }
    }

    /// Records a round's counts of the long and the short run of the baseline consumer
    /// (`first`) or of the measured one.
    fn push(&mut self, first: bool, [big, small]: [f64; 2]) {
        let runs = &mut self.runs[usize::from(!first)];
        runs[0].push(big);
        runs[1].push(small);
    }

    /// A consumer's figure a message: from the least count of each run size over the rounds,
    /// since what a shared machine adds (another process's cache misses, a migration) only
    /// ever adds.
    fn per_message(&self, consumer: usize) -> f64 {
        let least = |runs: &[f64]| runs.iter().copied().fold(f64::INFINITY, f64::min);
        let [big, small] = &self.runs[consumer];
        per_message(least(big), least(small), self.sizes)
    }

    /// Lily's layer.
    fn layer(&self) -> f64 {
        self.per_message(1) - self.per_message(0)
    }

    /// Lily's layer in each round on its own: the spread the least counts smooth.
    fn round_layers(&self) -> Vec<f64> {
        let each = |[big, small]: &[Vec<f64>; 2]| -> Vec<f64> {
            big.iter()
                .zip(small)
                .map(|(b, s)| per_message(*b, *s, self.sizes))
                .collect()
        };
        let (raw, lily) = (each(&self.runs[0]), each(&self.runs[1]));
        lily.iter().zip(&raw).map(|(l, r)| l - r).collect()
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Child::Consume { who, n, url }) = cli.child {
        return match consume::run(who, n, &url) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("lily-regress: {} consumer: {err}", who.name());
                ExitCode::FAILURE
            }
        };
    }
    match gate(&cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("lily-regress: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Measures, compares with (or records) the baseline; whether every figure is within its limit.
/// A figure over its limit is measured once more, and fails the gate only if it is over again:
/// a shared machine can slow one measurement as a whole, never two in a row by chance alike.
fn gate(cli: &Cli) -> Result<bool, String> {
    let text = std::fs::read_to_string(&cli.baseline)
        .map_err(|err| format!("{}: {err}", cli.baseline.display()))?;
    let mut baseline: Baseline =
        serde_json::from_str(&text).map_err(|err| format!("{}: {err}", cli.baseline.display()))?;
    let mut over = [true; 3];
    for attempt in 0..2 {
        let started = Instant::now();
        let figures = measure(cli)?;
        println!(
            "lily-regress: what Lily adds a message over a hand-written lapin consumer, on a \
             scripted peer (prefetch {}; {} s)",
            consume::PREFETCH,
            started.elapsed().as_secs()
        );
        println!(
            "{:<18} {:>10} {:>10} {:>10} {:>20} {:>10} {:>10}",
            "a message", "raw", "Lily", "layer", "(rounds' range)", "baseline", "limit"
        );
        let gated = [
            &mut baseline.instructions,
            &mut baseline.task_clock_ns,
            &mut baseline.context_switches,
        ];
        for ((measured, gated), over) in figures.iter().zip(gated).zip(&mut over) {
            let layer = measured.layer();
            let limit = gated.layer + gated.threshold;
            *over &= !cli.record && layer > limit;
            let verdict = match (cli.record, *over) {
                (true, _) => "recorded",
                (false, true) => "OVER",
                (false, false) => "ok",
            };
            if cli.record {
                // Hundredths: finer is noise.
                gated.layer = (layer * 100.0).round() / 100.0;
            }
            let (low, high) = range(&measured.round_layers());
            println!(
                "{:<18} {:>10.2} {:>10.2} {:>10.2} {:>20} {:>10.2} {:>10.2}  {verdict}",
                measured.name,
                measured.per_message(0),
                measured.per_message(1),
                layer,
                format!("{low:.2}–{high:.2}"),
                gated.layer,
                limit,
            );
        }
        if !over.contains(&true) {
            break;
        }
        if attempt == 0 {
            println!("lily-regress: over its limit; measuring once more before failing");
        }
    }
    if cli.record {
        write_baseline(&cli.baseline, &baseline)?;
        println!(
            "lily-regress: baselines written to {}",
            cli.baseline.display()
        );
    } else if over.contains(&true) {
        println!(
            "lily-regress: Lily's layer grew past its limit twice. Find what a message now costs \
             more (docs/src/performance.md, \"Where Lily's layer goes\"), or, if the cost is \
             meant, record a new baseline with `scripts/regress.sh --record` and say why in \
             CHANGELOG.md."
        );
    }
    Ok(!over.contains(&true))
}

/// One measurement of the three figures: instructions, task-clock, context switches.
fn measure(cli: &Cli) -> Result<[Measured; 3], String> {
    let peers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|err| format!("tokio runtime: {err}"))?;
    let exe = std::env::current_exe().map_err(|err| format!("this program's path: {err}"))?;
    let run = |wrap: &[&str], who: Who, n: u64| -> Result<String, String> {
        let peer = peers
            .block_on(Peer::start(n, consume::Order::body()))
            .map_err(|err| format!("the peer: {err}"))?;
        let mut command = Command::new(wrap[0]);
        command.args(&wrap[1..]).arg(&exe);
        command.args([
            "consume",
            &who.name().to_lowercase(),
            &n.to_string(),
            &peer.url(),
        ]);
        let stderr = finish(command)?;
        let tally = peer.tally();
        if tally.acked != n || tally.delivered != n || tally.refused != 0 {
            return Err(format!(
                "{} consumed {n} orders, yet the peer saw {tally:?}",
                who.name()
            ));
        }
        Ok(stderr)
    };

    if let Some(dir) = &cli.callgrind_dir {
        std::fs::create_dir_all(dir).map_err(|err| format!("{}: {err}", dir.display()))?;
    }
    let measured = if cli.aa { Who::Raw } else { Who::Lily };
    let mut instructions = Measured::new("instructions", CALLGRIND_N);
    for (first, who) in [(true, Who::Raw), (false, measured)] {
        let out = cli.callgrind_dir.as_ref().map_or_else(
            || "/dev/null".to_owned(),
            |dir| format!("{}/callgrind.%p", dir.display()),
        );
        let out = format!("--callgrind-out-file={out}");
        let [big, small] = CALLGRIND_N.map(|n| {
            let callgrind = ["valgrind", "--tool=callgrind", &out];
            run(&callgrind, who, n).and_then(|stderr| collected(&stderr))
        });
        instructions.push(first, [big?, small?]);
    }
    let (mut clock, mut switches) = (
        Measured::new("task-clock (ns)", PERF_N),
        Measured::new("context switches", PERF_N),
    );
    let counts = std::env::temp_dir().join(format!("lily-regress-{}.csv", std::process::id()));
    for round in 0..cli.rounds {
        let mut order = [(true, Who::Raw), (false, measured)];
        if round % 2 == 1 {
            order.reverse();
        }
        for (first, who) in order {
            let [big, small] = PERF_N.map(|n| {
                let out = counts.to_str().expect("a temporary path is UTF-8");
                let perf = [
                    "perf",
                    "stat",
                    "-x,",
                    "-e",
                    "task-clock,context-switches",
                    "-o",
                    out,
                    "--",
                ];
                run(&perf, who, n).and_then(|_| perf_counts(&counts))
            });
            let ([big_clock, big_switches], [small_clock, small_switches]) = (big?, small?);
            clock.push(first, [big_clock, small_clock]);
            switches.push(first, [big_switches, small_switches]);
        }
    }
    let _ = std::fs::remove_file(&counts);
    Ok([instructions, clock, switches])
}

/// Runs a child to its end; its stderr, or why it failed. The stderr is read as it comes, so a
/// child that writes much of it cannot block on a full pipe.
fn finish(mut command: Command) -> Result<String, String> {
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|err| format!("{command:?}: {err}"))?;
    let mut pipe = child.stderr.take().expect("stderr is piped");
    let reader = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    });
    let deadline = Instant::now() + CHILD_LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|err| err.to_string())? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{command:?} took over {} s", CHILD_LIMIT.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = reader.join().unwrap_or_default();
    if status.success() {
        Ok(stderr)
    } else {
        Err(format!("{command:?} failed ({status}):\n{stderr}"))
    }
}

/// Task-clock in nanoseconds and context switches, from `perf stat -x,` output at `path`.
fn perf_counts(path: &Path) -> Result<[f64; 2], String> {
    let text = std::fs::read_to_string(path).map_err(|err| format!("{}: {err}", path.display()))?;
    let count = |event: &str| {
        let line = text
            .lines()
            .find(|l| l.split(',').nth(2).is_some_and(|e| e.starts_with(event)));
        let value = line.and_then(|l| l.split(',').next()?.parse::<f64>().ok());
        value.ok_or_else(|| format!("`perf stat` counted no {event}:\n{text}"))
    };
    // task-clock is in milliseconds.
    Ok([count("task-clock")? * 1e6, count("context-switches")?])
}

/// `(big − small) / (N − N0)`.
#[allow(clippy::cast_precision_loss)]
fn per_message(big: f64, small: f64, [n, n0]: [u64; 2]) -> f64 {
    (big - small) / (n - n0) as f64
}

fn range(values: &[f64]) -> (f64, f64) {
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (low, high)
}

fn write_baseline(path: &Path, baseline: &Baseline) -> Result<(), String> {
    let text = serde_json::to_string_pretty(baseline).expect("a baseline encodes") + "\n";
    std::fs::write(path, text).map_err(|err| format!("{}: {err}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perf_stat_csv_is_read_in_nanoseconds() {
        let path = std::env::temp_dir().join(format!("lily-regress-test-{}", std::process::id()));
        let csv = "# started on Sun Dec  6\n\n812.34,msec,task-clock,812340000,100.00,0.98,CPUs utilized\n\
                   1234,,context-switches,812340000,100.00,1.52,K/sec\n";
        std::fs::write(&path, csv).unwrap();
        assert_eq!(perf_counts(&path).unwrap(), [812_340_000.0, 1234.0]);
        std::fs::write(&path, "<not counted>,,context-switches\n").unwrap();
        assert!(perf_counts(&path).is_err());
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_run_costs_its_difference_a_message() {
        assert_eq!(per_message(1_100.0, 200.0, [1_000, 100]), 1.0);
        let mut clock = Measured::new("clock", [1_000, 100]);
        clock.push(true, [1_100.0, 200.0]);
        clock.push(true, [1_000.0, 100.0]);
        clock.push(false, [2_000.0, 200.0]);
        clock.push(false, [2_900.0, 300.0]);
        // The least counts: raw (1 000 − 100) / 900, Lily (2 000 − 200) / 900.
        assert_eq!((clock.per_message(0), clock.per_message(1)), (1.0, 2.0));
        assert_eq!(clock.layer(), 1.0);
        assert_eq!(clock.round_layers(), [1.0, 1.0 + 1.0 / 9.0 * 8.0]);
        assert_eq!(collected("==1== Collected : 123456\n"), Ok(123_456.0));
    }
}
