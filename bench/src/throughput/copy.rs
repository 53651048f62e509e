//! The retry copy a hand-written lapin consumer publishes: the original's properties and
//! headers, persistent, plus Lily's eight failure headers (the set `throughput::raw` writes).

use std::time::{SystemTime, UNIX_EPOCH};

use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable, LongString};

use crate::throughput::copy_headers as h;

/// Properties of the retry copy of `delivery`, failed at its current attempt (the
/// `x-lily-attempt` header, 1 when absent): the attempt is bumped, the first failure time kept
/// when the delivery already carries one.
pub fn retry_properties(delivery: &Delivery, source_queue: &str, reason: &str) -> BasicProperties {
    let now = epoch_millis();
    let mut headers = delivery
        .properties
        .headers()
        .as_ref()
        .map(|t| t.inner().clone())
        .unwrap_or_default();
    let attempt = headers.get(h::ATTEMPT).and_then(as_u32).unwrap_or(1);
    let first = headers
        .get(h::FIRST_FAILURE_AT)
        .and_then(|v| match v {
            AMQPValue::LongLongInt(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(now);
    let mut put = |k: &str, v: AMQPValue| {
        headers.insert(k.into(), v);
    };
    put(h::ATTEMPT, AMQPValue::LongUInt(attempt.saturating_add(1)));
    put(h::FIRST_FAILURE_AT, AMQPValue::LongLongInt(first));
    put(h::LAST_FAILURE_AT, AMQPValue::LongLongInt(now));
    put(h::FAILURE_KIND, long("retryable"));
    put(h::REASON, long(&format!("handler failed: {reason}")));
    put(h::SOURCE_QUEUE, long(source_queue));
    put(h::ORIGINAL_EXCHANGE, long(delivery.exchange.as_str()));
    put(h::ORIGINAL_ROUTING_KEY, long(delivery.routing_key.as_str()));
    delivery
        .properties
        .clone()
        .with_headers(FieldTable::from(headers))
        .with_delivery_mode(2)
}

fn as_u32(value: &AMQPValue) -> Option<u32> {
    match value {
        AMQPValue::LongUInt(v) => Some(*v),
        AMQPValue::LongInt(v) => u32::try_from(*v).ok(),
        AMQPValue::LongLongInt(v) => u32::try_from(*v).ok(),
        AMQPValue::ShortUInt(v) => Some(u32::from(*v)),
        AMQPValue::ShortShortUInt(v) => Some(u32::from(*v)),
        _ => None,
    }
}

fn long(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
}

fn epoch_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
