//! The throughput benchmark: Lily against hand-written and hand-tuned lapin, the no-ack ceiling
//! and ruststream-lapin on the success path, and against pipelined and batched raw handoffs.
//! `cli` drives it.

use std::time::Duration;

use serde::Serialize;

use crate::median;
use crate::run::Sample;

pub mod cli;
pub mod lily_run;
pub mod peer;

/// How often a run polls a contender's settled count where a millisecond's resolution is enough:
/// the peer's counter, the Mongo scope's ACKs (Lily's throughput run polls finer: `lily_run`).
pub const POLL: Duration = Duration::from_millis(1);
/// The fewest repetitions a ratio is judged on.
pub const RULE_REPS: usize = 5;
/// Lily's client CPU a message, at most, over raw-batch's.
pub const CPU_TARGET: f64 = 1.10;

/// Which path a case measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Path {
    /// Every message is deserialized and ACKed.
    Success,
    /// Every message fails once and is handed off to a retry bucket (confirmed copy, then ACK).
    Handoff,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Handoff => "handoff",
        }
    }

    /// Retry delays of the path's topology: Lily's default policy's, or the parked bucket.
    pub fn delays(self) -> Vec<Duration> {
        match self {
            Self::Success => lily::consumer::Policy::default().retry_delays,
            Self::Handoff => vec![crate::run::HANDOFF_DELAY],
        }
    }
}

/// Who consumes, in the reports' column order (`clap::ValueEnum::value_variants`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Contender {
    /// Hand-written lapin, one delivery after the other, each ACK awaited; on the handoff path a
    /// task per delivery that awaits its own copy's confirm, then ACKs (pipelined).
    Raw,
    /// Hand-tuned lapin: a `multiple` ACK every prefetch/2 deliveries; on the handoff path the
    /// copies' confirms are awaited a batch at a time while the next batch is published.
    RawBatch,
    /// Raw-batch again, for the A/A ratio: what two identical contenders give in this run.
    RawBatchAgain,
    /// No-ack consume: the broker settles nothing, so no consumer that settles goes faster.
    Ceiling,
    /// Lily.
    Lily,
    /// ruststream-lapin.
    Peer,
}

impl Contender {
    pub fn name(self) -> &'static str {
        match self {
            Self::Raw => "raw lapin",
            Self::RawBatch => "raw-batch",
            Self::RawBatchAgain => "raw-batch again",
            Self::Ceiling => "ceiling (no-ack)",
            Self::Lily => "Lily",
            Self::Peer => "ruststream-lapin",
        }
    }

    /// The contenders `ran` holds for, in the reports' order.
    pub fn those(ran: impl Fn(Self) -> bool) -> Vec<Self> {
        let all = <Self as clap::ValueEnum>::value_variants().iter().copied();
        all.filter(|&w| ran(w)).collect()
    }
}

/// Everything one benchmark run measured.
#[derive(Debug, Serialize)]
pub struct Results {
    #[serde(flatten)]
    pub meta: crate::Meta,
    pub messages_per_run: u64,
    pub repetitions: u32,
    pub cases: Vec<CaseResult>,
    /// How long each contender takes to start, per queue type (success path).
    pub starts: Vec<Start>,
}

/// A contender's runs from its start until one waiting message is settled: connect, topology
/// (Lily's), `basic.consume` and one delivery.
#[derive(Debug, Serialize)]
pub struct Start {
    pub queue_type: &'static str,
    pub contender: Contender,
    pub ms: Vec<f64>,
    pub median_ms: f64,
}

/// One contender's runs in a case and their medians (CPU: µs a message, client = this process,
/// every thread; broker = the Erlang VM; steady: from the first delivery on).
#[derive(Debug, Serialize)]
pub struct Runs {
    pub contender: Contender,
    pub samples: Vec<Sample>,
    pub median_msgs_per_sec: f64,
    pub client_cpu_us_per_msg: Option<f64>,
    pub broker_cpu_us_per_msg: Option<f64>,
    pub median_steady_msgs_per_sec: Option<f64>,
}

/// Lily's median over another contender's, and the target where that contender is a bar.
#[derive(Debug, Serialize)]
pub struct Ratio {
    pub over: Contender,
    pub value: f64,
    pub target: Option<f64>,
    /// By [`meets`]; `None` without a target or with fewer than [`RULE_REPS`] repetitions.
    pub met: Option<bool>,
    /// Lily's rate over the other's in each repetition (the two ran one after the other): the
    /// spread of `value`.
    pub runs: Vec<f64>,
    /// The same over the steady rates (from each one's first delivery on), if both have them.
    pub steady: Option<f64>,
    pub steady_runs: Vec<f64>,
    /// Lily's client CPU a message over the other's: the median of the repetitions' ratios,
    /// then each repetition's.
    pub cpu: Option<f64>,
    pub cpu_runs: Vec<f64>,
    /// Against raw-batch on the success path, by [`meets`]: CPU a message at most
    /// [`CPU_TARGET`] times raw-batch's.
    pub cpu_met: Option<bool>,
}

