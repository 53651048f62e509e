//! The hand-written lapin contenders: what a user writes without a framework. One consume
//! loop for the success path ([`Settle`]); the handoff path pipelined ([`handoff`], also the
//! storm's) or batched ([`handoff_batch`]), the copies with Lily's failure headers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt as _;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicNackOptions, BasicPublishOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, PublisherConfirm};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::Order;
use crate::run::{FAILURE_REASON, FirstDelivery, STORM_REASON, Sample, run_limit};
use lily::headers as h;

/// A retry copy's publish: returned, not dropped, when unroutable.
pub const MANDATORY: BasicPublishOptions = BasicPublishOptions {
    mandatory: true,
    immediate: false,
};
/// A failed copy's original goes back to its queue.
pub const REQUEUE: BasicNackOptions = BasicNackOptions {
    multiple: false,
    requeue: true,
};

/// How the success-path loop settles each delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settle {
    /// `raw lapin`: one delivery after the other, each `ack().await`ed.
    Each,
    /// `raw-batch`: one `basic.ack` with `multiple` every `prefetch / 2` deliveries (awaited).
    Batch,
    /// `ceiling`: consumed with `no_ack`, nothing settled (the broker ignores the prefetch).
    NoAck,
}

/// `what: err`, and the connect-qos-consume opening, shared with the regression gate's
/// hand-written consumer.
pub use lily_mq_regress::consume::{failed, open};

/// A channel in confirm mode on `connection` (panics when the broker refuses it).
pub async fn confirm_channel(connection: &Connection) -> Channel {
    let confirms = connection.create_channel().await.expect("channel");
    let select = confirms.confirm_select(ConfirmSelectOptions::default());
    select.await.expect("confirm.select");
    confirms
}

/// The consumer's next delivery.
pub async fn next(consumer: &mut lapin::Consumer) -> Option<lapin::Result<Delivery>> {
    consumer.next().await
}

/// A contender's run: its consumer (and the channel and connection under it), the deliveries
/// received of `n`, when it started and when the first delivery reached its code.
struct Run {
    connection: Connection,
    channel: Channel,
    consumer: lapin::Consumer,
    received: u64,
    n: u64,
    started: Instant,
    first: FirstDelivery,
}

impl Run {
    /// Starts the clock and opens the consumer (panics when the broker cannot be reached).
    async fn open(url: &str, queue: &str, prefetch: u16, no_ack: bool, n: u64) -> Self {
        let started = Instant::now();
        let (connection, channel, consumer) =
            open(url, queue, prefetch, no_ack).await.expect("consume");
        Self {
            connection,
            channel,
            consumer,
            received: 0,
            n,
            started,
            first: FirstDelivery::new(),
        }
    }

    /// The next delivery while fewer than `n` were received: counted, the first one stamped.
    async fn take(&mut self) -> Option<Delivery> {
        if self.received >= self.n {
            return None;
        }
        let delivery = next(&mut self.consumer).await?.ok()?;
        self.first.get_or_init(Instant::now);
        self.received += 1;
        Some(delivery)
    }

    /// Stops the clock and closes; the sample of `settled` messages.
    async fn finish(self, settled: u64) -> Sample {
        let sample = Sample::new(settled, self.n, self.started.elapsed());
        let sample = sample.first_seen(self.started, &self.first);
        self.close().await;
        sample
    }

    /// Cancels the consumer and closes its channel and connection (and the channels beside).
    async fn close(self) {
        close(self.connection, self.channel, &self.consumer).await;
    }
}

/// Cancels `consumer`, then closes its channel and connection (errors ignored: the run is over).
pub async fn close(connection: Connection, channel: Channel, consumer: &lapin::Consumer) {
    let cancel = channel.basic_cancel(consumer.tag(), BasicCancelOptions::default());
    let _ = cancel.await;
    let _ = channel.close(200, "done".into()).await;
    let _ = connection.close(200, "done".into()).await;
}

/// Deserializes a delivery's order, as every contender does.
fn deserialize(delivery: &Delivery) {
    let order: Order = serde_json::from_slice(&delivery.data).expect("order");
    std::hint::black_box(order);
}

