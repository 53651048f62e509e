//! `raw-batch`: a raw lapin consumer as an expert tunes it for throughput. One loop on one
//! channel; each delivery is deserialized and joins the open batch, which is flushed at
//! `max(1, prefetch / 2)` deliveries or as soon as no further delivery is ready. A flush is one
//! `multiple` ACK; on the handoff path each copy is published at once (mandatory, persistent,
//! Lily's failure headers) and a flush first awaits the batch's confirms (a failed copy's
//! original is NACKed with requeue, the others ACKed singly). Method: `bench/README.md`.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use futures_core::Stream;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicCancelOptions};
use lapin::types::ShortString;
use lapin::{Acker, Channel, Confirmation, Connection, PublisherConfirm};
use tokio_util::sync::CancellationToken;

use crate::Order;
use crate::latency::timer::Sinks;
use crate::raw::{MANDATORY, REQUEUE, confirm_channel, next, retry_properties};
use crate::run::FAILURE_REASON;

/// Counters a run reads while `raw-batch` consumes.
#[derive(Debug, Default)]
pub struct Counters {
    /// Deliveries whose ACK completed.
    pub settled: AtomicU64,
    /// Deliveries NACKed (their copy failed) or whose ACK failed.
    pub failed: AtomicU64,
}

/// An open `raw-batch` consumer, recording settlements and copies in its [`Sinks`].
pub struct RawBatch {
    connection: Connection,
    channel: Channel,
    consumer: lapin::Consumer,
    /// The confirm channel and the bucket, on the handoff path.
    handoff: Option<(Channel, ShortString)>,
    queue: String,
    threshold: usize,
    sinks: Sinks,
    pub counters: Arc<Counters>,
}

struct Pending {
    acker: Acker,
    /// When the message was published: its latency's start.
    received: Instant,
    /// The copy's confirm (handoff path) and when its publish was written.
    confirm: Option<(PublisherConfirm, Instant)>,
    /// Whether the copy, if any, was published (and, once the flush awaited it, confirmed).
    copied: bool,
}

impl RawBatch {
    /// Connects and starts consuming `queue`; with `bucket`, every delivery is handed off there.
    ///
    /// # Panics
    /// When the broker cannot be reached or refuses the consumer.
    pub async fn open(
        url: &str,
        queue: &str,
        bucket: Option<&str>,
        prefetch: u16,
        sinks: Sinks,
    ) -> Self {
        let (connection, channel, consumer) = crate::raw::open(url, queue, prefetch, false)
            .await
            .unwrap_or_else(|err| panic!("{err}"));
        let handoff = match bucket {
            Some(bucket) => Some((confirm_channel(&connection).await, bucket.into())),
            None => None,
        };
        Self {
            connection,
            channel,
            consumer,
            handoff,
            queue: queue.to_owned(),
            threshold: usize::from((prefetch / 2).max(1)),
            sinks,
            counters: Arc::default(),
        }
    }

    /// Consumes until `stop` is cancelled (checked whenever no batch is open); then cancels the
    /// consumer and closes.
    pub async fn run(mut self, stop: CancellationToken) {
        let mut batch: Vec<Pending> = Vec::with_capacity(self.threshold);
        loop {
            let next = if batch.is_empty() {
                tokio::select! {
                    biased;
                    () = stop.cancelled() => break,
                    next = next(&mut self.consumer) => next,
                }
            } else {
                match ready_now(&mut self.consumer) {
                    Poll::Ready(next) => next,
                    Poll::Pending => {
                        self.flush(&mut batch).await;
                        continue;
                    }
                }
            };
            let Some(Ok(delivery)) = next else { break };
            batch.push(self.take(delivery).await);
            if batch.len() >= self.threshold {
                self.flush(&mut batch).await;
            }
        }
        self.flush(&mut batch).await;
        let _ = self
            .channel
            .basic_cancel(self.consumer.tag(), BasicCancelOptions::default())
            .await;
        let _ = self.connection.close(200, "done".into()).await;
    }

    /// Deserializes `delivery` and, on the handoff path, publishes its copy.
    async fn take(&self, delivery: Delivery) -> Pending {
        let id = delivery.properties.message_id().as_ref();
        let received = id.map_or_else(Instant::now, |id| self.sinks.settled.start_of(id.as_str()));
        let order: Order = serde_json::from_slice(&delivery.data).expect("order");
        std::hint::black_box(order);
        let (mut confirm, mut copied) = (None, true);
        if let Some((confirms, bucket)) = &self.handoff {
            let properties = retry_properties(&delivery, &self.queue, FAILURE_REASON);
            let publish = confirms.basic_publish(
                "".into(),
                bucket.clone(),
                MANDATORY,
                &delivery.data,
                properties,
            );
            confirm = publish.await.ok().map(|confirm| (confirm, Instant::now()));
            copied = confirm.is_some();
        }
        Pending {
            acker: delivery.acker,
            received,
            confirm,
            copied,
        }
    }

    /// Settles the batch: one `multiple` ACK when every copy (if any) was confirmed.
    async fn flush(&self, batch: &mut Vec<Pending>) {
        for pending in batch.iter_mut() {
            if let Some((confirm, written)) = pending.confirm.take() {
                let confirmed = confirm.await;
                self.sinks.copies.push(written, Instant::now());
                pending.copied = matches!(confirmed, Ok(Confirmation::Ack(None)));
            }
        }
        let Counters { settled, failed } = &*self.counters;
        if let (true, Some(last)) = (batch.iter().all(|p| p.copied), batch.last()) {
            let multiple = BasicAckOptions { multiple: true };
            let acked = last.acker.ack(multiple).await.is_ok_and(|written| written);
            let done = Instant::now();
            if acked {
                for pending in batch.iter() {
                    self.sinks.settled.push(pending.received, done);
                }
            }
            let counter = if acked { settled } else { failed };
            counter.fetch_add(batch.len() as u64, Ordering::Relaxed);
        } else {
            for pending in batch.iter() {
                let single = BasicAckOptions::default();
                let acked = pending.copied && pending.acker.ack(single).await.is_ok_and(|ok| ok);
                if acked {
                    self.sinks.settled.push(pending.received, Instant::now());
                } else if !pending.copied {
                    let _ = pending.acker.nack(REQUEUE).await;
                }
                let counter = if acked { settled } else { failed };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
        batch.clear();
    }
}

/// The next delivery if one is ready right now, without waiting.
fn ready_now(consumer: &mut lapin::Consumer) -> Poll<Option<lapin::Result<Delivery>>> {
    Pin::new(consumer).poll_next(&mut Context::from_waker(Waker::noop()))
}
