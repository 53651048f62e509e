//! The `hostile` child, Lily or raw lapin at the same prefetch: it prints `IDLE` once consuming,
//! holds what it receives until the parent writes `GO` and the window is full (`FULL`), then
//! drains at full speed; on `STOP` it shuts down and prints `RESULT`: its memory and what its
//! handler saw, by message index (the application's record, checked against the queues). Both
//! decode every body and check its id; Lily then fails or succeeds by the message's class, raw,
//! with no gate, ACKs every message. Method: `bench/README.md`.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use lily::prelude::{
    Consumer, ConsumerConfig, HandlerResult, Meta, QueueHandlerError, Router, State,
};
use lily_mq_regress::consume::{Who, queue_ack};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::messages::{Class, KIND, Load, index};
use super::{N, PREFETCH, limits, policy};
use crate::cost::memory::{Mem, idle, wait_for};
use crate::cost::{close_raw, failed};
use crate::run::Lily;

/// What the child reports.
#[derive(Debug, Serialize, Deserialize)]
pub struct Report {
    pub idle_rss_bytes: u64,
    /// The peak: `VmHWM` at exit, or the `VmRSS` sampled with the window full or once drained
    /// (still connected), where the kernel's lazily folded counters put that a few pages higher.
    pub peak_rss_bytes: u64,
    /// Successful handler calls per message, and the attempt of the latest.
    pub ok: Vec<u32>,
    pub attempt: Vec<u32>,
    /// Seconds from the window's opening to the last handler call.
    pub drain_secs: f64,
}

/// What the handler saw, by message index.
#[derive(Default)]
struct Tally {
    /// Opened once the window is full.
    gate: CancellationToken,
    opened: OnceLock<Instant>,
    ok: Vec<AtomicU32>,
    attempt: Vec<AtomicU32>,
    /// µs from the opening to the latest handler call.
    last_us: AtomicU64,
}

impl Tally {
    fn new(n: usize) -> Self {
        let zeros = || (0..n).map(|_| AtomicU32::new(0)).collect();
        let (ok, attempt) = (zeros(), zeros());
        Self {
            ok,
            attempt,
            ..Self::default()
        }
    }

    fn open(&self) {
        self.opened.get_or_init(Instant::now);
        self.gate.cancel();
    }

    /// Decodes the body, checks it belongs to the delivery and records the call: the message's
    /// index.
    fn call(&self, message_id: &str, body: &[u8]) -> Result<usize, &'static str> {
        let elapsed = self.opened.get().map_or(0, |at| at.elapsed().as_micros());
        let elapsed = u64::try_from(elapsed).unwrap_or(u64::MAX);
        self.last_us.fetch_max(elapsed, Ordering::Relaxed);
        let load: Load = serde_json::from_slice(body).map_err(|_| "undecodable body")?;
        if load.id != message_id || load.pad.is_empty() {
            return Err("body of another message");
        }
        index(message_id)
            .filter(|&i| i < self.ok.len())
            .ok_or("message id without an index")
    }

    fn success(&self, i: usize, attempt: u32) {
        self.ok[i].fetch_add(1, Ordering::Relaxed);
        self.attempt[i].store(attempt, Ordering::Relaxed);
    }

    fn report(&self, idle: Mem, full: Mem, settled: Mem) -> Report {
        let read = |v: &[AtomicU32]| v.iter().map(|a| a.load(Ordering::Relaxed)).collect();
        #[allow(clippy::cast_precision_loss)]
        let drain_secs = self.last_us.load(Ordering::Relaxed) as f64 / 1e6;
        let samples = [Mem::now().hwm_bytes, full.rss_bytes, settled.rss_bytes];
        Report {
            idle_rss_bytes: idle.rss_bytes,
            peak_rss_bytes: samples.into_iter().max().unwrap_or(0),
            ok: read(&self.ok),
            attempt: read(&self.attempt),
            drain_secs,
        }
    }
}

