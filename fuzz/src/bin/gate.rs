//! Fuzz target `gate`: the envelope gate (`lily_mq_core::transport::inspect`) on deliveries
//! parsed from arbitrary bytes, under the default limits and under small limits taken from the
//! input.
//!
//! Invariants:
//! - the verdict agrees with a reference check of every rule (body size, UTF-8 of every text
//!   property, routing field and header key, message id and type, header count, depth, bytes,
//!   key and value lengths, attempt and schema version): an accepted envelope respects every
//!   limit, and a refusal names a rule the delivery really breaks;
//! - an accepted envelope reports what the properties say;
//! - a refusal's reason is bounded, printable and never quotes the body.

use amq_protocol::protocol::BasicProperties;
use amq_protocol_types::{AMQPValue, ShortString};
use lily_mq_core::transport::inspect;
use lily_mq_core::transport::{GateRejection, as_u32, is_token};
use lily_mq_core::{HeaderKey, Limits, Reason, headers};
use lily_mq_fuzz::delivery::{BODY_MARKER, Delivery};
use lily_mq_fuzz::walk::Size;

fn main() {
    lily_mq_fuzz::run(check);
}

fn check(data: &[u8]) {
    let Some(delivery) = Delivery::decode(data) else {
        return;
    };
    check_with(&delivery, &Limits::default());
    check_with(&delivery, &delivery.limits);
}

/// What the gate must decide: `Err(true)` for an oversized body, `Err(false)` for another
/// broken rule.
fn expected(d: &Delivery, limits: &Limits) -> Result<(), bool> {
    if d.body.len() > limits.max_body_bytes {
        return Err(true);
    }
    let p = &d.properties;
    // Text that was not UTF-8 (rewritten) or nesting cut: both past what the gate accepts.
    let any_lossy = d.rewritten;
    let token = |s: &Option<ShortString>, max: usize| {
        s.as_ref().is_some_and(|s| {
            let s = s.as_str().as_bytes();
            !s.is_empty() && s.len() <= max && s.iter().all(|b| (0x21..=0x7e).contains(b))
        })
    };
    let valid = !any_lossy
        && token(p.message_id(), limits.max_message_id_len)
        && token(p.kind(), limits.max_type_len)
        && p.headers().as_ref().is_none_or(|h| {
            let get = |key: &str| h.inner().get(key);
            // Lily's own headers are read only under Lily's seal.
            Size::of(h).fits(limits)
                && (!sealed(p)
                    || get(headers::ATTEMPT).is_none_or(|v| {
                        number(v).is_some_and(|n| (1..=limits.max_attempt).contains(&n))
                    }))
                && get(headers::SCHEMA_VERSION).is_none_or(|v| number(v).is_some_and(|n| n >= 1))
        });
    if valid { Ok(()) } else { Err(false) }
}

/// Whether the message's headers carry a valid seal of the public key for its id.
fn sealed(p: &BasicProperties) -> bool {
    let id = p.message_id().as_ref().map_or("", |id| id.as_str());
    p.headers()
        .as_ref()
        .is_some_and(|h| HeaderKey::public().verify(id, h))
}

/// A non-negative integer header that fits `u32`; decimal text is accepted, a long string of
/// up to 10 bytes (`as_u32`'s documented rule, restated).
fn number(value: &AMQPValue) -> Option<u32> {
    let n = match value {
        AMQPValue::ShortShortInt(n) => i64::from(*n),
        AMQPValue::ShortShortUInt(n) => i64::from(*n),
        AMQPValue::ShortInt(n) => i64::from(*n),
        AMQPValue::ShortUInt(n) => i64::from(*n),
        AMQPValue::LongInt(n) => i64::from(*n),
        AMQPValue::LongUInt(n) => i64::from(*n),
        AMQPValue::LongLongInt(n) => *n,
        AMQPValue::ShortString(s) => return s.as_str().parse::<i128>().ok()?.try_into().ok(),
        AMQPValue::LongString(s) if s.len() <= 10 => {
            return std::str::from_utf8(s.as_bytes())
                .ok()?
                .parse::<i128>()
                .ok()?
                .try_into()
                .ok();
        }
        _ => return None,
    };
    u32::try_from(n).ok()
}

fn check_with(d: &Delivery, limits: &Limits) {
    let view = d.view();
    let verdict = inspect(&view, d.body.len(), limits);
    let expected = expected(d, limits);
    match (&verdict, expected) {
        (Ok(env), Ok(())) => {
            let p = &d.properties;
            assert_eq!(Some(env.message_id), view.message_id);
            assert_eq!(Some(env.kind), view.kind);
            assert!(is_token(env.message_id, limits.max_message_id_len));
            assert!(is_token(env.kind, limits.max_type_len));
            assert!(env.message_id.len() <= limits.max_message_id_len);
            assert!(env.kind.len() <= limits.max_type_len);
            assert_eq!(d.not_utf8, None);
            assert!(!d.rewritten);
            let header = |key| view.headers.and_then(|h| h.inner().get(key));
            let attempt = header(headers::ATTEMPT).filter(|_| sealed(p));
            assert_eq!(env.attempt, attempt.map_or(1, |v| number(v).unwrap()));
            assert!((1..=limits.max_attempt.max(1)).contains(&env.attempt));
            assert_eq!(
                env.schema_version,
                header(headers::SCHEMA_VERSION).map_or(1, |v| number(v).unwrap())
            );
            assert_eq!(
                env.delivery_count,
                header(headers::DELIVERY_COUNT).and_then(as_u32)
            );
            if let Some(ct) = env.content_type {
                assert!(!ct.contains(';'));
                assert!(view.content_type.is_some_and(|full| full.contains(ct)));
            }
            if let Some(h) = view.headers {
                let size = Size::of(h);
                assert!(
                    size.fits(limits),
                    "accepted headers over the limits: {size:?}"
                );
            }
        }
        (Err(rejection), Err(oversized)) => {
            assert_eq!(
                matches!(rejection, GateRejection::Oversized { .. }),
                oversized,
                "oversized bodies, and only they, are refused as oversized"
            );
            check_reason(&rejection.reason(limits));
        }
        (Ok(_), Err(oversized)) => panic!(
            "the gate accepted a delivery that breaks a rule (oversized: {oversized}); \
             headers: {:?}",
            view.headers.map(Size::of)
        ),
        (Err(rejection), Ok(())) => panic!(
            "the gate refused a delivery within every rule: {}",
            rejection.reason(limits)
        ),
    }
}

fn check_reason(reason: &Reason) {
    let text = reason.as_str();
    assert!(!text.is_empty());
    assert!(text.len() <= Reason::MAX_LEN, "reason too long");
    assert!(
        !text.chars().any(char::is_control),
        "control character in a reason"
    );
    let marker = std::str::from_utf8(BODY_MARKER).unwrap();
    assert!(!text.contains(marker), "a reason quotes the body");
}
