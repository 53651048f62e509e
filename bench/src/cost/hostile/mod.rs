//! Bounded memory under hostile load (`cost --only hostile`). Method: `bench/README.md`.

mod check;
pub mod child;
pub mod messages;

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{Confirmation, Connection, ConnectionProperties};
use lily::consumer::{Limits, Policy};
use lily::prelude::QueueKind;
use lily_mq_testkit::Client;
use serde_json::{Value, json};

use self::messages::{CLASSES, Class, Expected, message};
use super::{Bench, Contender};
use crate::fresh_topology;

/// Messages per run.
pub const N: usize = 10_000;
/// Prefetch (and concurrency) of the run, "full prefetch" as a production consumer would set
/// it. AMQP's prefetch count is 16 bits and Lily accepts 1..=65 535 (RabbitMQ adds no cap;
/// 0, unlimited, Lily refuses), but at 65 535 a 10 000-message run would hold every message at
/// once and say nothing about a window. 1 000 is over three times the top of the 100–300 range
/// RabbitMQ's guide recommends and 20 times Lily's default of 50; the bound is linear in it and
/// `--hostile-prefetch` measures another.
pub const PREFETCH: u16 = 1_000;
/// How often a child samples itself.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(200);
/// `max_body_bytes` in force: 64 KiB, so 10 000 messages stay within a shared machine's disk.
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// Copies of one delivery the bound allows at once (`--hostile-copies` states another bound,
/// for instance 1 to see the check fail).
pub const COPIES: u64 = 2;
/// lapin's frame buffers per connection: `FRAMES_STORAGE` (32) frames of `frame_max`, one
/// buffer to read and one to write (lapin 4.12, `io_loop.rs`).
const LAPIN_FRAME_BUFFERS: u64 = 2 * 32;
/// How long everything must stay quiet before the run counts as over (above the 1 s retry
/// delay, so a copy waiting in its bucket is seen there).
const QUIET: Duration = Duration::from_millis(1_500);
/// Publishes awaiting their confirm at once.
const PUBLISH_WINDOW: usize = 256;

/// The limits in force: Lily's defaults with `max_body_bytes` at 64 KiB.
pub fn limits() -> Limits {
    let mut limits = Limits::default();
    limits.max_body_bytes = MAX_BODY_BYTES;
    limits
}

/// Two attempts, one retry bucket of 1 s.
pub fn policy() -> Policy {
    Policy::default()
        .max_attempts(2)
        .retry_delays([Duration::from_secs(1)])
}

/// Bytes one message may hold under the limits: its body and its header bytes.
fn message_budget(limits: &Limits) -> u64 {
    (limits.max_body_bytes + limits.max_header_bytes) as u64
}

/// The stated bound, in bytes.
struct Bound {
    frame_max: u64,
    prefetch: u64,
    copies: u64,
}

impl Bound {
    fn bytes(&self, idle: u64, connections: u64, limits: &Limits) -> u64 {
        idle + connections * LAPIN_FRAME_BUFFERS * self.frame_max
            + self.prefetch * self.copies * message_budget(limits)
    }
}

/// The child's stdout, line by line, with the latest `SAMPLE` kept.
struct Lines {
    rx: mpsc::Receiver<String>,
    latest: Value,
}

impl Lines {
    fn new(child: &mut Child) -> Result<Self, String> {
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            rx,
            latest: Value::Null,
        })
    }

    fn take(&mut self, line: &str) -> Option<(String, Value)> {
        let (tag, json) = line.split_once(' ')?;
        let value: Value = serde_json::from_str(json).ok()?;
        if tag == "SAMPLE" {
            self.latest = value.clone();
        }
        Some((tag.to_owned(), value))
    }

    /// Waits for the line tagged `tag`.
    fn wait(&mut self, tag: &str, limit: Duration) -> Result<Value, String> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.rx.recv_timeout(left).map_err(|e| match e {
                mpsc::RecvTimeoutError::Timeout => format!("no {tag} within {limit:?}"),
                mpsc::RecvTimeoutError::Disconnected => format!("the child exited before {tag}"),
            })?;
            if let Some((got, value)) = self.take(&line)
                && got == tag
            {
                return Ok(value);
            }
        }
    }

    /// The latest sample, after reading every line waiting.
    fn latest(&mut self) -> Result<&Value, String> {
        loop {
            match self.rx.try_recv() {
                Ok(line) => {
                    self.take(&line);
                }
                Err(mpsc::TryRecvError::Empty) => return Ok(&self.latest),
                Err(mpsc::TryRecvError::Disconnected) => {
                    return Err("the child exited during the run".into());
                }
            }
        }
    }
}

fn tell(stdin: &mut ChildStdin, command: &str) -> Result<(), String> {
    writeln!(stdin, "{command}")
        .and_then(|()| stdin.flush())
        .map_err(|e| format!("write {command} to the child: {e}"))
}

