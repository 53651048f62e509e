//! The throughput benchmark: Lily against hand-written and hand-tuned lapin, the no-ack ceiling
//! and ruststream-lapin on the success path, and against pipelined and batched raw handoffs.
//! `cli` drives it.

use std::time::Duration;

use serde::Serialize;

use crate::median;
pub use crate::run::{FAILURE_REASON, FirstDelivery, Sample, copy_headers, run_limit};

pub mod cli;

pub mod lily_run;
pub mod peer;

/// How often a run polls a contender's settled count (Lily's totals, the peer's counter).
pub const POLL: Duration = Duration::from_millis(1);

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

    /// The contenders a case runs by default, the bars first; a quick run leaves out the old
    /// success-path baselines (raw lapin awaiting each ACK, ruststream-lapin).
    pub fn contenders(self, quick: bool) -> &'static [Contender] {
        match (self, quick) {
            (Self::Success, false) => &[
                Contender::RawBatch,
                Contender::Ceiling,
                Contender::Lily,
                Contender::Raw,
                Contender::Peer,
            ],
            (Self::Success, true) => &[Contender::RawBatch, Contender::Ceiling, Contender::Lily],
            (Self::Handoff, _) => &[Contender::RawBatch, Contender::Raw, Contender::Lily],
        }
    }

    /// Whether `who` can run this path.
    pub fn runs(self, who: Contender) -> bool {
        match self {
            Self::Success => true,
            Self::Handoff => matches!(who, Contender::Raw | Contender::RawBatch | Contender::Lily),
        }
    }

    /// What Lily must reach against `over` on this path, if that contender is a bar.
    pub fn target(self, over: Contender) -> Option<f64> {
        match (self, over) {
            (_, Contender::RawBatch) => Some(1.0),
            (Self::Success, Contender::Ceiling) => Some(0.8),
            _ => None,
        }
    }
}

/// Who consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Contender {
    /// Hand-written lapin, one delivery after the other, each ACK awaited; on the handoff path a
    /// task per delivery that awaits its own copy's confirm, then ACKs (pipelined).
    Raw,
    /// Hand-tuned lapin: a `multiple` ACK every prefetch/2 deliveries; on the handoff path the
    /// copies' confirms are awaited a batch at a time while the next batch is published.
    RawBatch,
    /// No-ack consume: the broker settles nothing, so no consumer that settles goes faster.
    Ceiling,
    /// Lily.
    Lily,
    /// ruststream-lapin.
    Peer,
}

impl Contender {
    pub const ALL: [Self; 5] = [
        Self::Raw,
        Self::RawBatch,
        Self::Ceiling,
        Self::Lily,
        Self::Peer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Raw => "raw lapin",
            Self::RawBatch => "raw-batch",
            Self::Ceiling => "ceiling (no-ack)",
            Self::Lily => "Lily",
            Self::Peer => "ruststream-lapin",
        }
    }

    /// How a raw lapin contender settles on the success path.
    ///
    /// # Panics
    /// For Lily and ruststream-lapin.
    pub fn settle(self) -> crate::raw::Settle {
        use crate::raw::Settle;
        match self {
            Self::Raw => Settle::Each,
            Self::RawBatch => Settle::Batch,
            Self::Ceiling => Settle::NoAck,
            Self::Lily | Self::Peer => unreachable!("{} is not raw lapin", self.name()),
        }
    }
}

/// Retry delay of the handoff path: long, so the copies stay parked in the bucket.
pub const HANDOFF_DELAY: Duration = Duration::from_secs(600);

/// The broker's version as Debian packaged it, or what the benchmark was written against.
pub fn broker_version() -> String {
    let version = |package: &str| {
        let out = std::process::Command::new("dpkg-query")
            .args(["-W", "-f=${Version}", package])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        (out.status.success() && !text.is_empty()).then_some(text)
    };
    match (version("rabbitmq-server"), version("erlang-base")) {
        (Some(rabbit), erlang) => {
            let upstream = rabbit.split('-').next().unwrap_or(&rabbit).to_owned();
            let erlang = erlang.map_or_else(String::new, |e| {
                let e = e.split_once(':').map_or(e.as_str(), |(_, v)| v);
                format!(", Erlang {}", e.split(['+', '-']).next().unwrap_or(e))
            });
            format!("RabbitMQ {upstream} (Debian {rabbit}){erlang}")
        }
        (None, _) => "RabbitMQ 3.10 (Debian)".into(),
    }
}