async fn handle(meta: Meta, State(tally): State<Arc<Tally>>) -> HandlerResult {
    tally.gate.cancelled().await;
    let i = tally
        .call(meta.message_id(), meta.body())
        .map_err(QueueHandlerError::permanent)?;
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
        for line in std::io::stdin().lines().map_while(Result::ok) {
            let _ = tx.send(line.trim().to_owned());
        }
    });
    rx
}

async fn expect(commands: &mut mpsc::UnboundedReceiver<String>, what: &str) -> Result<(), String> {
    match tokio::time::timeout(Duration::from_secs(900), commands.recv()).await {
        Ok(Some(line)) if line == what => Ok(()),
        other => Err(format!("expected {what} from the parent, got {other:?}")),
    }
}

async fn lily(url: &str, queue: &str) -> Result<Report, String> {
    let mut commands = commands();
    let tally = Arc::new(Tally::new(N));
    let router = Router::new()
        .route(KIND, handle)
        .with_state(Arc::clone(&tally));
    let window = usize::from(PREFETCH);
    // The gated window waits for the whole publish: no timeout may fire meanwhile.
    let config = ConsumerConfig::new(queue)
        .prefetch(PREFETCH)
        .concurrency(window)
        .limits(limits())
        .policy(policy())
        .handler_timeout(Duration::from_secs(900));
    let lily = Lily::ready(Consumer::new(url, config, router)).await?;
    let idle = idle().await;
    expect(&mut commands, "GO").await?;
    let full = || lily.stats.in_flight() >= window;
    wait_for("a full window", Duration::from_secs(300), full).await?;
    let full = Mem::now();
    tally.open();
    println!("FULL");
    expect(&mut commands, "STOP").await?;
    let settled = || lily.stats.in_flight() == 0;
    wait_for("the last deliveries", Duration::from_secs(60), settled).await?;
    let settled = Mem::now();
    lily.stop().await?;
    Ok(tally.report(idle, full, settled))
}

async fn raw(url: &str, queue: &str) -> Result<Report, String> {
    let mut commands = commands();
    let (connection, channel, mut consumer) = crate::raw::open(url, queue, PREFETCH, false).await?;
    let tally = Tally::new(N);
    let idle = idle().await;
    let window = usize::from(PREFETCH);
    let (mut held, mut go, mut full, mut settled) = (Vec::with_capacity(window), false, None, None);
    let process = |delivery: lapin::message::Delivery| -> Result<(), String> {
        let id = delivery.properties.message_id().as_ref();
        let id = id.map_or("", |s| s.as_str());
        tally.success(tally.call(id, &delivery.data)?, 1);
        queue_ack(&channel, delivery.delivery_tag).map_err(failed("ack"))
    };
    while settled.is_none() {
        tokio::select! {
            command = commands.recv() => match command.as_deref() {
                Some("GO") => go = true,
                Some("STOP") => settled = Some(Mem::now()),
                other => return Err(format!("unexpected command {other:?}")),
            },
            next = crate::raw::next(&mut consumer) => {
                let delivery = next.ok_or("the consumer ended")?.map_err(failed("delivery"))?;
                if full.is_some() {
                    process(delivery)?;
                } else {
                    held.push(delivery);
                }
            }
        }
        if go && full.is_none() && held.len() >= window {
            full = Some(Mem::now());
            tally.open();
            println!("FULL");
            held.drain(..).try_for_each(process)?;
        }
    }
    close_raw(connection, channel, PREFETCH).await?;
    Ok(tally.report(idle, full.unwrap_or_default(), settled.unwrap_or_default()))
}

/// The `hostile` child.
pub fn child(who: Who, url: &str, queue: &str) -> Result<Report, String> {
    crate::runtime(true).block_on(async {
        match who {
            Who::Raw => raw(url, queue).await,
            Who::Lily => lily(url, queue).await,
        }
    })
}