/// Publishes the `n` messages to `queue` with confirms, [`PUBLISH_WINDOW`] at a time. Returns
/// the bytes of bodies sent and the negotiated `frame_max`.
async fn publish(url: &str, queue: &str, n: usize, limits: &Limits) -> Result<(u64, u64), String> {
    let e = |what: &'static str| move |err: lapin::Error| format!("{what}: {err}");
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(e("connect"))?;
    let frame_max = u64::from(connection.configuration().frame_max());
    let channel = connection.create_channel().await.map_err(e("channel"))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(e("confirm.select"))?;
    let mut pending = std::collections::VecDeque::new();
    let mut bytes = 0;
    let settle = |i: usize, confirmation: lapin::Result<Confirmation>| match confirmation {
        Ok(Confirmation::Ack(None)) => Ok(()),
        Ok(other) => Err(format!("publish of message {i} not confirmed: {other:?}")),
        Err(err) => Err(format!("publish of message {i}: {err}")),
    };
    for i in 0..n {
        let (_, body, properties) = message(i, n, limits);
        bytes += body.len() as u64;
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &body,
                properties,
            )
            .await
            .map_err(e("publish"))?;
        pending.push_back((i, confirm));
        if pending.len() >= PUBLISH_WINDOW
            && let Some((i, confirm)) = pending.pop_front()
        {
            settle(i, confirm.await)?;
        }
    }
    while let Some((i, confirm)) = pending.pop_front() {
        settle(i, confirm.await)?;
    }
    let _ = connection.close(200, "published".into()).await;
    Ok((bytes, frame_max))
}

