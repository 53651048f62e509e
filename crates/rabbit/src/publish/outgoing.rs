//! What a [`Publisher`](super::publisher::Publisher) sends: a message and where it goes.

use std::time::{SystemTime, UNIX_EPOCH};

use lapin::BasicProperties;
use lapin::types::generation::gen_field_table;
use lapin::types::parsing::parse_field_table;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lily_mq_core::transport::{HandoffId, PropertiesView, inspect};
use lily_mq_core::{Limits, Reason, headers};
use serde::Serialize;

/// The version byte [`Outgoing::encode`] writes first.
const ENCODED: u8 = 1;

/// The header a message carries its publish id in, so a `basic.return` is matched to the one
/// message it concerns. The id is numbered per publisher and means nothing downstream.
pub const PUBLISH_ID: &str = "x-lily-publish-id";

/// Where a message goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Destination {
    pub(super) exchange: String,
    pub(super) routing_key: String,
}

impl Destination {
    /// The queue `name`, through the default exchange.
    pub fn queue(name: &str) -> Self {
        Self {
            exchange: String::new(),
            routing_key: name.to_owned(),
        }
    }

    /// The exchange `name`, with `routing_key`.
    pub fn exchange(name: &str, routing_key: &str) -> Self {
        Self {
            exchange: name.to_owned(),
            routing_key: routing_key.to_owned(),
        }
    }

    /// The exchange's name (empty for the default exchange).
    pub fn exchange_name(&self) -> &str {
        &self.exchange
    }

    /// The routing key (the queue's name through the default exchange).
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }
}

/// A message to publish: body, `message_id`, `type`, `schema-version` header and content type,
/// and any further headers.
///
/// ```
/// use lily_mq_rabbit::Outgoing;
///
/// #[derive(serde::Serialize)]
/// struct OrderPlaced { order_id: String, quantity: u32 }
///
/// let order = OrderPlaced { order_id: "o-17".into(), quantity: 2 };
/// let message = Outgoing::json("order.placed", "o-17", &order)?
///     .schema_version(2)
///     .header("tenant", "acme");
/// assert_eq!(message.message_id(), "o-17");
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone)]
pub struct Outgoing {
    pub(crate) body: Vec<u8>,
    message_id: String,
    kind: String,
    content_type: String,
    schema_version: u32,
    headers: Vec<(String, AMQPValue)>,
}

impl Outgoing {
    /// `value` as JSON (`application/json`), of type `kind`, with id `message_id`, schema
    /// version 1.
    ///
    /// # Errors
    /// `value` does not serialize (a map with keys that are not strings, say).
    pub fn json<T: Serialize + ?Sized>(
        kind: &str,
        message_id: &str,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        let body = serde_json::to_vec(value)?;
        Ok(Self::bytes(kind, message_id, "application/json", body))
    }

    /// `body` as it is, of type `kind` and `content_type`, with id `message_id`, schema
    /// version 1.
    pub fn bytes(kind: &str, message_id: &str, content_type: &str, body: Vec<u8>) -> Self {
        Self {
            body,
            message_id: message_id.to_owned(),
            kind: kind.to_owned(),
            content_type: content_type.to_owned(),
            schema_version: 1,
            headers: Vec::new(),
        }
    }

    /// Sets the `schema-version` header (1 unless set).
    #[must_use]
    pub fn schema_version(mut self, version: u32) -> Self {
        self.schema_version = version;
        self
    }

    /// Adds a header; a header of the same key is replaced.
    #[must_use]
    pub fn header(mut self, key: &str, value: impl Into<HeaderValue>) -> Self {
        self.headers.retain(|(k, _)| k != key);
        self.headers.push((key.to_owned(), value.into().0));
        self
    }

    /// The `message_id`.
    pub fn message_id(&self) -> &str {
        &self.message_id
    }

    /// The `type`.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The body.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// The message as bytes to keep, for an outbox that publishes it later; read back whole by
    /// [`Outgoing::decode`]. A version byte, then an AMQP field table of the id, type, content
    /// type, schema version and headers (each header keeps its exact AMQP type), then the body.
    ///
    /// # Errors
    /// What publishing it would refuse anyway: an id, type, content type or header key over
    /// 255 bytes, or one of Lily's own headers.
    pub fn encode(&self) -> Result<Vec<u8>, Reason> {
        self.build(HandoffId::new(0))?;
        let text = |s: &str| AMQPValue::LongString(s.into());
        let mut headers = FieldTable::default();
        for (key, value) in &self.headers {
            headers.insert(key.as_str().into(), value.clone());
        }
        let mut table = FieldTable::default();
        table.insert("message-id".into(), text(&self.message_id));
        table.insert("type".into(), text(&self.kind));
        table.insert("content-type".into(), text(&self.content_type));
        table.insert(
            "schema-version".into(),
            AMQPValue::LongUInt(self.schema_version),
        );
        table.insert("headers".into(), AMQPValue::FieldTable(headers));
        let mut bytes = cookie_factory::gen_simple(gen_field_table(&table), vec![ENCODED])
            .map_err(|_| Reason::new("the headers do not encode"))?;
        bytes.extend_from_slice(&self.body);
        Ok(bytes)
    }

