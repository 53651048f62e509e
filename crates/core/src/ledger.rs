//! The evidence ledger: what Lily observed for each delivery, in memory and bounded.
//!
//! Open entries are deliveries in flight; at shutdown they are the unresolved list. Terminal
//! outcomes are counted; unresolved ones are kept (up to a cap, then counted as overflow). The
//! ledger holds identities and short reasons, never bodies or secrets.

use std::collections::VecDeque;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::decision::{Outcome, RequeueCause};
use crate::reason::Reason;

/// The latest evidence seen for a delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Evidence {
    /// `basic.deliver` received.
    Received,
    /// Dispatched to a handler; the scope is open.
    Dispatched,
    /// The handler (and cleanup) finished.
    HandlerReturned,
    /// A settlement plan was chosen.
    Planned,
    /// The handoff copy was published; its confirm is awaited.
    HandoffPublished,
    /// The broker confirmed the handoff copy.
    HandoffConfirmed,
    /// The handoff failed.
    HandoffFailed,
    /// An ACK, NACK or reject frame was queued on the delivery's channel.
    SettleWritten,
    /// The channel closed before settlement.
    AuthorityLost,
    /// The task was aborted at shutdown before it finished.
    Aborted,
}

/// Who a delivery is: enough to find it in the broker and the logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Queue it was consumed from.
    pub queue: Arc<str>,
    /// Its `message_id`, when the gate found a valid one.
    pub message_id: Option<Box<str>>,
    /// Delivery tag on its channel.
    pub delivery_tag: u64,
    /// Application attempt.
    pub attempt: u32,
    /// The broker's redelivered flag.
    pub redelivered: bool,
}

/// A delivery whose settlement is not known to have completed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnresolvedEntry {
    /// Which delivery.
    pub identity: Identity,
    /// The last evidence observed.
    pub last: Evidence,
    /// Queue holding a confirmed handoff copy, kept even though the original is unresolved.
    pub handoff: Option<Box<str>>,
    /// Why it is unresolved.
    pub reason: Reason,
}

/// Counts of terminal outcomes over the ledger's lifetime.
///
/// `acked`, `retried`, `dead_lettered`, `parked` and `held` count ACK frames written; `acks_confirmed`
/// and `acks_uncertain` say what a later round trip on the same channel proved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct Totals {
    pub acked: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    pub parked: u64,
    /// Originals ACKed after a held copy was confirmed (see [`Outcome::Held`]).
    #[serde(default)]
    pub held: u64,
    /// Originals ACKed after a copy was confirmed in a retry bucket to wait out another
    /// owner's lease (see [`Outcome::Waited`]).
    #[serde(default)]
    pub waited: u64,
    pub requeued: u64,
    pub deferred: u64,
    pub rejected_at_gate: u64,
    pub duplicates_suppressed: u64,
    pub authority_lost: u64,
    pub unresolved: u64,
    pub acks_confirmed: u64,
    pub acks_uncertain: u64,
}

impl Totals {
    /// Every field with its name, in declaration order. The destructuring is exhaustive, so a
    /// new field fails to compile until it is listed here.
    pub fn fields(&self) -> [(&'static str, u64); 14] {
        let Self {
            acked,
            retried,
            dead_lettered,
            parked,
            held,
            waited,
            requeued,
            deferred,
            rejected_at_gate,
            duplicates_suppressed,
            authority_lost,
            unresolved,
            acks_confirmed,
            acks_uncertain,
        } = *self;
        [
            ("acked", acked),
            ("retried", retried),
            ("dead_lettered", dead_lettered),
            ("parked", parked),
            ("held", held),
            ("waited", waited),
            ("requeued", requeued),
            ("deferred", deferred),
            ("rejected_at_gate", rejected_at_gate),
            ("duplicates_suppressed", duplicates_suppressed),
            ("authority_lost", authority_lost),
            ("unresolved", unresolved),
            ("acks_confirmed", acks_confirmed),
            ("acks_uncertain", acks_uncertain),
        ]
    }

    /// Counts one outcome.
    pub fn count(&mut self, outcome: Outcome) {
        let slot = match outcome {
            Outcome::Acked => &mut self.acked,
            Outcome::Retried => &mut self.retried,
            Outcome::DeadLettered => &mut self.dead_lettered,
            Outcome::Parked => &mut self.parked,
            Outcome::Held => &mut self.held,
            Outcome::Waited => &mut self.waited,
            Outcome::Requeued(RequeueCause::HandoffFailed) => &mut self.requeued,
            Outcome::Requeued(RequeueCause::Deferred) => &mut self.deferred,
            Outcome::RejectedToDlx => &mut self.rejected_at_gate,
            Outcome::AuthorityLost => &mut self.authority_lost,
            Outcome::Unresolved(_) => &mut self.unresolved,
        };
        *slot += 1;
    }
}

/// Key of an open ledger entry: a slot and the sequence number it was opened with, so a stale
/// key never touches the slot's next occupant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EntryId {
    slot: usize,
    seq: u64,
}

