//! Writes the seed corpora of the fuzz targets to `fuzz/seeds/<target>/` (or under the
//! directory given as the first argument): small inputs that reach each rule of the gate, each
//! shape of hostile header, each row of the decision table. The files are committed; run this
//! again after changing an input layout (`cargo run --bin seeds` in `fuzz/`).
//!
//! Not a fuzz target: `scripts/fuzz.sh` does not run it.

use std::path::{Path, PathBuf};

use lily_mq_core::headers;
use lily_mq_fuzz::delivery::{BODY_MARKER, SMALL_LIMITS};
use lily_mq_fuzz::script::{flag, verdict};
use lily_mq_fuzz::wire::{Properties, Table, Value, delivery};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn main() {
    let root = std::env::args_os().nth(1).map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds"),
        PathBuf::from,
    );
    let deliveries = deliveries();
    for target in ["gate", "headers", "lane"] {
        write(&root.join(target), &deliveries);
    }
    write(&root.join("codec"), &codec());
    write(&root.join("machine"), &machine());
    write(&root.join("frames"), &frames());
}

/// Streams as the broker sends them (each after the byte that chooses how it is split):
/// deliveries with every kind of property and header, text that is not UTF-8, nesting past
/// the cap, a protocol header, a frame cut short.
fn frames() -> Vec<(&'static str, Vec<u8>)> {
    use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame};
    use amq_protocol::protocol::{AMQPClass, basic, channel};
    use amq_protocol_types::{AMQPValue, FieldArray, FieldTable};

    let encode = |frames: &[AMQPFrame]| {
        let mut wire = vec![0x31];
        for frame in frames {
            wire = gen_frame(frame)(WriteContext::from(wire))
                .expect("encodes")
                .write;
        }
        wire
    };
    let message = |tag: u64, routing_key: &str, properties: basic::AMQPProperties| {
        vec![
            AMQPFrame::Method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                    consumer_tag: "ctag".into(),
                    delivery_tag: tag,
                    redelivered: false,
                    exchange: "".into(),
                    routing_key: routing_key.into(),
                })),
            ),
            AMQPFrame::Header(
                1,
                AMQPContentHeader {
                    class_id: 60,
                    body_size: 2,
                    properties,
                },
            ),
            AMQPFrame::Body(1, b"{}".to_vec()),
        ]
    };
    let mut headers = FieldTable::default();
    headers.insert("x-café".into(), AMQPValue::LongString("naïve".into()));
    headers.insert(
        "list".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongInt(1)])),
    );
    let full = basic::AMQPProperties::default()
        .with_message_id("m-1".into())
        .with_type("order.placed".into())
        .with_content_type("application/json".into())
        .with_correlation_id("c".into())
        .with_app_id("app".into())
        .with_timestamp(1)
        .with_headers(headers);
    let mut traffic = vec![AMQPFrame::Method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
    )];
    traffic.extend(message(1, "orders", full.clone()));
    traffic.push(AMQPFrame::Heartbeat);
    traffic.extend(message(2, "#BAD#", full));
    let valid = encode(&traffic);
    let mut poison = valid.clone();
    let at = poison
        .windows(5)
        .position(|w| w == b"#BAD#")
        .expect("marker");
    poison[at] = 0xff;
    poison[at + 4] = 0xc3;
    let mut deep = AMQPValue::Boolean(true);
    for _ in 0..70 {
        let mut t = FieldTable::default();
        t.insert("n".into(), deep);
        deep = AMQPValue::FieldTable(t);
    }
    let mut nested = FieldTable::default();
    nested.insert("deep".into(), deep);
    let deep = encode(&message(
        3,
        "orders",
        basic::AMQPProperties::default().with_headers(nested),
    ));
    let cut = valid[..valid.len() - 5].to_vec();
    vec![
        ("valid", valid),
        ("not_utf8", poison),
        ("nested_past_the_cap", deep),
        ("protocol_header", b"\x31AMQP\x00\x00\x09\x01".to_vec()),
        ("cut_short", cut),
    ]
}