/// User + system CPU seconds of a process, all threads included (those that ended too). This
/// one's (`None`) from its CPU clock, to the nanosecond; another's from `/proc`, in the kernel's
/// ticks of 10 ms, so a figure over a short run is coarse.
pub fn cpu_secs(pid: Option<u32>) -> Option<f64> {
    let Some(pid) = pid else {
        let now = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
        #[allow(clippy::cast_precision_loss)]
        return Some(now.tv_sec as f64 + now.tv_nsec as f64 / 1e9);
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces): state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    #[allow(clippy::cast_precision_loss)]
    Some(ticks as f64 / 100.0) // USER_HZ is 100 on Linux
}

/// The broker's Erlang VM, from the pid file `scripts/rabbitmq.sh` keeps in `LILY_RABBIT_DIR`.
pub fn broker_pid() -> Option<u32> {
    let dir = std::env::var_os("LILY_RABBIT_DIR")?;
    let pid = std::fs::read_to_string(std::path::Path::new(&dir).join("rabbit.pid")).ok()?;
    pid.trim().parse().ok()
}

/// CPU spent by this process and the broker while a contender ran.
#[derive(Clone, Copy, Debug)]
pub struct CpuMeter {
    client: Option<f64>,
    broker: Option<f64>,
    broker_pid: Option<u32>,
}

impl CpuMeter {
    pub fn start() -> Self {
        let broker_pid = broker_pid();
        Self {
            client: cpu_secs(None),
            broker: broker_pid.and_then(|p| cpu_secs(Some(p))),
            broker_pid,
        }
    }

    /// Adds CPU microseconds per settled message to `sample`.
    pub fn stop(self, sample: &mut Sample) {
        #[allow(clippy::cast_precision_loss)]
        let per = |before: Option<f64>, after: Option<f64>| match (before, after) {
            (Some(b), Some(a)) if sample.settled > 0 => Some((a - b) * 1e6 / sample.settled as f64),
            _ => None,
        };
        sample.client_cpu_us_per_msg = per(self.client, cpu_secs(None));
        sample.broker_cpu_us_per_msg =
            per(self.broker, self.broker_pid.and_then(|p| cpu_secs(Some(p))));
    }
}

