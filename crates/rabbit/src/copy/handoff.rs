//! What a handoff publishes: the destination of a lane and the properties of the copy, built
//! from the note alone (its time included), so the same inputs always give the same copy; and
//! the [`HandoffPublisher`], which publishes copies on a [`Confirms`] pool of their own and
//! attributes the evidence.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lily_mq_core::transport::{HandoffId, HandoffResult, as_text, as_u32, is_token};
use lily_mq_core::{HeaderKey, Incoming, Lane, Reason, headers};
use tracing::{info, warn};

use crate::connect::Endpoint;
use crate::error::MissingPermission;
use crate::publish::{Confirms, Role, Route};
use crate::sync::lock;
use crate::topology::Topology;

/// Publishes handoff copies to their lanes through the default exchange, and knows which lanes
/// fail.
#[derive(Debug)]
pub(crate) struct HandoffPublisher {
    confirms: Confirms,
    queue: String,
    /// The lanes whose latest handoff failed, by queue name, each with its `lily_lane_failing`
    /// gauge.
    failing: Mutex<BTreeMap<String, metrics::Gauge>>,
}

impl HandoffPublisher {
    pub(crate) fn new(queue: &str) -> Self {
        let role = Role {
            name: "handoffs",
            id_header: headers::HANDOFF_ID,
            blocked_gauge: "lily_handoff_blocked",
            refused_gauge: "lily_handoff_refused",
            doing: "publish handoff copies",
        };
        Self {
            confirms: Confirms::new(queue, role),
            queue: queue.to_owned(),
            failing: Mutex::new(BTreeMap::new()),
        }
    }

    /// The lanes (queue names) whose latest handoff failed.
    pub(crate) fn failing_lanes(&self) -> Vec<String> {
        lock(&self.failing).keys().cloned().collect()
    }

    /// Whether the broker blocks the handoff connection (a resource alarm): handoffs wait.
    pub(crate) fn blocked(&self) -> bool {
        self.confirms.blocked()
    }

    /// The permission the broker refuses handoff copies for, while it does: see
    /// [`Confirms::refused`].
    pub(crate) fn refused(&self) -> Option<MissingPermission> {
        self.confirms.refused()
    }

    /// The permission the broker last refused handoff copies for; see
    /// [`Confirms::last_refused`].
    pub(crate) fn last_refused(&self) -> Option<MissingPermission> {
        self.confirms.last_refused()
    }

    /// How many times the broker came to refuse handoff copies; see [`Confirms::refusals`].
    pub(crate) fn refusals(&self) -> u64 {
        self.confirms.refusals()
    }

    /// See [`Confirms::warm`].
    pub(crate) async fn warm(&self, endpoint: &Endpoint) -> lapin::Result<()> {
        self.confirms.warm(endpoint).await
    }

    /// See [`Confirms::check_write`].
    pub(crate) async fn check_write(&self) -> lapin::Result<()> {
        self.confirms.check_write().await
    }

    /// A fresh id for the next copy to carry in its headers.
    pub(crate) fn next_id(&self) -> HandoffId {
        self.confirms.next_id()
    }

    /// Publishes the copy `body` with `properties`, which carry `id` (from [`Self::next_id`]),
    /// to `queue`; see [`Confirms::publish`].
    pub(crate) async fn publish(
        &self,
        queue: &str,
        id: HandoffId,
        body: &[u8],
        properties: BasicProperties,
        deadline: Duration,
    ) -> HandoffResult {
        let result = match Route::new("", queue) {
            Some(route) => {
                let body = body.to_vec();
                self.confirms
                    .publish(route, id, body, properties, deadline)
                    .await
            }
            None => HandoffResult::Failed,
        };
        self.record(queue, result);
        result
    }

    /// See [`Confirms::close`].
    pub(crate) async fn close(&self, within: Duration) {
        self.confirms.close(within).await;
    }

