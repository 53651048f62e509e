//! The raw lapin storm contender: `throughput::raw::handoff`'s algorithm, run for a duration.
//!
//! A task per delivery runs [`hand_off_one`]: it deserializes the order, publishes the retry
//! copy (mandatory, persistent, Lily's eight failure headers, the attempt bumped) to the bucket
//! on the one confirm channel, awaits its own confirm (a returned message is a failure) and then
//! ACKs; a failed copy NACKs the original with requeue. Confirms pipeline across the deliveries
//! in flight (up to prefetch).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{Connection, ConnectionProperties};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::storm::REASON;
use crate::throughput::raw::{hand_off_one, next};

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
            let done = hand_off_one(&confirms, bucket, delivery, &source, REASON).await;
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
