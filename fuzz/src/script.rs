//! The settlement machine's world, decoded from fuzz bytes: a [`Policy`], the first delivery's
//! [`Arrival`], and an endless stream of choices (what the handler returned, what the broker
//! answered, how much time passed).
//!
//! Layout: [`POLICY_BYTES`] bytes of policy, [`ARRIVAL_BYTES`] of arrival, then the choices.
//! The choices repeat from their start once used up, so a short input stands for a world that
//! keeps behaving the same way (a lane that always returns its copies, a scope that always
//! conflicts) and the machine must still end. Missing bytes read as 0, which is always the
//! plain choice: a valid default-ish policy, a dispatched delivery, success, confirmed, written.

use std::time::Duration;

use lily_mq_core::machine::{Arrival, HeldCopy, Verdict};
use lily_mq_core::transport::GateRejection;
use lily_mq_core::{FailureKind, Policy, Reason, Terminal};

/// Bytes that choose the policy.
pub const POLICY_BYTES: usize = 6;
/// Bytes that choose the first arrival.
pub const ARRIVAL_BYTES: usize = 9;

/// Arrival flag bits (byte 2 of the arrival).
pub mod flag {
    /// The broker's `redelivered`.
    pub const REDELIVERED: u8 = 1;
    /// A transactional scope wraps the handler.
    pub const SCOPED: u8 = 2;
    /// A refused message still has a valid id, so its requeues can be counted.
    pub const VALID_ID: u8 = 4;
    /// A quorum queue: the broker counts deliveries (`x-delivery-count`).
    pub const QUORUM: u8 = 8;
    /// The message waited out another owner's lease before, up to past the most waits.
    pub const WAITS: u8 = 16;
}

/// Verdicts by their arrival byte.
pub mod verdict {
    /// Passed the gate; a handler takes it.
    pub const DISPATCHED: u8 = 0;
    /// Passed the gate; no handler takes it.
    pub const UNDISPATCHED: u8 = 1;
    /// Refused by the gate: invalid envelope.
    pub const INVALID: u8 = 2;
    /// Refused by the gate: body too large.
    pub const OVERSIZED: u8 = 3;
}

/// Decoded bytes: head (policy and arrival) and the repeating choices.
#[derive(Debug)]
pub struct Script<'a> {
    head: &'a [u8],
    choices: &'a [u8],
    at: usize,
}

impl<'a> Script<'a> {
    /// Splits `data` into head and choices.
    pub fn new(data: &'a [u8]) -> Self {
        let split = data.len().min(POLICY_BYTES + ARRIVAL_BYTES);
        let (head, choices) = data.split_at(split);
        Self {
            head,
            choices,
            at: 0,
        }
    }

    fn head(&self, i: usize) -> u8 {
        self.head.get(i).copied().unwrap_or(0)
    }

    /// The next choice byte; the choices repeat, and none at all reads as zeros.
    pub fn byte(&mut self) -> u8 {
        if self.choices.is_empty() {
            return 0;
        }
        let b = self.choices[self.at % self.choices.len()];
        self.at = self.at.wrapping_add(1);
        b
    }

    /// One of `n` options (`n` > 0).
    pub fn pick(&mut self, n: usize) -> usize {
        usize::from(self.byte()) % n
    }

    /// True with probability 1/16: the rare event (authority lost, a refused ACK).
    pub fn rarely(&mut self) -> bool {
        self.byte() >= 0xF0
    }

    /// How many choice bytes there are before they repeat.
    pub fn period(&self) -> usize {
        self.choices.len()
    }

    /// The policy; always valid.
    pub fn policy(&self) -> Policy {
        let secs = Duration::from_secs;
        let millis = Duration::from_millis;
        let max_attempts = 1 + u32::from(self.head(0) % 5);
        let buckets = [secs(5), secs(60), secs(600)];
        let mut n = usize::from(self.head(1) % 4);
        if max_attempts > 1 {
            n = n.max(1);
        }
        let budget = [secs(10), secs(1), secs(30)][usize::from(self.head(3) % 3)];
        let reserve = [secs(1), millis(100), secs(5)][usize::from(self.head(3) / 3 % 3)];
        let reserve = if reserve < budget {
            reserve
        } else {
            budget / 2
        };
        let deferrals = [millis(100), secs(1), secs(5)];
        let release = [secs(900), secs(1), secs(10)][usize::from(self.head(5) % 3)];
        Policy::default()
            .max_attempts(max_attempts)
            .retry_delays(buckets[..n].iter().copied())
            .max_requeues(u32::from(self.head(2) % 6))
            .settlement_budget(budget, reserve)
            .deferral_delays(
                deferrals[..1 + usize::from(self.head(4) % 3)]
                    .iter()
                    .copied(),
            )
            .release_held_after(release)
    }

    /// The first delivery's arrival.
    pub fn arrival(&self) -> Arrival {
        let a = |i: usize| self.head(POLICY_BYTES + i);
        let flags = a(2);
        let on = |bit: u8| flags & bit != 0;
        let verdict = match a(0) % 4 {
            verdict::DISPATCHED => Verdict::Dispatched,
            verdict::UNDISPATCHED => Verdict::Undispatched(Reason::new("no handler for type")),
            verdict::INVALID => Verdict::Refused {
                rejection: GateRejection::Invalid(Reason::new("message_id property missing")),
                reason: Reason::new("message_id property missing"),
            },
            _ => Verdict::Refused {
                rejection: GateRejection::Oversized { len: 2048 },
                reason: Reason::new("body of 2048 bytes is over the 1024 byte limit"),
            },
        };
        let refused = matches!(verdict, Verdict::Refused { .. });
        let target = match a(6) % 4 {
            1 => Some(Terminal::DeadLetter),
            2 => Some(Terminal::Parking),
            _ => None,
        };
        let kinds = [
            None,
            Some(FailureKind::Retryable),
            Some(FailureKind::Permanent),
            Some(FailureKind::Indeterminate),
        ];
        let held = target.map(|target| HeldCopy {
            target,
            kind: kinds[usize::from(a(7) % 4)],
            holds: u32::from(a(7) / 4 % 4),
        });
        Arrival {
            // The gate reads no attempt from a message it refuses.
            attempt: if refused { 1 } else { 1 + u32::from(a(1) % 6) },
            verdict,
            redelivered: on(flag::REDELIVERED),
            delivery_count: on(flag::QUORUM).then_some(u32::from(a(4) % 8)),
            // A message that passed the gate has a valid id.
            local_requeues: (!refused || on(flag::VALID_ID)).then_some(u32::from(a(3) % 8)),
            scoped: on(flag::SCOPED),
            waits: if on(flag::WAITS) {
                lily_mq_core::machine::MAX_LEASE_WAITS - 2 + u32::from(a(5) % 4)
            } else {
                u32::from(a(5) % 2)
            },
            held,
            replayed_from: [None, Some(Terminal::DeadLetter), Some(Terminal::Parking)]
                [usize::from(a(8) % 3)],
        }
    }
}