impl Ratio {
    /// `numerator`'s runs over `over`'s on `path`, judged by [`meets`] where they are Lily and
    /// raw-batch. Lily must reach raw-batch's rate, and on the success path its CPU a message; the
    /// no-ack ceiling is the node's reference, not a bar: the broker's settling work alone keeps
    /// any consumer that settles well below it.
    fn new(numerator: &Runs, over: &Runs, path: Path) -> Self {
        let bar = numerator.contender == Contender::Lily && over.contender == Contender::RawBatch;
        let target = bar.then_some(1.0);
        let cpu_target = (bar && path == Path::Success).then_some(CPU_TARGET);
        // Each repetition's `numerator / over` of a rate, where both have it.
        let paired = |rate: fn(&Sample) -> Option<f64>| -> Vec<f64> {
            let pairs = numerator.samples.iter().zip(&over.samples);
            pairs
                .filter_map(|(l, o)| Some(rate(l)? / rate(o)?))
                .collect()
        };
        let value = numerator.median_msgs_per_sec / over.median_msgs_per_sec;
        let runs = paired(|s| Some(s.msgs_per_sec));
        let cpu_runs = paired(|s| s.client_cpu_us_per_msg);
        let cpu = (!cpu_runs.is_empty()).then(|| median(&mut cpu_runs.clone()));
        Self {
            over: over.contender,
            value,
            met: target.and_then(|t| meets(value, &runs, t, true)),
            target,
            runs,
            steady: numerator
                .median_steady_msgs_per_sec
                .zip(over.median_steady_msgs_per_sec)
                .map(|(l, o)| l / o),
            steady_runs: paired(|s| s.steady_msgs_per_sec),
            cpu_met: cpu
                .zip(cpu_target)
                .and_then(|(cpu, t)| meets(cpu, &cpu_runs, t, false)),
            cpu,
            cpu_runs,
        }
    }
}

/// Whether a ratio meets its target by the project's rule: two identical contenders give a
/// median at or above 1.0 only half the time, so over at least [`RULE_REPS`] repetitions the
/// median must be within 3 % of the target and the repetitions' range must reach it. `floor`:
/// the target is a least value (a rate), else a most (CPU). `None` with fewer repetitions.
pub fn meets(median: f64, runs: &[f64], target: f64, floor: bool) -> Option<bool> {
    (runs.len() >= RULE_REPS).then(|| {
        if floor {
            median >= target * 0.97 && runs.iter().any(|&r| r >= target)
        } else {
            median <= target * 1.03 && runs.iter().any(|&r| r <= target)
        }
    })
}

/// One path × queue type × prefetch, all its runs and their medians.
#[derive(Debug, Serialize)]
pub struct CaseResult {
    pub path: Path,
    pub queue_type: &'static str,
    pub prefetch: u16,
    pub runs: Vec<Runs>,
    /// Lily / each other contender (but raw-batch again).
    pub lily_over: Vec<Ratio>,
    /// Raw-batch again / raw-batch: the A/A ratio, the spread two identical contenders give.
    pub aa: Option<Ratio>,
    pub all_runs_complete: bool,
}

impl CaseResult {
    pub fn new(
        path: Path,
        queue_type: &'static str,
        prefetch: u16,
        samples: Vec<(Contender, Vec<Sample>)>,
    ) -> Self {
        let runs: Vec<Runs> = samples
            .into_iter()
            .filter(|(_, s)| !s.is_empty())
            .map(|(contender, samples)| {
                let med = |f: fn(&Sample) -> Option<f64>| {
                    let mut v: Vec<f64> = samples.iter().filter_map(f).collect();
                    (!v.is_empty()).then(|| median(&mut v))
                };
                Runs {
                    contender,
                    median_msgs_per_sec: med(|x| Some(x.msgs_per_sec)).unwrap_or(f64::NAN),
                    client_cpu_us_per_msg: med(|x| x.client_cpu_us_per_msg),
                    broker_cpu_us_per_msg: med(|x| x.broker_cpu_us_per_msg),
                    median_steady_msgs_per_sec: med(|x| x.steady_msgs_per_sec),
                    samples,
                }
            })
            .collect();
        let all_runs_complete = runs.iter().flat_map(|r| &r.samples).all(|s| s.complete);
        let find = |who| runs.iter().find(|r| r.contender == who);
        let lily_over = find(Contender::Lily).map_or_else(Vec::new, |lily| {
            let others = runs
                .iter()
                .filter(|r| !matches!(r.contender, Contender::Lily | Contender::RawBatchAgain));
            others.map(|r| Ratio::new(lily, r, path)).collect()
        });
        let aa = find(Contender::RawBatchAgain)
            .zip(find(Contender::RawBatch))
            .map(|(again, batch)| Ratio::new(again, batch, path));
        Self {
            path,
            queue_type,
            prefetch,
            runs,
            lily_over,
            aa,
            all_runs_complete,
        }
    }

    pub fn runs(&self, who: Contender) -> Option<&Runs> {
        self.runs.iter().find(|r| r.contender == who)
    }

    /// Lily / `over`, if both ran.
    pub fn ratio(&self, over: Contender) -> Option<&Ratio> {
        self.lily_over.iter().find(|r| r.over == over)
    }
}