fn write(dir: &Path, seeds: &[(&str, Vec<u8>)]) {
    std::fs::create_dir_all(dir).expect("create the seed directory");
    for (name, data) in seeds {
        std::fs::write(dir.join(name), data).expect("write a seed");
    }
    println!("{}: {} seeds", dir.display(), seeds.len());
}

/// `p` with the seal Lily writes (the public key) over its `x-lily-*` headers and id.
fn sealed(p: Properties) -> Properties {
    use amq_protocol_types::{AMQPValue, FieldArray, FieldTable};
    fn amqp(value: &Value) -> AMQPValue {
        match value {
            Value::Bool(b) => AMQPValue::Boolean(*b),
            Value::I32(n) => AMQPValue::LongInt(*n),
            Value::U32(n) => AMQPValue::LongUInt(*n),
            Value::I64(n) => AMQPValue::LongLongInt(*n),
            Value::F64(n) => AMQPValue::Double(*n),
            Value::Timestamp(n) => AMQPValue::Timestamp(*n),
            Value::Text(t) => AMQPValue::LongString(t.clone().into()),
            Value::Bytes(b) => AMQPValue::ByteArray(b.clone().into()),
            Value::Void => AMQPValue::Void,
            Value::Array(items) => {
                AMQPValue::FieldArray(FieldArray::from(items.iter().map(amqp).collect::<Vec<_>>()))
            }
            Value::Table(t) => AMQPValue::FieldTable(table(t)),
        }
    }
    fn table(t: &Table) -> FieldTable {
        let mut out = FieldTable::default();
        for (key, value) in &t.0 {
            out.insert(String::from_utf8_lossy(key).as_ref().into(), amqp(value));
        }
        out
    }
    let id = p
        .message_id
        .as_deref()
        .map(String::from_utf8_lossy)
        .unwrap_or_default()
        .into_owned();
    let headers = p.headers.as_ref().map(table).unwrap_or_default();
    let seal = lily_mq_core::HeaderKey::public().seal(&id, &headers);
    let text = lily_mq_core::transport::as_text(&seal)
        .unwrap_or_default()
        .to_owned();
    p.header(headers::SEAL, Value::text(text))
}

/// A body of `len` bytes once [`BODY_MARKER`] is appended.
fn body(len: usize) -> Vec<u8> {
    vec![b'b'; len - BODY_MARKER.len()]
}

