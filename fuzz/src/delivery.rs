//! A delivery decoded from fuzz bytes, as the broker would hand it to Lily.
//!
//! Layout of the input:
//!
//! | bytes | what |
//! |---|---|
//! | 9 | gate [`Limits`], one byte each (see [`limits`]) |
//! | 1 + n | exchange, an AMQP short string |
//! | 1 + n | routing key, an AMQP short string |
//! | 2 + … | basic properties in wire form: property flags, then the present fields |
//! | rest | the body; [`BODY_MARKER`] is appended to it |
//!
//! The strings and properties reach amq-protocol's own parser as the consumer's do: framed as a
//! `basic.deliver` and a content header, through Lily's stream rewriter
//! (`lily_mq_rabbit::testing::Sanitizer`), which makes short strings that are not UTF-8 valid
//! and cuts tables nested too deeply, and names the first field it rewrote. So the gate sees
//! exactly what lapin would give it. Input the parser still refuses decodes to `None`, and so
//! does input over [`MAX_INPUT`] bytes.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::protocol::basic::parse_properties;
use amq_protocol_types::ShortString;
use amq_protocol_types::parsing::parse_short_string;
use lily_mq_core::Limits;
use lily_mq_core::transport::PropertiesView;
use lily_mq_rabbit::testing::{Rewrites, Sanitizer};

/// Appended to every decoded body: no reason, header or log line may ever contain it.
pub const BODY_MARKER: &[u8] = b"<lily-fuzz-body-marker:4f1c>";

/// The largest input decoded.
pub const MAX_INPUT: usize = 16 * 1024;

/// How many leading bytes set the limits.
pub const LIMIT_BYTES: usize = 9;

/// A delivery and the limits to gate it with.
#[derive(Debug)]
pub struct Delivery {
    /// Limits decoded from the first [`LIMIT_BYTES`] bytes.
    pub limits: Limits,
    /// The exchange it was published to.
    pub exchange: ShortString,
    /// Its routing key.
    pub routing_key: ShortString,
    /// Its properties, headers included.
    pub properties: BasicProperties,
    /// Its body, ending in [`BODY_MARKER`].
    pub body: Vec<u8>,
    /// The first field the rewriter found not UTF-8, as the consumer hands it to the gate.
    pub not_utf8: Option<&'static str>,
    /// Whether the rewriter changed any byte (text that was not UTF-8, or nesting cut).
    pub rewritten: bool,
}

impl Delivery {
    /// Decodes `data` (see the [module](self)); `None` when amq-protocol cannot parse it.
    pub fn decode(data: &[u8]) -> Option<Self> {
        if data.len() > MAX_INPUT {
            return None;
        }
        let (head, rest) = data.split_at_checked(LIMIT_BYTES)?;
        let limits = limits(head.try_into().ok()?);
        let (exchange, rest) = short(rest)?;
        let (routing_key, rest) = short(rest)?;
        // basic.deliver on channel 1, delivery tag 1, then its content header, whose payload
        // is the properties and whatever follows them (the body, here).
        let mut deliver = vec![0, 60, 0, 60, 0];
        deliver.extend_from_slice(&1u64.to_be_bytes());
        deliver.push(0);
        deliver.extend_from_slice(exchange);
        deliver.extend_from_slice(routing_key);
        let mut header = vec![0, 60, 0, 0];
        header.extend_from_slice(&0u64.to_be_bytes());
        header.extend_from_slice(rest);
        let mut wire = frame(1, &deliver);
        let header_at = wire.len() + 7;
        wire.extend(frame(2, &header));
        let raw = wire.clone();
        let rewrites = Rewrites::default();
        let ready = Sanitizer::new(rewrites.clone()).scan(&mut wire);
        assert_eq!(ready, wire.len(), "two whole frames are ready at once");
        assert_eq!(wire.len(), raw.len());
        let not_utf8 = rewrites.take(1, 1);
        let rewritten = wire != raw;
        assert!(
            not_utf8.is_none() || rewritten,
            "a rewrite reported is a rewrite made"
        );
        let strings = &wire[7 + 14..];
        let (strings, exchange) = parse_short_string(strings).ok()?;
        let (_, routing_key) = parse_short_string(strings).ok()?;
        let payload = &wire[header_at + 12..header_at + header.len()];
        let (rest, properties) = parse_properties(payload).ok()?;
        let mut body = rest.to_vec();
        body.extend_from_slice(BODY_MARKER);
        Some(Self {
            limits,
            exchange,
            routing_key,
            properties,
            body,
            not_utf8,
            rewritten,
        })
    }

    /// The text of property `field`, unless it was rewritten (as `crates/rabbit/src/admit.rs`).
    pub fn sent<'a>(&self, field: &str, value: &'a Option<ShortString>) -> Option<&'a str> {
        value
            .as_ref()
            .filter(|_| self.not_utf8 != Some(field))
            .map(ShortString::as_str)
    }

    /// What the gate reads, built as the consumer builds it (`crates/rabbit/src/admit.rs`).
    pub fn view(&self) -> PropertiesView<'_> {
        let p = &self.properties;
        PropertiesView {
            message_id: self.sent("message_id", p.message_id()),
            kind: self.sent("type", p.kind()),
            content_type: self.sent("content_type", p.content_type()),
            headers: p.headers().as_ref(),
            not_utf8: self.not_utf8,
            key: None,
        }
    }
}

/// A short string's wire bytes (length, then text) at the start of `data`, and the rest.
fn short(data: &[u8]) -> Option<(&[u8], &[u8])> {
    let len = usize::from(*data.first()?);
    data.split_at_checked(1 + len)
}

/// An AMQP frame of `kind` on channel 1 around `payload`.
fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut frame = vec![kind, 0, 1];
    frame.extend_from_slice(&u32::try_from(payload.len()).expect("small").to_be_bytes());
    frame.extend_from_slice(payload);
    frame.push(0xCE);
    frame
}

/// Gate limits from nine bytes: body bytes ÷ 4, header count, key length, value length ÷ 4,
/// depth (mod 8), header bytes ÷ 16, message id length, type length, highest attempt. Small on
/// purpose, so that inputs of a few hundred bytes reach every bound.
pub fn limits(b: [u8; LIMIT_BYTES]) -> Limits {
    let mut limits = Limits::default();
    limits.max_body_bytes = usize::from(b[0]) * 4;
    limits.max_headers = b[1].into();
    limits.max_header_key_len = b[2].into();
    limits.max_header_value_len = usize::from(b[3]) * 4;
    limits.max_header_depth = usize::from(b[4] % 8);
    limits.max_header_bytes = usize::from(b[5]) * 16;
    limits.max_message_id_len = b[6].into();
    limits.max_type_len = b[7].into();
    limits.max_attempt = b[8].into();
    limits
}

/// Limit bytes that give small but workable limits: 64 body bytes, 4 headers, keys of 16,
/// values of 64, depth 2, 128 header bytes, ids and types of 16, 5 attempts.
pub const SMALL_LIMITS: [u8; LIMIT_BYTES] = [16, 4, 16, 16, 2, 8, 16, 16, 5];
