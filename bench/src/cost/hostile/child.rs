//! The children `hostile-lily PREFETCH N QUEUE` and `hostile-raw PREFETCH N QUEUE`, on the
//! multi-thread runtime. The parent talks to them over stdin and stdout:
//!
//! 1. the child consumes the empty queue, samples itself and prints `IDLE {sample}`;
//! 2. the parent publishes the `N` messages and writes `GO`; until then the child holds what it
//!    receives (Lily's handlers wait on a gate before decoding; raw keeps the deliveries
//!    unacked), so the window is full: `PREFETCH` deliveries of messages just under the limits;
//! 3. once `PREFETCH` are held the child samples again, prints `FULL {sample}` and opens the
//!    gate: from then on messages flow at full speed, the queue still holding the rest;
//! 4. every [`SAMPLE_EVERY`] a sampler thread prints `SAMPLE {…}` (RSS, live heap, in flight,
//!    handled), which the parent reads to see when the run is over;
//! 5. on `STOP` the child samples once more (settled, still connected), shuts down and prints
//!    `RESULT {…}` with every sample and what its handler saw, by message index.
//!
//! Lily's handler takes `Meta` and the tally (`State`), waits on the gate, decodes the body
//! (`serde_json`, the [`Load`] with its ~64 KiB string) and checks its id, then fails or succeeds
//! by the message's class. The raw contender is a hand-written lapin consumer at the same
//! prefetch that decodes every delivery the same way and queues its ACK; it has no gate, so it
//! acks the messages Lily refuses too.

use std::future::poll_fn;
use std::io::BufRead as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_core::Stream;
use lapin::options::BasicQosOptions;
use lily::prelude::{
    Consumer, ConsumerConfig, HandlerResult, Meta, QueueHandlerError, Router, Shutdown, State,
    Trigger,
};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::messages::{Class, KIND, Load, index};
use super::{SAMPLE_EVERY, limits, policy};
use crate::broker_url;
use crate::cost::Contender;
use crate::cost::consume::queue_ack;
use crate::cost::memory::{SETTLE, announce, sample, wait_for};

/// What the handler saw, by message index: the application's record, which the parent checks
/// against the queues (Lily's own counters are not the evidence).
struct Tally {
    /// Opened on `GO`, once the window is full.
    gate: CancellationToken,
    /// Successful handler calls per message.
    ok: Vec<AtomicU32>,
    /// The attempt of the latest success per message.
    attempt: Vec<AtomicU32>,
    /// Successful handler calls in all.
    handled: AtomicU64,
    /// Handler calls in all, failures included.
    calls: AtomicU64,
}

impl Tally {
    fn new(n: usize) -> Self {
        Self {
            gate: CancellationToken::new(),
            ok: (0..n).map(|_| AtomicU32::new(0)).collect(),
            attempt: (0..n).map(|_| AtomicU32::new(0)).collect(),
            handled: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        }
    }

    fn success(&self, i: usize, attempt: u32) {
        if let (Some(ok), Some(at)) = (self.ok.get(i), self.attempt.get(i)) {
            ok.fetch_add(1, Ordering::Relaxed);
            at.store(attempt, Ordering::Relaxed);
        }
        self.handled.fetch_add(1, Ordering::Relaxed);
    }

    fn record(&self) -> Value {
        let read =
            |v: &[AtomicU32]| -> Vec<u32> { v.iter().map(|a| a.load(Ordering::Relaxed)).collect() };
        json!({
            "ok": read(&self.ok),
            "attempt": read(&self.attempt),
            "handled": self.handled.load(Ordering::Relaxed),
            "calls": self.calls.load(Ordering::Relaxed),
        })
    }
}

/// Decodes the body and checks it belongs to the delivery: the real but cheap work.
fn decode(message_id: &str, body: &[u8]) -> Result<usize, &'static str> {
    let load: Load = serde_json::from_slice(body).map_err(|_| "undecodable body")?;
    if load.id != message_id || load.pad.is_empty() {
        return Err("body of another message");
    }
    index(message_id).ok_or("message id without an index")
}

