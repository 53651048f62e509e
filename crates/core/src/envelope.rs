//! The gate: envelope validation and metadata bounds, checked before any application code.
//!
//! Headers and properties come from strangers. [`inspect`] walks what the client library already
//! parsed, stops at the first bound it breaks and allocates nothing; its verdict decides between
//! a broker-native reject (oversized body), a dead-letter handoff with sanitized metadata
//! (invalid envelope) and dispatch.

use amq_protocol_types::{AMQPValue, FieldTable, ShortString};

use crate::headers::{self, as_u32};
use crate::reason::Reason;
use crate::seal::HeaderKey;

/// Bounds on what a delivery may carry. The defaults suit typical JSON commands and events.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Largest body accepted, in bytes. Larger bodies are rejected to the broker's DLX.
    pub max_body_bytes: usize,
    /// Most header entries, counting entries of nested tables and arrays. The headers Lily
    /// and the broker write ([`headers::is_reserved`]: `x-lily-*`, `x-death` and its kin,
    /// `x-delivery-count`) are counted apart from the producer's, each group against this
    /// limit and [`Limits::max_header_bytes`], so a message admitted once is admitted again
    /// when it comes back from a retry bucket with Lily's headers and the broker's.
    pub max_headers: usize,
    /// Longest header key, in bytes.
    pub max_header_key_len: usize,
    /// Longest string or byte-array header value, in bytes.
    pub max_header_value_len: usize,
    /// Deepest nesting of tables and arrays (`x-death` needs 3).
    pub max_header_depth: usize,
    /// Most bytes across all header keys and values (each group apart, as for
    /// [`Limits::max_headers`]).
    pub max_header_bytes: usize,
    /// Longest message id, in bytes.
    pub max_message_id_len: usize,
    /// Longest message type, in bytes.
    pub max_type_len: usize,
    /// Highest attempt number accepted in [`headers::ATTEMPT`].
    pub max_attempt: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 1024 * 1024,
            max_headers: 64,
            max_header_key_len: 128,
            max_header_value_len: 4096,
            max_header_depth: 4,
            max_header_bytes: 16 * 1024,
            max_message_id_len: 128,
            max_type_len: 128,
            max_attempt: 1000,
        }
    }
}

/// Borrowed view of the properties the gate reads.
#[derive(Clone, Copy, Debug, Default)]
pub struct PropertiesView<'a> {
    /// The `message_id` property.
    pub message_id: Option<&'a str>,
    /// The `type` property.
    pub kind: Option<&'a str>,
    /// The `content_type` property.
    pub content_type: Option<&'a str>,
    /// The headers table.
    pub headers: Option<&'a FieldTable>,
    /// The first property, routing field or header key whose wire bytes were not valid UTF-8:
    /// the transport rewrites such bytes before its AMQP client parses them, and names the
    /// field here, since the text it hands over is only an approximation.
    pub not_utf8: Option<&'static str>,
    /// The key Lily's headers are sealed with; `None` for the [public](HeaderKey::public) one.
    pub key: Option<&'a HeaderKey>,
}

/// A delivery that passed the gate: identity and routing facts, borrowed from the delivery.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Envelope<'a> {
    /// Operation identity: the `message_id` property.
    pub message_id: &'a str,
    /// Message type used for routing, such as `order.placed`.
    pub kind: &'a str,
    /// Schema version of the payload (header [`headers::SCHEMA_VERSION`], default 1).
    pub schema_version: u32,
    /// Content type without parameters, if set.
    pub content_type: Option<&'a str>,
    /// Application attempt, starting at 1.
    pub attempt: u32,
    /// Earlier deliveries counted by the broker (quorum queues only).
    pub delivery_count: Option<u32>,
    /// The headers Lily reads itself, found in the gate's walk.
    pub known: Known<'a>,
}