    /// Records how the latest handoff to `lane` went. A blocked connection says nothing about
    /// the lane: it has its own flag.
    fn record(&self, lane: &str, result: HandoffResult) {
        let mut failing = lock(&self.failing);
        match result {
            HandoffResult::Confirmed => {
                if let Some(gauge) = failing.remove(lane) {
                    gauge.set(0.0);
                    info!(queue = %self.queue, lane, "handoffs to the lane succeed again");
                }
            }
            HandoffResult::Blocked => {}
            _ if failing.contains_key(lane) => {}
            _ => {
                let gauge = metrics::gauge!(
                    "lily_lane_failing", "queue" => self.queue.clone(), "lane" => lane.to_owned()
                );
                gauge.set(1.0);
                match self.refused().filter(|_| result == HandoffResult::Refused) {
                    Some(missing) => {
                        warn!(queue = %self.queue, lane, ?result, lacks = %missing, "handoffs to the lane fail");
                    }
                    None => warn!(queue = %self.queue, lane, ?result, "handoffs to the lane fail"),
                }
                failing.insert(lane.to_owned(), gauge);
            }
        }
    }
}

/// Destination queue of a lane.
pub(crate) fn destination(topology: &Topology, lane: Lane) -> Option<String> {
    match lane {
        Lane::Retry { bucket, .. } | Lane::Held { bucket, .. } | Lane::Wait { bucket } => {
            topology.bucket(bucket).map(str::to_owned)
        }
        Lane::DeadLetter => Some(topology.dead_letter_queue()),
        Lane::Parking => Some(topology.parking_queue()),
    }
}

/// What the copy says about the failure.
pub(crate) struct FailureNote<'a> {
    pub(crate) lane: Lane,
    pub(crate) kind: &'a str,
    pub(crate) reason: &'a Reason,
    /// Seals Lily's headers on the copy.
    pub(crate) key: &'a HeaderKey,
    pub(crate) source_queue: &'a str,
    /// The handoff the copy belongs to; its `basic.return`, if any, carries it back.
    pub(crate) id: HandoffId,
    /// When the failure is recorded, in milliseconds since the Unix epoch.
    pub(crate) at_millis: i64,
}

/// Properties of the copy of a message that passed the gate: the original properties and
/// headers, plus Lily's failure headers. The copy carries nothing RabbitMQ would act on
/// differently from the lane Lily chose: `expiration` (the copy would expire in the lane),
/// `user_id` (a publish whose `user_id` is not the publishing user is refused) and the `CC`
/// and `BCC` headers (extra routes) move into `x-lily-original-*` headers, from which a replay
/// restores them. The broker's `x-delivery-count` is not carried over.
pub(crate) fn copy_properties(incoming: &Incoming, note: &FailureNote<'_>) -> BasicProperties {
    let original = incoming.properties();
    let now = note.at_millis;
    let message_id = original.message_id().as_ref().map_or("", |id| id.as_str());
    let mut map = match original.headers() {
        // Lily's namespace without Lily's seal is a publisher's: the copy does not carry it.
        Some(table) if !note.key.verify(message_id, table) => {
            let mut map = table.inner().clone();
            map.retain(|key, _| !headers::is_lily(key.as_str()));
            map
        }
        Some(table) => table.inner().clone(),
        None => Default::default(),
    };
    let first = match map.get(headers::FIRST_FAILURE_AT) {
        Some(AMQPValue::LongLongInt(n)) => *n,
        _ => now,
    };
    map.remove(headers::DELIVERY_COUNT);
    map.remove(headers::SEAL);
    let holds = map.remove(headers::HOLDS).as_ref().and_then(as_u32);
    let waits = map.remove(headers::WAITS).as_ref().and_then(as_u32);
    map.remove(headers::HELD_FOR);
    for (routing, aside) in [
        (headers::CC, headers::ORIGINAL_CC),
        (headers::BCC, headers::ORIGINAL_BCC),
    ] {
        if let Some(value) = map.remove(routing) {
            map.insert(aside.into(), value);
        }
    }
    let mut table = FieldTable::from(map);
    let attempt = match note.lane {
        Lane::Retry { next_attempt, .. } => next_attempt,
        Lane::DeadLetter | Lane::Parking | Lane::Held { .. } | Lane::Wait { .. } => {
            incoming.attempt()
        }
    };
    table.insert(headers::ATTEMPT.into(), AMQPValue::LongUInt(attempt));
    held_headers(&mut table, note.lane, holds);
    if let Lane::Wait { .. } = note.lane {
        let waits = waits.unwrap_or(0).saturating_add(1);
        table.insert(headers::WAITS.into(), AMQPValue::LongUInt(waits));
    }
    table.insert(
        headers::FIRST_FAILURE_AT.into(),
        AMQPValue::LongLongInt(first),
    );
    table.insert(headers::LAST_FAILURE_AT.into(), AMQPValue::LongLongInt(now));
    table.insert(headers::FAILURE_KIND.into(), long(note.kind));
    table.insert(headers::REASON.into(), long(note.reason.as_str()));
    table.insert(headers::SOURCE_QUEUE.into(), long(note.source_queue));
    table.insert(headers::HANDOFF_ID.into(), note.id.header_value());
    if !table.contains_key(headers::ORIGINAL_EXCHANGE) {
        table.insert(headers::ORIGINAL_EXCHANGE.into(), long(incoming.exchange()));
        table.insert(
            headers::ORIGINAL_ROUTING_KEY.into(),
            long(incoming.routing_key()),
        );
    }
    if let Some(expiration) = original.expiration() {
        table.insert(
            headers::ORIGINAL_EXPIRATION.into(),
            long(expiration.as_str()),
        );
    }
    if let Some(user_id) = original.user_id() {
        table.insert(headers::ORIGINAL_USER_ID.into(), long(user_id.as_str()));
    }
    let seal = note.key.seal(message_id, &table);
    table.insert(headers::SEAL.into(), seal);
    without_moved(original)
        .with_headers(table)
        .with_delivery_mode(2)
}

