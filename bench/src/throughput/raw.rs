//! Hand-written lapin contenders: what a user writes without a framework.

use std::sync::Arc;
use std::time::Instant;

use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Confirmation, Connection, ConnectionProperties, PublisherConfirm};
use tokio::task::JoinSet;

use crate::Order;
use crate::throughput::copy::retry_properties;
use crate::throughput::{FAILURE_REASON, FirstDelivery, Sample, run_limit};

/// Deserializes `delivery`, publishes its retry copy to `bucket` (mandatory, persistent, Lily's
/// failure headers) on `confirms`, awaits that copy's own confirm (a returned copy fails), then
/// ACKs; a failed copy's original is NACKed and requeued. True when the ACK was written.
pub async fn hand_off_one(
    confirms: &Channel,
    bucket: ShortString,
    delivery: lapin::message::Delivery,
    source: &str,
    reason: &str,
) -> bool {
    let order: Order = serde_json::from_slice(&delivery.data).expect("order");
    std::hint::black_box(order);
    let properties = retry_properties(&delivery, source, reason);
    let mandatory = BasicPublishOptions {
        mandatory: true,
        immediate: false,
    };
    let confirmed = async {
        confirms
            .basic_publish("".into(), bucket, mandatory, &delivery.data, properties)
            .await?
            .await
    }
    .await;
    if matches!(confirmed, Ok(Confirmation::Ack(None))) {
        return delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .is_ok_and(|written| written);
    }
    let requeue = BasicNackOptions {
        multiple: false,
        requeue: true,
    };
    let _ = delivery.acker.nack(requeue).await;
    false
}

/// The consumer's next delivery within `limit`; `None` when it ended, failed or took longer.
async fn next_within(
    consumer: &mut lapin::Consumer,
    limit: std::time::Duration,
) -> Option<lapin::message::Delivery> {
    match tokio::time::timeout(limit, next(consumer)).await {
        Ok(Some(Ok(delivery))) => Some(delivery),
        _ => None,
    }
}

/// The consumer's next delivery.
pub async fn next(
    consumer: &mut lapin::Consumer,
) -> Option<lapin::Result<lapin::message::Delivery>> {
    use futures_core::Stream;
    std::future::poll_fn(|cx| std::pin::Pin::new(&mut *consumer).poll_next(cx)).await
}

async fn open(url: &str, queue: &str, prefetch: u16) -> (Connection, Channel, lapin::Consumer) {
    open_with(url, queue, prefetch, false).await
}

