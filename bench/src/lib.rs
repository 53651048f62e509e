//! Shared pieces of Lily's benchmark programs: the broker URL, topology, publishing, the
//! 512-byte JSON payload and statistics.
//!
//! Run them through `scripts/bench.sh`, which starts a private RabbitMQ node on loopback.
#![allow(missing_docs, unreachable_pub)]

pub mod args;
pub mod chart;
pub mod cli;
pub mod cluster;
pub mod cost;
pub mod latency;
pub mod mongo;
pub mod raw;
pub mod report;
pub mod run;
pub mod storm;
pub mod throughput;

use std::time::Duration;

use lapin::options::QueueDeleteOptions;
use lapin::{Connection, ConnectionProperties};
use lily::prelude::{QueueKind, TopologyMode};
use lily::publish::{Destination, Outgoing, Publisher};
use lily::topology::Topology;
use serde::Serialize;

/// The broker named by `LILY_AMQP_URL` (set by `scripts/bench.sh`).
///
/// # Panics
/// When it is unset.
pub fn broker_url() -> String {
    std::env::var("LILY_AMQP_URL")
        .expect("LILY_AMQP_URL is unset: run the benchmarks through scripts/bench.sh")
}

/// The payload every benchmark message carries: a 512-byte JSON order (the regression gate's).
pub use lily_mq_regress::consume::Order;

/// Queue type as text for reports.
pub fn kind_name(kind: QueueKind) -> &'static str {
    match kind {
        QueueKind::Classic => "classic",
        QueueKind::Quorum => "quorum",
    }
}

/// Deletes and re-declares `queue` with Lily's topology (same arguments for every contender).
///
/// Retried a few times: RabbitMQ 3.10's quorum-queue log writer has been seen to crash when a
/// busy quorum queue is deleted (`ra_log_segment_writer`, `enoent`), closing the channel of the
/// declare that follows; the node recovers within a second.
pub async fn fresh_topology(
    url: &str,
    queue: &str,
    kind: QueueKind,
    retry: &[Duration],
) -> Topology {
    // As the consumer declares it, with its default delivery limit.
    let topology = Topology::new(queue, kind, retry)
        .delivery_limit(lily::consumer::ConsumerConfig::new(queue).delivery_limit);
    for tries in 1.. {
        match redeclare(url, &topology).await {
            Ok(()) => break,
            Err(err) if tries < 5 => {
                eprintln!("bench: fresh topology for {queue} failed ({err}); retrying");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Err(err) => panic!("declare topology for {queue}: {err}"),
        }
    }
    topology
}

async fn redeclare(url: &str, topology: &Topology) -> Result<(), Box<dyn std::error::Error>> {
    let connection = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let (dlq, parking) = (topology.dead_letter_queue(), topology.parking_queue());
    let mut names = vec![topology.queue(), &dlq, &parking];
    names.extend(topology.buckets().map(|(name, _)| name));
    for name in names {
        let _ = channel
            .queue_delete(name.into(), QueueDeleteOptions::default())
            .await;
    }
    let declared = topology.apply(&channel, TopologyMode::Declare).await;
    let _ = connection.close(200, "declared".into()).await;
    declared?;
    Ok(())
}

/// Publishes `n` persistent 512-byte orders (type `order.placed`, a message id each) through
/// [`Publisher`], in windows of 2 000 publishes in flight.
///
/// # Panics
/// When a publish is not confirmed.
pub async fn publish(url: &str, queue: &str, n: usize) {
    let publisher = Publisher::connect(url)
        .await
        .expect("connect the publisher");
    let (to, body) = (Destination::queue(queue), Order::body());
    for start in (0..n).step_by(2000) {
        let messages = (start..n.min(start + 2000)).map(|i| {
            Outgoing::bytes(
                "order.placed",
                &format!("m-{i}"),
                "application/json",
                body.to_vec(),
            )
        });
        let published = publisher.publish_all(&to, messages).await;
        if let Some(failed) = published.iter().find(|p| !p.is_confirmed()) {
            panic!("a benchmark publish was not confirmed: {failed:?}");
        }
    }
    publisher.close().await;
}

/// Ready messages in `queue` (a passive declare on `channel`), or `None` if it cannot be read.
pub async fn ready(channel: &lapin::Channel, queue: &str) -> Option<u32> {
    let passive = lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let declared = channel.queue_declare(queue.into(), passive, Default::default());
    declared.await.ok().map(|q| q.message_count())
}

/// [`ready`] on a connection of its own.
pub async fn depth(url: &str, queue: &str) -> Option<u32> {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .ok()?;
    let depth = match connection.create_channel().await {
        Ok(channel) => ready(&channel, queue).await,
        Err(_) => None,
    };
    let _ = connection.close(200, "depth".into()).await;
    depth
}

/// `scheme://host:port/vhost` without credentials.
pub fn redact(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("amqp", url));
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{rest}")
}

/// Median of `values` (sorted in place).
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        return f64::NAN;
    }
    (values[(n - 1) / 2] + values[n / 2]) / 2.0
}

/// `12345.6` → `12 345.6`: thousands apart, as the reports and charts write numbers.
pub fn group(text: &str) -> String {
    let (sign, rest) = text.strip_prefix('-').map_or(("", text), |r| ("-", r));
    let int = rest.find('.').map_or(rest, |dot| &rest[..dot]);
    let mut out = String::from(sign);
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    out + &rest[int.len()..]
}

/// The note every report ends with: where its method is written down.
pub const METHOD: &str = "How this program measures: bench/README.md. The machine is shared: \
                          read the ratios, measured side by side, not the absolute figures.";