async fn handle(meta: Meta, State(tally): State<Arc<Tally>>) -> HandlerResult {
    tally.gate.cancelled().await;
    tally.calls.fetch_add(1, Ordering::Relaxed);
    let i = decode(meta.message_id(), meta.body()).map_err(QueueHandlerError::permanent)?;
    match Class::of(i, tally.ok.len()) {
        Class::Permanent => Err(QueueHandlerError::permanent("hostile load: permanent")),
        Class::Retried if meta.attempt() == 1 => {
            Err(QueueHandlerError::retryable("hostile load: retry once"))
        }
        _ => {
            tally.success(i, meta.attempt());
            Ok(())
        }
    }
}

/// The parent's commands, read from stdin on a thread of their own.
fn commands() -> mpsc::UnboundedReceiver<String> {
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            if tx.send(line.trim().to_owned()).is_err() {
                break;
            }
        }
    });
    rx
}

async fn expect(commands: &mut mpsc::UnboundedReceiver<String>, what: &str) -> Result<(), String> {
    match tokio::time::timeout(Duration::from_secs(900), commands.recv()).await {
        Ok(Some(line)) if line == what => Ok(()),
        Ok(Some(line)) => Err(format!("expected {what}, the parent wrote {line:?}")),
        Ok(None) => Err(format!("stdin closed before {what}")),
        Err(_) => Err(format!("no {what} within 900 s")),
    }
}

/// Samples the process every [`SAMPLE_EVERY`] on a thread of its own (a busy runtime cannot
/// delay it) and prints each as `SAMPLE {…}`.
struct Sampler {
    started: Instant,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Value>>,
}

impl Sampler {
    /// `probe` tells deliveries in flight and messages handled so far.
    fn start(probe: impl Fn() -> (usize, u64) + Send + 'static) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let started = Instant::now();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !stopped.load(Ordering::Relaxed) {
                let mut s = sample();
                s["t_ms"] = json!(started.elapsed().as_millis() as u64);
                let (in_flight, handled) = probe();
                s["in_flight"] = json!(in_flight);
                s["handled"] = json!(handled);
                announce("SAMPLE", &s);
                samples.push(s);
                std::thread::sleep(SAMPLE_EVERY);
            }
            samples
        });
        Self {
            started,
            stop,
            thread,
        }
    }

    /// `sample()` stamped with the sampler's clock and `in_flight`.
    fn stamped(&self, in_flight: usize) -> Value {
        let mut s = sample();
        s["t_ms"] = json!(self.started.elapsed().as_millis() as u64);
        s["in_flight"] = json!(in_flight);
        s
    }

    fn finish(self) -> Vec<Value> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

async fn lily(url: &str, queue: &str, prefetch: u16, n: usize) -> Result<Value, String> {
    let mut commands = commands();
    let tally = Arc::new(Tally::new(n));
    let router = Router::new()
        .route(KIND, handle)
        .with_state(Arc::clone(&tally));
    let config = ConsumerConfig::new(queue)
        .prefetch(prefetch)
        .concurrency(usize::from(prefetch))
        .limits(limits())
        .policy(policy())
        // The gated window waits for the whole publish: no timeout may fire meanwhile.
        .handler_timeout(Duration::from_secs(900));
    let consumer = Consumer::new(url, config, router);
    let stats = consumer.stats();
    let shutdown = Shutdown::default();
    let run = tokio::spawn(consumer.run(shutdown.clone()));
    wait_for("Lily to consume", Duration::from_secs(60), || {
        stats.ready() || run.is_finished()
    })
    .await?;
    if run.is_finished() {
        return Err("Lily's consumer stopped before consuming".into());
    }
    tokio::time::sleep(SETTLE).await;
    let idle = sample();
    let sampler = {
        let stats = stats.clone();
        let tally = Arc::clone(&tally);
        Sampler::start(move || (stats.in_flight(), tally.handled.load(Ordering::Relaxed)))
    };
    announce("IDLE", &idle);
    expect(&mut commands, "GO").await?;
    let window = usize::from(prefetch);
    wait_for("a full window", Duration::from_secs(300), || {
        stats.in_flight() >= window
    })
    .await
    .map_err(|e| format!("{e}: {} in flight of {window}", stats.in_flight()))?;
    let full = sampler.stamped(stats.in_flight());
    tally.gate.cancel();
    announce("FULL", &full);
    expect(&mut commands, "STOP").await?;
    let settled = sample();
    shutdown.trigger(Trigger::Api);
    let report = run
        .await
        .map_err(|e| format!("consumer task: {e}"))?
        .map_err(|e| format!("consumer: {e}"))?;
    let samples = sampler.finish();
    let last = sample();
    Ok(json!({
        "contender": Contender::Lily.name(),
        "idle": idle,
        "full": full,
        "settled": settled,
        "exit": last,
        "samples": samples,
        "tally": tally.record(),
        "report": {
            "clean": report.clean,
            "acked": report.totals.acked,
            "totals": format!("{:?}", report.totals),
        },
    }))
}

