//! The evidence ledger: what Lily observed for each delivery, in memory and bounded.
//!
//! Open entries are deliveries in flight; at shutdown they are the unresolved list. Terminal
//! outcomes are counted; unresolved ones are kept (up to a cap, then counted as overflow). The
//! ledger holds identities and short reasons, never bodies or secrets.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::{Outcome, Reason, RequeueCause};

/// The latest evidence seen for a delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
    /// An ACK, NACK or reject frame was written.
    SettleWritten,
    /// The channel closed before settlement.
    AuthorityLost,
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
    /// Why it is unresolved.
    pub reason: Reason,
}

/// Counts of terminal outcomes over the ledger's lifetime.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct Totals {
    pub acked: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    pub parked: u64,
    pub requeued: u64,
    pub deferred: u64,
    pub rejected_at_gate: u64,
    pub duplicates_suppressed: u64,
    pub authority_lost: u64,
    pub unresolved: u64,
}

impl Totals {
    /// Counts one outcome.
    pub fn count(&mut self, outcome: Outcome) {
        let slot = match outcome {
            Outcome::Acked => &mut self.acked,
            Outcome::Retried => &mut self.retried,
            Outcome::DeadLettered => &mut self.dead_lettered,
            Outcome::Parked => &mut self.parked,
            Outcome::Requeued(RequeueCause::HandoffFailed) => &mut self.requeued,
            Outcome::Requeued(RequeueCause::Deferred) => &mut self.deferred,
            Outcome::RejectedToDlx => &mut self.rejected_at_gate,
            Outcome::AuthorityLost => &mut self.authority_lost,
            Outcome::Unresolved(_) => &mut self.unresolved,
        };
        *slot += 1;
    }
}

/// Key of an open ledger entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EntryId(u64);

/// In-memory evidence ledger.
#[derive(Debug)]
pub struct Ledger {
    next: u64,
    open: HashMap<EntryId, (Identity, Evidence)>,
    unresolved: VecDeque<UnresolvedEntry>,
    unresolved_cap: usize,
    overflow: u64,
    totals: Totals,
}

impl Ledger {
    /// A ledger keeping at most `unresolved_cap` unresolved entries.
    pub fn new(unresolved_cap: usize) -> Self {
        Self {
            next: 0,
            open: HashMap::new(),
            unresolved: VecDeque::new(),
            unresolved_cap,
            overflow: 0,
            totals: Totals::default(),
        }
    }

    /// Opens an entry for a received delivery.
    pub fn open(&mut self, identity: Identity) -> EntryId {
        let id = EntryId(self.next);
        self.next += 1;
        self.open.insert(id, (identity, Evidence::Received));
        id
    }

    /// Records newer evidence.
    pub fn note(&mut self, id: EntryId, evidence: Evidence) {
        if let Some(entry) = self.open.get_mut(&id) {
            entry.1 = evidence;
        }
    }

    /// Closes an entry with its outcome. Unresolved outcomes are kept with `reason`.
    pub fn close(&mut self, id: EntryId, outcome: Outcome, reason: impl FnOnce() -> Reason) {
        let Some((identity, last)) = self.open.remove(&id) else {
            return;
        };
        self.totals.count(outcome);
        if let Outcome::Unresolved(_) = outcome {
            if self.unresolved.len() == self.unresolved_cap {
                self.unresolved.pop_front();
                self.overflow += 1;
            }
            if self.unresolved_cap > 0 {
                self.unresolved.push_back(UnresolvedEntry {
                    identity,
                    last,
                    reason: reason(),
                });
            } else {
                self.overflow += 1;
            }
        }
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
        self.open.len()
    }

    /// Unresolved deliveries: those closed as unresolved, then those still open.
    pub fn unresolved(&self) -> impl Iterator<Item = UnresolvedEntry> + '_ {
        let open = self.open.values().map(|(identity, last)| UnresolvedEntry {
            identity: identity.clone(),
            last: *last,
            reason: Reason::new("still in flight"),
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
    use crate::Unresolved;

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
}