/// Properties of the DLQ copy of a message the gate refused: only bounded, sanitized metadata.
pub(crate) fn sanitized_properties(
    original: &BasicProperties,
    (exchange, routing_key): (&str, &str),
    not_utf8: Option<&str>,
    note: &FailureNote<'_>,
    limits: &lily_mq_core::Limits,
) -> BasicProperties {
    let now = note.at_millis;
    let mut table = FieldTable::default();
    table.insert(headers::FAILURE_KIND.into(), long(note.kind));
    table.insert(headers::REASON.into(), long(note.reason.as_str()));
    table.insert(headers::SOURCE_QUEUE.into(), long(note.source_queue));
    table.insert(headers::HANDOFF_ID.into(), note.id.header_value());
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
    let token = |field: &str, s: &Option<ShortString>, max: usize| {
        s.as_ref()
            .filter(|v| not_utf8 != Some(field) && is_token(v.as_str(), max))
            .cloned()
    };
    let message_id = token(
        "message_id",
        original.message_id(),
        limits.max_message_id_len,
    );
    let id_text = message_id.as_ref().map_or("", |id| id.as_str());
    // A held copy's count, when Lily's seal proves it.
    let holds = original
        .headers()
        .as_ref()
        .filter(|h| note.key.verify(id_text, h))
        .and_then(|h| h.inner().get(headers::HOLDS))
        .and_then(as_u32);
    held_headers(&mut table, note.lane, holds);
    // The trace goes on, when the original names one in the W3C form: nothing else of the
    // refused message's headers is kept.
    let traceparent = original
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(headers::TRACEPARENT))
        .and_then(as_text)
        .filter(|text| headers::is_traceparent(text));
    if let Some(traceparent) = traceparent {
        table.insert(headers::TRACEPARENT.into(), long(traceparent));
    }
    let seal = note.key.seal(id_text, &table);
    table.insert(headers::SEAL.into(), seal);
    let mut props = BasicProperties::default()
        .with_headers(table)
        .with_delivery_mode(2);
    if let Some(id) = message_id {
        props = props.with_message_id(id);
    }
    if let Some(kind) = token("type", original.kind(), limits.max_type_len) {
        props = props.with_type(kind);
    }
    if let Some(ct) = token("content_type", original.content_type(), 128) {
        props = props.with_content_type(ct);
    }
    props
}

/// On a held copy, the lane it is bound for and how many times it waited, this time included.
fn held_headers(table: &mut FieldTable, lane: Lane, holds: Option<u32>) {
    if let Lane::Held { target, .. } = lane {
        table.insert(headers::HELD_FOR.into(), long(target.as_str()));
        let holds = holds.unwrap_or(0).saturating_add(1);
        table.insert(headers::HOLDS.into(), AMQPValue::LongUInt(holds));
    }
}