fn deliveries() -> Vec<(&'static str, Vec<u8>)> {
    let small =
        |p: &Properties, body: &[u8]| delivery(SMALL_LIMITS, b"orders", b"order.placed", p, body);
    let order = || Properties::message("m-1", "order.placed");
    let json = br#"{"quantity":2}"#;
    let nested = |depth: usize| {
        let mut value = Value::Bool(true);
        for _ in 0..depth {
            value = Value::Table(Table::default().with("n", value));
        }
        value
    };
    let x_death = Value::Array(vec![Value::Table(
        Table::default()
            .with("count", Value::I64(1))
            .with("reason", Value::text("expired"))
            .with("queue", Value::text("orders.retry.5s"))
            .with("routing-keys", Value::Array(vec![Value::text("orders")])),
    )]);
    let four = (0..4).fold(order(), |p, i| p.header(format!("h{i}"), Value::Bool(true)));
    vec![
        (
            "valid",
            small(
                &order().header(headers::SCHEMA_VERSION, Value::I32(1)),
                json,
            ),
        ),
        (
            "valid_traced",
            small(
                &order()
                    .header(headers::TRACEPARENT, Value::text(TRACEPARENT))
                    .header(headers::TRACESTATE, Value::text("lily=1")),
                json,
            ),
        ),
        ("x_death", small(&order().header("x-death", x_death), json)),
        ("at_every_small_limit", {
            let p = Properties::message(&"i".repeat(16), &"t".repeat(16))
                .header("k".repeat(16), Value::Text(vec![b'v'; 64]))
                .header("a", Value::I32(1))
                .header("b", Value::Bool(true));
            small(&p, &body(64))
        }),
        ("body_over_small_limit", small(&order(), &body(65))),
        (
            "five_headers",
            small(&four.clone().header("h4", Value::Void), json),
        ),
        ("retry_copy_of_four_headers", {
            // Lily's and the broker's headers count apart from the producer's four.
            let p = four
                .clone()
                .header(headers::ATTEMPT, Value::U32(2))
                .header(headers::FAILURE_KIND, Value::text("retryable"))
                .header(
                    "x-death",
                    Value::Array(vec![Value::Table(Table::default())]),
                )
                .header(headers::DELIVERY_COUNT, Value::I64(1));
            small(&p, json)
        }),
        ("too_deep", small(&order().header("deep", nested(5)), json)),
        (
            "key_too_long",
            small(&order().header("k".repeat(17), Value::Bool(true)), json),
        ),
        (
            "value_too_long",
            small(&order().header("k", Value::Bytes(vec![0; 65])), json),
        ),
        ("header_bytes_over", {
            let p = order()
                .header("a", Value::text("x".repeat(60)))
                .header("b", Value::text("y".repeat(60)));
            small(&p, json)
        }),
        ("keys_only_bytes", {
            let empty = || Value::Table(Table::default());
            let p = order()
                .header("k".repeat(16), empty())
                .header("l".repeat(16), empty())
                .header("m".repeat(16), empty());
            delivery(
                [255, 255, 255, 255, 7, 2, 255, 255, 255],
                b"",
                b"q",
                &p,
                json,
            )
        }),
        ("id_not_utf8", {
            let mut p = order();
            p.message_id = Some(b"m-\xff".to_vec());
            small(&p, json)
        }),
        (
            "key_not_utf8",
            small(&order().header(b"k\xc3(", Value::Bool(true)), json),
        ),
        (
            "nested_key_not_utf8",
            small(
                &order().header(
                    "t",
                    Value::Table(Table::default().with(b"\xfe", Value::Void)),
                ),
                json,
            ),
        ),
        (
            "routing_key_not_utf8",
            delivery(SMALL_LIMITS, b"orders", b"rk-\x80", &order(), json),
        ),
        ("app_id_not_utf8", {
            let mut p = order();
            p.app_id = Some(b"\xc3\x28".to_vec());
            small(&p, json)
        }),
        ("id_with_space_and_control", {
            let mut p = order();
            p.message_id = Some(b"m 1\x07\n".to_vec());
            small(&p, json)
        }),
        ("no_id_no_type", small(&Properties::default(), json)),
        (
            "attempt_zero",
            small(&order().header(headers::ATTEMPT, Value::U32(0)), json),
        ),
        (
            "attempt_over_max",
            small(&order().header(headers::ATTEMPT, Value::I64(6)), json),
        ),
        (
            "attempt_as_text",
            small(&order().header(headers::ATTEMPT, Value::text("3")), json),
        ),
        (
            "schema_negative",
            small(
                &order().header(headers::SCHEMA_VERSION, Value::I64(-1)),
                json,
            ),
        ),
        ("routing_and_moved", {
            let mut p = order()
                .header(headers::CC, Value::Array(vec![Value::text("side")]))
                .header(headers::BCC, Value::Array(vec![Value::text("hidden")]));
            p.expiration = Some(b"60000".to_vec());
            p.user_id = Some(b"producer".to_vec());
            p.correlation_id = Some(b"c-1".to_vec());
            small(&p, json)
        }),
        ("held_for_dead_letter", {
            let p = order()
                .header(headers::HELD_FOR, Value::text("dead-letter"))
                .header(headers::FAILURE_KIND, Value::text("permanent"))
                .header(headers::HOLDS, Value::U32(2));
            small(&p, json)
        }),
        ("held_refused_traced", {
            let mut p = Properties::default()
                .header(headers::HELD_FOR, Value::text("parking"))
                .header(headers::REASON, Value::text("line\nbreak"))
                .header(headers::TRACEPARENT, Value::text(TRACEPARENT));
            p.kind = Some(b"order.placed".to_vec());
            small(&p, json)
        }),
        ("retried_type", {
            let p = Properties::message("m-2", "fuzz.retry")
                .header(headers::ATTEMPT, Value::U32(2))
                .header(headers::REPLAYED_FROM, Value::text("parking"));
            small(&p, json)
        }),
        // Lily's headers count only under Lily's seal: the same, sealed.
        ("retried_type_sealed", {
            let p = Properties::message("m-2", "fuzz.retry")
                .header(headers::ATTEMPT, Value::U32(2))
                .header(headers::REPLAYED_FROM, Value::text("parking"));
            small(&sealed(p), json)
        }),
        // Times no RFC 3339 writes, for the lane rendering.
        (
            "times_out_of_range",
            small(
                &order()
                    .header(headers::LAST_FAILURE_AT, Value::I64(i64::MAX))
                    .header(headers::FIRST_FAILURE_AT, Value::I64(-5)),
                json,
            ),
        ),
        ("held_for_dead_letter_sealed", {
            let p = order()
                .header(headers::HELD_FOR, Value::text("dead-letter"))
                .header(headers::FAILURE_KIND, Value::text("permanent"))
                .header(headers::HOLDS, Value::U32(2));
            small(&sealed(p), json)
        }),
        ("refused_bad_traceparent", {
            let p = Properties::default().header(
                headers::TRACEPARENT,
                Value::text(TRACEPARENT.to_uppercase()),
            );
            small(&p, json)
        }),
        ("content_type_params", {
            let mut p = order();
            p.content_type = Some(b"application/json; charset=utf-8".to_vec());
            small(&p, json)
        }),
    ]
}