fn num(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// When the drain ended, in the child's clock: the first sample from which nothing was in
/// flight and the handled count was final.
fn end_ms(samples: &[Value]) -> Option<u64> {
    let last = samples.last()?;
    let done = |s: &Value| num(&s["in_flight"]) == 0 && s["handled"] == last["handled"];
    let first_quiet = samples.iter().rposition(|s| !done(s)).map_or(0, |i| i + 1);
    samples.get(first_quiet).map(|s| num(&s["t_ms"]))
}

/// One contender's run: its figures and the evidence.
fn run(b: &Bench, who: Contender, prefetch: u16, n: usize) -> Result<Value, String> {
    let limits = limits();
    let queue = format!("lily-bench-cost-hostile-{}", who.name());
    let topology = b.rt.block_on(fresh_topology(
        &b.url,
        &queue,
        QueueKind::Classic,
        &policy().retry_delays,
    ));
    let mut child = Command::new(&b.exe)
        .env("LILY_AMQP_URL", &b.url)
        .arg("cost")
        .arg(format!("hostile-{}", who.name()))
        .arg(prefetch.to_string())
        .arg(n.to_string())
        .arg(&queue)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("spawn hostile-{}: {e}", who.name()))?;
    let outcome = drive(b, &mut child, &queue, &topology, n, &limits);
    if outcome.is_err() {
        let _ = child.kill();
    }
    let status = child.wait().map_err(|e| format!("wait: {e}"))?;
    let (result, published, frame_max, drain_wall) = outcome?;
    if !status.success() {
        return Err(format!("hostile-{} exited with {status}", who.name()));
    }
    let client = b.rt.block_on(Client::connect(&b.url));
    let expected = move |class: Class| match who {
        Contender::Lily => class.expected(),
        // No gate and no failures: raw acks every message it decodes.
        Contender::Raw => Expected::Handled { attempt: 1 },
    };
    let evidence = b.rt.block_on(check::evidence(
        &client,
        &topology,
        n,
        &result["tally"],
        expected,
    ));
    let connections = if who == Contender::Lily { 2 } else { 1 };
    let idle = num(&result["idle"]["rss_bytes"]);
    let bound = Bound {
        frame_max,
        prefetch: u64::from(prefetch),
        copies: b.options.hostile_copies,
    }
    .bytes(idle, connections, &limits);
    let samples = result["samples"].as_array().cloned().unwrap_or_default();
    let max_of = |key: &str| samples.iter().map(|s| num(&s[key])).max().unwrap_or(0);
    // The kernel keeps RSS counters per thread and folds them in lazily, so VmHWM can trail a
    // VmRSS sample by a few pages: the peak is the larger of the two.
    let hwm = [
        num(&result["exit"]["hwm_bytes"]),
        max_of("rss_bytes"),
        num(&result["full"]["rss_bytes"]),
        num(&result["settled"]["rss_bytes"]),
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    let full_ms = num(&result["full"]["t_ms"]);
    let drain_ms = end_ms(&samples)
        .map(|end| end.saturating_sub(full_ms))
        .filter(|ms| *ms > 0);
    let drain_s = drain_ms.map_or(drain_wall.as_secs_f64(), |ms| ms as f64 / 1e3);
    let per_delivery = hwm.saturating_sub(idle) as f64 / f64::from(prefetch);
    let mib = |bytes: u64| bytes as f64 / 1048576.0;
    let series: Vec<Value> = samples
        .iter()
        .map(|s| {
            json!([
                num(&s["t_ms"]),
                (mib(num(&s["rss_bytes"])) * 10.0).round() / 10.0
            ])
        })
        .collect();
    Ok(json!({
        "connections": connections,
        "rss_idle_bytes": idle,
        "rss_full_window_bytes": result["full"]["rss_bytes"],
        "in_flight_at_full_window": result["full"]["in_flight"],
        "rss_peak_sampled_bytes": max_of("rss_bytes"),
        "vmhwm_bytes": result["exit"]["hwm_bytes"],
        "hwm_bytes": hwm,
        "rss_settled_bytes": result["settled"]["rss_bytes"],
        "heap_idle_bytes": result["idle"]["heap_live_bytes"],
        "heap_full_window_bytes": result["full"]["heap_live_bytes"],
        "heap_peak_sampled_bytes": max_of("heap_live_bytes"),
        "heap_settled_bytes": result["settled"]["heap_live_bytes"],
        "bound_bytes": bound,
        "peak_over_bound": hwm as f64 / bound as f64,
        "peak_above_idle_per_window_delivery": per_delivery,
        "met": hwm <= bound,
        "drain_s": drain_s,
        "msgs_per_s": n as f64 / drain_s,
        "published_body_bytes": published,
        "frame_max": frame_max,
        "handler_calls": result["tally"]["calls"],
        "report": result["report"],
        "evidence": evidence,
        "rss_mib_series": series,
    }))
}

/// The child's part of a run, up to its `RESULT`: returns it with the published bytes,
/// `frame_max` and the wall time of the drain.
fn drive(
    b: &Bench,
    child: &mut Child,
    queue: &str,
    topology: &lily::topology::Topology,
    n: usize,
    limits: &Limits,
) -> Result<(Value, u64, u64, Duration), String> {
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let mut lines = Lines::new(child)?;
    lines.wait("IDLE", Duration::from_secs(90))?;
    let publish_started = Instant::now();
    let (published, frame_max) = b.rt.block_on(publish(&b.url, queue, n, limits))?;
    eprintln!(
        "cost: hostile: {n} messages ({:.0} MiB of bodies) published in {:.1} s",
        published as f64 / 1048576.0,
        publish_started.elapsed().as_secs_f64()
    );
    tell(&mut stdin, "GO")?;
    let full = lines.wait("FULL", Duration::from_secs(300))?;
    eprintln!(
        "cost: hostile: window full ({} in flight, RSS {:.1} MiB); draining",
        full["in_flight"],
        num(&full["rss_bytes"]) as f64 / 1048576.0
    );
    let started = Instant::now();
    let client = b.rt.block_on(Client::connect(&b.url));
    let mut lanes = vec![topology.queue().to_owned()];
    lanes.extend(topology.buckets().map(|(name, _)| name.to_owned()));
    let mut quiet_since: Option<Instant> = None;
    let mut last_handled = None;
    loop {
        std::thread::sleep(SAMPLE_EVERY);
        let latest = lines.latest()?.clone();
        let depth: u64 = b.rt.block_on(async {
            let mut depth = 0;
            for lane in &lanes {
                depth += u64::from(client.depth(lane).await);
            }
            depth
        });
        let handled = num(&latest["handled"]);
        let quiet =
            depth == 0 && latest["in_flight"].as_u64() == Some(0) && last_handled == Some(handled);
        last_handled = Some(handled);
        if quiet {
            if quiet_since.get_or_insert_with(Instant::now).elapsed() >= QUIET {
                break;
            }
        } else {
            quiet_since = None;
        }
        if started.elapsed() > Duration::from_secs(900) {
            return Err(format!(
                "the run did not settle within 900 s (depth {depth}, latest {latest})"
            ));
        }
    }
    let drain_wall = quiet_since.map_or(started.elapsed(), |q| q - started);
    tell(&mut stdin, "STOP")?;
    let result = lines.wait("RESULT", Duration::from_secs(120))?;
    Ok((result, published, frame_max, drain_wall))
}

/// The hostile-load measurement: Lily and raw lapin side by side, judged against the bound.
pub(super) fn measure(b: &Bench) -> Result<Value, String> {
    let started = Instant::now();
    let n = b.options.hostile_n;
    let prefetch = b.options.hostile_prefetch;
    let copies = b.options.hostile_copies;
    if n < 2 * usize::from(prefetch) {
        return Err(format!(
            "--hostile-n {n} cannot fill a window of {prefetch} and keep the queue full: give at \
             least twice the prefetch"
        ));
    }
    let limits = limits();
    let mut mix: BTreeMap<&str, usize> = BTreeMap::new();
    for i in 0..n {
        *mix.entry(Class::of(i, n).name()).or_default() += 1;
    }
    let mix: serde_json::Map<String, Value> = CLASSES
        .iter()
        .filter_map(|c| Some((c.name().to_owned(), json!(mix.get(c.name())?))))
        .collect();
    let mut out = serde_json::Map::new();
    let mut fail = Vec::new();
    for who in [Contender::Lily, Contender::Raw] {
        eprintln!("cost: hostile: {}", who.name());
        let r = run(b, who, prefetch, n)?;
        let e = &r["evidence"];
        for (key, what) in [
            ("missing_count", "missing"),
            ("unsettled", "left unsettled in a queue"),
        ] {
            if num(&e[key]) > 0 {
                fail.push(format!("{}: {} messages {what}", who.name(), e[key]));
            }
        }
        if who == Contender::Lily && r["met"] != json!(true) {
            fail.push(format!(
                "lily: peak RSS {} bytes over the bound of {} bytes",
                r["hwm_bytes"], r["bound_bytes"]
            ));
        }
        let mib = |key: &str| num(&r[key]) as f64 / 1048576.0;
        eprintln!(
            "cost: hostile {}: idle {:.1} MiB, full window {:.1} MiB, peak (VmHWM) {:.1} MiB, \
             bound {:.1} MiB ({:.2} of it), {:.0} msg/s, settled {}/{n}, unexpected {}",
            who.name(),
            mib("rss_idle_bytes"),
            mib("rss_full_window_bytes"),
            mib("hwm_bytes"),
            mib("bound_bytes"),
            r["peak_over_bound"].as_f64().unwrap_or(f64::NAN),
            r["msgs_per_s"].as_f64().unwrap_or(f64::NAN),
            e["settled"],
            e["unexpected"],
        );
        out.insert(who.name().into(), r);
    }
    let ratio = |key: &str| num(&out["lily"][key]) as f64 / (num(&out["raw"][key]) as f64).max(1.0);
    let above_idle = |who: &str| {
        num(&out[who]["hwm_bytes"]).saturating_sub(num(&out[who]["rss_idle_bytes"])) as f64
    };
    let side_by_side = json!({
        "peak": ratio("hwm_bytes"),
        "peak_above_idle": above_idle("lily") / above_idle("raw").max(1.0),
        "throughput": out["lily"]["msgs_per_s"].as_f64().unwrap_or(f64::NAN)
            / out["raw"]["msgs_per_s"].as_f64().unwrap_or(f64::NAN),
    });
    for reason in &fail {
        eprintln!("cost: hostile FAIL: {reason}");
    }
    Ok(json!({
        "method": format!(
            "child process per contender, multi-thread runtime, prefetch = concurrency = \
             {prefetch}, classic queue; {n} persistent messages published (confirms) while the \
             child holds its window, then drained at full speed from a full queue; VmRSS and \
             live heap sampled every {} ms, the peak is VmHWM; every id checked from outside \
             by draining the work queue, retry bucket, parking lane and DLQ with basic.get, \
             beside the handler's record of its successes",
            SAMPLE_EVERY.as_millis()
        ),
        "n": n,
        "prefetch": prefetch,
        "limits": {
            "max_body_bytes": limits.max_body_bytes,
            "max_headers": limits.max_headers,
            "max_header_key_len": limits.max_header_key_len,
            "max_header_value_len": limits.max_header_value_len,
            "max_header_depth": limits.max_header_depth,
            "max_header_bytes": limits.max_header_bytes,
        },
        "message": format!(
            "JSON body of max_body_bytes - {} bytes; {} headers (one key of {} bytes, {} values \
             of {} bytes) whose keys and values total max_header_bytes - {}; per hundred: 1 body \
             one byte over, 4 headers just over one bound (count, value length, total bytes, \
             depth), 5 failing permanently, 5 failing retryably once (first fifth only)",
            messages::BODY_MARGIN,
            limits.max_headers - 1,
            limits.max_header_key_len - 1,
            3,
            limits.max_header_value_len - 6,
            messages::HEADER_MARGIN,
        ),
        "mix": mix,
        "message_budget_bytes": message_budget(&limits),
        "copies": copies,
        "bound_formula": format!(
            "idle RSS + connections x {LAPIN_FRAME_BUFFERS} x frame_max + prefetch x {copies} x \
             (max_body_bytes + max_header_bytes)"
        ),
        "lily": out["lily"],
        "raw": out["raw"],
        "lily_over_raw": side_by_side,
        "met": fail.is_empty(),
        "fail": fail,
        "elapsed_s": started.elapsed().as_secs_f64(),
    }))
}
