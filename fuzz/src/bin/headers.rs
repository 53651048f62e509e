//! Fuzz target `headers`: what Lily makes of hostile headers and text.
//!
//! - `Reason::new` (every reason that reaches a header, log or report): bounded, printable, the
//!   text itself when it is clean and short, otherwise a cut of it; idempotent.
//! - `headers::is_traceparent` against a restatement of the W3C rule.
//! - `HeldCopy::from_headers`: reads only what the headers say.
//! - The copy a handoff publishes, through the transport's in-process consumer
//!   (`lily_mq_rabbit::testing`), built by the real gate, machine and copy code:
//!   - for a delivery the gate refused, the DLQ copy carries only sanitized metadata: Lily's
//!     failure headers (bounded, within the default limits), a valid `traceparent` and nothing
//!     else of the original's headers, the id, type and content type only when they are
//!     tokens; sanitizing that copy again keeps the same;
//!   - for a delivery that passed, the copy keeps every header of the original except what
//!     RabbitMQ would act on (`CC`, `BCC`, moved aside) and the broker's and hold counters,
//!     and moves `expiration` and `user_id` aside.

use std::cell::RefCell;

use amq_protocol::protocol::BasicProperties;
use amq_protocol_types::{AMQPValue, FieldTable, LongString, ShortString};
use lily_mq_core::machine::HeldCopy;
use lily_mq_core::transport::{
    GateRejection, Known, PropertiesView, as_text, as_u32, inspect, is_token,
};
use lily_mq_core::{
    FailureKind, HeaderKey, Lane, Limits, Outcome, QueueHandlerError, Reason, Router,
};
use lily_mq_core::{Terminal, headers};
use lily_mq_fuzz::delivery::{BODY_MARKER, Delivery};
use lily_mq_fuzz::walk::Size;
use lily_mq_rabbit::ConsumerConfig;
use lily_mq_rabbit::testing::{Copy, Settled, TestConsumer, TestDelivery};

/// The work queue of the in-process consumer; its deliveries come from the default exchange.
const QUEUE: &str = "fuzz";
/// A type whose handler always fails retryably, so copies to retry buckets are built too.
const RETRIED: &str = "fuzz.retry";

/// The only headers a sanitized copy may carry.
const SANITIZED: [&str; 12] = [
    headers::SEAL,
    headers::FAILURE_KIND,
    headers::REASON,
    headers::SOURCE_QUEUE,
    headers::HANDOFF_ID,
    headers::FIRST_FAILURE_AT,
    headers::LAST_FAILURE_AT,
    headers::ORIGINAL_EXCHANGE,
    headers::ORIGINAL_ROUTING_KEY,
    headers::TRACEPARENT,
    headers::HELD_FOR,
    headers::HOLDS,
];

/// Headers a copy of a message that passed the gate may write over or drop.
const REWRITTEN: [&str; 19] = [
    headers::SEAL,
    headers::WAITS,
    headers::ATTEMPT,
    headers::FIRST_FAILURE_AT,
    headers::LAST_FAILURE_AT,
    headers::FAILURE_KIND,
    headers::REASON,
    headers::SOURCE_QUEUE,
    headers::HANDOFF_ID,
    headers::ORIGINAL_EXCHANGE,
    headers::ORIGINAL_ROUTING_KEY,
    headers::ORIGINAL_EXPIRATION,
    headers::ORIGINAL_USER_ID,
    headers::ORIGINAL_CC,
    headers::ORIGINAL_BCC,
    headers::HELD_FOR,
    headers::HOLDS,
    headers::CC,
    headers::BCC,
];

thread_local! {
    static RUNTIME: RefCell<tokio::runtime::Runtime> = RefCell::new(
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime"),
    );
}

fn main() {
    lily_mq_fuzz::run(check);
}

