//! Names of the headers Lily reads and writes, and readers of header values ([`as_text`],
//! [`as_u32`]).
//!
//! Lily owns every header starting with `x-lily-`. Producers set `schema-version`; the broker sets
//! `x-delivery-count` on quorum queues and `x-death` when it dead-letters.

use amq_protocol_types::AMQPValue;

/// Attempt number of this delivery, starting at 1. Absent means 1.
pub const ATTEMPT: &str = "x-lily-attempt";
/// Milliseconds since the Unix epoch of the first failure.
pub const FIRST_FAILURE_AT: &str = "x-lily-first-failure-at";
/// Milliseconds since the Unix epoch of the latest failure.
pub const LAST_FAILURE_AT: &str = "x-lily-last-failure-at";
/// `retryable`, `permanent`, `indeterminate` or `rejected` (the gate refused the envelope).
pub const FAILURE_KIND: &str = "x-lily-failure-kind";
/// Bounded, sanitized reason of the latest failure.
pub const REASON: &str = "x-lily-reason";
/// Exchange the message was first published to.
pub const ORIGINAL_EXCHANGE: &str = "x-lily-original-exchange";
/// Routing key the message was first published with.
pub const ORIGINAL_ROUTING_KEY: &str = "x-lily-original-routing-key";
/// Work queue the message was consumed from when it failed.
pub const SOURCE_QUEUE: &str = "x-lily-source-queue";
/// Schema version of the payload, set by producers. Absent means 1.
pub const SCHEMA_VERSION: &str = "schema-version";
/// Set by RabbitMQ on quorum queues: how many times the message was delivered before.
pub const DELIVERY_COUNT: &str = "x-delivery-count";
/// Identity of the handoff publish that carried this copy; a `basic.return` counts against a
/// handoff only when it carries that handoff's id (see [`crate::transport::InFlight`]).
pub const HANDOFF_ID: &str = "x-lily-handoff-id";
/// The original `expiration` property, moved aside so the copy does not expire in a lane.
pub const ORIGINAL_EXPIRATION: &str = "x-lily-original-expiration";
/// The original `user_id` property, moved aside: RabbitMQ refuses a publish whose `user_id` is
/// not the publishing user.
pub const ORIGINAL_USER_ID: &str = "x-lily-original-user-id";
/// The original `CC` header, moved aside: RabbitMQ would route the copy to those queues too.
pub const ORIGINAL_CC: &str = "x-lily-original-cc";
/// The original `BCC` header, moved aside for the same reason as `CC`.
pub const ORIGINAL_BCC: &str = "x-lily-original-bcc";
/// Sender-selected distribution header: extra routing keys RabbitMQ routes a publish to.
pub const CC: &str = "CC";
/// Like [`CC`], and removed by RabbitMQ before delivery.
pub const BCC: &str = "BCC";
/// On a held copy: the lane it is bound for (`dead-letter` or `parking`). A delivery carrying it
/// goes straight to that lane, without running the handler.
pub const HELD_FOR: &str = "x-lily-held-for";
/// On a held copy: how many times the message waited for its lane so far.
pub const HOLDS: &str = "x-lily-holds";
/// Proof that Lily wrote the `x-lily-*` headers beside it: a keyed MAC over the message id and
/// every one of them ([`HeaderKey`](crate::HeaderKey)). Headers of Lily's namespace without it
/// are a publisher's: the gate does not read them and no copy carries them.
pub const SEAL: &str = "x-lily-seal";
/// Whether `key` is in Lily's namespace, `x-lily-*`.
pub fn is_lily(key: &str) -> bool {
    key.starts_with("x-lily-")
}
/// On a copy waiting out another owner's lease in a retry bucket: how many times the message
/// waited so far, this time included.
pub const WAITS: &str = "x-lily-waits";
/// On a message an operator replayed from a lane (`lily dlq replay`, `lily parking replay`): the
/// lane it came from (`dead-letter` or `parking`). A message replayed from the parking lane never
/// enters a retry bucket: where the decision table would retry it, it goes back to parking.
pub const REPLAYED_FROM: &str = "x-lily-replayed-from";
/// On a replayed message: milliseconds since the Unix epoch of its latest replay.
pub const REPLAYED_AT: &str = "x-lily-replayed-at";
/// On a replayed message: how many times an operator replayed it.
pub const REPLAYS: &str = "x-lily-replays";
/// W3C Trace Context: the trace and parent span a message belongs to,
/// `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`. With feature `otel` of the transport
/// it becomes the parent of the delivery's span; every copy carries it on.
pub const TRACEPARENT: &str = "traceparent";
/// W3C Trace Context: vendor-specific trace state that goes with [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