/// Consumes `n` messages on the success path, settling them as `settle` says (panics when the
/// broker cannot be reached, or an awaited ACK fails).
pub async fn success(url: &str, queue: &str, prefetch: u16, n: u64, settle: Settle) -> Sample {
    let mut run = Run::open(url, queue, prefetch, settle == Settle::NoAck, n).await;
    let batch = u64::from((prefetch / 2).max(1));
    let mut settled = 0;
    // One deadline for the whole run, not a timer a delivery: a timer armed at every wait is a
    // cost the simplest loop does not pay (raw-batch ran at 0.90 of it with one, 1.11 without).
    let drained = async {
        while let Some(delivery) = run.take().await {
            deserialize(&delivery);
            match settle {
                Settle::Each => {
                    let ack = delivery.acker.ack(BasicAckOptions::default());
                    ack.await.expect("ack");
                    settled += 1;
                }
                Settle::Batch if run.received - settled == batch || run.received == n => {
                    let multiple = BasicAckOptions { multiple: true };
                    let ack = run.channel.basic_ack(delivery.delivery_tag, multiple);
                    ack.await.expect("ack");
                    settled = run.received;
                }
                Settle::NoAck => settled += 1,
                Settle::Batch => {}
            }
        }
    };
    let _ = tokio::time::timeout(run_limit(n), drained).await;
    run.finish(settled).await
}

/// What the pipelined handoff counts.
#[derive(Debug, Default)]
pub struct Counters {
    /// Copies confirmed and originals ACKed.
    pub handoffs: AtomicU64,
    /// Copies not confirmed (original NACKed) or ACKs that failed.
    pub failed: AtomicU64,
}