/// `props` without `expiration` and `user_id` (and without headers: the caller sets them).
fn without_moved(props: &BasicProperties) -> BasicProperties {
    // BasicProperties has no setter that clears a field; rebuild without them.
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
    keep!(delivery_mode, with_delivery_mode);
    keep!(priority, with_priority);
    keep!(correlation_id, with_correlation_id);
    keep!(reply_to, with_reply_to);
    keep!(message_id, with_message_id);
    keep!(timestamp, with_timestamp);
    keep!(kind, with_type);
    keep!(app_id, with_app_id);
    keep!(cluster_id, with_cluster_id);
    out
}

fn long(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use lapin::types::FieldTable;
    use lily_mq_core::transport::IncomingParts;
    use lily_mq_core::{Incoming, Lane, Reason, headers};

    use super::*;

    fn incoming(properties: BasicProperties) -> Incoming {
        Incoming::from_parts(IncomingParts {
            body: b"{}".to_vec(),
            properties,
            exchange: "orders".into(),
            routing_key: "order.placed".into(),
            queue: Arc::from("work"),
            delivery_tag: 1,
            redelivered: false,
            attempt: 2,
            schema_version: 1,
        })
    }

    fn note(reason: &Reason) -> FailureNote<'_> {
        FailureNote {
            lane: Lane::Retry {
                bucket: 0,
                next_attempt: 3,
            },
            kind: "retryable",
            reason,
            key: HeaderKey::public_ref(),
            source_queue: "work",
            id: HandoffId::new(42),
            at_millis: 1_700_000_000_000,
        }
    }

    fn header<'a>(p: &'a BasicProperties, key: &str) -> Option<&'a AMQPValue> {
        p.headers().as_ref()?.inner().get(key)
    }

    #[test]
    fn a_copy_moves_aside_what_the_broker_would_act_on_and_carries_the_note() {
        let mut table = FieldTable::default();
        table.insert(headers::CC.into(), long("side"));
        table.insert(headers::BCC.into(), long("hidden"));
        table.insert(headers::DELIVERY_COUNT.into(), AMQPValue::LongUInt(3));
        table.insert("customer".into(), long("kept"));
        let original = BasicProperties::default()
            .with_headers(table)
            .with_expiration("60000".into())
            .with_user_id("producer".into())
            .with_message_id("m-1".into());
        let reason = Reason::new("down");
        let copy = copy_properties(&incoming(original), &note(&reason));

        assert_eq!(copy.expiration(), &None);
        assert_eq!(copy.user_id(), &None);
        assert_eq!(copy.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
        assert_eq!(copy.delivery_mode(), &Some(2));
        for (gone, aside, value) in [
            (headers::CC, headers::ORIGINAL_CC, "side"),
            (headers::BCC, headers::ORIGINAL_BCC, "hidden"),
            ("", headers::ORIGINAL_EXPIRATION, "60000"),
            ("", headers::ORIGINAL_USER_ID, "producer"),
        ] {
            assert_eq!(header(&copy, gone), None);
            assert_eq!(header(&copy, aside), Some(&long(value)), "{aside}");
        }
        assert_eq!(header(&copy, headers::DELIVERY_COUNT), None);
        assert_eq!(header(&copy, "customer"), Some(&long("kept")));
        assert_eq!(
            header(&copy, headers::ATTEMPT),
            Some(&AMQPValue::LongUInt(3))
        );
        assert_eq!(
            header(&copy, headers::HANDOFF_ID),
            Some(&HandoffId::new(42).header_value())
        );
        for at in [headers::FIRST_FAILURE_AT, headers::LAST_FAILURE_AT] {
            assert_eq!(
                header(&copy, at),
                Some(&AMQPValue::LongLongInt(1_700_000_000_000))
            );
        }
        assert_eq!(
            header(&copy, headers::ORIGINAL_ROUTING_KEY),
            Some(&long("order.placed"))
        );
    }

    #[test]
    fn the_same_inputs_give_the_same_copy() {
        let reason = Reason::new("down");
        let message = incoming(BasicProperties::default().with_message_id("m-1".into()));
        assert_eq!(
            copy_properties(&message, &note(&reason)),
            copy_properties(&message, &note(&reason))
        );
    }
}
