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
use lapin::Acker;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};

use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Confirmation, Connection, ConnectionProperties, PublisherConfirm};
use tokio_util::sync::CancellationToken;

use crate::Order;
use crate::latency::timer::Sink;
use crate::raw::{next, retry_properties};
use crate::run::FAILURE_REASON;

/// Counters a run reads while `raw-batch` consumes.
#[derive(Debug, Default)]
pub struct Counters {
    /// Deliveries whose ACK completed.
    pub settled: AtomicU64,
    /// Deliveries NACKed (their copy failed) or whose ACK failed.
    pub failed: AtomicU64,
    /// Handoff path: each copy from its publish written to its confirm seen, keyed by the
    /// former.
    pub copies: Sink,
}

/// An open `raw-batch` consumer.
pub struct RawBatch {
    connection: Connection,
    channel: Channel,
    consumer: lapin::Consumer,
    /// The confirm channel and the bucket, on the handoff path.
    handoff: Option<(Channel, ShortString)>,
    queue: String,
    threshold: usize,
}

struct Pending {
    acker: Acker,
    /// When the message was published: its latency's start.
    received: Instant,
    /// The copy's confirm (handoff path) and when its publish was written; `None` when its
    /// publish already failed.
    confirm: Option<(PublisherConfirm, Instant)>,
}

impl RawBatch {
    /// Connects and starts consuming `queue`; with `bucket`, every delivery is handed off there.
    ///
    /// # Panics
    /// When the broker cannot be reached or refuses the consumer.
    pub async fn open(url: &str, queue: &str, bucket: Option<&str>, prefetch: u16) -> Self {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .expect("connect");
        let channel = connection.create_channel().await.expect("channel");
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .expect("basic.qos");
        let handoff = match bucket {
            Some(bucket) => {
                let confirms = connection.create_channel().await.expect("channel");
                confirms
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .expect("confirm.select");
                Some((confirms, bucket.into()))
            }
            None => None,
        };
        let consumer = channel
            .basic_consume(
                queue.into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("basic.consume");
        Self {
            connection,
            channel,
            consumer,
            handoff,
            queue: queue.to_owned(),
            threshold: usize::from((prefetch / 2).max(1)),
        }
    }

    /// Consumes until `stop` is cancelled (checked whenever no batch is open), recording each
    /// settled delivery in `sink` and `counters`; then cancels the consumer and closes.
    pub async fn run(mut self, stop: CancellationToken, sink: Arc<Sink>, counters: Arc<Counters>) {
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
                        self.flush(&mut batch, &sink, &counters).await;
                        continue;
                    }
                }
            };
            let Some(Ok(delivery)) = next else { break };
            let pending = self.take(delivery, &sink).await;
            batch.push(pending);
            if batch.len() >= self.threshold {
                self.flush(&mut batch, &sink, &counters).await;
            }
        }
        self.flush(&mut batch, &sink, &counters).await;
        let _ = self
            .channel
            .basic_cancel(self.consumer.tag(), BasicCancelOptions::default())
            .await;
        if let Some((confirms, _)) = &self.handoff {
            let _ = confirms.close(200, "done".into()).await;
        }
        let _ = self.channel.close(200, "done".into()).await;
        let _ = self.connection.close(200, "done".into()).await;
    }

    /// Deserializes `delivery` and, on the handoff path, publishes its copy.
    async fn take(&self, delivery: Delivery, sink: &Sink) -> Pending {
        let id = delivery.properties.message_id().as_ref();
        let received = id.map_or_else(Instant::now, |id| sink.start_of(id.as_str()));
        let order: Order = serde_json::from_slice(&delivery.data).expect("order");
        std::hint::black_box(order);
        let confirm = match &self.handoff {
            Some((confirms, bucket)) => {
                let properties = retry_properties(&delivery, &self.queue, FAILURE_REASON);
                confirms
                    .basic_publish(
                        "".into(),
                        bucket.clone(),
                        crate::raw::MANDATORY,
                        &delivery.data,
                        properties,
                    )
                    .await
                    .ok()
                    .map(|confirm| (confirm, Instant::now()))
            }
            None => None,
        };
        Pending {
            acker: delivery.acker,
            received,
            confirm,
        }
    }

    /// Settles the batch: one `multiple` ACK when every copy (if any) was confirmed.
    async fn flush(&self, batch: &mut Vec<Pending>, sink: &Sink, counters: &Counters) {
        if batch.is_empty() {
            return;
        }
        let mut confirmed = vec![true; batch.len()];
        if self.handoff.is_some() {
            for (ok, pending) in confirmed.iter_mut().zip(batch.iter_mut()) {
                *ok = match pending.confirm.take() {
                    Some((confirm, written)) => {
                        let confirmed = confirm.await;
                        counters.copies.push(written);
                        matches!(confirmed, Ok(Confirmation::Ack(None)))
                    }
                    None => false,
                };
            }
        }
        let n = batch.len() as u64;
        if let (true, Some(last)) = (confirmed.iter().all(|ok| *ok), batch.last()) {
            let acked = last
                .acker
                .ack(BasicAckOptions { multiple: true })
                .await
                .is_ok_and(|written| written);
            let done = Instant::now();
            if acked {
                for pending in batch.iter() {
                    sink.push_at(pending.received, done);
                }
                counters.settled.fetch_add(n, Ordering::Relaxed);
            } else {
                counters.failed.fetch_add(n, Ordering::Relaxed);
            }
        } else {
            for (ok, pending) in confirmed.iter().zip(batch.iter()) {
                if *ok {
                    let acked = pending
                        .acker
                        .ack(BasicAckOptions::default())
                        .await
                        .is_ok_and(|written| written);
                    if acked {
                        sink.push(pending.received);
                        counters.settled.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                } else {
                    let _ = pending.acker.nack(crate::raw::REQUEUE).await;
                }
                counters.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
        batch.clear();
    }
}

/// The next delivery if one is ready right now, without waiting.
fn ready_now(consumer: &mut lapin::Consumer) -> Poll<Option<lapin::Result<Delivery>>> {
    let mut cx = Context::from_waker(Waker::noop());
    Pin::new(consumer).poll_next(&mut cx)
}