async fn raw(url: &str, queue: &str, prefetch: u16, n: usize) -> Result<Value, String> {
    let mut commands = commands();
    let e = |what: &'static str| move |err: lapin::Error| format!("{what}: {err}");
    let (connection, channel, mut consumer) = crate::raw::open(url, queue, prefetch, false).await?;
    let tally = Arc::new(Tally::new(n));
    let held_now = Arc::new(AtomicUsize::new(0));
    tokio::time::sleep(SETTLE).await;
    let idle = sample();
    let sampler = {
        let held_now = Arc::clone(&held_now);
        let tally = Arc::clone(&tally);
        Sampler::start(move || {
            (
                held_now.load(Ordering::Relaxed),
                tally.handled.load(Ordering::Relaxed),
            )
        })
    };
    announce("IDLE", &idle);
    let window = usize::from(prefetch);
    let mut held = Vec::with_capacity(window);
    let (mut go, mut open, mut stop) = (false, false, false);
    let mut full = Value::Null;
    let mut settled = Value::Null;
    let process = |delivery: lapin::message::Delivery| -> Result<(), String> {
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map_or("", |s| s.as_str());
        let i = decode(id, &delivery.data)?;
        tally.success(i, 1);
        queue_ack(&channel, delivery.delivery_tag).map_err(e("ack"))
    };
    while !stop {
        tokio::select! {
            command = commands.recv() => match command.as_deref() {
                Some("GO") => go = true,
                Some("STOP") => {
                    settled = sample();
                    stop = true;
                }
                other => return Err(format!("unexpected command {other:?}")),
            },
            next = poll_fn(|cx| std::pin::Pin::new(&mut consumer).poll_next(cx)) => {
                let delivery = next.ok_or("the consumer ended")?.map_err(e("delivery"))?;
                if open {
                    process(delivery)?;
                } else {
                    held.push(delivery);
                    held_now.store(held.len(), Ordering::Relaxed);
                }
            }
        }
        if go && !open && held.len() >= window {
            full = sampler.stamped(held.len());
            announce("FULL", &full);
            open = true;
            for delivery in held.drain(..) {
                process(delivery)?;
            }
            held_now.store(0, Ordering::Relaxed);
        }
    }
    // A round trip proves the broker processed the ACKs.
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await
        .map_err(e("basic.qos"))?;
    let _ = channel.close(200, "done".into()).await;
    let _ = connection.close(200, "done".into()).await;
    let samples = sampler.finish();
    let last = sample();
    Ok(json!({
        "contender": Contender::Raw.name(),
        "idle": idle,
        "full": full,
        "settled": settled,
        "exit": last,
        "samples": samples,
        "tally": tally.record(),
    }))
}

/// Entry point of `hostile-raw` / `hostile-lily`: `PREFETCH N QUEUE`.
pub fn child(who: Contender, args: &[String]) -> Result<Value, String> {
    let usage = "usage: cost hostile-raw|hostile-lily PREFETCH N QUEUE";
    let prefetch: u16 = args.first().and_then(|a| a.parse().ok()).ok_or(usage)?;
    let n: usize = args.get(1).and_then(|a| a.parse().ok()).ok_or(usage)?;
    let queue = args.get(2).ok_or(usage)?;
    let url = broker_url();
    let rt = crate::cost::runtime(true);
    rt.block_on(async {
        match who {
            Contender::Raw => raw(&url, queue, prefetch, n).await,
            Contender::Lily => lily(&url, queue, prefetch, n).await,
        }
    })
}