    /// The message [`Outgoing::encode`] wrote.
    ///
    /// # Errors
    /// The bytes are not what `encode` writes (another version, or damaged).
    pub fn decode(bytes: &[u8]) -> Result<Self, Reason> {
        let broken = || Reason::new("not an encoded Outgoing of version 1");
        let Some((&ENCODED, rest)) = bytes.split_first() else {
            return Err(broken());
        };
        let (body, table) = parse_field_table(rest).map_err(|_| broken())?;
        let table = table.inner();
        let text = |key: &str| match table.get(key) {
            Some(AMQPValue::LongString(s)) => std::str::from_utf8(s.as_bytes()).ok(),
            _ => None,
        };
        let (Some(message_id), Some(kind), Some(content_type)) =
            (text("message-id"), text("type"), text("content-type"))
        else {
            return Err(broken());
        };
        let Some(AMQPValue::LongUInt(schema_version)) = table.get("schema-version") else {
            return Err(broken());
        };
        let Some(AMQPValue::FieldTable(headers)) = table.get("headers") else {
            return Err(broken());
        };
        Ok(Self {
            body: body.to_vec(),
            message_id: message_id.to_owned(),
            kind: kind.to_owned(),
            content_type: content_type.to_owned(),
            schema_version: *schema_version,
            headers: headers
                .inner()
                .iter()
                .map(|(k, v)| (k.as_str().to_owned(), v.clone()))
                .collect(),
        })
    }

    /// The properties to publish with, or why the consumer's gate would refuse the message.
    pub(super) fn properties(
        &self,
        id: HandoffId,
        limits: &Limits,
    ) -> Result<BasicProperties, Reason> {
        let properties = self.build(id)?;
        let view = PropertiesView {
            message_id: Some(&self.message_id),
            kind: Some(&self.kind),
            content_type: Some(&self.content_type),
            // What Lily adds goes through the gate too: the consumer counts every header.
            headers: properties.headers().as_ref(),
            not_utf8: None,
            key: None,
        };
        match inspect(&view, self.body.len(), limits) {
            Ok(_) => Ok(properties),
            Err(rejection) => Err(rejection.reason(limits)),
        }
    }

