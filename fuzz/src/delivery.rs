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
//! The strings and properties go through amq-protocol's own parser (with Lily's patch, which
//! reads short strings that are not UTF-8 leniently and marks them), so the gate sees exactly
//! what lapin would give it. Input the parser refuses decodes to `None`, and so does input
//! over [`MAX_INPUT`] bytes: amq-protocol parses nested tables and arrays recursively and
//! overflows the stack at some thousands of levels (about 10 000 on an 8 MiB stack), a limit
//! of the client library that this target leaves out.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::protocol::basic::parse_properties;
use amq_protocol_types::ShortString;
use amq_protocol_types::parsing::parse_short_string;
use lily_mq_core::Limits;
use lily_mq_core::transport::{PropertiesView, not_utf8};

/// Appended to every decoded body: no reason, header or log line may ever contain it.
pub const BODY_MARKER: &[u8] = b"<lily-fuzz-body-marker:4f1c>";

/// The largest input decoded: at most some 2 700 levels of nesting, well within the stack.
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
}

impl Delivery {
    /// Decodes `data` (see the [module](self)); `None` when amq-protocol cannot parse it.
    pub fn decode(data: &[u8]) -> Option<Self> {
        if data.len() > MAX_INPUT {
            return None;
        }
        let (head, rest) = data.split_at_checked(LIMIT_BYTES)?;
        let limits = limits(head.try_into().ok()?);
        let (rest, exchange) = parse_short_string(rest).ok()?;
        let (rest, routing_key) = parse_short_string(rest).ok()?;
        let (rest, properties) = parse_properties(rest).ok()?;
        let mut body = rest.to_vec();
        body.extend_from_slice(BODY_MARKER);
        Some(Self {
            limits,
            exchange,
            routing_key,
            properties,
            body,
        })
    }

    /// What the gate reads, built as the consumer builds it (`crates/rabbit/src/admit.rs`).
    pub fn view(&self) -> PropertiesView<'_> {
        let p = &self.properties;
        PropertiesView {
            message_id: p.message_id().as_ref().map(ShortString::as_str),
            kind: p.kind().as_ref().map(ShortString::as_str),
            content_type: p.content_type().as_ref().map(ShortString::as_str),
            headers: p.headers().as_ref(),
            not_utf8: not_utf8(p, &self.exchange, &self.routing_key),
            key: None,
        }
    }
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
