//! A delivery as the application sees it: read-only, with no way to settle.

use std::sync::Arc;

use amq_protocol::protocol::BasicProperties;
use amq_protocol_types::{AMQPValue, FieldTable, ShortString};

/// One delivery that passed the gate. Shared by the extractors of one handler call.
///
/// It holds the body, properties and routing facts, never a channel or an acker: nothing reached
/// from it can ACK, NACK or reject.
#[derive(Debug)]
pub struct Incoming {
    body: Vec<u8>,
    properties: BasicProperties,
    exchange: ShortString,
    routing_key: ShortString,
    queue: Arc<str>,
    delivery_tag: u64,
    redelivered: bool,
    attempt: u32,
    schema_version: u32,
}

/// The parts an [`Incoming`] is built from; filled by the transport after the gate.
#[derive(Debug)]
#[allow(missing_docs)]
pub struct IncomingParts {
    pub body: Vec<u8>,
    pub properties: BasicProperties,
    pub exchange: ShortString,
    pub routing_key: ShortString,
    pub queue: Arc<str>,
    pub delivery_tag: u64,
    pub redelivered: bool,
    pub attempt: u32,
    pub schema_version: u32,
}

impl Incoming {
    /// Builds an incoming delivery. The transport calls this after [`crate::transport::inspect`] passed.
    pub fn from_parts(parts: IncomingParts) -> Self {
        let IncomingParts {
            body,
            properties,
            exchange,
            routing_key,
            queue,
            delivery_tag,
            redelivered,
            attempt,
            schema_version,
        } = parts;
        Self {
            body,
            properties,
            exchange,
            routing_key,
            queue,
            delivery_tag,
            redelivered,
            attempt,
            schema_version,
        }
    }

    /// The message body.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// The message properties, headers included.
    pub fn properties(&self) -> &BasicProperties {
        &self.properties
    }

    /// The `message_id` property (validated by the gate).
    pub fn message_id(&self) -> &str {
        self.properties
            .message_id()
            .as_ref()
            .map_or("", ShortString::as_str)
    }

    /// The `type` property (validated by the gate).
    pub fn kind(&self) -> &str {
        self.properties
            .kind()
            .as_ref()
            .map_or("", ShortString::as_str)
    }

    /// A header value.
    pub fn header(&self, key: &str) -> Option<&AMQPValue> {
        self.headers().and_then(|h| h.inner().get(key))
    }

    /// The headers table, if any.
    pub fn headers(&self) -> Option<&FieldTable> {
        self.properties.headers().as_ref()
    }

    /// Exchange the message was published to.
    pub fn exchange(&self) -> &str {
        self.exchange.as_str()
    }

    /// Routing key the message was published with.
    pub fn routing_key(&self) -> &str {
        self.routing_key.as_str()
    }

    /// Queue the message was consumed from.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// Delivery tag on the consuming channel.
    pub fn delivery_tag(&self) -> u64 {
        self.delivery_tag
    }

    /// The broker's `redelivered` flag. It does not say whether earlier work committed.
    pub fn redelivered(&self) -> bool {
        self.redelivered
    }

    /// Application attempt, starting at 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Schema version of the payload.
    pub fn schema_version(&self) -> u32 {
        self.schema_version
    }
}