fn check(data: &[u8]) {
    let Some(d) = Delivery::decode(data) else {
        return;
    };
    let text = String::from_utf8_lossy(&d.body[..d.body.len() - BODY_MARKER.len()]);
    check_reason(&text);
    check_traceparent(&text);
    if let Some(h) = d.properties.headers() {
        for value in h.inner().values() {
            if let Some(text) = as_text(value) {
                check_traceparent(text);
            }
        }
        check_held(h);
    }
    check_copies(&d);
}

fn check_reason(text: &str) {
    let reason = Reason::new(text.to_owned());
    let out = reason.as_str();
    assert!(out.len() <= Reason::MAX_LEN);
    assert!(!out.chars().any(char::is_control));
    assert_eq!(
        Reason::new(out.to_owned()),
        reason,
        "sanitizing is idempotent"
    );
    let printable: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if text.len() <= Reason::MAX_LEN {
        assert_eq!(
            out, printable,
            "short text only loses its control characters"
        );
    } else if out != printable {
        let kept = out
            .strip_suffix('…')
            .expect("a cut reason ends in an ellipsis");
        assert!(
            printable.starts_with(kept),
            "a cut reason is a prefix of the text"
        );
    }
}

/// `00-<32 hex>-<16 hex>-<2 hex>`, lowercase, trace and span ids not all zeros.
fn traceparent(text: &str) -> bool {
    let b = text.as_bytes();
    let dash = |i: usize| matches!(i, 2 | 35 | 52);
    let hex = |c: &u8| c.is_ascii_digit() || (b'a'..=b'f').contains(c);
    b.len() == 55
        && b.starts_with(b"00")
        && b.iter()
            .enumerate()
            .all(|(i, c)| if dash(i) { *c == b'-' } else { hex(c) })
        && b[3..35].iter().any(|c| *c != b'0')
        && b[36..52].iter().any(|c| *c != b'0')
}

fn check_traceparent(text: &str) {
    assert_eq!(headers::is_traceparent(text), traceparent(text));
}

fn check_held(h: &FieldTable) {
    let known = Known::lookup(Some(h), None, None);
    let Some(held) = HeldCopy::from_known(&known) else {
        return;
    };
    // Only Lily's sealed headers make a held copy.
    assert!(!known.unsealed && HeaderKey::public().verify("", h));
    let text = |key| h.inner().get(key).and_then(as_text);
    assert_eq!(text(headers::HELD_FOR), Some(held.target.as_str()));
    assert_eq!(
        held.kind,
        text(headers::FAILURE_KIND).and_then(FailureKind::parse)
    );
    let holds = h.inner().get(headers::HOLDS).and_then(as_u32);
    assert_eq!(held.holds, holds.unwrap_or(0));
}

/// Settles `properties` and `body` with the in-process consumer.
fn settle(limits: &Limits, properties: BasicProperties, body: Vec<u8>) -> Settled {
    async fn retry() -> Result<(), QueueHandlerError> {
        Err(QueueHandlerError::retryable("try again"))
    }
    let config = ConsumerConfig::new(QUEUE).limits(limits.clone());
    let router = Router::new().route(RETRIED, retry);
    let consumer = TestConsumer::new(config, router).expect("a valid consumer");
    let delivery = TestDelivery::new(body, properties);
    RUNTIME.with(|rt| rt.borrow().block_on(consumer.deliver(delivery)))
}

