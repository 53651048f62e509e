//! Whose evidence is it: attributing publisher confirms and `basic.return`s to handoffs.
//!
//! RabbitMQ sends a publish's `basic.return` before that publish's confirm, but the confirm of
//! another publish on the same channel may come in between, and one `multiple` confirm completes
//! several publishes at once. A client that hands the oldest waiting return to whichever confirm
//! completes next (lapin does) attributes returns by arrival order, which is wrong as soon as two
//! handoffs share a channel: one copy that was dropped counts as confirmed (its original is ACKed
//! and the message is lost) and one that was routed counts as returned (its original is requeued
//! and the message exists twice).
//!
//! Lily therefore stamps every copy with a [`HandoffId`] and publishes copies in batches: a
//! confirm channel carries one batch at a time, and the batch is judged only when every one of
//! its confirms has arrived. By then every return of the batch has arrived too (each came before
//! its own publish's confirm), whichever confirm the client attached it to. [`attribute_batch`] then
//! counts a return only against the publish whose id it carries, and a confirm as success only
//! when the whole batch's evidence is in and accounted for:
//!
//! - a return proves its own copy was dropped, whatever else happened;
//! - an ACK proves a copy was stored only when every confirm of the batch arrived (a missing one
//!   could be carrying this copy's return) and every return carries the id of a batch member
//!   (anything else means the channel's evidence is confused);
//! - otherwise the handoff fails, its original is requeued, and at worst the message exists
//!   twice, never zero times.
//!
//! A channel whose batch was not accounted for in full is closed, never reused: a late confirm
//! or a stray return on it could be taken for the next batch's, and the client keeps the
//! confirms nobody awaits until the channel closes.

use amq_protocol_types::{AMQPValue, FieldTable};

use crate::decision::HandoffResult;
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

/// What a confirm channel showed for one publish of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Confirm {
    /// `basic.ack`: the broker took responsibility for the message (unless it returned it).
    Ack,
    /// `basic.nack`: the broker could not take the message.
    Nack,
    /// No confirm: the publish or its confirm failed on the channel.
    Failed,
    /// No confirm within the deadline.
    TimedOut,
}

/// The verdict on one batch: each member's result, in order, and whether its channel may carry
/// the next batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchVerdict {
    /// One result per member, in the order given to [`attribute_batch`].
    pub results: Vec<HandoffResult>,
    /// Every confirm arrived and every return belonged to a member.
    pub channel_clean: bool,
}