/// An open entry.
#[derive(Debug)]
struct Open {
    seq: u64,
    identity: Identity,
    last: Evidence,
}

/// In-memory evidence ledger.
///
/// Open entries live in a slab (a vector of slots and a free list): opening, noting and
/// closing are O(1) without hashing, which matters on the per-delivery path.
#[derive(Debug)]
pub struct Ledger {
    next: u64,
    slots: Vec<Option<Open>>,
    free: Vec<usize>,
    open_count: usize,
    unresolved: VecDeque<UnresolvedEntry>,
    unresolved_cap: usize,
    overflow: u64,
    totals: Totals,
    awaiting: VecDeque<Awaiting>,
}

/// An ACK written but not yet proven processed by a later round trip on its channel.
#[derive(Debug)]
struct Awaiting {
    channel: u64,
    seq: u64,
    identity: Identity,
    handoff: Option<Box<str>>,
}

impl Ledger {
    /// A ledger keeping at most `unresolved_cap` unresolved entries.
    pub fn new(unresolved_cap: usize) -> Self {
        Self {
            next: 0,
            slots: Vec::new(),
            free: Vec::new(),
            open_count: 0,
            unresolved: VecDeque::new(),
            unresolved_cap,
            overflow: 0,
            totals: Totals::default(),
            awaiting: VecDeque::new(),
        }
    }

    /// Opens an entry for a received delivery.
    pub fn open(&mut self, identity: Identity) -> EntryId {
        self.open_at(identity, Evidence::Received)
    }