/// The values of the headers Lily reads itself, as they came. The gate finds them in the one
/// walk it makes over the headers anyway, instead of a lookup each.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Known<'a> {
    /// [`headers::ATTEMPT`].
    pub attempt: Option<&'a AMQPValue>,
    /// [`headers::SCHEMA_VERSION`].
    pub schema_version: Option<&'a AMQPValue>,
    /// [`headers::DELIVERY_COUNT`].
    pub delivery_count: Option<&'a AMQPValue>,
    /// [`headers::HELD_FOR`].
    pub held_for: Option<&'a AMQPValue>,
    /// [`headers::FAILURE_KIND`].
    pub failure_kind: Option<&'a AMQPValue>,
    /// [`headers::HOLDS`].
    pub holds: Option<&'a AMQPValue>,
    /// [`headers::REPLAYED_FROM`].
    pub replayed_from: Option<&'a AMQPValue>,
    /// [`headers::WAITS`].
    pub waits: Option<&'a AMQPValue>,
    /// The message carries headers of Lily's namespace without a valid
    /// [`SEAL`](headers::SEAL): a publisher's. None of them was read, and no copy of the
    /// message carries them.
    pub unsealed: bool,
}

/// The keys of [`Known`]'s headers.
const KNOWN: [&str; 8] = [
    headers::ATTEMPT,
    headers::SCHEMA_VERSION,
    headers::DELIVERY_COUNT,
    headers::HELD_FOR,
    headers::FAILURE_KIND,
    headers::HOLDS,
    headers::REPLAYED_FROM,
    headers::WAITS,
];

impl<'a> Known<'a> {
    /// Looks each of them up in `table`: for a delivery the gate refused before its walk ended.
    /// Lily's own are read only under a seal `key` (the public one when `None`) proves for
    /// `message_id`.
    pub fn lookup(
        table: Option<&'a FieldTable>,
        message_id: Option<&str>,
        key: Option<&HeaderKey>,
    ) -> Self {
        let mut known = Self::default();
        if let Some(table) = table {
            let lily = table.inner().keys().any(|k| headers::is_lily(k.as_str()));
            let trusted = lily && sealed(table, message_id.unwrap_or_default(), key);
            for key in KNOWN {
                if let Some(value) = table.inner().get(key)
                    && (trusted || !headers::is_lily(key))
                {
                    known.note(key, value);
                }
            }
            known.unsealed = lily && !trusted;
        }
        known
    }

    /// Keeps `value` if `key` is one of them.
    fn note(&mut self, key: &str, value: &'a AMQPValue) {
        let slot = match key {
            headers::ATTEMPT => &mut self.attempt,
            headers::SCHEMA_VERSION => &mut self.schema_version,
            headers::DELIVERY_COUNT => &mut self.delivery_count,
            headers::HELD_FOR => &mut self.held_for,
            headers::FAILURE_KIND => &mut self.failure_kind,
            headers::HOLDS => &mut self.holds,
            headers::REPLAYED_FROM => &mut self.replayed_from,
            headers::WAITS => &mut self.waits,
            _ => return,
        };
        *slot = Some(value);
    }
}

/// Whether `table`'s Lily headers carry a valid seal for `message_id` under `key` (the public
/// key when `None`).
fn sealed(table: &FieldTable, message_id: &str, key: Option<&HeaderKey>) -> bool {
    key.unwrap_or_else(|| HeaderKey::public_ref())
        .verify(message_id, table)
}

/// Why the gate refused a delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GateRejection {
    /// The body is larger than [`Limits::max_body_bytes`]: reject without requeue.
    Oversized {
        /// Body length in bytes.
        len: usize,
    },
    /// The envelope or its metadata breaks a rule: dead-letter with sanitized metadata.
    Invalid(Reason),
}

impl GateRejection {
    /// Why, in words, for the copy's reason header and logs (never quoting the body).
    pub fn reason(&self, limits: &Limits) -> Reason {
        match self {
            Self::Oversized { len } => Reason::new(format!(
                "body of {len} bytes is over the {} byte limit",
                limits.max_body_bytes
            )),
            Self::Invalid(reason) => reason.clone(),
        }
    }
}