/// The 1-minute load average.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `git describe --always --dirty` of the working tree, or `unknown`.
pub fn revision() -> String {
    std::process::Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// Everything one benchmark run measured.
#[derive(Debug, Serialize)]
pub struct Results {
    /// The run's conditions.
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

impl Start {
    pub fn new(queue_type: &'static str, contender: Contender, samples: &[Sample]) -> Self {
        let ms: Vec<f64> = samples.iter().map(|s| s.secs * 1000.0).collect();
        let median_ms = median(&mut ms.clone());
        Self {
            queue_type,
            contender,
            ms,
            median_ms,
        }
    }
}

/// One contender's runs in a case and their medians.
#[derive(Debug, Serialize)]
pub struct Runs {
    pub contender: Contender,
    pub samples: Vec<Sample>,
    pub median_msgs_per_sec: f64,
    /// Median client CPU µs per message (this process, every thread).
    pub client_cpu_us_per_msg: Option<f64>,
    /// Median broker CPU µs per message (the Erlang VM).
    pub broker_cpu_us_per_msg: Option<f64>,
    /// Median steady rate: messages over the time from the first delivery on.
    pub median_steady_msgs_per_sec: Option<f64>,
}

/// Lily's median over another contender's, and the target where that contender is a bar.
#[derive(Debug, Serialize)]
pub struct Ratio {
    pub over: Contender,
    pub value: f64,
    pub target: Option<f64>,
    pub met: Option<bool>,
    /// Lily's rate over the other's in each repetition (the two ran one after the other): the
    /// spread of `value`.
    pub runs: Vec<f64>,
    /// The same over the steady rates (from each one's first delivery on), if both have them.
    pub steady: Option<f64>,
    pub steady_runs: Vec<f64>,
}

/// Each repetition's `lily / other` of `rate`, where both have it.
fn paired(lily: &[Sample], other: &[Sample], rate: impl Fn(&Sample) -> Option<f64>) -> Vec<f64> {
    lily.iter()
        .zip(other)
        .filter_map(|(l, o)| Some(rate(l)? / rate(o)?))
        .collect()
}

/// One path × queue type × prefetch, all its runs and their medians.
#[derive(Debug, Serialize)]
pub struct CaseResult {
    pub path: Path,
    pub queue_type: &'static str,
    pub prefetch: u16,
    pub runs: Vec<Runs>,
    /// Lily / each other contender.
    pub lily_over: Vec<Ratio>,
    pub all_runs_complete: bool,
}

impl CaseResult {
    pub fn new(
        path: Path,
        queue_type: &'static str,
        prefetch: u16,
        samples: Vec<(Contender, Vec<Sample>)>,
    ) -> Self {
        let med = |v: &mut Vec<f64>| (!v.is_empty()).then(|| median(v));
        let runs: Vec<Runs> = samples
            .into_iter()
            .filter(|(_, s)| !s.is_empty())
            .map(|(contender, samples)| Runs {
                contender,
                median_msgs_per_sec: median(
                    &mut samples.iter().map(|x| x.msgs_per_sec).collect::<Vec<_>>(),
                ),
                client_cpu_us_per_msg: med(&mut samples
                    .iter()
                    .filter_map(|x| x.client_cpu_us_per_msg)
                    .collect()),
                broker_cpu_us_per_msg: med(&mut samples
                    .iter()
                    .filter_map(|x| x.broker_cpu_us_per_msg)
                    .collect()),
                median_steady_msgs_per_sec: med(&mut samples
                    .iter()
                    .filter_map(|x| x.steady_msgs_per_sec)
                    .collect()),
                samples,
            })
            .collect();
        let all_runs_complete = runs.iter().flat_map(|r| &r.samples).all(|s| s.complete);
        let lily_over = runs
            .iter()
            .find(|r| r.contender == Contender::Lily)
            .map(|lily| {
                runs.iter()
                    .filter(|r| r.contender != Contender::Lily)
                    .map(|r| {
                        let value = lily.median_msgs_per_sec / r.median_msgs_per_sec;
                        let target = path.target(r.contender);
                        Ratio {
                            over: r.contender,
                            value,
                            target,
                            met: target.map(|t| value >= t),
                            runs: paired(&lily.samples, &r.samples, |s| Some(s.msgs_per_sec)),
                            steady: lily
                                .median_steady_msgs_per_sec
                                .zip(r.median_steady_msgs_per_sec)
                                .map(|(l, o)| l / o),
                            steady_runs: paired(&lily.samples, &r.samples, |s| {
                                s.steady_msgs_per_sec
                            }),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        Self {
            path,
            queue_type,
            prefetch,
            runs,
            lily_over,
            all_runs_complete,
        }
    }

    /// The median msgs/s of `who`, if it ran.
    pub fn median(&self, who: Contender) -> Option<f64> {
        self.runs(who).map(|r| r.median_msgs_per_sec)
    }

    pub fn runs(&self, who: Contender) -> Option<&Runs> {
        self.runs.iter().find(|r| r.contender == who)
    }

    /// Lily / `over`, if both ran.
    pub fn ratio(&self, over: Contender) -> Option<&Ratio> {
        self.lily_over.iter().find(|r| r.over == over)
    }
}

#[cfg(test)]
mod tests {
    use super::cpu_secs;

    /// The process's own CPU is read finer than the kernel's 10 ms ticks: the first change a
    /// busy loop sees is far below a tick, where `/proc`'s count would first move by a whole one.
    #[test]
    fn this_process_cpu_is_read_below_a_tick() {
        let start = cpu_secs(None).expect("the CPU clock");
        let step = loop {
            let now = cpu_secs(None).expect("the CPU clock");
            if now > start {
                break now - start;
            }
        };
        assert!(
            step < 0.005,
            "the CPU clock moved by {step} s at once, a tick's step"
        );
    }
}
