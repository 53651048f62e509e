//! Confirmed handoffs: mandatory, persistent publishes whose confirm is awaited within the
//! settlement budget. Each delivery awaits only its own confirm, so confirms pipeline across
//! concurrent deliveries.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use lily_mq_core::{HandoffResult, Incoming, Lane, Reason, headers, is_token};
use tokio::sync::RwLock;

use crate::Topology;

/// A confirm-mode channel for handoffs, reopened when it closes.
#[derive(Debug)]
pub(crate) struct Publisher {
    channel: RwLock<Channel>,
}

impl Publisher {
    pub(crate) async fn open(connection: &Connection) -> lapin::Result<Self> {
        Ok(Self {
            channel: RwLock::new(confirm_channel(connection).await?),
        })
    }

    /// Publishes `body` with `properties` to `queue` through the default exchange
    /// (mandatory, so a missing queue comes back as a return) and awaits the confirm.
    ///
    /// # Cancel safety
    /// Dropping the future after the publish was written leaves the confirm unobserved: the
    /// copy may exist. Callers bound it with `deadline` instead of dropping it.
    pub(crate) async fn publish(
        &self,
        connection: &Connection,
        queue: &str,
        body: &[u8],
        properties: BasicProperties,
        deadline: Duration,
    ) -> HandoffResult {
        let Ok(routing_key) = ShortString::try_new(queue) else {
            return HandoffResult::Failed;
        };
        let attempt = async {
            let channel = self.channel(connection).await?;
            let confirm = channel
                .basic_publish(
                    ShortString::from(""),
                    routing_key,
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    body,
                    properties,
                )
                .await?;
            confirm.await
        };
        match tokio::time::timeout(deadline, attempt).await {
            Err(_) => HandoffResult::TimedOut,
            Ok(Err(_)) => HandoffResult::Failed,
            Ok(Ok(Confirmation::Ack(None))) => HandoffResult::Confirmed,
            // A confirm for a returned message is a failed handoff, not a success.
            Ok(Ok(Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)))) => {
                HandoffResult::Returned
            }
            Ok(Ok(Confirmation::Nack(None))) => HandoffResult::Nacked,
            Ok(Ok(Confirmation::NotRequested)) => HandoffResult::Failed,
        }
    }

    async fn channel(&self, connection: &Connection) -> lapin::Result<Channel> {
        let current = self.channel.read().await.clone();
        if current.status().connected() {
            return Ok(current);
        }
        let mut slot = self.channel.write().await;
        if !slot.status().connected() {
            *slot = confirm_channel(connection).await?;
        }
        Ok(slot.clone())
    }
}

async fn confirm_channel(connection: &Connection) -> lapin::Result<Channel> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// Destination queue of a lane.
pub(crate) fn destination(topology: &Topology, lane: Lane) -> Option<String> {
    match lane {
        Lane::Retry { bucket, .. } => topology.bucket(bucket).map(str::to_owned),
        Lane::DeadLetter => Some(topology.dead_letter_queue()),
        Lane::Parking => Some(topology.parking_queue()),
    }
}

/// What the copy says about the failure.
pub(crate) struct FailureNote<'a> {
    pub(crate) lane: Lane,
    pub(crate) kind: &'a str,
    pub(crate) reason: &'a Reason,
    pub(crate) source_queue: &'a str,
}

