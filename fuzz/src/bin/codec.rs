//! Fuzz target `codec`: `JsonCodec::decode` of arbitrary bytes into `serde_json::Value` and
//! into a small payload struct.
//!
//! Invariants: it returns, never panics; an error is one of the codec's bounded reasons, which
//! never quote the body; whatever decodes encodes again and decodes to an equal value.

use lily_mq_core::{Codec, JsonCodec, Reason};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A payload of the kind handlers take.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Order {
    id: String,
    quantity: u32,
    #[serde(default)]
    tags: Vec<String>,
    note: Option<String>,
    price: Option<f64>,
    #[serde(default)]
    kind: Kind,
}

#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
enum Kind {
    #[default]
    Standard,
    Gift {
        to: String,
    },
}

fn main() {
    lily_mq_fuzz::run(check);
}

fn check(data: &[u8]) {
    round_trip::<Value>(data, same_value);
    let value = |o: &Order| serde_json::to_value(o).expect("an order encodes");
    round_trip::<Order>(data, |a, b| same_value(&value(a), &value(b)));
}

fn round_trip<T: DeserializeOwned + Serialize + std::fmt::Debug>(
    data: &[u8],
    same: impl Fn(&T, &T) -> bool,
) {
    match JsonCodec::decode::<T>(data) {
        Ok(value) => {
            let encoded = serde_json::to_vec(&value).expect("a decoded value encodes");
            let again = JsonCodec::decode::<T>(&encoded)
                .unwrap_or_else(|e| panic!("re-encoded value does not decode: {e}"));
            assert!(same(&value, &again), "decode(encode(v)) differs from v");
        }
        Err(reason) => check_reason(&reason),
    }
}

/// The codec's reasons: `payload is <category> (line L, column C)`, nothing from the body.
fn check_reason(reason: &Reason) {
    let text = reason.as_str();
    let rest = [
        "payload is unreadable (",
        "payload is not valid JSON (",
        "payload is JSON of the wrong shape (",
        "payload is truncated JSON (",
    ]
    .iter()
    .find_map(|prefix| text.strip_prefix(prefix))
    .unwrap_or_else(|| panic!("unexpected reason {text:?}"));
    let position = rest
        .strip_prefix("line ")
        .and_then(|r| r.strip_suffix(')'))
        .and_then(|r| r.split_once(", column "));
    let numeric = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    assert!(
        position.is_some_and(|(line, column)| numeric(line) && numeric(column)),
        "unexpected reason {text:?}"
    );
}

/// Equal, except that floating-point numbers may be a couple of units in the last place apart:
/// without serde_json's `float_roundtrip` feature (Lily does not turn it on), parsing is not
/// always correctly rounded, so `123456789.123456789` comes back 1 ULP off.
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => {
            ulps(x.as_f64().unwrap(), y.as_f64().unwrap()) <= 2
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_value(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => a == b,
    }
}

/// How many representable doubles lie between `x` and `y`.
fn ulps(x: f64, y: f64) -> u64 {
    // Bits reordered so that the integers are in the order of the numbers they stand for.
    let ordered = |v: f64| {
        let bits = v.to_bits() as i64;
        if bits < 0 { i64::MIN - bits } else { bits }
    };
    ordered(x).abs_diff(ordered(y))
}
