//! Hand-written lapin contenders: what a user writes without a framework.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Confirmation, Connection, ConnectionProperties};
use tokio::task::JoinSet;

use crate::Order;
use crate::throughput::{FAILURE_REASON, Sample, copy_headers as h, run_limit};

async fn next(consumer: &mut lapin::Consumer) -> Option<lapin::Result<lapin::message::Delivery>> {
    use futures_core::Stream;
    std::future::poll_fn(|cx| std::pin::Pin::new(&mut *consumer).poll_next(cx)).await
}

async fn open(url: &str, queue: &str, prefetch: u16) -> (Connection, Channel, lapin::Consumer) {
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
            BasicConsumeOptions::default(),
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
    let (connection, channel, mut consumer) = open(url, queue, prefetch).await;
    let mut settled = 0;
    let limit = run_limit(n);
    while settled < n {
        let delivery = match tokio::time::timeout(limit, next(&mut consumer)).await {
            Ok(Some(Ok(delivery))) => delivery,
            _ => break,
        };
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
    Sample::new(settled, n, elapsed)
}

/// Consumes `n` messages with a task per delivery (deserialize, then ACK), so ACKs overlap the
/// way Lily's concurrent deliveries do: the stricter baseline for Lily's success path.
pub async fn success_concurrent(url: &str, queue: &str, prefetch: u16, n: u64) -> Sample {
    let started = Instant::now();
    let (connection, channel, mut consumer) = open(url, queue, prefetch).await;
    let mut tasks = JoinSet::new();
    let (mut settled, mut failed, mut received) = (0, 0, 0);
    let limit = run_limit(n);
    while received < n {
        let delivery = match tokio::time::timeout(limit, next(&mut consumer)).await {
            Ok(Some(Ok(delivery))) => delivery,
            _ => break,
        };
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
    Sample::new(settled, n, elapsed)
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
        let delivery = match tokio::time::timeout(limit, next(&mut consumer)).await {
            Ok(Some(Ok(delivery))) => delivery,
            _ => break,
        };
        received += 1;
        let confirms = confirms.clone();
        let bucket = bucket.clone();
        let source = Arc::clone(&source);
        tasks.spawn(async move {
            let order: Order = serde_json::from_slice(&delivery.data).expect("order");
            std::hint::black_box(order);
            let now = epoch_millis();
            let mut headers = delivery
                .properties
                .headers()
                .as_ref()
                .map(|t| t.inner().clone())
                .unwrap_or_default();
            let mut put = |k: &str, v: AMQPValue| {
                headers.insert(k.into(), v);
            };
            put(h::ATTEMPT, AMQPValue::LongUInt(2));
            put(h::FIRST_FAILURE_AT, AMQPValue::LongLongInt(now));
            put(h::LAST_FAILURE_AT, AMQPValue::LongLongInt(now));
            put(h::FAILURE_KIND, long("retryable"));
            put(
                h::REASON,
                long(&format!("handler failed: {FAILURE_REASON}")),
            );
            put(h::SOURCE_QUEUE, long(&source));
            put(h::ORIGINAL_EXCHANGE, long(delivery.exchange.as_str()));
            put(h::ORIGINAL_ROUTING_KEY, long(delivery.routing_key.as_str()));
            let properties = delivery
                .properties
                .clone()
                .with_headers(FieldTable::from(headers))
                .with_delivery_mode(2);
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
            if matches!(confirmed, Ok(Confirmation::Ack(None))) {
                delivery.acker.ack(BasicAckOptions::default()).await.is_ok()
            } else {
                let _ = delivery
                    .acker
                    .nack(BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    })
                    .await;
                false
            }
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
    Sample::new(settled, n, elapsed)
}

fn long(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
}

fn epoch_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
