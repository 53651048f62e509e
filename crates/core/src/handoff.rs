//! Whose evidence is it: attributing a publisher confirm and a `basic.return` to one handoff.
//!
//! RabbitMQ sends a publish's `basic.return` before that publish's confirm, but the confirm of
//! another publish on the same channel may come in between, and one `multiple` confirm completes
//! several publishes at once. A client that hands the oldest waiting return to whichever confirm
//! completes next (lapin does) attributes returns by arrival order, which is wrong as soon as two
//! handoffs share a channel: one copy that was dropped counts as confirmed (its original is ACKed
//! and the message is lost) and one that was routed counts as returned (its original is requeued
//! and the message exists twice).
//!
//! Lily therefore never has two handoffs in flight on one channel, and stamps every copy with a
//! [`HandoffId`]. [`PublishEvidence::attribute`] then counts a return only against the publish
//! whose id it carries, and a confirm as success only when no return came with it. A return that
//! carries another id means the channel's evidence cannot be trusted: the handoff fails (its
//! original is requeued; at worst the message exists twice, never zero times).

use amq_protocol_types::{AMQPValue, FieldTable};

use crate::HandoffResult;
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

    /// The id a message's headers carry, if any.
    pub fn from_headers(table: Option<&FieldTable>) -> Option<Self> {
        match table?.inner().get(headers::HANDOFF_ID)? {
            AMQPValue::LongLongInt(n) => Some(Self(u64::from_ne_bytes(n.to_ne_bytes()))),
            _ => None,
        }
    }
}

/// The publisher confirm the broker sent for a publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Confirm {
    /// `basic.ack`: the broker took responsibility for the message.
    Ack,
    /// `basic.nack`: the broker could not take the message.
    Nack,
}

/// What the channel delivered when a handoff's confirm completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublishEvidence {
    /// The confirm.
    pub confirm: Confirm,
    /// The `basic.return` that completed with it, by the handoff id it carries (`Some(None)`:
    /// a return carrying no id).
    pub returned: Option<Option<HandoffId>>,
}

impl PublishEvidence {
    /// The result of the handoff `own`, from evidence that belongs to it alone.
    pub fn attribute(self, own: HandoffId) -> HandoffResult {
        match (self.returned, self.confirm) {
            (Some(Some(id)), _) if id == own => HandoffResult::Returned,
            // Somebody else's return: this channel's evidence is confused, so nothing on it
            // proves this handoff either way.
            (Some(_), _) => HandoffResult::Failed,
            (None, Confirm::Ack) => HandoffResult::Confirmed,
            (None, Confirm::Nack) => HandoffResult::Nacked,
        }
    }
}

impl HandoffResult {
    /// Whether the channel the handoff used has nothing of it left in flight and no doubt about
    /// its evidence, so the next handoff may use it. After a timeout, a channel error or a
    /// foreign return, the channel is closed instead: a late confirm or return could otherwise
    /// be taken for the next handoff's, and lapin keeps unobserved confirms until it closes.
    pub const fn leaves_channel_clean(self) -> bool {
        matches!(self, Self::Confirmed | Self::Returned | Self::Nacked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: HandoffId = HandoffId::new(7);
    const OTHER: HandoffId = HandoffId::new(8);

    fn evidence(confirm: Confirm, returned: Option<Option<HandoffId>>) -> HandoffResult {
        PublishEvidence { confirm, returned }.attribute(OWN)
    }

    #[test]
    fn an_ack_without_a_return_is_the_only_confirmation() {
        assert_eq!(evidence(Confirm::Ack, None), HandoffResult::Confirmed);
        assert_eq!(evidence(Confirm::Nack, None), HandoffResult::Nacked);
    }

    #[test]
    fn a_return_counts_against_the_handoff_whose_id_it_carries() {
        assert_eq!(
            evidence(Confirm::Ack, Some(Some(OWN))),
            HandoffResult::Returned
        );
        assert_eq!(
            evidence(Confirm::Nack, Some(Some(OWN))),
            HandoffResult::Returned
        );
    }

    #[test]
    fn a_foreign_or_anonymous_return_never_confirms() {
        for returned in [Some(Some(OTHER)), Some(None)] {
            for confirm in [Confirm::Ack, Confirm::Nack] {
                assert_eq!(evidence(confirm, returned), HandoffResult::Failed);
            }
        }
    }

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

    #[test]
    fn only_settled_evidence_lets_a_channel_be_reused() {
        use HandoffResult::*;
        for (result, clean) in [
            (Confirmed, true),
            (Returned, true),
            (Nacked, true),
            (Failed, false),
            (TimedOut, false),
            (Blocked, false),
        ] {
            assert_eq!(result.leaves_channel_clean(), clean, "{result:?}");
        }
    }
}