fn check_copies(d: &Delivery) {
    // A synthetic delivery carries no report of rewritten text: the gate target covers those.
    if d.rewritten {
        return;
    }
    let limits = &d.limits;
    let p = &d.properties;
    let view = PropertiesView {
        key: None,
        ..d.view()
    };
    let verdict = inspect(&view, d.body.len(), limits);
    let settled = settle(limits, p.clone(), d.body.clone());
    check_bounded(settled.reason.as_str());
    let known = Known::lookup(view.headers, view.message_id, None);
    let held = HeldCopy::from_known(&known);
    if let Ok(envelope) = &verdict {
        // The gate's walk finds what a lookup of each would.
        assert_eq!(envelope.known, known);
    }
    match verdict {
        Err(GateRejection::Oversized { .. }) => {
            assert_eq!(settled.outcome, Outcome::RejectedToDlx);
            assert!(settled.copy.is_none());
        }
        Err(GateRejection::Invalid(_)) => {
            let copy = settled.copy.expect("a refused delivery is handed off");
            let target = held.map_or(Terminal::DeadLetter, |h| h.target);
            assert_eq!(copy.lane, target.lane());
            assert_eq!(copy.body, d.body);
            check_sanitized(&copy, p, limits);
            // Sanitized again (refused for its missing id this time), it keeps the same.
            let c = &copy.properties;
            let mut again =
                BasicProperties::default().with_headers(c.headers().clone().unwrap_or_default());
            if let Some(kind) = c.kind() {
                again = again.with_type(kind.clone());
            }
            if let Some(ct) = c.content_type() {
                again = again.with_content_type(ct.clone());
            }
            let twice = settle(limits, again.clone(), copy.body.clone());
            let twice = twice.copy.expect("refused again and handed off");
            check_sanitized(&twice, &again, limits);
            assert_eq!(keys(&twice), keys(&copy));
            assert_eq!(twice.properties.kind(), copy.properties.kind());
            assert_eq!(
                twice.properties.content_type(),
                copy.properties.content_type()
            );
            assert_eq!(
                twice.header_text(headers::TRACEPARENT),
                copy.header_text(headers::TRACEPARENT)
            );
        }
        Ok(env) => {
            let copy = settled
                .copy
                .expect("an undispatched or failed delivery is handed off");
            assert_eq!(copy.body, d.body);
            match copy.lane {
                Lane::Retry { next_attempt, .. } => {
                    assert_eq!(env.kind, RETRIED);
                    assert_eq!(next_attempt, env.attempt + 1);
                    assert_eq!(copy.attempt(), Some(next_attempt));
                }
                Lane::DeadLetter | Lane::Parking => assert_eq!(copy.attempt(), Some(env.attempt)),
                Lane::Held { .. } => panic!("every handoff is confirmed: nothing is held"),
                Lane::Wait { .. } => panic!("no scope holds a lease: nothing waits"),
            }
            check_original(&copy, p);
        }
    }
}

fn keys(copy: &Copy) -> Vec<String> {
    let mut keys: Vec<String> = copy
        .properties
        .headers()
        .as_ref()
        .map(|h| h.inner().keys().map(|k| k.as_str().to_owned()).collect())
        .unwrap_or_default();
    keys.sort();
    keys
}

fn check_bounded(text: &str) {
    assert!(text.len() <= Reason::MAX_LEN);
    assert!(!text.chars().any(char::is_control));
    assert!(!text.contains(std::str::from_utf8(BODY_MARKER).unwrap()));
}

fn check_sanitized(copy: &Copy, original: &BasicProperties, limits: &Limits) {
    let c = &copy.properties;
    let table = c.headers().clone().unwrap_or_default();
    for (key, value) in table.inner() {
        assert!(
            SANITIZED.contains(&key.as_str()),
            "a sanitized copy carries {key:?}"
        );
        if let Some(text) = as_text(value) {
            check_bounded(text);
        }
    }
    assert!(
        Size::of(&table).fits(&Limits::default()),
        "sanitized headers over the limits"
    );
    let traceparent = original
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(headers::TRACEPARENT))
        .and_then(as_text)
        .filter(|t| traceparent(t));
    assert_eq!(copy.header_text(headers::TRACEPARENT), traceparent);
    let token =
        |s: &Option<ShortString>, max| s.as_ref().filter(|s| is_token(s.as_str(), max)).cloned();
    assert_eq!(
        c.message_id(),
        &token(original.message_id(), limits.max_message_id_len)
    );
    assert_eq!(c.kind(), &token(original.kind(), limits.max_type_len));
    assert_eq!(c.content_type(), &token(original.content_type(), 128));
    assert_eq!(c.delivery_mode(), &Some(2));
    let dropped = [
        c.content_encoding(),
        c.correlation_id(),
        c.reply_to(),
        c.expiration(),
        c.user_id(),
        c.app_id(),
        c.cluster_id(),
    ];
    assert!(
        dropped.iter().all(|p| p.is_none()),
        "a sanitized copy keeps a property"
    );
    assert_eq!((c.priority(), c.timestamp()), (&None, &None));
}