/// The headers RabbitMQ writes when it dead-letters a message (a retry bucket's TTL expiring
/// sends the copy back this way).
const BROKER: [&str; 8] = [
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
    DELIVERY_COUNT,
];

/// Whether `key` is a header Lily (`x-lily-*`) or the broker (`x-death` and its kin,
/// `x-delivery-count`) writes, rather than the producer. The gate bounds these apart from the
/// producer's headers, so the headers a retry adds never push a message over the limits.
pub fn is_reserved(key: &str) -> bool {
    // Every one begins with `x-`, and most producers' headers do not.
    key.starts_with("x-") && (key.starts_with("x-lily-") || BROKER.contains(&key))
}

/// Whether `text` is a W3C `traceparent` of version `00` with a trace id and a span id that
/// are not all zeros.
pub fn is_traceparent(text: &str) -> bool {
    let hex = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let mut parts = text.split('-');
    let (Some(version), Some(trace), Some(span), Some(flags), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return false;
    };
    let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
    version == "00"
        && trace.len() == 32
        && span.len() == 16
        && flags.len() == 2
        && [trace, span, flags].into_iter().all(hex)
        && nonzero(trace)
        && nonzero(span)
}

/// Reads a string header: a short or long string that is valid UTF-8.
pub fn as_text(value: &AMQPValue) -> Option<&str> {
    match value {
        AMQPValue::ShortString(s) => Some(s.as_str()),
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
        _ => None,
    }
}

/// Reads a non-negative integer header that fits in `u32`; decimal strings are accepted.
pub fn as_u32(value: &AMQPValue) -> Option<u32> {
    let wide: i128 = match value {
        AMQPValue::ShortShortInt(n) => (*n).into(),
        AMQPValue::ShortShortUInt(n) => (*n).into(),
        AMQPValue::ShortInt(n) => (*n).into(),
        AMQPValue::ShortUInt(n) => (*n).into(),
        AMQPValue::LongInt(n) => (*n).into(),
        AMQPValue::LongUInt(n) => (*n).into(),
        AMQPValue::LongLongInt(n) => (*n).into(),
        AMQPValue::ShortString(s) => s.as_str().parse().ok()?,
        AMQPValue::LongString(s) if s.len() <= 10 => {
            std::str::from_utf8(s.as_bytes()).ok()?.parse().ok()?
        }
        _ => return None,
    };
    u32::try_from(wide).ok()
}

#[cfg(test)]
mod tests {
    use super::{BROKER, is_reserved, is_traceparent};

    #[test]
    fn lilys_and_the_brokers_headers_are_reserved_and_no_others() {
        for key in BROKER.iter().copied().chain([super::ATTEMPT, super::HOLDS]) {
            assert!(is_reserved(key), "{key}");
        }
        for key in [
            "",
            "x-",
            "x-lily",
            "x-custom",
            "x-deaths",
            "lily-attempt",
            "X-LILY-ATTEMPT",
            super::SCHEMA_VERSION,
            super::TRACEPARENT,
        ] {
            assert!(!is_reserved(key), "{key}");
        }
    }

    #[test]
    fn traceparents_are_checked_to_the_letter() {
        assert!(is_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert!(!is_traceparent(bad), "{bad}");
        }
    }
}
