//! Fuzz target `lane`: what `lily dlq list` and `lily dlq show` write of a lane message's
//! headers, whatever they hold (the same input layout as `gate`; see
//! [`lily_mq_fuzz::delivery`]).
//!
//! Invariants: rendering returns and never panics (a time past the year 9999, negative, not a
//! number; any nesting, any bytes); the text is bounded and has no control character, so a
//! header cannot drive the operator's terminal; a time Lily writes (`x-…-at`, an integer) shows
//! as RFC 3339 when it is one, and otherwise says it is before 1970 or after 9999; an age is
//! bounded whatever the two times.

use amq_protocol_types::AMQPValue;
use lily_mq_cli::message::{LAST_RFC3339_MS, age, time_text, value_text};
use lily_mq_core::Reason;
use lily_mq_fuzz::delivery::Delivery;

fn main() {
    lily_mq_fuzz::run(check);
}

fn check(data: &[u8]) {
    let Some(d) = Delivery::decode(data) else {
        return;
    };
    let Some(table) = d.properties.headers().as_ref() else {
        return;
    };
    for (key, value) in table.inner() {
        check_value(key.as_str(), value);
        // Nested values render too (an `x-death` entry is a table of them).
        if let AMQPValue::FieldTable(inner) = value {
            for (k, v) in inner.inner() {
                check_value(k.as_str(), v);
            }
        }
        if let AMQPValue::FieldArray(items) = value {
            for item in items.as_slice() {
                check_value(key.as_str(), item);
            }
        }
    }
    // Ages between any two times a header could name.
    let mut numbers = data
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
    if let (Some(now), Some(at)) = (numbers.next(), numbers.next()) {
        let text = age(now, Some(at));
        assert!(text.len() <= 32, "{text}");
    }
}

fn check_value(key: &str, value: &AMQPValue) {
    let text = value_text(key, value);
    assert!(text.len() <= Reason::MAX_LEN + 80, "{} bytes", text.len());
    assert!(!text.chars().any(char::is_control), "{text:?}");
    if let AMQPValue::LongLongInt(ms) = value
        && key.ends_with("-at")
    {
        assert_eq!(text, time_text(*ms));
        match *ms {
            ..0 => assert!(text.contains("before 1970"), "{text}"),
            0..=LAST_RFC3339_MS => assert!(text.ends_with("Z)"), "{text}"),
            _ => assert!(text.contains("after the year 9999"), "{text}"),
        }
    }
}