/// What every program's results open with: the conditions of the run.
#[derive(Debug, Serialize)]
pub struct Meta {
    pub benchmark: &'static str,
    pub broker: String,
    pub broker_url: String,
    pub message_bytes: usize,
    pub cpus: usize,
    pub started_at_unix: u64,
    /// `git describe --always --dirty` of the tree the benchmark ran in.
    pub lily_revision: String,
    /// 1-minute load average when the run started and when it ended (the machine is shared).
    pub load_average: [Option<f64>; 2],
    pub wall_secs: f64,
    pub notes: Vec<String>,
}

impl Meta {
    /// The conditions at the start of `benchmark` against the broker at `url`.
    pub fn new(benchmark: &'static str, url: &str, notes: Vec<String>) -> Self {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        Self {
            benchmark,
            broker: broker_version(url),
            broker_url: redact(url),
            message_bytes: Order::body().len(),
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            started_at_unix: now.map_or(0, |d| d.as_secs()),
            lily_revision: revision(),
            load_average: [load_average(), None],
            wall_secs: 0.0,
            notes,
        }
    }

    /// Records the load average at the end, and the time since `started`.
    pub fn finish(&mut self, started: std::time::Instant) {
        self.load_average[1] = load_average();
        self.wall_secs = started.elapsed().as_secs_f64();
    }
}

/// The broker's version as it announces it (`connection.start`) and the Erlang runtime its VM
/// runs (from the pid file `scripts/rabbitmq.sh` keeps), e.g. `RabbitMQ 4.0.5, erts 15.2.7`.
/// (Debian's package would name 3.10.8 when the run was against the 4.0 broker.)
pub fn broker_version(url: &str) -> String {
    let url = url.to_owned();
    // Asked on a thread of its own: `Meta::new` is called from synchronous and async code.
    let asked = std::thread::spawn(move || {
        let announced = runtime(false).block_on(lily::topology::broker_version(&url, None));
        announced.ok().flatten()
    });
    let version = asked.join().ok().flatten();
    let version = version.map_or_else(|| "(version not announced)".into(), |v| v.to_string());
    // The VM's executable is `…/erts-<version>/bin/beam.smp`.
    let exe = pid_in("LILY_RABBIT_DIR", "rabbit.pid")
        .and_then(|pid| std::fs::read_link(format!("/proc/{pid}/exe")).ok());
    let mut parts = exe.iter().flat_map(|exe| exe.iter());
    match parts.find_map(|part| part.to_str()?.strip_prefix("erts-")) {
        Some(erts) => format!("RabbitMQ {version}, erts {erts}"),
        None => format!("RabbitMQ {version}"),
    }
}

/// A tokio runtime: current-thread (repeatable counts) or multi-thread.
pub fn runtime(multi_thread: bool) -> tokio::runtime::Runtime {
    let mut builder = if multi_thread {
        tokio::runtime::Builder::new_multi_thread()
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    builder.enable_all().build().expect("tokio runtime")
}

/// User + system CPU seconds of a process, all threads included (those that ended too). This
/// one's (`None`) from its CPU clock, to the nanosecond; another's from `/proc`, in the kernel's
/// ticks of 10 ms, so a figure over a short run is coarse.
#[allow(clippy::cast_precision_loss)]
pub fn cpu_secs(pid: Option<u32>) -> Option<f64> {
    let Some(pid) = pid else {
        let now = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
        return Some(now.tv_sec as f64 + now.tv_nsec as f64 / 1e9);
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces): state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0) // USER_HZ is 100 on Linux
}

/// The pid in the file `file` of the directory named by the environment variable `var`: the
/// broker's VM (`LILY_RABBIT_DIR`, `rabbit.pid`, kept by `scripts/rabbitmq.sh`) or mongod
/// (`LILY_MONGO_DIR`, `mongod.pid`, kept by `scripts/mongod.sh`).
pub fn pid_in(var: &str, file: &str) -> Option<u32> {
    let dir = std::env::var_os(var)?;
    let pid = std::fs::read_to_string(std::path::Path::new(&dir).join(file)).ok()?;
    pid.trim().parse().ok()
}

/// CPU spent by this process, the broker and (when `LILY_MONGO_DIR` names its directory) mongod
/// while a contender ran: each one's pid (`None`: this one) and its CPU seconds at the start
/// (`None`: a process not found, left unmeasured).
#[derive(Clone, Copy, Debug)]
pub struct CpuMeter([(Option<u32>, Option<f64>); 3]);

impl CpuMeter {
    pub fn start() -> Self {
        let other = |pid: Option<u32>| (pid, pid.and_then(|pid| cpu_secs(Some(pid))));
        let broker = other(pid_in("LILY_RABBIT_DIR", "rabbit.pid"));
        let mongod = other(pid_in("LILY_MONGO_DIR", "mongod.pid"));
        Self([(None, cpu_secs(None)), broker, mongod])
    }

    /// Adds the CPU µs per settled message of this process and the broker to `sample`; returns
    /// mongod's.
    #[allow(clippy::cast_precision_loss)]
    pub fn stop(self, sample: &mut run::Sample) -> Option<f64> {
        let [client, broker, mongod] = self.0.map(|(pid, before)| {
            let spent = before.and_then(|before| Some(cpu_secs(pid)? - before));
            spent
                .filter(|_| sample.settled > 0)
                .map(|s| s * 1e6 / sample.settled as f64)
        });
        (sample.client_cpu_us_per_msg, sample.broker_cpu_us_per_msg) = (client, broker);
        mongod
    }
}

/// The 1-minute load average.
pub fn load_average() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// `git describe --always --dirty` of the working tree, or `unknown`.
pub fn revision() -> String {
    let described = std::process::Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .output();
    let described = described.ok().filter(|o| o.status.success());
    let described = described.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    described
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "unknown".into())
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
