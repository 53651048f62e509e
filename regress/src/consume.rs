//! The measured children: a consumer that drains `n` orders from the peer and exits. Both run on
//! tokio's current-thread runtime, so a run's instructions do not depend on which worker thread
//! picked up a task. Handled messages are counted in a static and Lily's child waits on a static
//! `Notify`, so the wait adds no work a message.

use std::future::{Future as _, poll_fn};
use std::hint::black_box;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_core::Stream;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use lily::prelude::{Consumer, ConsumerConfig, Json, QueueHandlerError, Router, Shutdown, Trigger};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

/// Prefetch of both consumers, and the concurrency of Lily's.
pub const PREFETCH: u16 = 50;

/// The queue the gate's children consume from (the peer serves any name).
const QUEUE: &str = "orders";

/// Which consumer a child runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Who {
    /// A hand-written lapin consumer that deserializes each order and ACKs it the way Lily
    /// does (the frame queued on the channel, its write not awaited).
    Raw,
    /// Lily's `Consumer` with a `Json<Order>` handler.
    Lily,
}

impl Who {
    /// How reports name it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Raw => "raw",
            Self::Lily => "Lily",
        }
    }
}

/// What each message carries: a 512-byte JSON order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Order {
    /// `order-000000001`.
    pub order_id: String,
    /// `SKU-42`.
    pub sku: String,
    /// 3.
    pub quantity: u32,
    /// Filler that makes the body 512 bytes.
    pub note: String,
}

impl Order {
    /// A 512-byte JSON body.
    pub fn body() -> Vec<u8> {
        let mut order = Self {
            order_id: "order-000000001".into(),
            sku: "SKU-42".into(),
            quantity: 3,
            note: String::new(),
        };
        let bare = serde_json::to_vec(&order).expect("an order encodes").len();
        order.note = "x".repeat(512 - bare);
        let body = serde_json::to_vec(&order).expect("an order encodes");
        assert_eq!(body.len(), 512);
        body
    }
}

static HANDLED: AtomicU64 = AtomicU64::new(0);
static TARGET: AtomicU64 = AtomicU64::new(u64::MAX);
static DONE: Notify = Notify::const_new();

fn count() {
    if HANDLED.fetch_add(1, Ordering::Relaxed) + 1 == TARGET.load(Ordering::Relaxed) {
        DONE.notify_one();
    }
}

/// Orders handled so far in this process.
pub fn handled() -> u64 {
    HANDLED.load(Ordering::Relaxed)
}

/// Drains `n` orders from the peer at `url` with `who` on a current-thread runtime, then
/// closes.
///
/// # Errors
/// What went wrong, in words.
pub fn run(who: Who, n: u64, url: &str) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|err| format!("tokio runtime: {err}"))?;
    runtime.block_on(drain(who, url, QUEUE, n))
}

/// Drains `n` orders from `queue` at `url` with `who`, then closes: Lily's consumer through
/// its shutdown (its report must be clean), the hand-written one after a `basic.qos` round trip
/// has proved its ACKs arrived.
///
/// # Errors
/// What went wrong, in words.
pub async fn drain(who: Who, url: &str, queue: &str, n: u64) -> Result<(), String> {
    TARGET.store(HANDLED.load(Ordering::Relaxed) + n, Ordering::Relaxed);
    match who {
        Who::Raw => raw(url, queue, n).await,
        Who::Lily => lily(url, queue, n).await,
    }
}

/// Queues an ACK of `tag` on `channel` (one poll of `basic_ack`) without awaiting its write, as
/// Lily settles; a later `basic.qos` round trip proves it.
///
/// # Errors
/// The channel refused the frame.
pub fn queue_ack(channel: &Channel, tag: u64) -> lapin::Result<()> {
    let ack = pin!(channel.basic_ack(tag, BasicAckOptions::default()));
    match ack.poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Err(err)) => Err(err),
        _ => Ok(()),
    }
}

async fn place(Json(order): Json<Order>) -> Result<(), QueueHandlerError> {
    black_box(&order);
    count();
    Ok(())
}

async fn lily(url: &str, queue: &str, n: u64) -> Result<(), String> {
    let router = Router::new().route("order.placed", place);
    let config = ConsumerConfig::new(queue)
        .prefetch(PREFETCH)
        .concurrency(usize::from(PREFETCH));
    let consumer = Consumer::new(url, config, router);
    let (stats, shutdown) = (consumer.stats(), Shutdown::default());
    let mut task = tokio::spawn(consumer.run(shutdown.clone()));
    tokio::select! {
        () = DONE.notified() => {}
        ended = &mut task => {
            return Err(format!("Lily's consumer ended before the last order: {ended:?}"));
        }
    }
    // The last handler returned; its ACK follows within microseconds.
    while stats.totals().acked < n {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    shutdown.trigger(Trigger::Api);
    let report = task
        .await
        .map_err(|err| format!("Lily's consumer task: {err}"))?
        .map_err(|err| format!("Lily's consumer failed: {err}"))?;
    if report.totals.acked != n || !report.clean {
        return Err(format!(
            "expected {n} clean ACKs; the report says {:?} (clean: {})",
            report.totals, report.clean
        ));
    }
    Ok(())
}

/// `what: err`, for `map_err` on lapin's results.
pub fn failed(what: &'static str) -> impl Fn(lapin::Error) -> String {
    move |err| format!("{what}: {err}")
}

/// Connects, sets `basic.qos(prefetch)` and starts consuming `queue` (with `no_ack` if asked).
///
/// # Errors
/// Which step lapin failed, and why.
pub async fn open(
    url: &str,
    queue: &str,
    prefetch: u16,
    no_ack: bool,
) -> Result<(Connection, Channel, lapin::Consumer), String> {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(failed("connect"))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(failed("channel"))?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await
        .map_err(failed("basic.qos"))?;
    let options = BasicConsumeOptions {
        no_ack,
        ..BasicConsumeOptions::default()
    };
    let consumer = channel
        .basic_consume(queue.into(), "".into(), options, FieldTable::default())
        .await
        .map_err(failed("basic.consume"))?;
    Ok((connection, channel, consumer))
}

async fn raw(url: &str, queue: &str, n: u64) -> Result<(), String> {
    let (connection, channel, mut consumer) = open(url, queue, PREFETCH, false).await?;
    for _ in 0..n {
        let next = poll_fn(|cx| Pin::new(&mut consumer).poll_next(cx)).await;
        let delivery = next
            .ok_or("the consumer ended")?
            .map_err(failed("delivery"))?;
        let order: Order =
            serde_json::from_slice(&delivery.data).map_err(|err| format!("json: {err}"))?;
        black_box(&order);
        // Counted without the notice Lily's child waits for: a notice nobody awaits would stay
        // stored and end the wait of a Lily consumer run after it in the same process.
        HANDLED.fetch_add(1, Ordering::Relaxed);
        queue_ack(&channel, delivery.delivery_tag).map_err(failed("ack"))?;
    }
    // A `basic.qos` round trip proves the ACKs arrived, as Lily's shutdown does.
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await
        .map_err(failed("basic.qos"))?;
    let _ = channel.close(200, "done".into()).await;
    let _ = connection.close(200, "done".into()).await;
    Ok(())
}
