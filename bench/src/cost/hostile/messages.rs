//! The messages of the hostile run, chosen by index (the mix: `bench/README.md`): bodies and
//! headers just under the limits in force, a share just over one limit each.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lily::consumer::Limits;
use lily::headers::{self, as_text};
use serde::Deserialize;

/// The message type of the run.
pub const KIND: &str = "hostile.load";
/// Bytes a body under the limit stays below `max_body_bytes`.
pub const BODY_MARGIN: usize = 64;
/// Bytes the headers of a message under the limit stay below `max_header_bytes`.
pub const HEADER_MARGIN: usize = 64;
/// Header values near `max_header_value_len` on every message under the limits.
const BIG_VALUES: usize = 3;
/// Prefix of the hostile header keys.
pub const KEY_PREFIX: &str = "x-load-";

/// What a message is built to exercise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Under every limit; the handler decodes it and succeeds.
    Succeeds,
    /// Under every limit; the handler fails it retryably on attempt 1 (a copy to the retry
    /// bucket), and succeeds when it comes back.
    Retried,
    /// Under every limit; the handler fails it permanently (a copy to the DLQ).
    Permanent,
    /// Body one byte over `max_body_bytes`: a broker-native reject to the DLX.
    Oversized,
    /// `max_headers + 1` entries: a sanitized copy to the DLQ.
    TooManyHeaders,
    /// One value of `max_header_value_len + 1` bytes: a sanitized copy to the DLQ.
    ValueTooLong,
    /// Keys and values one byte over `max_header_bytes` in total: a sanitized copy to the DLQ.
    HeadersTooLarge,
    /// Tables nested `max_header_depth + 1` deep: a sanitized copy to the DLQ.
    TooDeep,
}

/// Where a message of a class ends, seen from outside Lily.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expected {
    /// The handler succeeded on this attempt.
    Handled(u32),
    /// In the DLQ, with this `x-lily-failure-kind` (`broker-rejected` for the broker's own
    /// dead-lettering of a reject, which carries `x-death` instead).
    DeadLettered(&'static str),
}

impl Class {
    /// The class of message `i` of `n`: per hundred, 1 oversized, 4 with invalid headers, 5
    /// failing permanently, 5 failing retryably (among the first fifth only, so their retries
    /// come back while the bulk still flows), the rest succeeding.
    pub fn of(i: usize, n: usize) -> Self {
        match i % 100 {
            0 => Self::Oversized,
            1 => Self::TooManyHeaders,
            2 => Self::ValueTooLong,
            3 => Self::HeadersTooLarge,
            4 => Self::TooDeep,
            5..=9 => Self::Permanent,
            10..=14 if i < n / 5 => Self::Retried,
            _ => Self::Succeeds,
        }
    }

    /// What Lily should make of it.
    pub fn expected(self) -> Expected {
        match self {
            Self::Succeeds => Expected::Handled(1),
            Self::Retried => Expected::Handled(2),
            Self::Permanent => Expected::DeadLettered("permanent"),
            Self::Oversized => Expected::DeadLettered("broker-rejected"),
            Self::TooManyHeaders | Self::ValueTooLong | Self::HeadersTooLarge | Self::TooDeep => {
                Expected::DeadLettered("rejected")
            }
        }
    }
}

/// The body every message carries: `{"id":"h-00042","pad":"xxxx…"}`.
#[derive(Debug, Deserialize)]
pub struct Load {
    pub id: String,
    pub pad: String,
}

/// The message id of message `i`.
pub fn id(i: usize) -> String {
    format!("h-{i:05}")
}

/// The index in a message id of [`id`].
pub fn index(id: &str) -> Option<usize> {
    id.strip_prefix("h-")?.parse().ok()
}

/// A JSON [`Load`] of exactly `len` bytes.
pub fn body(i: usize, len: usize) -> Vec<u8> {
    let head = format!("{{\"id\":\"{}\",\"pad\":\"", id(i));
    let pad = len
        .checked_sub(head.len() + 2)
        .expect("a body longer than its JSON frame");
    format!("{head}{}\"}}", "x".repeat(pad)).into_bytes()
}

fn key(j: usize) -> String {
    format!("{KEY_PREFIX}{j:02}")
}

/// Headers just under every bound: `max_headers - 1` entries, one key of
/// `max_header_key_len - 1` bytes, [`BIG_VALUES`] values of `max_header_value_len - 6` bytes and
/// small values filling keys and values to `max_header_bytes - HEADER_MARGIN`, counted as the
/// gate counts them.
fn under_limits(limits: &Limits) -> Vec<(String, usize)> {
    let entries = limits.max_headers - 1;
    let mut keys: Vec<String> = (0..entries).map(key).collect();
    let long_key = "k".repeat(limits.max_header_key_len - 1 - keys[0].len());
    keys[0] += &long_key;
    let big = limits.max_header_value_len - 6;
    let key_bytes: usize = keys.iter().map(String::len).sum();
    let small_total = (limits.max_header_bytes - HEADER_MARGIN)
        .checked_sub(key_bytes + BIG_VALUES * big)
        .expect("limits too tight for the hostile headers");
    // `small_total` spread over the small values, the remainder on the last.
    let each = small_total / (entries - BIG_VALUES);
    let mut spec: Vec<(String, usize)> = keys.into_iter().map(|key| (key, each)).collect();
    spec[..BIG_VALUES]
        .iter_mut()
        .for_each(|(_, len)| *len = big);
    spec[entries - 1].1 += small_total - each * (entries - BIG_VALUES);
    spec
}