/// The pipelined handoff of every delivery `run` takes until `stop` (when given) is cancelled,
/// each on a task of its own: deserializes it, publishes its retry copy to `bucket` (mandatory,
/// persistent, Lily's failure headers) on a confirm channel, awaits that copy's own confirm (a
/// returned copy fails), then ACKs; a failed copy's original is NACKed and requeued. Confirms
/// pipeline across the deliveries in flight (up to the prefetch). Then waits for the handoffs in
/// flight.
async fn hand_off_all(
    run: &mut Run,
    (queue, bucket): (&str, &str),
    reason: &'static str,
    counters: &Arc<Counters>,
    stop: Option<&CancellationToken>,
) {
    let confirms = confirm_channel(&run.connection).await;
    let (bucket, source): (ShortString, Arc<str>) = (bucket.into(), queue.into());
    let mut tasks = JoinSet::new();
    loop {
        let delivery = match stop {
            None => run.take().await,
            Some(stop) => tokio::select! {
                biased;
                () = stop.cancelled() => None,
                delivery = run.take() => delivery,
            },
        };
        let Some(delivery) = delivery else { break };
        let (confirms, bucket) = (confirms.clone(), bucket.clone());
        let (source, counters) = (Arc::clone(&source), Arc::clone(counters));
        tasks.spawn(async move {
            deserialize(&delivery);
            let properties = retry_properties(&delivery, &source, reason);
            let confirmed = async {
                let options = MANDATORY;
                let publish =
                    confirms.basic_publish("".into(), bucket, options, &delivery.data, properties);
                publish.await?.await
            };
            let done = if matches!(confirmed.await, Ok(Confirmation::Ack(None))) {
                let ack = delivery.acker.ack(BasicAckOptions::default());
                ack.await.is_ok_and(|written| written)
            } else {
                let _ = delivery.acker.nack(REQUEUE).await;
                false
            };
            let counter = if done {
                &counters.handoffs
            } else {
                &counters.failed
            };
            counter.fetch_add(1, Ordering::Relaxed);
        });
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
}

/// Consumes `n` messages, each failing once, handed off pipelined (`hand_off_all`).
pub async fn handoff(url: &str, queue: &str, bucket: &str, prefetch: u16, n: u64) -> Sample {
    let mut run = Run::open(url, queue, prefetch, false, n).await;
    let counters = Arc::<Counters>::default();
    // One deadline for the run, as on the success path.
    let consumed = hand_off_all(&mut run, (queue, bucket), FAILURE_REASON, &counters, None);
    let _ = tokio::time::timeout(run_limit(n), consumed).await;
    let sample = run.finish(counters.handoffs.load(Ordering::Relaxed)).await;
    let failed = counters.failed.load(Ordering::Relaxed);
    if failed > 0 {
        eprintln!("raw handoff: {failed} handoffs failed");
    }
    sample
}

/// Consumes `n` messages, each failing once, as a hand-tuned publisher batches confirms: the
/// loop publishes each retry copy (mandatory, persistent, Lily's failure headers) on one confirm
/// channel without waiting, and every `prefetch / 2` copies hands the batch to a settler. The
/// settler awaits the batch's confirms while the next batch is published; when all are acks and
/// none was returned it ACKs the originals with one `multiple` ACK, otherwise one by one (a failed
/// copy's original is NACKed and requeued).
pub async fn handoff_batch(url: &str, queue: &str, bucket: &str, prefetch: u16, n: u64) -> Sample {
    let mut run = Run::open(url, queue, prefetch, false, n).await;
    let confirms = confirm_channel(&run.connection).await;
    let batch = usize::from((prefetch / 2).max(1));
    let (batches, mut settle) = tokio::sync::mpsc::channel::<Vec<(u64, PublisherConfirm)>>(1);
    let settler = tokio::spawn({
        let channel = run.channel.clone();
        async move {
            let (mut settled, mut failed) = (0_u64, 0_u64);
            while let Some(batch) = settle.recv().await {
                let mut outcomes = Vec::with_capacity(batch.len());
                for (tag, confirm) in batch {
                    outcomes.push((tag, matches!(confirm.await, Ok(Confirmation::Ack(None)))));
                }
                let all_acked = outcomes.iter().all(|(_, ok)| *ok);
                if let Some(&(last, _)) = outcomes.last().filter(|_| all_acked) {
                    let multiple = BasicAckOptions { multiple: true };
                    if channel.basic_ack(last, multiple).await.is_ok() {
                        settled += outcomes.len() as u64;
                    }
                    continue;
                }
                for (tag, ok) in outcomes {
                    if ok
                        && channel
                            .basic_ack(tag, BasicAckOptions::default())
                            .await
                            .is_ok()
                    {
                        settled += 1;
                    } else {
                        failed += 1;
                        let _ = channel.basic_nack(tag, REQUEUE).await;
                    }
                }
            }
            (settled, failed)
        }
    });
    let bucket: ShortString = bucket.into();
    let mut pending = Vec::with_capacity(batch);
    let consumed = async {
        while let Some(delivery) = run.take().await {
            deserialize(&delivery);
            let properties = retry_properties(&delivery, queue, FAILURE_REASON);
            let (to, data) = (bucket.clone(), &delivery.data);
            let published = confirms.basic_publish("".into(), to, MANDATORY, data, properties);
            match published.await {
                Ok(confirm) => pending.push((delivery.delivery_tag, confirm)),
                Err(_) => {
                    let _ = delivery.acker.nack(REQUEUE).await;
                }
            }
            if (pending.len() == batch || run.received == n)
                && batches.send(std::mem::take(&mut pending)).await.is_err()
            {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(run_limit(n), consumed).await;
    drop(batches);
    let (settled, failed) = settler.await.unwrap_or((0, n));
    let sample = run.finish(settled).await;
    if failed > 0 {
        eprintln!("raw-batch handoff: {failed} handoffs failed");
    }
    sample
}

/// The storm: `hand_off_all` for every delivery until `stop` is cancelled; then lets the tasks in
/// flight finish, cancels the consumer and closes (panics when the broker cannot be reached or
/// refuses the consumer).
pub async fn storm(
    url: String,
    (queue, bucket): (String, String),
    prefetch: u16,
    counters: Arc<Counters>,
    stop: CancellationToken,
) {
    let mut run = Run::open(&url, &queue, prefetch, false, u64::MAX).await;
    let queues = (queue.as_str(), bucket.as_str());
    hand_off_all(&mut run, queues, STORM_REASON, &counters, Some(&stop)).await;
    run.close().await;
}

/// Properties of the retry copy of `delivery`, failed at its current attempt (the
/// `x-lily-attempt` header, 1 when absent): the attempt is bumped, the first failure time kept
/// when the delivery already carries one.
pub fn retry_properties(delivery: &Delivery, source_queue: &str, reason: &str) -> BasicProperties {
    let now = SystemTime::now().duration_since(UNIX_EPOCH);
    let now = now.map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let mut headers = delivery
        .properties
        .headers()
        .as_ref()
        .map(|t| t.inner().clone())
        .unwrap_or_default();
    let attempt = headers.get(h::ATTEMPT).and_then(h::as_u32).unwrap_or(1);
    let first = match headers.get(h::FIRST_FAILURE_AT) {
        Some(AMQPValue::LongLongInt(t)) => *t,
        _ => now,
    };
    let mut put = |k: &str, v: AMQPValue| {
        headers.insert(k.into(), v);
    };
    put(h::ATTEMPT, AMQPValue::LongUInt(attempt.saturating_add(1)));
    put(h::FIRST_FAILURE_AT, AMQPValue::LongLongInt(first));
    put(h::LAST_FAILURE_AT, AMQPValue::LongLongInt(now));
    put(h::FAILURE_KIND, long("retryable"));
    put(h::REASON, long(&format!("handler failed: {reason}")));
    put(h::SOURCE_QUEUE, long(source_queue));
    put(h::ORIGINAL_EXCHANGE, long(delivery.exchange.as_str()));
    put(h::ORIGINAL_ROUTING_KEY, long(delivery.routing_key.as_str()));
    delivery
        .properties
        .clone()
        .with_headers(FieldTable::from(headers))
        .with_delivery_mode(2)
}

fn long(text: &str) -> AMQPValue {
    AMQPValue::LongString(text.into())
}
