//! `raw-batch`: a raw lapin consumer as an expert tunes it for throughput. One loop on one
//! channel; each delivery is deserialized and joins the open batch, which is flushed at
//! `max(1, prefetch / 2)` deliveries or as soon as no further delivery is ready. A flush is one
//! `multiple` ACK; on the handoff path each copy is published at once (mandatory, persistent,
//! Lily's failure headers) and a flush first awaits the batch's confirms (a failed copy's
//! original is NACKed with requeue, the others ACKed singly). Method: `bench/README.md`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use futures_util::FutureExt as _;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::types::ShortString;
use lapin::{Acker, Channel, Confirmation, PublisherConfirm};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::Order;
use crate::latency::QUEUE;
use crate::latency::timer::{COPIES, SETTLED, published_at};
use crate::raw::{MANDATORY, REQUEUE, close, confirm_channel, next, open, retry_properties};
use crate::run::FAILURE_REASON;

/// Counters a run reads while `raw-batch` consumes.
#[derive(Debug, Default)]
pub struct Counters {
    /// Deliveries whose ACK completed.
    pub settled: AtomicU64,
    /// Deliveries NACKed (their copy failed) or whose ACK failed.
    pub failed: AtomicU64,
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

/// Connects and starts consuming [`QUEUE`] on a task of its own, recording settlements and
/// copies in [`SETTLED`] and [`COPIES`]; with `bucket`, every delivery is handed off there.
/// Returns once it consumes: its stop, its task and its counters. The task consumes until the
/// stop is cancelled (checked whenever no batch is open), then cancels the consumer and closes.
///
/// # Panics
/// When the broker cannot be reached or refuses the consumer.
pub async fn start(
    url: &str,
    bucket: Option<&str>,
    prefetch: u16,
) -> (CancellationToken, JoinHandle<()>, Arc<Counters>) {
    let (connection, channel, mut consumer) = open(url, QUEUE, prefetch, false)
        .await
        .unwrap_or_else(|err| panic!("{err}"));
    let handoff = match bucket {
        Some(bucket) => Some((
            confirm_channel(&connection).await,
            ShortString::from(bucket),
        )),
        None => None,
    };
    let (stop, counters) = (CancellationToken::new(), Arc::<Counters>::default());
    let (stopped, counted) = (stop.clone(), Arc::clone(&counters));
    let threshold = usize::from((prefetch / 2).max(1));
    let task = tokio::spawn(async move {
        let mut batch: Vec<Pending> = Vec::with_capacity(threshold);
        loop {
            let next = if batch.is_empty() {
                tokio::select! {
                    biased;
                    () = stopped.cancelled() => break,
                    next = next(&mut consumer) => next,
                }
            } else if let Some(ready) = next(&mut consumer).now_or_never() {
                ready
            } else {
                flush(&mut batch, &counted).await;
                continue;
            };
            let Some(Ok(delivery)) = next else { break };
            batch.push(take(delivery, handoff.as_ref()).await);
            if batch.len() >= threshold {
                flush(&mut batch, &counted).await;
            }
        }
        flush(&mut batch, &counted).await;
        close(connection, channel, &consumer).await;
    });
    (stop, task, counters)
}

/// Deserializes `delivery` and, on the handoff path, publishes its copy.
async fn take(delivery: Delivery, handoff: Option<&(Channel, ShortString)>) -> Pending {
    let id = delivery.properties.message_id().as_ref();
    let received = id.map_or_else(Instant::now, |id| published_at(id.as_str()));
    let order: Order = serde_json::from_slice(&delivery.data).expect("order");
    std::hint::black_box(order);
    let (mut confirm, mut copied) = (None, true);
    if let Some((confirms, bucket)) = handoff {
        let properties = retry_properties(&delivery, QUEUE, FAILURE_REASON);
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
async fn flush(batch: &mut Vec<Pending>, Counters { settled, failed }: &Counters) {
    for pending in batch.iter_mut() {
        if let Some((confirm, written)) = pending.confirm.take() {
            let confirmed = confirm.await;
            COPIES.push(written, Instant::now());
            pending.copied = matches!(confirmed, Ok(Confirmation::Ack(None)));
        }
    }
    if let (true, Some(last)) = (batch.iter().all(|p| p.copied), batch.last()) {
        let multiple = BasicAckOptions { multiple: true };
        let acked = last.acker.ack(multiple).await.is_ok_and(|written| written);
        let done = Instant::now();
        if acked {
            for pending in batch.iter() {
                SETTLED.push(pending.received, done);
            }
        }
        let counter = if acked { settled } else { failed };
        counter.fetch_add(batch.len() as u64, Ordering::Relaxed);
    } else {
        for pending in batch.iter() {
            let single = BasicAckOptions::default();
            let acked = pending.copied && pending.acker.ack(single).await.is_ok_and(|ok| ok);
            if acked {
                SETTLED.push(pending.received, Instant::now());
            } else if !pending.copied {
                let _ = pending.acker.nack(REQUEUE).await;
            }
            let counter = if acked { settled } else { failed };
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }
    batch.clear();
}
