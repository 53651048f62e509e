//! Whose evidence is it: the identity each handoff copy carries.
//!
//! RabbitMQ sends a publish's `basic.return` before that publish's confirm, but the confirm of
//! another publish on the same channel may come in between, and one `multiple` confirm completes
//! several publishes at once. A client that hands the oldest waiting return to whichever confirm
//! completes next (lapin does) attributes returns by arrival order, which is wrong as soon as two
//! handoffs share a channel: one copy that was dropped counts as confirmed (its original is ACKed
//! and the message is lost) and one that was routed counts as returned (its original is requeued
//! and the message exists twice).
//!
//! Lily therefore stamps every copy with a [`HandoffId`], counts a return only against the
//! publish whose id it carries, and counts a confirm as success only once that publish's own
//! return, had there been one, must have been seen: [`crate::transport::InFlight`] says when.

use amq_protocol_types::{AMQPValue, FieldTable};

use crate::headers;

/// Identity of one handoff publish, carried by the copy in [`headers::HANDOFF_ID`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HandoffId(u64);

impl HandoffId {
    /// The id numbered `n` (the publisher counts them).
    pub const fn new(n: u64) -> Self {
        Self(n)
    }

    /// The header value a copy carries.
    pub fn header_value(self) -> AMQPValue {
        AMQPValue::LongLongInt(i64::from_ne_bytes(self.0.to_ne_bytes()))
    }

    /// The id a message's headers carry in [`headers::HANDOFF_ID`], if any.
    pub fn from_headers(table: Option<&FieldTable>) -> Option<Self> {
        Self::from_header(table, headers::HANDOFF_ID)
    }

    /// The id a message's headers carry in `key`, if any.
    pub fn from_header(table: Option<&FieldTable>, key: &str) -> Option<Self> {
        match table?.inner().get(key)? {
            AMQPValue::LongLongInt(n) => Some(Self(u64::from_ne_bytes(n.to_ne_bytes()))),
            _ => None,
        }
    }
}

/// The publisher confirm a publish got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Confirm {
    /// `basic.ack`: the broker took responsibility for the message (unless it returned it).
    Ack,
    /// `basic.nack`: the broker could not take the message.
    Nack,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_survives_the_header_round_trip() {
        for n in [0, 1, u64::MAX, 1 << 63] {
            let id = HandoffId::new(n);
            let mut table = FieldTable::default();
            table.insert(headers::HANDOFF_ID.into(), id.header_value());
            assert_eq!(HandoffId::from_headers(Some(&table)), Some(id));
        }
        assert_eq!(HandoffId::from_headers(None), None);
        let mut wrong = FieldTable::default();
        wrong.insert(headers::HANDOFF_ID.into(), AMQPValue::LongUInt(7));
        assert_eq!(HandoffId::from_headers(Some(&wrong)), None);
    }
}
