//! The evidence after a storm, read from outside the contender: the work queue and the bucket
//! are drained and their messages counted by message id; the DLQ and the parking lane must be
//! empty. Every id of the population must be present exactly once.

use std::collections::HashMap;
use std::pin::Pin;
use std::time::Duration;

use futures_core::Stream;
use lapin::options::{BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use serde::Serialize;

/// What the queues held after a contender stopped.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Check {
    pub population: u64,
    /// Messages found in the work queue and in the bucket.
    pub in_work_queue: u64,
    pub in_bucket: u64,
    /// Ready messages in the DLQ and the parking lane (not drained).
    pub in_dead_letter_queue: Option<u32>,
    pub in_parking: Option<u32>,
    /// Population ids found nowhere.
    pub missing: u64,
    /// Extra copies of population ids (count − 1, summed).
    pub duplicates: u64,
    /// Messages whose id is not in the population.
    pub strangers: u64,
    /// Every id exactly once, nothing else, DLQ and parking empty.
    pub ok: bool,
}

/// How long a drain waits for the next message before giving up.
const QUIET: Duration = Duration::from_secs(5);

/// Drains `work` and `bucket`, reads the depths of `dlq` and `parking`, and checks the ids
/// `m-0 … m-{population − 1}`.
///
/// # Panics
/// When the broker cannot be reached.
pub async fn check(
    url: &str,
    work: &str,
    bucket: &str,
    dlq: &str,
    parking: &str,
    population: u64,
) -> Check {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .basic_qos(1000, BasicQosOptions::default())
        .await
        .expect("basic.qos");
    let mut ids: HashMap<String, u64> = HashMap::new();
    let in_bucket = drain(&channel, bucket, &mut ids).await;
    let in_work_queue = drain(&channel, work, &mut ids).await;
    let in_dead_letter_queue = crate::ready(&channel, dlq).await;
    let in_parking = crate::ready(&channel, parking).await;
    let _ = connection.close(200, "checked".into()).await;
    let mut missing = 0;
    let mut duplicates = 0;
    for i in 0..population {
        match ids.remove(&format!("m-{i}")) {
            None | Some(0) => missing += 1,
            Some(n) => duplicates += n - 1,
        }
    }
    let strangers = ids.values().sum();
    Check {
        population,
        in_work_queue,
        in_bucket,
        in_dead_letter_queue,
        in_parking,
        missing,
        duplicates,
        strangers,
        ok: missing == 0
            && duplicates == 0
            && strangers == 0
            && in_dead_letter_queue == Some(0)
            && in_parking == Some(0),
    }
}

/// Consumes every ready message of `queue` (ACKing in batches), counting ids into `ids`.
async fn drain(channel: &Channel, queue: &str, ids: &mut HashMap<String, u64>) -> u64 {
    let Some(expected) = crate::ready(channel, queue).await.filter(|&d| d > 0) else {
        return 0;
    };
    let Ok(mut consumer) = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
    else {
        return 0;
    };
    let mut got: u64 = 0;
    let mut last = None;
    while got < u64::from(expected) {
        let next = std::future::poll_fn(|cx| Pin::new(&mut consumer).poll_next(cx));
        let Ok(Some(Ok(delivery))) = tokio::time::timeout(QUIET, next).await else {
            break;
        };
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map_or_else(String::new, |id| id.as_str().to_owned());
        *ids.entry(id).or_insert(0) += 1;
        got += 1;
        if got.is_multiple_of(500) {
            let _ = delivery.acker.ack(BasicAckOptions { multiple: true }).await;
            last = None;
        } else {
            last = Some(delivery.acker);
        }
    }
    if let Some(acker) = last {
        let _ = acker.ack(BasicAckOptions { multiple: true }).await;
    }
    let _ = channel
        .basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await;
    got
}