fn codec() -> Vec<(&'static str, Vec<u8>)> {
    let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
    let seeds: Vec<(&str, &[u8])> = vec![
        (
            "order",
            br#"{"id":"o-1","quantity":2,"tags":["a"],"note":null,"price":9.99}"#,
        ),
        (
            "gift",
            br#"{"id":"o-2","quantity":1,"kind":{"type":"gift","to":"ann"}}"#,
        ),
        ("wrong_shape", br#"{"id":"o-3","quantity":"secret-4111"}"#),
        ("negative", br#"{"id":"o-4","quantity":-1}"#),
        (
            "floats",
            b"[0.1,-0.0,1e308,5e-324,2.2250738585072014e-308,123456789.123456789]",
        ),
        ("ints", b"[18446744073709551615,-9223372036854775808,1e400]"),
        ("escapes", br#"{"s":"a\"b\\c\n\u00e9\ud83d\ude00"}"#),
        ("lone_surrogate", br#""\ud800""#),
        ("duplicate_keys", br#"{"a":1,"a":2}"#),
        ("truncated", br#"{"id":"o-5","quan"#),
        ("not_utf8", b"\"\xff\xfe\""),
        ("bom", b"\xef\xbb\xbf{}"),
        ("trailing", b"{} x"),
        ("empty", b""),
        ("deep", deep.as_bytes()),
    ];
    seeds.into_iter().map(|(n, d)| (n, d.to_vec())).collect()
}

/// `[policy; 6] [arrival; 9] choices…` (see `src/script.rs`).
fn machine() -> Vec<(&'static str, Vec<u8>)> {
    // Three attempts, two buckets, two requeues, 10 s budget, two deferral delays, release
    // after 1 s at the limit.
    const POLICY: [u8; 6] = [2, 2, 2, 0, 1, 1];
    let seed = |arrival: [u8; 9], choices: &[u8]| {
        let mut out = POLICY.to_vec();
        out.extend(arrival);
        out.extend_from_slice(choices);
        out
    };
    let fresh = |v: u8, f: u8| [v, 0, f, 0, 0, 0, 0, 0, 0];
    let dispatched = fresh(verdict::DISPATCHED, 0);
    let scoped = fresh(verdict::DISPATCHED, flag::SCOPED);
    // Choice bytes. Handler: result, cleanup, wait, authority. Handoff: result, wait,
    // authority. Settle: refused when ≥ 0xF0. Hold: cut short when 7 (mod 8).
    let (ok, retryable, permanent, indeterminate, hinted) = (0, 1, 2, 3, 4);
    let (panicked, timed_out, deferred, transient) = (7, 8, 9, 10);
    let (confirmed, returned, nacked, timeout) = (0, 1, 2, 4);
    let lost = 0xFF;
    vec![
        ("ack", seed(dispatched, &[])),
        (
            "retry",
            seed(dispatched, &[retryable, 0, 0, 0, confirmed, 0, 0, 0]),
        ),
        (
            "retry_hint",
            seed(dispatched, &[hinted, 2, 0, 0, 0, confirmed, 0, 0, 0]),
        ),
        (
            "dead_letter",
            seed(dispatched, &[permanent, 0, 0, 0, confirmed, 0, 0, 0]),
        ),
        (
            "park",
            seed(dispatched, &[indeterminate, 0, 0, 0, confirmed, 0, 0, 0]),
        ),
        ("panic", seed(dispatched, &[panicked, 0, 0, 0])),
        ("timeout", seed(dispatched, &[timed_out, 0, 0, 0])),
        ("cleanup_failed", seed(dispatched, &[ok, 3, 0, 0])),
        (
            "exhausted",
            seed([0, 2, 0, 0, 0, 0, 0, 0, 0], &[retryable, 0, 0, 0]),
        ),
        (
            "returned_then_requeued",
            seed(dispatched, &[permanent, 0, 0, 0, returned, 0, 0]),
        ),
        (
            "nacked",
            seed(dispatched, &[retryable, 0, 0, 0, nacked, 0, 0]),
        ),
        (
            "confirm_timeout",
            seed(dispatched, &[permanent, 0, 0, 0, timeout, 0]),
        ),
        (
            "ack_refused",
            seed(dispatched, &[permanent, 0, 0, 0, confirmed, 0, 0, lost]),
        ),
        ("authority_lost", seed(dispatched, &[permanent, 0, 0, lost])),
        (
            "committed",
            seed(scoped, &[0, 0, 0, ok, 0, 0, 0, 0, 0, 0, 0]),
        ),
        (
            "commit_ambiguous",
            seed(scoped, &[0, 0, 0, ok, 0, 0, 0, 2, 0, 9, 0]),
        ),
        ("duplicate", seed(scoped, &[2, 0, 0])),
        ("lease_held", seed(scoped, &[5, 1, 0, 0])),
        (
            "transient_reruns",
            seed(scoped, &[0, 0, 0, transient, 0, 0, 0, 0, 0]),
        ),
        ("deferred", seed(dispatched, &[deferred, 0, 0, 0])),
        ("oversized", seed(fresh(verdict::OVERSIZED, 0), &[])),
        (
            "invalid",
            seed(fresh(verdict::INVALID, 0), &[confirmed, 0, 0, 0]),
        ),
        (
            "invalid_no_id_failing",
            seed(fresh(verdict::INVALID, 0), &[returned, 0, 0, 0]),
        ),
        ("undispatched", seed(fresh(verdict::UNDISPATCHED, 0), &[])),
        (
            "held_copy",
            seed([0, 0, 0, 0, 0, 0, 2, 1, 0], &[confirmed, 0, 0, 0]),
        ),
        (
            "waited_past_the_most",
            seed([0, 0, flag::SCOPED | flag::WAITS, 0, 0, 3, 0, 0, 0], &[]),
        ),
        (
            "replayed_from_parking",
            seed([0, 0, 0, 0, 0, 0, 0, 0, 2], &[retryable, 0, 0, 0]),
        ),
        (
            "quorum_at_limit_failing",
            seed(
                [0, 0, flag::QUORUM, 0, 2, 0, 0, 0, 0],
                &[permanent, 0, 0, 0, returned, 0, 0],
            ),
        ),
        (
            "redelivered_counted",
            seed(
                [0, 0, flag::REDELIVERED, 1, 0, 0, 0, 0, 0],
                &[deferred, 0, 0, 0, 0],
            ),
        ),
    ]
}