    /// Opens an entry whose latest evidence is already `last` (say, dispatched).
    pub fn open_at(&mut self, identity: Identity, last: Evidence) -> EntryId {
        self.next += 1;
        let seq = self.next;
        let entry = Some(Open {
            seq,
            identity,
            last,
        });
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = entry;
                slot
            }
            None => {
                self.slots.push(entry);
                self.slots.len() - 1
            }
        };
        self.open_count += 1;
        EntryId { slot, seq }
    }

    /// Records newer evidence.
    pub fn note(&mut self, id: EntryId, evidence: Evidence) {
        if let Some(Some(entry)) = self.slots.get_mut(id.slot)
            && entry.seq == id.seq
        {
            entry.last = evidence;
        }
    }

    fn take(&mut self, id: EntryId) -> Option<(Identity, Evidence)> {
        let slot = self.slots.get_mut(id.slot)?;
        if slot.as_ref()?.seq != id.seq {
            return None;
        }
        let entry = slot.take()?;
        self.free.push(id.slot);
        self.open_count -= 1;
        Some((entry.identity, entry.last))
    }

    fn open_entries(&self) -> impl Iterator<Item = &Open> {
        self.slots.iter().flatten()
    }

    /// Closes an entry with its outcome. Unresolved and authority-lost outcomes are listed with
    /// `reason`.
    pub fn close(&mut self, id: EntryId, outcome: Outcome, reason: impl FnOnce() -> Reason) {
        let Some((identity, last)) = self.take(id) else {
            return;
        };
        self.totals.count(outcome);
        if matches!(outcome, Outcome::Unresolved(_) | Outcome::AuthorityLost) {
            self.list(UnresolvedEntry {
                identity,
                last,
                handoff: None,
                reason: reason(),
            });
        }
    }

    /// Closes an entry whose ACK frame was written on `channel`; it waits for a round trip on
    /// that channel to confirm it. `handoff` names the queue of a confirmed copy, if any.
    pub fn close_acked(
        &mut self,
        id: EntryId,
        outcome: Outcome,
        channel: u64,
        handoff: Option<Box<str>>,
    ) {
        let Some((identity, _)) = self.take(id) else {
            return;
        };
        self.totals.count(outcome);
        self.next += 1;
        self.awaiting.push_back(Awaiting {
            channel,
            seq: self.next,
            identity,
            handoff,
        });
    }

    /// A mark to pass to [`confirm_acks`](Self::confirm_acks) after a round trip started now.
    pub fn ack_mark(&self) -> u64 {
        self.next
    }

    /// A round trip on `channel`, started at `mark`, completed: every ACK written there before
    /// it is confirmed.
    pub fn confirm_acks(&mut self, channel: u64, mark: u64) {
        let before = self.awaiting.len();
        self.awaiting
            .retain(|a| a.channel != channel || a.seq > mark);
        self.totals.acks_confirmed += (before - self.awaiting.len()) as u64;
    }

    /// `channel` closed (or, with `None`, every channel): its unconfirmed ACKs are uncertain and
    /// their deliveries unresolved.
    pub fn acks_uncertain(&mut self, channel: Option<u64>) {
        let (lost, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.awaiting)
            .into_iter()
            .partition(|a| channel.is_none_or(|c| a.channel == c));
        self.awaiting = kept.into();
        for a in lost {
            self.totals.acks_uncertain += 1;
            self.totals.unresolved += 1;
            self.list(UnresolvedEntry {
                identity: a.identity,
                last: Evidence::SettleWritten,
                handoff: a.handoff,
                reason: Reason::new("ack written; channel closed before a round trip confirmed it"),
            });
        }
    }

    /// Records that an open delivery's task was aborted at shutdown.
    pub fn abort_open(&mut self) {
        for entry in self.slots.iter_mut().flatten() {
            if entry.last != Evidence::AuthorityLost {
                entry.last = Evidence::Aborted;
            }
        }
    }

    fn list(&mut self, entry: UnresolvedEntry) {
        if self.unresolved_cap == 0 {
            self.overflow += 1;
            return;
        }
        if self.unresolved.len() == self.unresolved_cap {
            self.unresolved.pop_front();
            self.overflow += 1;
        }
        self.unresolved.push_back(entry);
    }

    /// Counts a suppressed duplicate.
    pub fn count_duplicate(&mut self) {
        self.totals.duplicates_suppressed += 1;
    }

    /// Totals so far.
    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// Deliveries still in flight.
    pub fn in_flight(&self) -> usize {
        self.open_count
    }

    /// ACKs written and not yet confirmed by a round trip.
    pub fn acks_awaiting(&self) -> usize {
        self.awaiting.len()
    }

    /// How many unresolved deliveries there are, listed or overflowed, open ones included.
    pub fn unresolved_count(&self) -> u64 {
        self.unresolved.len() as u64 + self.overflow + self.open_count as u64
    }

    /// Unresolved deliveries: those closed as unresolved, then those still open.
    pub fn unresolved(&self) -> impl Iterator<Item = UnresolvedEntry> + '_ {
        let open = self.open_entries().map(|entry| UnresolvedEntry {
            identity: entry.identity.clone(),
            last: entry.last,
            handoff: None,
            reason: Reason::new(match entry.last {
                Evidence::Aborted => "aborted at shutdown; the broker will redeliver",
                _ => "still in flight",
            }),
        });
        self.unresolved.iter().cloned().chain(open)
    }

    /// Unresolved entries dropped because the list was full.
    pub fn overflow(&self) -> u64 {
        self.overflow
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::Unresolved;

    fn identity(tag: u64) -> Identity {
        Identity {
            queue: "orders".into(),
            message_id: Some("m".into()),
            delivery_tag: tag,
            attempt: 1,
            redelivered: false,
        }
    }

    #[test]
    fn unresolved_list_is_bounded_with_an_overflow_count() {
        let mut ledger = Ledger::new(2);
        for tag in 0..5 {
            let id = ledger.open(identity(tag));
            ledger.note(id, Evidence::HandoffConfirmed);
            ledger.close(id, Outcome::Unresolved(Unresolved::BudgetExhausted), || {
                Reason::new("ack failed")
            });
        }
        let tags: Vec<u64> = ledger
            .unresolved()
            .map(|e| e.identity.delivery_tag)
            .collect();
        assert_eq!(tags, vec![3, 4]);
        assert_eq!(ledger.overflow(), 3);
        assert_eq!(ledger.totals().unresolved, 5);
        assert!(
            ledger
                .unresolved()
                .all(|e| e.last == Evidence::HandoffConfirmed)
        );
    }

    #[test]
    fn open_entries_are_listed_as_in_flight() {
        let mut ledger = Ledger::new(10);
        let a = ledger.open(identity(1));
        let _b = ledger.open(identity(2));
        ledger.close(a, Outcome::Acked, || Reason::new("unused"));
        assert_eq!(ledger.in_flight(), 1);
        assert_eq!(ledger.totals().acked, 1);
        let listed: Vec<_> = ledger.unresolved().collect();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].identity.delivery_tag, 2);
        assert_eq!(listed[0].reason.as_str(), "still in flight");
    }

    #[test]
    fn acks_are_confirmed_by_a_round_trip_or_become_uncertain_with_their_handoff() {
        let mut ledger = Ledger::new(10);
        let a = ledger.open(identity(1));
        let b = ledger.open(identity(2));
        ledger.close_acked(a, Outcome::Acked, 7, None);
        let mark = ledger.ack_mark();
        ledger.close_acked(b, Outcome::Retried, 7, Some("orders.retry.5s".into()));
        ledger.confirm_acks(7, mark);
        assert_eq!(ledger.totals().acks_confirmed, 1);
        assert_eq!(ledger.acks_awaiting(), 1);
        ledger.acks_uncertain(Some(7));
        let listed: Vec<_> = ledger.unresolved().collect();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].identity.delivery_tag, 2);
        assert_eq!(listed[0].handoff.as_deref(), Some("orders.retry.5s"));
        assert_eq!(listed[0].last, Evidence::SettleWritten);
        assert_eq!(
            (ledger.totals().acks_uncertain, ledger.totals().retried),
            (1, 1)
        );
    }

    #[test]
    fn authority_lost_deliveries_are_listed() {
        let mut ledger = Ledger::new(10);
        let a = ledger.open(identity(1));
        ledger.note(a, Evidence::AuthorityLost);
        ledger.close(a, Outcome::AuthorityLost, || Reason::new("authority lost"));
        assert_eq!(ledger.unresolved().count(), 1);
        assert_eq!(ledger.totals().authority_lost, 1);
    }
}