fn check_original(copy: &Copy, original: &BasicProperties) {
    let c = &copy.properties;
    let empty = FieldTable::default();
    let o = original.headers().as_ref().unwrap_or(&empty).inner();
    let held = matches!(copy.lane, Lane::Held { .. });
    for gone in [headers::CC, headers::BCC, headers::DELIVERY_COUNT] {
        assert!(copy.header(gone).is_none(), "the copy carries {gone}");
    }
    if !held {
        assert!(copy.header(headers::HELD_FOR).is_none());
        assert!(copy.header(headers::HOLDS).is_none());
    }
    for (from, to) in [
        (headers::CC, headers::ORIGINAL_CC),
        (headers::BCC, headers::ORIGINAL_BCC),
    ] {
        if let Some(value) = o.get(from) {
            assert!(
                copy.header(to).is_some_and(|v| same(v, value)),
                "{from} is moved aside"
            );
        }
    }
    let id = original.message_id().as_ref().map_or("", |id| id.as_str());
    let sealed = original
        .headers()
        .as_ref()
        .is_some_and(|h| HeaderKey::public().verify(id, h));
    for (key, value) in o {
        let key = key.as_str();
        if headers::is_lily(key) && !sealed {
            // A publisher's header in Lily's namespace: never carried as if Lily wrote it.
            let carried = copy.header(key).is_some_and(|v| same(v, value));
            assert!(
                !carried || REWRITTEN.contains(&key),
                "the copy carries {key:?}"
            );
        } else if key != headers::DELIVERY_COUNT && !REWRITTEN.contains(&key) {
            let kept = copy.header(key).is_some_and(|v| same(v, value));
            assert!(kept, "the copy keeps header {key:?}");
        }
    }
    let table = c.headers().as_ref().expect("a copy has headers");
    assert!(HeaderKey::public().verify(id, table), "the copy is sealed");
    let long = |s: &ShortString| AMQPValue::LongString(LongString::from(s.as_str().as_bytes()));
    for (property, aside) in [
        (original.expiration(), headers::ORIGINAL_EXPIRATION),
        (original.user_id(), headers::ORIGINAL_USER_ID),
    ] {
        if let Some(value) = property {
            assert_eq!(copy.header(aside), Some(&long(value)));
        }
    }
    assert_eq!((c.expiration(), c.user_id()), (&None, &None));
    assert_eq!(c.message_id(), original.message_id());
    assert_eq!(c.kind(), original.kind());
    assert!(copy.header(headers::HANDOFF_ID).is_some());
    check_bounded(copy.reason().expect("the copy carries its reason"));
}

/// Equal values, floating-point ones bit for bit (a NaN header is kept as it came).
fn same(a: &AMQPValue, b: &AMQPValue) -> bool {
    match (a, b) {
        (AMQPValue::Float(x), AMQPValue::Float(y)) => x.to_bits() == y.to_bits(),
        (AMQPValue::Double(x), AMQPValue::Double(y)) => x.to_bits() == y.to_bits(),
        (AMQPValue::FieldArray(x), AMQPValue::FieldArray(y)) => {
            let (x, y) = (x.as_slice(), y.as_slice());
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y))
        }
        (AMQPValue::FieldTable(x), AMQPValue::FieldTable(y)) => {
            let (x, y) = (x.inner(), y.inner());
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}