/// Judges a batch published back to back on one confirm channel: `members` are each publish's
/// id and confirm, `returned` the id carried by every `basic.return` the batch's confirms
/// brought, whichever confirm each came with (`None`: a return carrying no id).
pub fn attribute_batch(
    members: &[(HandoffId, Confirm)],
    returned: &[Option<HandoffId>],
) -> BatchVerdict {
    let complete = members
        .iter()
        .all(|(_, c)| matches!(c, Confirm::Ack | Confirm::Nack));
    let accounted = returned
        .iter()
        .all(|r| r.is_some_and(|id| members.iter().any(|(own, _)| *own == id)));
    let channel_clean = complete && accounted;
    let results = members
        .iter()
        .map(|(own, confirm)| {
            if returned.contains(&Some(*own)) {
                return HandoffResult::Returned;
            }
            match confirm {
                Confirm::Ack if channel_clean => HandoffResult::Confirmed,
                // Its return may be on a confirm that never arrived, or be the stray one.
                Confirm::Ack => HandoffResult::Failed,
                Confirm::Nack => HandoffResult::Nacked,
                Confirm::Failed => HandoffResult::Failed,
                Confirm::TimedOut => HandoffResult::TimedOut,
            }
        })
        .collect();
    BatchVerdict {
        results,
        channel_clean,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use HandoffResult::*;

    const A: HandoffId = HandoffId::new(7);
    const B: HandoffId = HandoffId::new(8);
    const C: HandoffId = HandoffId::new(9);

    fn verdict(
        members: &[(HandoffId, Confirm)],
        returned: &[Option<HandoffId>],
    ) -> Vec<HandoffResult> {
        attribute_batch(members, returned).results
    }

    #[test]
    fn an_ack_without_a_return_confirms_once_the_batch_is_complete() {
        let members = [(A, Confirm::Ack), (B, Confirm::Nack)];
        let v = attribute_batch(&members, &[]);
        assert_eq!(v.results, [Confirmed, Nacked]);
        assert!(v.channel_clean);
    }

    #[test]
    fn a_return_counts_against_the_member_whose_id_it_carries_whichever_confirm_brought_it() {
        // lapin attached B's return to A's confirm: only ids decide.
        let members = [(A, Confirm::Ack), (B, Confirm::Ack), (C, Confirm::Nack)];
        assert_eq!(verdict(&members, &[Some(B)]), [Confirmed, Returned, Nacked]);
        assert_eq!(
            verdict(&members, &[Some(C), Some(A)]),
            [Returned, Confirmed, Returned]
        );
    }

    #[test]
    fn a_missing_confirm_leaves_every_ack_of_the_batch_unproven() {
        for missing in [Confirm::TimedOut, Confirm::Failed] {
            let members = [(A, Confirm::Ack), (B, missing), (C, Confirm::Ack)];
            let v = attribute_batch(&members, &[Some(C)]);
            // C's return is proof on its own; A's ACK could be hiding B's... or its own return.
            let lost = if missing == Confirm::TimedOut {
                TimedOut
            } else {
                Failed
            };
            assert_eq!(v.results, [Failed, lost, Returned]);
            assert!(!v.channel_clean);
        }
    }

    #[test]
    fn a_stray_or_anonymous_return_never_lets_an_ack_confirm() {
        for stray in [Some(HandoffId::new(99)), None] {
            let members = [(A, Confirm::Ack), (B, Confirm::Nack)];
            let v = attribute_batch(&members, &[stray]);
            assert_eq!(v.results, [Failed, Nacked]);
            assert!(!v.channel_clean);
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

    /// lapin's behaviour, modelled: returns wait in a FIFO queue and each completed confirm
    /// takes the oldest; a `multiple` ACK completes its tags in any order.
    fn wire(
        returned: &[bool],
        seed: u64,
        cut: usize,
    ) -> (Vec<(HandoffId, Confirm)>, Vec<Option<HandoffId>>) {
        let mut rng = seed | 1;
        let mut next = move |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        };
        let n = returned.len();
        // The wire: each publish's return (if any) before its ACK; returns and ACKs each in
        // publish order; runs of ACKs grouped into `multiple` frames.
        let (mut ret, mut ack) = (0, 0);
        let mut frames: Vec<Result<usize, Vec<usize>>> = Vec::new();
        while ack < n {
            while ret < n && !returned[ret] {
                ret += 1;
            }
            let may_ack = ret > ack || !returned[ack];
            if ret < n && (!may_ack || next(2) == 0) {
                frames.push(Ok(ret));
                ret += 1;
            } else {
                let mut tags = vec![ack];
                ack += 1;
                while ack < n && (ret > ack || !returned[ack]) && next(2) == 0 {
                    tags.push(ack);
                    ack += 1;
                }
                for i in (1..tags.len()).rev() {
                    tags.swap(i, next(i + 1));
                }
                frames.push(Err(tags));
            }
        }
        let mut waiting = std::collections::VecDeque::new();
        let mut confirms = vec![Confirm::TimedOut; n];
        let mut brought = Vec::new();
        for frame in frames.into_iter().take(cut) {
            match frame {
                Ok(i) => waiting.push_back(HandoffId::new(i as u64)),
                Err(tags) => {
                    for tag in tags {
                        confirms[tag] = Confirm::Ack;
                        if let Some(id) = waiting.pop_front() {
                            brought.push(Some(id));
                        }
                    }
                }
            }
        }
        let members = (0..n)
            .map(|i| (HandoffId::new(i as u64), confirms[i]))
            .collect();
        (members, brought)
    }

    proptest::proptest! {
        #[test]
        fn a_returned_copy_never_counts_as_confirmed(
            returned in proptest::collection::vec(proptest::bool::ANY, 1..40),
            seed in proptest::num::u64::ANY,
            cut in 0usize..100,
        ) {
            let (members, brought) = wire(&returned, seed, cut);
            let verdict = attribute_batch(&members, &brought);
            let complete = members.iter().all(|(_, c)| *c == Confirm::Ack);
            for (i, result) in verdict.results.iter().enumerate() {
                if returned[i] {
                    proptest::prop_assert_ne!(*result, Confirmed);
                }
                if complete {
                    let exact = if returned[i] { Returned } else { Confirmed };
                    proptest::prop_assert_eq!(*result, exact);
                }
            }
            proptest::prop_assert_eq!(verdict.channel_clean, complete);
        }
    }
}