/// Checks a delivery against `limits` before any application code runs.
///
/// # Errors
/// Returns the first rule the delivery breaks.
pub fn inspect<'a>(
    properties: &PropertiesView<'a>,
    body_len: usize,
    limits: &Limits,
) -> Result<Envelope<'a>, GateRejection> {
    if body_len > limits.max_body_bytes {
        return Err(GateRejection::Oversized { len: body_len });
    }
    let invalid = |reason: &'static str| GateRejection::Invalid(Reason::new(reason));
    if let Some(field) = properties.not_utf8 {
        return Err(GateRejection::Invalid(Reason::new(format!(
            "{field} is not valid UTF-8"
        ))));
    }
    let message_id = properties
        .message_id
        .ok_or_else(|| invalid("message_id property missing"))?;
    if !is_token(message_id, limits.max_message_id_len) {
        return Err(invalid("message_id empty, too long or not printable ASCII"));
    }
    let kind = properties
        .kind
        .ok_or_else(|| invalid("type property missing"))?;
    if !is_token(kind, limits.max_type_len) {
        return Err(invalid("type empty, too long or not printable ASCII"));
    }
    let mut known = Known::default();
    if let Some(table) = properties.headers {
        // The producer's headers and the ones Lily and the broker add are bounded apart.
        let (mut producer, mut reserved) = (Walk::default(), Walk::default());
        let mut lily = false;
        for (key, value) in table.inner() {
            let key_text = key.as_str();
            let walk = if headers::is_reserved(key_text) {
                &mut reserved
            } else {
                &mut producer
            };
            walk.entry(key, value, 1, limits)
                .map_err(GateRejection::Invalid)?;
            if headers::is_lily(key_text) {
                lily = true;
            } else {
                known.note(key_text, value);
            }
        }
        // Lily's namespace is read only under Lily's seal: a publisher's is not Lily's.
        if lily {
            if sealed(table, message_id, properties.key) {
                for (key, value) in table.inner() {
                    if headers::is_lily(key.as_str()) {
                        known.note(key.as_str(), value);
                    }
                }
            } else {
                known.unsealed = true;
            }
        }
    }
    let attempt = match known.attempt {
        Some(value) => as_u32(value)
            .filter(|n| (1..=limits.max_attempt).contains(n))
            .ok_or_else(|| invalid("x-lily-attempt is not an attempt number"))?,
        None => 1,
    };
    let schema_version = match known.schema_version {
        Some(value) => as_u32(value)
            .filter(|n| *n >= 1)
            .ok_or_else(|| invalid("schema-version is not a positive integer"))?,
        None => 1,
    };
    let delivery_count = known.delivery_count.and_then(as_u32);
    let content_type = properties
        .content_type
        .map(|ct| ct.split(';').next().unwrap_or(ct).trim());
    Ok(Envelope {
        message_id,
        kind,
        schema_version,
        content_type,
        attempt,
        delivery_count,
        known,
    })
}

/// True when `text` is 1..=`max` bytes of printable, non-space ASCII.
pub fn is_token(text: &str, max: usize) -> bool {
    !text.is_empty() && text.len() <= max && text.bytes().all(|b| b.is_ascii_graphic())
}

#[derive(Default)]
struct Walk {
    entries: usize,
    bytes: usize,
}

impl Walk {
    fn table(&mut self, table: &FieldTable, depth: usize, limits: &Limits) -> Result<(), Reason> {
        if depth > limits.max_header_depth {
            return Err(Reason::new("headers nested too deeply"));
        }
        for (key, value) in table.inner() {
            self.entry(key, value, depth, limits)?;
        }
        Ok(())
    }

    fn entry(
        &mut self,
        key: &ShortString,
        value: &AMQPValue,
        depth: usize,
        limits: &Limits,
    ) -> Result<(), Reason> {
        if key.as_str().len() > limits.max_header_key_len {
            return Err(Reason::new("header key too long"));
        }
        self.bytes += key.as_str().len();
        // Checked here too: a key whose value is a table or array adds no value bytes.
        if self.bytes > limits.max_header_bytes {
            return Err(Reason::new("headers too large in total"));
        }
        self.value(value, depth, limits)
    }