async fn open_with(
    url: &str,
    queue: &str,
    prefetch: u16,
    no_ack: bool,
) -> (Connection, Channel, lapin::Consumer) {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await
        .expect("basic.qos");
    let consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions {
                no_ack,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("basic.consume");
    (connection, channel, consumer)
}

async fn close(connection: Connection, channel: Channel, consumer: &lapin::Consumer) {
    let _ = channel
        .basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await;
    let _ = channel.close(200, "done".into()).await;
    let _ = connection.close(200, "done".into()).await;
}

/// Consumes `n` messages one after the other: deserialize, then ACK (awaited).
pub async fn success(url: &str, queue: &str, prefetch: u16, n: u64) -> Sample {
    let started = Instant::now();
    let first = FirstDelivery::new();
    let (connection, channel, mut consumer) = open(url, queue, prefetch).await;
    let mut settled = 0;
    let limit = run_limit(n);
    while settled < n {
        let Some(delivery) = next_within(&mut consumer, limit).await else {
            break;
        };
        first.get_or_init(Instant::now);
        let order: Order = serde_json::from_slice(&delivery.data).expect("order");
        std::hint::black_box(order);
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .expect("ack");
        settled += 1;
    }
    let elapsed = started.elapsed();
    close(connection, channel, &consumer).await;
    Sample::new(settled, n, elapsed).first_seen(started, &first)
}

/// Consumes `n` messages as an expert tunes it: deserialize each, and ACK with `multiple` every
/// `prefetch / 2` deliveries (the rest at the end), so the broker's window never runs dry.
pub async fn success_batch(url: &str, queue: &str, prefetch: u16, n: u64) -> Sample {
    let started = Instant::now();
    let first = FirstDelivery::new();
    let (connection, channel, mut consumer) = open(url, queue, prefetch).await;
    let batch = u64::from((prefetch / 2).max(1));
    let (mut settled, mut unacked) = (0, 0);
    let limit = run_limit(n);
    while settled + unacked < n {
        let Some(delivery) = next_within(&mut consumer, limit).await else {
            break;
        };
        first.get_or_init(Instant::now);
        let order: Order = serde_json::from_slice(&delivery.data).expect("order");
        std::hint::black_box(order);
        unacked += 1;
        if unacked == batch || settled + unacked == n {
            channel
                .basic_ack(delivery.delivery_tag, BasicAckOptions { multiple: true })
                .await
                .expect("ack");
            settled += unacked;
            unacked = 0;
        }
    }
    let elapsed = started.elapsed();
    close(connection, channel, &consumer).await;
    Sample::new(settled, n, elapsed).first_seen(started, &first)
}

/// Consumes `n` messages with `no_ack`: the broker settles each as it sends it, so nothing that
/// settles can be faster on this node. The same deserialization as every other contender.
pub async fn ceiling(url: &str, queue: &str, prefetch: u16, n: u64) -> Sample {
    let started = Instant::now();
    let first = FirstDelivery::new();
    // The broker ignores the prefetch of a no-ack consumer; it is set as for the others.
    let (connection, channel, mut consumer) = open_with(url, queue, prefetch, true).await;
    let mut settled = 0;
    let limit = run_limit(n);
    while settled < n {
        let Some(delivery) = next_within(&mut consumer, limit).await else {
            break;
        };
        first.get_or_init(Instant::now);
        let order: Order = serde_json::from_slice(&delivery.data).expect("order");
        std::hint::black_box(order);
        settled += 1;
    }
    let elapsed = started.elapsed();
    close(connection, channel, &consumer).await;
    Sample::new(settled, n, elapsed).first_seen(started, &first)
}

/// Consumes `n` messages with a task per delivery (deserialize, then ACK), so ACKs overlap the
/// way Lily's concurrent deliveries do: the stricter baseline for Lily's success path.
pub async fn success_concurrent(url: &str, queue: &str, prefetch: u16, n: u64) -> Sample {
    let started = Instant::now();
    let first = FirstDelivery::new();
    let (connection, channel, mut consumer) = open(url, queue, prefetch).await;
    let mut tasks = JoinSet::new();
    let (mut settled, mut failed, mut received) = (0, 0, 0);
    let limit = run_limit(n);
    while received < n {
        let Some(delivery) = next_within(&mut consumer, limit).await else {
            break;
        };
        first.get_or_init(Instant::now);
        received += 1;
        tasks.spawn(async move {
            let order: Order = serde_json::from_slice(&delivery.data).expect("order");
            std::hint::black_box(order);
            delivery.acker.ack(BasicAckOptions::default()).await.is_ok()
        });
        while let Some(result) = tasks.try_join_next() {
            tally(result, &mut settled, &mut failed);
        }
    }
    while let Some(result) = tasks.join_next().await {
        tally(result, &mut settled, &mut failed);
    }
    let elapsed = started.elapsed();
    close(connection, channel, &consumer).await;
    Sample::new(settled, n, elapsed).first_seen(started, &first)
}

fn tally(result: Result<bool, tokio::task::JoinError>, settled: &mut u64, failed: &mut u64) {
    match result {
        Ok(true) => *settled += 1,
        _ => *failed += 1,
    }
}

/// Consumes `n` messages, each failing once: per delivery a task deserializes, publishes the
/// retry copy to `bucket` (mandatory, persistent, Lily's failure headers) on the one confirm
/// channel, awaits its own confirm (a returned message is a failure) and then ACKs. Confirms
/// pipeline across the deliveries in flight (up to `prefetch`).
pub async fn handoff(url: &str, queue: &str, bucket: &str, prefetch: u16, n: u64) -> Sample {
    let started = Instant::now();
    let first = FirstDelivery::new();
    let (connection, channel, mut consumer) = open(url, queue, prefetch).await;
    let confirms = connection.create_channel().await.expect("channel");
    confirms
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let bucket: ShortString = bucket.into();
    let source: Arc<str> = queue.into();
    let mut tasks = JoinSet::new();
    let mut settled = 0;
    let mut failed = 0;
    let mut received = 0;
    let limit = run_limit(n);
    while received < n {
        let Some(delivery) = next_within(&mut consumer, limit).await else {
            break;
        };
        first.get_or_init(Instant::now);
        received += 1;
        let confirms = confirms.clone();
        let bucket = bucket.clone();
        let source = Arc::clone(&source);
        tasks.spawn(async move {
            hand_off_one(&confirms, bucket, delivery, &source, FAILURE_REASON).await
        });
        while let Some(result) = tasks.try_join_next() {
            tally(result, &mut settled, &mut failed);
        }
    }
    while let Some(result) = tasks.join_next().await {
        tally(result, &mut settled, &mut failed);
    }
    let elapsed = started.elapsed();
    if failed > 0 {
        eprintln!("raw handoff: {failed} handoffs failed");
    }
    let _ = confirms.close(200, "done".into()).await;
    close(connection, channel, &consumer).await;
    Sample::new(settled, n, elapsed).first_seen(started, &first)
}

/// Consumes `n` messages, each failing once, as a hand-tuned publisher batches confirms: the
/// loop publishes each retry copy (mandatory, persistent, Lily's failure headers) on one confirm
/// channel without waiting, and every `prefetch / 2` copies hands the batch to a settler. The
/// settler awaits the batch's confirms while the next batch is published; when all are acks and
/// none was returned it ACKs the originals with one `multiple` ACK, otherwise one by one (a failed
/// copy's original is NACKed and requeued).
pub async fn handoff_batch(url: &str, queue: &str, bucket: &str, prefetch: u16, n: u64) -> Sample {
    let started = Instant::now();
    let first = FirstDelivery::new();
    let (connection, channel, mut consumer) = open(url, queue, prefetch).await;
    let confirms = connection.create_channel().await.expect("channel");
    confirms
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let batch = usize::from((prefetch / 2).max(1));
    let (batches, mut settle) = tokio::sync::mpsc::channel::<Vec<(u64, PublisherConfirm)>>(1);
    let settler = tokio::spawn({
        let channel = channel.clone();
        async move {
            let (mut settled, mut failed) = (0_u64, 0_u64);
            while let Some(batch) = settle.recv().await {
                let mut outcomes = Vec::with_capacity(batch.len());
                for (tag, confirm) in batch {
                    outcomes.push((tag, matches!(confirm.await, Ok(Confirmation::Ack(None)))));
                }
                if outcomes.iter().all(|(_, ok)| *ok) {
                    let Some(&(last, _)) = outcomes.last() else {
                        continue;
                    };
                    if channel
                        .basic_ack(last, BasicAckOptions { multiple: true })
                        .await
                        .is_ok()
                    {
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
                        let requeue = BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        };
                        let _ = channel.basic_nack(tag, requeue).await;
                    }
                }
            }
            (settled, failed)
        }
    });
    let bucket: ShortString = bucket.into();
    let mut pending = Vec::with_capacity(batch);
    let mut received = 0;
    let limit = run_limit(n);
    while received < n {
        let Some(delivery) = next_within(&mut consumer, limit).await else {
            break;
        };
        first.get_or_init(Instant::now);
        received += 1;
        let order: Order = serde_json::from_slice(&delivery.data).expect("order");
        std::hint::black_box(order);
        let properties = retry_properties(&delivery, queue, FAILURE_REASON);
        let mandatory = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let published = confirms
            .basic_publish(
                "".into(),
                bucket.clone(),
                mandatory,
                &delivery.data,
                properties,
            )
            .await;
        match published {
            Ok(confirm) => pending.push((delivery.delivery_tag, confirm)),
            Err(_) => {
                let requeue = BasicNackOptions {
                    multiple: false,
                    requeue: true,
                };
                let _ = delivery.acker.nack(requeue).await;
            }
        }
        if (pending.len() == batch || received == n)
            && batches.send(std::mem::take(&mut pending)).await.is_err()
        {
            break;
        }
    }
    drop(batches);
    let (settled, failed) = settler.await.unwrap_or((0, n));
    let elapsed = started.elapsed();
    if failed > 0 {
        eprintln!("raw-batch handoff: {failed} handoffs failed");
    }
    let _ = confirms.close(200, "done".into()).await;
    close(connection, channel, &consumer).await;
    Sample::new(settled, n, elapsed).first_seen(started, &first)
}
