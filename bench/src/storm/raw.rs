//! The raw lapin storm contender: `throughput::raw::handoff`'s algorithm, run for a duration.
//!
//! A task per delivery deserializes the [`Order`], publishes the retry copy (mandatory,
//! persistent, Lily's eight failure headers, the attempt bumped) to the bucket on the one
//! confirm channel, awaits its own confirm (a returned message is a failure) and then ACKs; a
//! failed copy NACKs the original with requeue. Confirms pipeline across the deliveries in
//! flight (up to prefetch).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_core::Stream;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{Confirmation, Connection, ConnectionProperties};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::Order;
use crate::storm::REASON;
use crate::throughput::copy::retry_properties;

/// What the raw contender counts.
#[derive(Debug, Default)]
pub struct Counters {
    /// Copies confirmed and originals ACKed.
    pub handoffs: AtomicU64,
    /// Copies not confirmed (original NACKed) or ACKs that failed.
    pub failed: AtomicU64,
}

/// Consumes `queue` until `stop` is cancelled, handing every delivery off to `bucket`; then
/// cancels the consumer, lets the tasks in flight finish and closes.
///
/// # Panics
/// When the broker cannot be reached or refuses the consumer.
pub async fn run(
    url: String,
    queue: String,
    bucket: String,
    prefetch: u16,
    counters: Arc<Counters>,
    stop: CancellationToken,
) {
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await
        .expect("basic.qos");
    let confirms = connection.create_channel().await.expect("channel");
    confirms
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("basic.consume");
    let bucket: ShortString = bucket.as_str().into();
    let source: Arc<str> = queue.as_str().into();
    let mut tasks = JoinSet::new();
    loop {
        let next = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            next = next(&mut consumer) => next,
        };
        let Some(Ok(delivery)) = next else { break };
        let (confirms, bucket, source) = (confirms.clone(), bucket.clone(), Arc::clone(&source));
        let counters = Arc::clone(&counters);
        tasks.spawn(async move {
            let order: Order = serde_json::from_slice(&delivery.data).expect("order");
            std::hint::black_box(order);
            let properties = retry_properties(&delivery, &source, REASON);
            let confirmed = async {
                confirms
                    .basic_publish(
                        "".into(),
                        bucket,
                        BasicPublishOptions {
                            mandatory: true,
                            immediate: false,
                        },
                        &delivery.data,
                        properties,
                    )
                    .await?
                    .await
            }
            .await;
            let done = if matches!(confirmed, Ok(Confirmation::Ack(None))) {
                delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .is_ok_and(|written| written)
            } else {
                let _ = delivery
                    .acker
                    .nack(BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    })
                    .await;
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
    let _ = channel
        .basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await;
    while tasks.join_next().await.is_some() {}
    let _ = confirms.close(200, "done".into()).await;
    let _ = channel.close(200, "done".into()).await;
    let _ = connection.close(200, "done".into()).await;
}

async fn next(consumer: &mut lapin::Consumer) -> Option<lapin::Result<lapin::message::Delivery>> {
    std::future::poll_fn(|cx| Pin::new(&mut *consumer).poll_next(cx)).await
}