    fn value(&mut self, value: &AMQPValue, depth: usize, limits: &Limits) -> Result<(), Reason> {
        self.entries += 1;
        if self.entries > limits.max_headers {
            return Err(Reason::new("too many headers"));
        }
        // Strings and byte arrays count by their length; other scalars count as 8 bytes toward
        // the total but have no length of their own to bound.
        let (len, measured) = match value {
            AMQPValue::ShortString(s) => (s.as_str().len(), true),
            AMQPValue::LongString(s) => (s.len(), true),
            AMQPValue::ByteArray(b) => (b.len(), true),
            AMQPValue::FieldTable(t) => return self.table(t, depth + 1, limits),
            AMQPValue::FieldArray(a) => {
                if depth + 1 > limits.max_header_depth {
                    return Err(Reason::new("headers nested too deeply"));
                }
                for item in a.as_slice() {
                    self.value(item, depth + 1, limits)?;
                }
                return Ok(());
            }
            _ => (8, false),
        };
        if measured && len > limits.max_header_value_len {
            return Err(Reason::new("header value too long"));
        }
        self.bytes += len;
        if self.bytes > limits.max_header_bytes {
            return Err(Reason::new("headers too large in total"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol_types::{FieldArray, LongString, ShortString};

    fn view<'a>(headers: Option<&'a FieldTable>) -> PropertiesView<'a> {
        PropertiesView {
            message_id: Some("m-1"),
            kind: Some("order.placed"),
            content_type: Some("application/json; charset=utf-8"),
            headers,
            not_utf8: None,
            key: None,
        }
    }

    /// `table` with the public key's seal for `m-1`, as Lily would write it.
    fn sealed(mut table: FieldTable) -> FieldTable {
        let seal = crate::HeaderKey::public().seal("m-1", &table);
        table.insert(headers::SEAL.into(), seal);
        table
    }

    fn rejection(props: &PropertiesView<'_>) -> String {
        match inspect(props, 10, &Limits::default()) {
            Err(GateRejection::Invalid(reason)) => reason.to_string(),
            other => panic!("expected invalid, got {other:?}"),
        }
    }

    #[test]
    fn valid_envelope_passes_with_defaults() {
        let env = inspect(&view(None), 10, &Limits::default()).expect("valid");
        assert_eq!(env.message_id, "m-1");
        assert_eq!(env.kind, "order.placed");
        assert_eq!(env.content_type, Some("application/json"));
        assert_eq!(
            (env.attempt, env.schema_version, env.delivery_count),
            (1, 1, None)
        );
    }

    #[test]
    fn oversized_body_is_refused_before_anything_else() {
        let props = PropertiesView::default();
        let limits = Limits {
            max_body_bytes: 4,
            ..Limits::default()
        };
        assert_eq!(
            inspect(&props, 5, &limits),
            Err(GateRejection::Oversized { len: 5 })
        );
    }

    #[test]
    fn missing_or_hostile_identity_is_invalid() {
        let mut props = view(None);
        props.message_id = None;
        assert_eq!(rejection(&props), "message_id property missing");
        props.message_id = Some("has space");
        assert!(rejection(&props).starts_with("message_id"));
        let long = "x".repeat(129);
        props.message_id = Some(&long);
        assert!(rejection(&props).starts_with("message_id"));
        props.message_id = Some("ok");
        props.kind = None;
        assert_eq!(rejection(&props), "type property missing");
    }

    #[test]
    fn text_that_was_not_utf8_is_refused_by_field() {
        let mut props = view(None);
        props.not_utf8 = Some("correlation_id");
        assert_eq!(rejection(&props), "correlation_id is not valid UTF-8");
        props.not_utf8 = Some("a nested header key");
        assert_eq!(rejection(&props), "a nested header key is not valid UTF-8");
    }

    #[test]
    fn header_bounds_are_enforced() {
        let mut many = FieldTable::default();
        for i in 0..65 {
            many.insert(ShortString::from(format!("h{i}")), AMQPValue::Boolean(true));
        }
        assert_eq!(rejection(&view(Some(&many))), "too many headers");

        let mut long_value = FieldTable::default();
        long_value.insert(
            "k".into(),
            AMQPValue::LongString(LongString::from(vec![b'a'; 4097])),
        );
        assert_eq!(rejection(&view(Some(&long_value))), "header value too long");

        let mut deep = FieldTable::default();
        for _ in 0..5 {
            let mut outer = FieldTable::default();
            outer.insert("n".into(), AMQPValue::FieldTable(deep));
            deep = outer;
        }
        assert_eq!(rejection(&view(Some(&deep))), "headers nested too deeply");

        let mut arrays = FieldTable::default();
        let mut nested = AMQPValue::Boolean(true);
        for _ in 0..5 {
            nested = AMQPValue::FieldArray(FieldArray::from(vec![nested]));
        }
        arrays.insert("a".into(), nested);
        assert_eq!(rejection(&view(Some(&arrays))), "headers nested too deeply");

        let mut wide = FieldTable::default();
        for i in 0..5 {
            wide.insert(
                ShortString::from(format!("k{i}")),
                AMQPValue::LongString(LongString::from(vec![b'a'; 4000])),
            );
        }
        assert_eq!(rejection(&view(Some(&wide))), "headers too large in total");
    }

    #[test]
    fn keys_of_tables_and_arrays_count_against_the_header_bytes() {
        let limits = Limits {
            max_header_bytes: 32,
            ..Limits::default()
        };
        // Keys of 16 bytes whose values add no bytes of their own.
        let keys = |n: usize, value: AMQPValue| {
            let mut table = FieldTable::default();
            for key in ["k", "l", "m"].into_iter().take(n) {
                table.insert(ShortString::from(key.repeat(16)), value.clone());
            }
            table
        };
        let empty_table = AMQPValue::FieldTable(FieldTable::default());
        let empty_array = AMQPValue::FieldArray(FieldArray::default());
        for value in [empty_table, empty_array] {
            assert!(inspect(&view(Some(&keys(2, value.clone()))), 1, &limits).is_ok());
            assert_eq!(
                inspect(&view(Some(&keys(3, value))), 1, &limits),
                Err(GateRejection::Invalid(Reason::new(
                    "headers too large in total"
                )))
            );
        }
    }

    #[test]
    fn only_strings_and_byte_arrays_are_held_to_the_value_length() {
        let limits = Limits {
            max_header_value_len: 4,
            ..Limits::default()
        };
        let mut table = FieldTable::default();
        table.insert("flag".into(), AMQPValue::Boolean(true));
        table.insert("count".into(), AMQPValue::LongLongInt(7));
        table.insert("tag".into(), AMQPValue::LongString("abcd".into()));
        assert!(inspect(&view(Some(&table)), 1, &limits).is_ok());
        table.insert("tag".into(), AMQPValue::LongString("abcde".into()));
        assert_eq!(
            inspect(&view(Some(&table)), 1, &limits),
            Err(GateRejection::Invalid(Reason::new("header value too long")))
        );
    }

    #[test]
    fn lily_headers_are_read_and_checked() {
        let mut table = FieldTable::default();
        table.insert(headers::ATTEMPT.into(), AMQPValue::LongInt(3));
        table.insert(
            headers::SCHEMA_VERSION.into(),
            AMQPValue::LongString("2".into()),
        );
        table.insert(headers::DELIVERY_COUNT.into(), AMQPValue::LongLongInt(4));
        let table = sealed(table);
        let env = inspect(&view(Some(&table)), 1, &Limits::default()).expect("valid");
        assert_eq!(
            (env.attempt, env.schema_version, env.delivery_count),
            (3, 2, Some(4))
        );

        let mut table = table;
        table.insert(headers::ATTEMPT.into(), AMQPValue::LongInt(0));
        let mut table = sealed(table);
        assert!(rejection(&view(Some(&table))).starts_with("x-lily-attempt"));
        table.insert(headers::ATTEMPT.into(), AMQPValue::LongInt(1));
        table.insert(headers::SCHEMA_VERSION.into(), AMQPValue::LongLongInt(-1));
        let table = sealed(table);
        assert!(rejection(&view(Some(&table))).starts_with("schema-version"));
    }

    #[test]
    fn x_death_from_the_broker_fits_the_default_bounds() {
        let mut death = FieldTable::default();
        death.insert("count".into(), AMQPValue::LongLongInt(1));
        death.insert("reason".into(), AMQPValue::LongString("expired".into()));
        death.insert(
            "queue".into(),
            AMQPValue::LongString("orders.retry.5s".into()),
        );
        let mut rk = FieldArray::default();
        rk.push(AMQPValue::LongString("orders".into()));
        death.insert("routing-keys".into(), AMQPValue::FieldArray(rk));
        let mut table = FieldTable::default();
        table.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        );
        assert!(inspect(&view(Some(&table)), 1, &Limits::default()).is_ok());
    }

    /// The broker's `x-death` after a message expired out of `buckets` retry buckets.
    fn x_death(buckets: usize) -> AMQPValue {
        let entries = (0..buckets)
            .map(|n| {
                let mut death = FieldTable::default();
                death.insert("count".into(), AMQPValue::LongLongInt(1));
                death.insert("reason".into(), AMQPValue::LongString("expired".into()));
                let queue = format!("orders.retry.{n}s");
                death.insert("queue".into(), AMQPValue::LongString(queue.into()));
                death.insert("time".into(), AMQPValue::Timestamp(1));
                death.insert("exchange".into(), AMQPValue::LongString("".into()));
                let keys = vec![AMQPValue::LongString("orders".into())];
                death.insert(
                    "routing-keys".into(),
                    AMQPValue::FieldArray(FieldArray::from(keys)),
                );
                AMQPValue::FieldTable(death)
            })
            .collect::<Vec<_>>();
        AMQPValue::FieldArray(FieldArray::from(entries))
    }

    #[test]
    fn the_headers_a_retry_adds_never_push_a_message_over_the_limits() {
        let limits = Limits::default();
        // The producer's headers, just under both the count and the byte limit.
        let mut table = FieldTable::default();
        for n in 0..limits.max_headers - 1 {
            let value = vec![b'v'; 16 * 1024 / limits.max_headers - 16];
            let key = format!("app-{n:02}");
            table.insert(key.into(), AMQPValue::LongString(value.into()));
        }
        assert!(inspect(&view(Some(&table)), 1, &limits).is_ok());
        // What a second trip through the retry buckets adds: Lily's headers and the broker's.
        for key in [
            headers::ATTEMPT,
            headers::FIRST_FAILURE_AT,
            headers::LAST_FAILURE_AT,
            headers::FAILURE_KIND,
            headers::ORIGINAL_EXCHANGE,
            headers::ORIGINAL_ROUTING_KEY,
            headers::SOURCE_QUEUE,
            headers::HANDOFF_ID,
        ] {
            table.insert(key.into(), AMQPValue::LongString("3".into()));
        }
        let reason = vec![b'r'; 512];
        table.insert(headers::REASON.into(), AMQPValue::LongString(reason.into()));
        table.insert("x-death".into(), x_death(2));
        for key in ["x-first-death-queue", "x-last-death-queue"] {
            table.insert(key.into(), AMQPValue::LongString("orders.retry.1s".into()));
        }
        table.insert(headers::DELIVERY_COUNT.into(), AMQPValue::LongLongInt(2));
        let mut table = sealed(table);
        let envelope = inspect(&view(Some(&table)), 1, &limits).expect("still admitted");
        assert_eq!(envelope.attempt, 3);

        // One more header of the producer's is one too many, as before.
        table.insert("app-last".into(), AMQPValue::LongString("x".into()));
        table.insert("app-extra".into(), AMQPValue::LongString("x".into()));
        assert_eq!(rejection(&view(Some(&table))), "too many headers");
    }

    #[test]
    fn the_walk_finds_the_known_headers_a_lookup_finds_and_no_nested_ones() {
        let mut table = FieldTable::default();
        for (n, key) in (1..).zip(KNOWN) {
            table.insert(key.into(), AMQPValue::LongInt(n));
        }
        table.insert("app".into(), AMQPValue::LongString("x".into()));
        let mut nested = FieldTable::default();
        nested.insert(headers::HELD_FOR.into(), AMQPValue::LongInt(99));
        table.insert("x-death".into(), AMQPValue::FieldTable(nested));
        let table = sealed(table);
        let envelope = inspect(&view(Some(&table)), 1, &Limits::default()).expect("valid");
        assert_eq!(
            envelope.known,
            Known::lookup(Some(&table), Some("m-1"), None)
        );
        assert_eq!(envelope.known.held_for, Some(&AMQPValue::LongInt(4)));
        assert_eq!(envelope.known.replayed_from, Some(&AMQPValue::LongInt(7)));
        assert!(!envelope.known.unsealed);
        assert_eq!(Known::lookup(None, None, None), Known::default());
    }

    #[test]
    fn lilys_headers_without_lilys_seal_are_not_read() {
        let mut table = FieldTable::default();
        table.insert(headers::ATTEMPT.into(), AMQPValue::LongUInt(4));
        table.insert(
            headers::HELD_FOR.into(),
            AMQPValue::LongString("dead-letter".into()),
        );
        table.insert(headers::SCHEMA_VERSION.into(), AMQPValue::LongUInt(2));
        // A garbage attempt number is not refused either: it is not Lily's.
        let mut garbage = table.clone();
        garbage.insert(headers::ATTEMPT.into(), AMQPValue::LongString("x".into()));
        for forged in [&table, &garbage] {
            let envelope = inspect(&view(Some(forged)), 1, &Limits::default()).expect("admitted");
            assert_eq!(envelope.attempt, 1);
            assert_eq!(
                envelope.schema_version, 2,
                "the producer's own header is read"
            );
            assert!(envelope.known.unsealed);
            assert_eq!(envelope.known.held_for, None);
            let looked_up = Known::lookup(Some(forged), Some("m-1"), None);
            assert!(looked_up.unsealed && looked_up.held_for.is_none());
        }
        // Sealed for another message, or under another key: not Lily's either.
        let other = {
            let mut t = table.clone();
            let seal = crate::HeaderKey::public().seal("m-2", &t);
            t.insert(headers::SEAL.into(), seal);
            t
        };
        let keyed = crate::HeaderKey::new("a secret of sixteen bytes or more");
        let sealed_public = sealed(table.clone());
        for (t, key) in [(&other, None), (&sealed_public, Some(&keyed))] {
            let props = PropertiesView {
                key,
                ..view(Some(t))
            };
            let envelope = inspect(&props, 1, &Limits::default()).expect("admitted");
            assert_eq!((envelope.attempt, envelope.known.unsealed), (1, true));
        }
        // Sealed for it under the key in use: read.
        let envelope = inspect(&view(Some(&sealed_public)), 1, &Limits::default()).expect("ok");
        assert_eq!((envelope.attempt, envelope.known.unsealed), (4, false));
    }

    #[test]
    fn headers_named_like_lilys_are_bounded_too() {
        let limits = Limits::default();
        let mut table = FieldTable::default();
        for n in 0..=limits.max_headers {
            let key = format!("x-lily-forged-{n}");
            table.insert(key.into(), AMQPValue::LongString("x".into()));
        }
        assert_eq!(rejection(&view(Some(&table))), "too many headers");
        let mut table = FieldTable::default();
        for n in 0..8 {
            let value = vec![b'v'; 4000];
            let key = format!("x-lily-forged-{n}");
            table.insert(key.into(), AMQPValue::LongString(value.into()));
        }
        assert_eq!(rejection(&view(Some(&table))), "headers too large in total");
    }
}