    /// The properties as published, carrying `id`, before the gate looks at them.
    pub(crate) fn build(&self, id: HandoffId) -> Result<BasicProperties, Reason> {
        let short = |what: &str, text: &str| {
            ShortString::try_new(text).map_err(|_| Reason::new(format!("{what} is over 255 bytes")))
        };
        let mut table = FieldTable::default();
        for (key, value) in &self.headers {
            if key.starts_with("x-lily-") || key == headers::SCHEMA_VERSION {
                return Err(Reason::new(format!(
                    "header {key:?} is Lily's own; set it through Outgoing's methods"
                )));
            }
            table.insert(short("a header key", key)?, value.clone());
        }
        table.insert(
            headers::SCHEMA_VERSION.into(),
            AMQPValue::LongUInt(self.schema_version),
        );
        table.insert(PUBLISH_ID.into(), id.header_value());
        if !table.inner().contains_key(headers::TRACEPARENT)
            && let Some((parent, state)) = crate::trace::current()
        {
            table.insert(
                headers::TRACEPARENT.into(),
                AMQPValue::LongString(parent.into()),
            );
            if let Some(state) = state {
                table.insert(
                    headers::TRACESTATE.into(),
                    AMQPValue::LongString(state.into()),
                );
            }
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(BasicProperties::default()
            .with_message_id(short("message_id", &self.message_id)?)
            .with_type(short("type", &self.kind)?)
            .with_content_type(short("content_type", &self.content_type)?)
            .with_delivery_mode(2)
            .with_timestamp(now)
            .with_headers(table))
    }
}

impl std::fmt::Debug for Outgoing {
    // Not derived: the body and header values are the application's, never logged.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outgoing")
            .field("message_id", &self.message_id)
            .field("kind", &self.kind)
            .field("schema_version", &self.schema_version)
            .field("body_len", &self.body.len())
            .field(
                "headers",
                &self.headers.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// A header value: text, a number, a flag, or any AMQP value.
#[derive(Clone, Debug)]
pub struct HeaderValue(pub(crate) AMQPValue);

impl From<&str> for HeaderValue {
    fn from(text: &str) -> Self {
        Self(AMQPValue::LongString(text.into()))
    }
}

impl From<String> for HeaderValue {
    fn from(text: String) -> Self {
        Self(AMQPValue::LongString(text.into()))
    }
}

impl From<i64> for HeaderValue {
    fn from(n: i64) -> Self {
        Self(AMQPValue::LongLongInt(n))
    }
}

impl From<bool> for HeaderValue {
    fn from(flag: bool) -> Self {
        Self(AMQPValue::Boolean(flag))
    }
}

impl From<AMQPValue> for HeaderValue {
    fn from(value: AMQPValue) -> Self {
        Self(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text<'a>(p: &'a BasicProperties, key: &str) -> Option<&'a AMQPValue> {
        p.headers().as_ref()?.inner().get(key)
    }

    #[test]
    fn an_encoded_message_decodes_whole() {
        let mut nested = FieldTable::default();
        nested.insert("n".into(), AMQPValue::ShortInt(-3));
        let message = Outgoing::bytes("order.placed", "o-1", "application/x", vec![0, 255, 7])
            .schema_version(4)
            .header("tenant", "acme")
            .header("count", 17_i64)
            .header("flag", true)
            .header("nested", AMQPValue::FieldTable(nested))
            .header("float", AMQPValue::Double(0.5));
        let encoded = message.encode().unwrap();
        let decoded = Outgoing::decode(&encoded).unwrap();
        let built = |m: &Outgoing| m.build(HandoffId::new(9)).unwrap().with_timestamp(0);
        assert_eq!(built(&decoded), built(&message));
        assert_eq!(decoded.body(), &[0, 255, 7]);
        for damaged in [
            &[][..],
            &[2, 0, 0, 0, 0][..],
            &encoded[..5],
            &[1, 0, 0, 0, 0][..],
        ] {
            assert!(Outgoing::decode(damaged).is_err(), "{damaged:?}");
        }
        let reserved =
            Outgoing::bytes("t", "o-2", "text/plain", Vec::new()).header("x-lily-x", 1_i64);
        assert!(reserved.encode().is_err());
    }

    #[test]
    fn a_message_carries_what_the_consumer_reads() {
        let message = Outgoing::json("order.placed", "o-1", &serde_json::json!({"q": 1}))
            .unwrap()
            .schema_version(3)
            .header("tenant", "acme")
            .header("tenant", "other");
        let p = message
            .properties(HandoffId::new(9), &Limits::default())
            .unwrap();
        assert_eq!(p.message_id().as_ref().unwrap().as_str(), "o-1");
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "order.placed");
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(
            text(&p, headers::SCHEMA_VERSION),
            Some(&AMQPValue::LongUInt(3))
        );
        assert_eq!(
            text(&p, "tenant"),
            Some(&AMQPValue::LongString("other".into()))
        );
        assert_eq!(
            text(&p, PUBLISH_ID),
            Some(&HandoffId::new(9).header_value())
        );
    }

    #[test]
    fn the_headers_lily_adds_count_against_the_consumers_limit() {
        let limits = Limits::default();
        // `schema-version` counts with the producer's headers: one over the limit. The publish
        // id is Lily's own (`x-lily-*`), counted apart as the consumer's gate counts it.
        let message = (0..limits.max_headers).fold(
            Outgoing::bytes("t", "id-1", "text/plain", Vec::new()),
            |m, n| m.header(&format!("h{n}"), "v"),
        );
        assert!(message.properties(HandoffId::new(0), &limits).is_err());
        let message = (0..limits.max_headers - 1).fold(
            Outgoing::bytes("t", "id-1", "text/plain", Vec::new()),
            |m, n| m.header(&format!("h{n}"), "v"),
        );
        assert!(message.properties(HandoffId::new(0), &limits).is_ok());
    }

    #[test]
    fn debug_shows_ids_and_sizes_never_the_body_or_header_values() {
        let message = Outgoing::bytes("t", "id-1", "text/plain", b"card-4111".to_vec())
            .header("note", "secret-value");
        let shown = format!("{message:?}");
        assert!(
            shown.contains("id-1") && shown.contains("body_len: 9"),
            "{shown}"
        );
        assert!(
            !shown.contains("4111") && !shown.contains("secret-value"),
            "{shown}"
        );
    }
}