/// The headers of a message of `class`: string values of `v`s, named and sized by its spec.
pub fn headers(class: Class, limits: &Limits) -> FieldTable {
    let mut spec = under_limits(limits);
    match class {
        Class::Succeeds | Class::Retried | Class::Permanent | Class::Oversized => {}
        Class::TooManyHeaders => spec = (0..=limits.max_headers).map(|j| (key(j), 8)).collect(),
        Class::ValueTooLong => spec[0].1 = limits.max_header_value_len + 1,
        Class::HeadersTooLarge => spec[limits.max_headers - 2].1 += HEADER_MARGIN + 1,
        Class::TooDeep => spec.truncate(BIG_VALUES),
    }
    let mut table = FieldTable::default();
    for (key, len) in spec {
        let value = AMQPValue::LongString(LongString::from(vec![b'v'; len]));
        table.insert(key.as_str().into(), value);
    }
    if class == Class::TooDeep {
        let mut nested = AMQPValue::LongUInt(1);
        for _ in 0..limits.max_header_depth {
            let mut inner = FieldTable::default();
            inner.insert("a".into(), nested);
            nested = AMQPValue::FieldTable(inner);
        }
        table.insert(format!("{KEY_PREFIX}deep").as_str().into(), nested);
    }
    table
}

/// The failure kind a DLQ copy says it has: Lily's `x-lily-failure-kind`, or `broker-rejected`
/// for the broker's own dead-lettering of a reject (which carries `x-death` instead).
pub fn failure_kind(properties: &BasicProperties) -> &'static str {
    let table = properties.headers().as_ref().map(FieldTable::inner);
    match table
        .and_then(|t| t.get(headers::FAILURE_KIND))
        .and_then(as_text)
    {
        Some("permanent") => "permanent",
        Some("rejected") => "rejected",
        Some(_) => "other",
        None if table.is_some_and(|t| t.contains_key("x-death")) => "broker-rejected",
        None => "unmarked",
    }
}

/// Message `i` of `n`: its class, body and properties.
pub fn message(i: usize, n: usize, limits: &Limits) -> (Class, Vec<u8>, BasicProperties) {
    let class = Class::of(i, n);
    let properties = BasicProperties::default()
        .with_message_id(id(i).as_str().into())
        .with_type(KIND.into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_headers(headers(class, limits));
    let len = match class {
        Class::Oversized => limits.max_body_bytes + 1,
        _ => limits.max_body_bytes - BODY_MARGIN,
    };
    (class, body(i, len), properties)
}

#[cfg(test)]
mod tests {
    use lily_mq_core::transport::{GateRejection, PropertiesView, inspect};

    use super::*;

    /// The class of message `i` of 10 000, and the gate's verdict on it: `None` when it passes,
    /// else the reason it gives.
    fn verdict(i: usize) -> (Class, Option<String>) {
        let limits = super::super::limits();
        let (class, body, properties) = message(i, 10_000, &limits);
        let view = PropertiesView {
            message_id: properties.message_id().as_ref().map(|s| s.as_str()),
            kind: properties.kind().as_ref().map(|s| s.as_str()),
            content_type: properties.content_type().as_ref().map(|s| s.as_str()),
            headers: properties.headers().as_ref(),
            not_utf8: None,
            key: None,
        };
        let refused = inspect(&view, body.len(), &limits).err();
        let reason = refused.map(|rejection| match rejection {
            GateRejection::Oversized { .. } => "oversized".to_owned(),
            GateRejection::Invalid(reason) => reason.as_str().to_owned(),
        });
        (class, reason)
    }

    #[test]
    fn each_class_passes_the_gate_or_breaks_exactly_its_own_limit() {
        let cases = [
            (10, Class::Retried, None),
            (1_914, Class::Retried, None),
            (2_010, Class::Succeeds, None),
            (15, Class::Succeeds, None),
            (5, Class::Permanent, None),
            (100, Class::Oversized, Some("oversized")),
            (101, Class::TooManyHeaders, Some("too many headers")),
            (102, Class::ValueTooLong, Some("header value too long")),
            (
                103,
                Class::HeadersTooLarge,
                Some("headers too large in total"),
            ),
            (104, Class::TooDeep, Some("headers nested too deeply")),
        ];
        for (i, class, reason) in cases {
            assert_eq!(verdict(i), (class, reason.map(str::to_owned)));
        }
    }

    #[test]
    fn messages_under_the_limits_sit_just_under_each_bound() {
        let limits = super::super::limits();
        let table = headers(Class::Succeeds, &limits);
        assert_eq!(table.inner().len(), limits.max_headers - 1);
        // The gate's own byte count: keys plus string values.
        let value = |v: &AMQPValue| v.as_long_string().map_or(0, LongString::len);
        let bytes = table
            .inner()
            .iter()
            .map(|(k, v)| k.as_str().len() + value(v));
        assert_eq!(
            bytes.sum::<usize>(),
            limits.max_header_bytes - HEADER_MARGIN
        );
        let longest_key = table.inner().keys().map(|k| k.as_str().len()).max();
        assert_eq!(longest_key, Some(limits.max_header_key_len - 1));
        let body = |i| message(i, 10_000, &limits).1;
        assert_eq!(body(100).len(), limits.max_body_bytes + 1);
        assert_eq!(body(42).len(), limits.max_body_bytes - BODY_MARGIN);
        let load: Load = serde_json::from_slice(&body(42)).expect("a JSON load");
        assert_eq!((load.id.as_str(), index(&load.id)), ("h-00042", Some(42)));
    }
}