/// Properties of the copy of a message that passed the gate: the original properties and
/// headers, plus Lily's failure headers. `expiration` moves to a header so the copy does not
/// expire in the DLQ; the broker's `x-delivery-count` is not carried over.
pub(crate) fn copy_properties(incoming: &Incoming, note: &FailureNote<'_>) -> BasicProperties {
    let original = incoming.properties();
    let now = epoch_millis();
    let first = incoming
        .header(headers::FIRST_FAILURE_AT)
        .and_then(|v| match v {
            AMQPValue::LongLongInt(n) => Some(*n),
            _ => None,
        })
        .unwrap_or(now);
    let mut map = original
        .headers()
        .as_ref()
        .map(|t| t.inner().clone())
        .unwrap_or_default();
    map.remove(headers::DELIVERY_COUNT);
    let mut table = FieldTable::from(map);
    let attempt = match note.lane {
        Lane::Retry { next_attempt, .. } => next_attempt,
        Lane::DeadLetter | Lane::Parking => incoming.attempt(),
    };
    table.insert(headers::ATTEMPT.into(), AMQPValue::LongUInt(attempt));
    table.insert(
        headers::FIRST_FAILURE_AT.into(),
        AMQPValue::LongLongInt(first),
    );
    table.insert(headers::LAST_FAILURE_AT.into(), AMQPValue::LongLongInt(now));
    table.insert(headers::FAILURE_KIND.into(), long(note.kind));
    table.insert(headers::REASON.into(), long(note.reason.as_str()));
    table.insert(headers::SOURCE_QUEUE.into(), long(note.source_queue));
    if !table.contains_key(headers::ORIGINAL_EXCHANGE) {
        table.insert(headers::ORIGINAL_EXCHANGE.into(), long(incoming.exchange()));
        table.insert(
            headers::ORIGINAL_ROUTING_KEY.into(),
            long(incoming.routing_key()),
        );
    }
    let mut props = original.clone();
    if let Some(expiration) = original.expiration() {
        table.insert(
            "x-lily-original-expiration".into(),
            long(expiration.as_str()),
        );
        props = without_expiration(props);
    }
    props.with_headers(table).with_delivery_mode(2)
}

/// Properties of the DLQ copy of a message the gate refused: only bounded, sanitized metadata.
pub(crate) fn sanitized_properties(
    original: &BasicProperties,
    exchange: &str,
    routing_key: &str,
    note: &FailureNote<'_>,
    limits: &lily_mq_core::Limits,
) -> BasicProperties {
    let now = epoch_millis();
    let mut table = FieldTable::default();
    table.insert(headers::FAILURE_KIND.into(), long(note.kind));
    table.insert(headers::REASON.into(), long(note.reason.as_str()));
    table.insert(headers::SOURCE_QUEUE.into(), long(note.source_queue));
    table.insert(
        headers::FIRST_FAILURE_AT.into(),
        AMQPValue::LongLongInt(now),
    );
    table.insert(headers::LAST_FAILURE_AT.into(), AMQPValue::LongLongInt(now));
    table.insert(
        headers::ORIGINAL_EXCHANGE.into(),
        long(Reason::new(exchange.to_owned()).as_str()),
    );
    table.insert(
        headers::ORIGINAL_ROUTING_KEY.into(),
        long(Reason::new(routing_key.to_owned()).as_str()),
    );
    let mut props = BasicProperties::default()
        .with_headers(table)
        .with_delivery_mode(2);
    let token = |s: &Option<ShortString>, max: usize| {
        s.as_ref().filter(|v| is_token(v.as_str(), max)).cloned()
    };
    if let Some(id) = token(original.message_id(), limits.max_message_id_len) {
        props = props.with_message_id(id);
    }
    if let Some(kind) = token(original.kind(), limits.max_type_len) {
        props = props.with_type(kind);
    }
    if let Some(ct) = token(original.content_type(), 128) {
        props = props.with_content_type(ct);
    }
    props
}

fn without_expiration(props: BasicProperties) -> BasicProperties {
    // BasicProperties has no setter that clears a field; rebuild without it.
    let mut out = BasicProperties::default();
    macro_rules! keep {
        ($get:ident, $with:ident) => {
            if let Some(v) = props.$get() {
                out = out.$with(v.clone());
            }
        };
    }
    keep!(content_type, with_content_type);
    keep!(content_encoding, with_content_encoding);
    keep!(headers, with_headers);
    keep!(delivery_mode, with_delivery_mode);
    keep!(priority, with_priority);
    keep!(correlation_id, with_correlation_id);
    keep!(reply_to, with_reply_to);
    keep!(message_id, with_message_id);
    keep!(timestamp, with_timestamp);
    keep!(kind, with_type);
    keep!(user_id, with_user_id);
    keep!(app_id, with_app_id);
    keep!(cluster_id, with_cluster_id);
    out
}

fn long(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
}

fn epoch_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
