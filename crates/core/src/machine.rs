//! One delivery as a pure machine, in the style of quinn-proto: evidence goes in through
//! [`Delivery::handle`], the next thing to do comes out of [`Delivery::poll_action`], and what the
//! ledger should record comes out of [`Delivery::poll_evidence`]. Nothing here waits, reads a clock
//! or touches a socket; the transport executes the actions and reports back.
//!
//! The machine owns every decision between `basic.deliver` and a terminal [`Outcome`]:
//!
//! - which step comes next: open the scope, run the handler, commit or abort, hold a deferral,
//!   publish a copy, ACK, requeue, reject;
//! - how many requeues the message has had (the broker's `x-delivery-count`, this consumer's
//!   [`RequeueMemory`] for a redelivery, the deferrals a scope counted durably, whichever is
//!   highest), and that a message without a valid id counts as already at the limit, since nothing
//!   could count its requeues;
//! - which copy a handoff publishes (the original, or only sanitized metadata for an envelope the
//!   gate refused);
//! - the deferral hold before a deferred requeue, so it is never requeued hot;
//! - a held copy back from its retry bucket ([`HeldCopy`]): straight to its lane, without the
//!   handler;
//! - a transient transaction error (write conflict): the whole transaction again, after a growing
//!   backoff, within the settlement budget since arrival, then a deferral; never an application
//!   attempt;
//! - the plan ([`decide_at_gate`], [`decide`]) and its settlement ([`Settlement`]).
//!
//! Each settle action (ACK, requeue, reject) is handed out at most once, and every terminal outcome
//! rests on the evidence reported for it; the property tests below drive the machine with random
//! evidence to check both.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::decision::Action as SettleAction;
use crate::decision::{
    Authority, Cause, CleanupResult, Handoff, HandoffResult, Lane, Outcome, PipelineResult, Plan,
    RequeueCause, SettleResult, Settlement, Situation, Terminal, TransactionOutcome, decide,
    decide_at_gate,
};
use crate::envelope::{GateRejection, Known};
use crate::error::FailureKind;
use crate::headers::{as_text, as_u32};
use crate::ledger::Evidence;
use crate::policy::Policy;
use crate::reason::Reason;
use crate::transaction::Committed;

/// The reason of a delivery that succeeded.
static OK: Reason = Reason::from_static("ok");

/// The reason of a commit refused because a newer owner took the lease over.
static FENCED: Reason = Reason::from_static("lease taken over by a newer owner (stale fence)");

/// The reason logged for a held copy back for its lane.
static HELD: Reason = Reason::from_static("a held copy, back for its lane");

/// The first backoff before a transaction runs again after a transient error; it doubles.
const RERUN_BACKOFF: Duration = Duration::from_millis(10);

/// The longest backoff between two runs of a transaction.
const RERUN_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// The most runs of one delivery's transaction after the first.
const MAX_RERUNS: u32 = 20;

/// The most times one message waits out another owner's lease in a retry bucket. A dead
/// owner's lease takes one wait (two when the longest bucket is shorter than the lease); a live
/// owner renews its lease only up to its cap. Past this, a lease still held is a deferral.
pub const MAX_LEASE_WAITS: u32 = 20;

/// What the gate and dispatch made of a delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The gate refused the envelope, for `reason`.
    Refused {
        /// Why the gate refused it.
        rejection: GateRejection,
        /// The same, as the copy's and the log's reason.
        reason: Reason,
    },
    /// It passed the gate but no handler takes it.
    Undispatched(Reason),
    /// It passed the gate and a handler takes it.
    Dispatched,
}

/// A delivery as it arrives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arrival {
    /// What the gate and dispatch made of it.
    pub verdict: Verdict,
    /// Application attempt from its headers (1 when the gate refused it).
    pub attempt: u32,
    /// The broker's `redelivered` flag.
    pub redelivered: bool,
    /// RabbitMQ's `x-delivery-count` (quorum queues).
    pub delivery_count: Option<u32>,
    /// Requeues this consumer counted for its message id ([`RequeueMemory::get`]); `None` when
    /// it has no valid id, so its requeues cannot be counted.
    pub local_requeues: Option<u32>,
    /// Whether a transactional scope wraps the handler.
    pub scoped: bool,
    /// How many times the message waited out another owner's lease so far (its
    /// [`WAITS`](crate::headers::WAITS) header).
    pub waits: u32,
    /// What its [`HELD_FOR`](crate::headers::HELD_FOR) headers say, when it is a held copy.
    pub held: Option<HeldCopy>,
    /// The lane an operator replayed it from ([`replayed_from`]).
    pub replayed_from: Option<Terminal>,
}

/// The lane its [`REPLAYED_FROM`](crate::headers::REPLAYED_FROM) header names, if any.
pub fn replayed_from(known: &Known<'_>) -> Option<Terminal> {
    Terminal::parse(as_text(known.replayed_from?)?)
}

/// A held copy back from its retry bucket: its lane failed when it was handed off.
///
/// Anyone who can publish to the work queue can set these headers; what they buy is their own
/// message in the dead-letter or parking lane unhandled, nothing more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldCopy {
    /// The lane it is bound for.
    pub target: Terminal,
    /// The failure's kind, from its headers (`None` for a gate rejection).
    pub kind: Option<FailureKind>,
    /// How many times it waited so far.
    pub holds: u32,
}

impl HeldCopy {
    /// Reads a held copy's headers; `None` unless [`HELD_FOR`](crate::headers::HELD_FOR) names
    /// a lane.
    pub fn from_known(known: &Known<'_>) -> Option<Self> {
        Some(Self {
            target: Terminal::parse(as_text(known.held_for?)?)?,
            kind: known
                .failure_kind
                .and_then(as_text)
                .and_then(FailureKind::parse),
            holds: known.holds.and_then(as_u32).unwrap_or(0),
        })
    }
}

/// What opening the scope found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScopeOpened {
    /// Run the handler; `transaction` says whether a commit or abort follows it.
    Proceed {
        /// Whether a transaction is open.
        transaction: bool,
        /// Earlier handlings of the message that began and never ended in a settlement, when
        /// the scope records them ([`Begin::Proceed`](crate::Begin::Proceed)). At the requeue
        /// limit the handler is not run: the message may be killing its worker.
        deaths: Option<u32>,
    },
    /// Another owner holds the message's lease, which can expire in `expires_in`: the message
    /// waits it out in a retry bucket.
    Wait {
        /// Why.
        reason: Reason,
        /// How long until the other owner's lease can expire.
        expires_in: Duration,
    },
    /// The inbox already holds this message with the same fingerprint.
    Duplicate,
    /// The inbox holds this message id with another fingerprint.
    Conflict(Reason),
    /// A transient transaction error while opening: run it all again after a backoff.
    Transient(Reason),
    /// Work cannot start for an infrastructure reason (a lease held elsewhere).
    Defer {
        /// Why.
        reason: Reason,
        /// Deferrals counted durably so far, if the scope counts them.
        deferrals: Option<u32>,
    },
}

/// Which copy a handoff publishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyOf {
    /// The original body and properties, with Lily's failure headers.
    Original,
    /// The body with sanitized metadata only: the gate refused the envelope.
    Sanitized,
}

/// The next thing to do for a delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Open the scope; report through [`Input::Scope`].
    OpenScope,
    /// Run the pipeline (extractors, hooks, handler, cleanup); report through
    /// [`Input::Pipeline`].
    RunHandler,
    /// Commit the transaction; report through [`Input::Commit`].
    Commit,
    /// Abort the transaction; report through [`Input::Aborted`].
    Abort,
    /// Wait this long (cut short by shutdown), then report through [`Input::Held`].
    Hold(Duration),
    /// Wait up to this long (the executor picks a random part of it, at least half, so that
    /// transactions that conflicted do not meet again), then report through
    /// [`Input::Held`]; the whole transaction runs again.
    Backoff(Duration),
    /// Publish the copy within `deadline`; report through [`Input::Handoff`].
    Publish {
        /// Lane and cause.
        handoff: Handoff,
        /// Which copy.
        copy: CopyOf,
        /// Time allowed for publish and confirm.
        deadline: Duration,
    },
    /// ACK the original; report through [`Input::Settled`].
    Ack,
    /// NACK the original with requeue; count the requeue first when `counted` (the redelivery
    /// can arrive before the report); report through [`Input::Settled`].
    Requeue {
        /// Whether the message's requeues are counted in the [`RequeueMemory`].
        counted: bool,
    },
    /// Reject the original without requeue; report through [`Input::Settled`].
    Reject,
}

/// What the executor reports back to the machine, each the answer to one [`Action`]:
/// [`Delivery::handle`] takes it.
#[derive(Debug)]
pub enum Input {
    /// What opening the scope found ([`Action::OpenScope`]).
    Scope(ScopeOpened),
    /// The pipeline's result, its cleanup's, and its failure's reason ([`Action::RunHandler`]).
    Pipeline(PipelineResult, CleanupResult, Option<Reason>),
    /// The commit's outcome, with the deferrals the scope counted durably and, when the lease
    /// was taken over, how long the new owner's lease can live ([`Action::Commit`]).
    Commit(Committed),
    /// The transaction was aborted ([`Action::Abort`]).
    Aborted,
    /// The hold or the backoff is over; a hold may have been cut short by shutdown
    /// ([`Action::Hold`], [`Action::Backoff`]).
    Held,
    /// The evidence of the handoff publish ([`Action::Publish`]).
    Handoff(HandoffResult),
    /// The evidence of an ACK, NACK or reject ([`Action::Ack`], [`Action::Requeue`],
    /// [`Action::Reject`]).
    Settled(SettleResult),
}

#[derive(Clone, Debug)]
enum Step<'p> {
    Ready(Action),
    Waiting(Action),
    /// Before the verdict placed the first step.
    Arriving,
    Settling(Settlement<'p>),
}

/// The pipeline's result, kept until the transaction's outcome is known.
#[derive(Clone, Copy, Debug)]
struct Ran {
    pipeline: PipelineResult,
    cleanup: CleanupResult,
}

/// One delivery, from arrival to a terminal [`Outcome`].
#[derive(Clone, Debug)]
pub struct Delivery<'p> {
    policy: &'p Policy,
    step: Step<'p>,
    attempt: u32,
    /// Requeues known at arrival; a scope's durable deferral count can raise it.
    requeues: u32,
    counted: bool,
    redelivered: bool,
    copy: CopyOf,
    transaction: bool,
    ran: Ran,
    reason: Option<Reason>,
    evidence: Notes,
    /// The time of the latest input.
    now: Instant,
    /// When the delivery arrived: transient transaction errors are run again within the
    /// settlement budget from here.
    arrived: Instant,
    /// Transaction runs started again after a transient transaction error.
    reruns: u32,
    /// How many times the message waited as a held copy.
    holds: u32,
    /// How many times the message waited out another owner's lease.
    waits: u32,
    replayed_from: Option<Terminal>,
}

impl<'p> Delivery<'p> {
    /// A delivery that arrived at `now`; `authority` is asked only when the gate or dispatch
    /// already decided its plan.
    pub fn new(
        arrival: Arrival,
        policy: &'p Policy,
        authority: impl FnOnce() -> Authority,
        now: Instant,
    ) -> Self {
        let counted = arrival.local_requeues.is_some();
        let requeues = match arrival.local_requeues {
            // Nothing can count its requeues: at the limit from the start.
            None => policy.max_requeues,
            Some(local) => {
                let local = if arrival.redelivered { local } else { 0 };
                local.max(arrival.delivery_count.unwrap_or(0))
            }
        };
        let mut delivery = Self {
            policy,
            step: Step::Arriving,
            attempt: arrival.attempt,
            requeues,
            counted,
            redelivered: arrival.redelivered,
            copy: CopyOf::Original,
            transaction: false,
            ran: Ran {
                pipeline: PipelineResult::Succeeded,
                cleanup: CleanupResult::Succeeded,
            },
            reason: None,
            evidence: Notes::default(),
            now,
            arrived: now,
            reruns: 0,
            holds: 0,
            waits: arrival.waits,
            replayed_from: arrival.replayed_from,
        };
        let oversized = matches!(
            arrival.verdict,
            Verdict::Refused {
                rejection: GateRejection::Oversized { .. },
                ..
            }
        );
        if let (Some(held), false) = (arrival.held, oversized) {
            if matches!(arrival.verdict, Verdict::Refused { .. }) {
                delivery.copy = CopyOf::Sanitized;
            }
            delivery.holds = held.holds;
            // The copy's own reason is a header value: it goes on to the lane's copy, never to
            // a log line.
            delivery.reason = Some(HELD.clone());
            let plan = Plan::Handoff(Handoff {
                lane: held.target.lane(),
                kind: held.kind,
                cause: Cause::Held,
            });
            delivery.settle(plan, now);
            return delivery;
        }
        match arrival.verdict {
            Verdict::Refused { rejection, reason } => {
                delivery.copy = CopyOf::Sanitized;
                delivery.reason = Some(reason);
                delivery.settle(decide_at_gate(&rejection), now);
            }
            Verdict::Undispatched(reason) => {
                delivery.decided(PipelineResult::NotDispatched, reason, authority(), now);
            }
            Verdict::Dispatched if arrival.scoped => delivery.step = Step::Ready(Action::OpenScope),
            Verdict::Dispatched => delivery.step = Step::Ready(Action::RunHandler),
        }
        delivery
    }

    /// The next action, handed out once. `authority` is asked only before a copy would be
    /// published: none is once authority is lost.
    pub fn poll_action(&mut self, authority: impl FnOnce() -> Authority) -> Option<Action> {
        match &mut self.step {
            Step::Ready(action) => {
                let action = *action;
                self.step = Step::Waiting(action);
                Some(action)
            }
            Step::Waiting(_) | Step::Arriving => None,
            Step::Settling(settlement) => match settlement.poll_action()? {
                SettleAction::Publish { handoff, deadline } => {
                    if authority() == Authority::Lost {
                        self.evidence.push(Evidence::AuthorityLost);
                        // Without authority the settlement ends here: nothing more to do.
                        settlement.handle_handoff(HandoffResult::Failed, Authority::Lost, self.now);
                        return None;
                    }
                    self.evidence.push(Evidence::HandoffPublished);
                    Some(Action::Publish {
                        handoff,
                        copy: self.copy,
                        deadline,
                    })
                }
                SettleAction::Ack => Some(Action::Ack),
                SettleAction::Requeue => Some(Action::Requeue {
                    counted: self.counted,
                }),
                SettleAction::Reject => Some(Action::Reject),
                SettleAction::Hold(delay) => Some(Action::Hold(delay)),
            },
        }
    }

    /// The next piece of evidence for the ledger, in order.
    pub fn poll_evidence(&mut self) -> Option<Evidence> {
        self.evidence.pop()
    }

    /// Takes the answer to the last action, with the delivery's authority and the time now.
    pub fn handle(&mut self, input: Input, authority: Authority, now: Instant) {
        match input {
            Input::Scope(opened) => self.on_scope(opened, authority, now),
            Input::Pipeline(pipeline, cleanup, reason) => {
                self.on_pipeline(pipeline, cleanup, reason, authority, now);
            }
            Input::Commit(committed) => self.on_commit(committed, authority, now),
            Input::Aborted => self.on_aborted(authority, now),
            Input::Held => self.on_held(now),
            Input::Handoff(result) => self.on_handoff(result, authority, now),
            Input::Settled(result) => self.on_settled(result),
        }
    }

    /// Takes what opening the scope found.
    fn on_scope(&mut self, opened: ScopeOpened, authority: Authority, now: Instant) {
        if !self.waiting_for(Action::OpenScope) {
            return;
        }
        match opened {
            // Handled that many times without being settled: the worker (or its connection)
            // died with it each time. Not run again.
            ScopeOpened::Proceed {
                transaction,
                deaths: Some(deaths),
            } if deaths > 0 && deaths >= self.policy.max_requeues => {
                self.transaction = transaction;
                self.requeues = self.requeues.max(deaths);
                self.ran = Ran {
                    pipeline: PipelineResult::Deferred,
                    cleanup: CleanupResult::Succeeded,
                };
                self.reason = Some(Reason::new(format!(
                    "handled {deaths} times without being settled (it may be killing its worker)"
                )));
                if transaction {
                    self.step = Step::Ready(Action::Abort);
                } else {
                    self.plan(TransactionOutcome::NotRequired, authority, now);
                }
            }
            ScopeOpened::Proceed { transaction, .. } => {
                self.transaction = transaction;
                self.step = Step::Ready(Action::RunHandler);
            }
            ScopeOpened::Wait { reason, expires_in } => {
                self.wait_out(reason, expires_in, authority, now);
            }
            ScopeOpened::Duplicate => self.decided(
                PipelineResult::Duplicate,
                Reason::new("duplicate suppressed by the inbox"),
                authority,
                now,
            ),
            ScopeOpened::Conflict(reason) => {
                self.decided(PipelineResult::Conflict, reason, authority, now);
            }
            ScopeOpened::Defer { reason, deferrals } => {
                self.raise_requeues(deferrals);
                self.decided(PipelineResult::Deferred, reason, authority, now);
            }
            ScopeOpened::Transient(reason) => {
                self.reason = Some(reason);
                self.ran = Ran {
                    pipeline: PipelineResult::Transient,
                    cleanup: CleanupResult::Succeeded,
                };
                self.rerun_or_plan(TransactionOutcome::NotRequired, authority, now);
            }
        }
    }

    /// Takes the pipeline's result (and its failure's reason).
    fn on_pipeline(
        &mut self,
        pipeline: PipelineResult,
        cleanup: CleanupResult,
        reason: Option<Reason>,
        authority: Authority,
        now: Instant,
    ) {
        if !self.waiting_for(Action::RunHandler) {
            return;
        }
        self.evidence.push(Evidence::HandlerReturned);
        // Without a transaction to run again, a transient error is an ordinary retryable one.
        let pipeline = match pipeline {
            PipelineResult::Transient if !self.transaction => PipelineResult::Failed {
                kind: FailureKind::Retryable,
                retry_after: None,
            },
            other => other,
        };
        self.ran = Ran { pipeline, cleanup };
        self.reason = reason;
        if !self.transaction {
            self.plan(TransactionOutcome::NotRequired, authority, now);
        } else if (pipeline, cleanup) == (PipelineResult::Succeeded, CleanupResult::Succeeded) {
            self.step = Step::Ready(Action::Commit);
        } else {
            self.step = Step::Ready(Action::Abort);
        }
    }

    /// Takes the commit's outcome, with the deferrals the scope counted durably and, when the
    /// lease was taken over, how long the new owner's lease can live.
    fn on_commit(&mut self, committed: Committed, authority: Authority, now: Instant) {
        if !self.waiting_for(Action::Commit) {
            return;
        }
        let Committed {
            outcome,
            reason,
            deferrals,
            wait,
        } = committed;
        self.raise_requeues(deferrals);
        if reason.is_some() {
            self.reason = reason;
        }
        if let (TransactionOutcome::Fenced, Some(expires_in)) = (outcome, wait) {
            let reason = self.reason.take().unwrap_or_else(|| FENCED.clone());
            self.wait_out(reason, expires_in, authority, now);
        } else if outcome == TransactionOutcome::Transient {
            self.rerun_or_plan(outcome, authority, now);
        } else {
            self.plan(outcome, authority, now);
        }
    }

    /// The transaction was aborted.
    fn on_aborted(&mut self, authority: Authority, now: Instant) {
        if !self.waiting_for(Action::Abort) {
            return;
        }
        if self.ran.pipeline == PipelineResult::Transient {
            self.rerun_or_plan(TransactionOutcome::Aborted, authority, now);
        } else {
            self.plan(TransactionOutcome::Aborted, authority, now);
        }
    }

    /// The hold or the backoff is over (a hold may have been cut short by shutdown).
    fn on_held(&mut self, now: Instant) {
        self.now = now;
        match &mut self.step {
            Step::Settling(settlement) => settlement.handle_held(now),
            Step::Waiting(Action::Hold(_)) => {
                self.settle(Plan::Requeue(RequeueCause::Deferred), now);
            }
            Step::Waiting(Action::Backoff(_)) => {
                // A fresh scope and transaction, and the handler again.
                self.transaction = false;
                self.step = Step::Ready(Action::OpenScope);
            }
            _ => {}
        }
    }

    /// Takes the evidence of the handoff publish.
    fn on_handoff(&mut self, result: HandoffResult, authority: Authority, now: Instant) {
        self.now = now;
        if let Step::Settling(settlement) = &mut self.step {
            self.evidence.push(if result == HandoffResult::Confirmed {
                Evidence::HandoffConfirmed
            } else {
                Evidence::HandoffFailed
            });
            settlement.handle_handoff(result, authority, now);
        }
    }

    /// Takes the evidence of an ACK, NACK or reject.
    fn on_settled(&mut self, result: SettleResult) {
        if let Step::Settling(settlement) = &mut self.step {
            if result == SettleResult::Refused {
                self.evidence.push(Evidence::AuthorityLost);
            }
            settlement.handle_settled(result);
        }
    }

    /// The terminal outcome, once reached.
    pub fn outcome(&self) -> Option<Outcome> {
        match &self.step {
            Step::Settling(settlement) => settlement.outcome(),
            _ => None,
        }
    }

    /// The lane of the confirmed handoff, kept even when the ACK that follows fails.
    pub fn confirmed_handoff(&self) -> Option<Lane> {
        match &self.step {
            Step::Settling(settlement) => settlement.confirmed_handoff(),
            _ => None,
        }
    }

    /// Why the delivery took its path ("ok" after a success).
    pub fn reason(&self) -> &Reason {
        self.reason.as_ref().unwrap_or(&OK)
    }

    /// Whether the message left the queue for good after a redelivery, so its count in the
    /// [`RequeueMemory`] can go.
    pub fn forgets_requeues(&self) -> bool {
        self.counted
            && self.redelivered
            && !matches!(self.outcome(), Some(Outcome::Requeued(_)) | None)
    }

    /// After a transient transaction error: the whole transaction again after a backoff, while
    /// the settlement budget since arrival allows; otherwise the decision table, which defers.
    fn rerun_or_plan(
        &mut self,
        transaction: TransactionOutcome,
        authority: Authority,
        now: Instant,
    ) {
        let backoff = RERUN_BACKOFF
            .saturating_mul(1 << self.reruns.min(6))
            .min(RERUN_BACKOFF_MAX);
        let window = self.arrived + self.policy.settlement_budget;
        if authority == Authority::Held && self.reruns < MAX_RERUNS && now + backoff < window {
            self.reruns += 1;
            self.step = Step::Ready(Action::Backoff(backoff));
        } else {
            self.ran.pipeline = PipelineResult::Transient;
            self.plan(transaction, authority, now);
        }
    }

    /// Another owner holds the lease for `expires_in` at most: a copy waits that long in a
    /// retry bucket (the shortest as long, or the longest), leaves the queue and comes back to
    /// be handled; the rest of the window goes on meanwhile. Neither an attempt nor a requeue.
    /// Without buckets, or past [`MAX_LEASE_WAITS`], a deferral as before.
    fn wait_out(
        &mut self,
        reason: Reason,
        expires_in: Duration,
        authority: Authority,
        now: Instant,
    ) {
        self.ran = Ran {
            pipeline: PipelineResult::Deferred,
            cleanup: CleanupResult::Succeeded,
        };
        self.reason = Some(reason);
        let bucket = self.policy.wait_bucket(expires_in);
        match bucket {
            Some(bucket) if self.waits < MAX_LEASE_WAITS && authority == Authority::Held => {
                self.settle(
                    Plan::Handoff(Handoff {
                        lane: Lane::Wait { bucket },
                        kind: None,
                        cause: Cause::LeaseHeld,
                    }),
                    now,
                );
            }
            _ => self.plan(TransactionOutcome::NotRequired, authority, now),
        }
    }

    fn waiting_for(&self, action: Action) -> bool {
        matches!(self.step, Step::Waiting(a) if a == action)
    }

    fn raise_requeues(&mut self, deferrals: Option<u32>) {
        self.requeues = self.requeues.max(deferrals.unwrap_or(0));
    }

    /// Decided before the handler ran.
    fn decided(
        &mut self,
        pipeline: PipelineResult,
        reason: Reason,
        authority: Authority,
        now: Instant,
    ) {
        self.ran = Ran {
            pipeline,
            cleanup: CleanupResult::Succeeded,
        };
        self.reason = Some(reason);
        self.plan(TransactionOutcome::NotRequired, authority, now);
    }

    /// Runs the decision table; a deferred requeue holds first.
    fn plan(&mut self, transaction: TransactionOutcome, authority: Authority, now: Instant) {
        let situation = Situation {
            pipeline: self.ran.pipeline,
            cleanup: self.ran.cleanup,
            transaction,
            attempt: self.attempt,
            requeues: self.requeues,
            authority,
            replayed_from: self.replayed_from,
        };
        match decide(&situation, self.policy) {
            Plan::Requeue(RequeueCause::Deferred) => {
                let hold = self.policy.deferral_delay(self.requeues);
                self.step = Step::Ready(Action::Hold(hold));
            }
            plan => self.settle(plan, now),
        }
    }

    fn settle(&mut self, plan: Plan, now: Instant) {
        self.now = now;
        match plan {
            Plan::Abandon => self.evidence.push(Evidence::AuthorityLost),
            Plan::Ack => {} // the ACK follows at once; its outcome closes the entry
            _ => self.evidence.push(Evidence::Planned),
        }
        self.step = Step::Settling(
            Settlement::start(plan, self.requeues, self.policy, now).held_before(self.holds),
        );
    }
}

/// A few pieces of evidence waiting for the ledger, kept inline: a delivery produces at most
/// four between two polls.
#[derive(Clone, Copy, Debug, Default)]
struct Notes {
    items: [Option<Evidence>; 4],
    head: usize,
    len: usize,
}

impl Notes {
    fn push(&mut self, evidence: Evidence) {
        if self.len == self.items.len() {
            // Never reached by the machine; the oldest note gives way rather than panic.
            self.pop();
        }
        self.items[(self.head + self.len) % self.items.len()] = Some(evidence);
        self.len += 1;
    }

    fn pop(&mut self) -> Option<Evidence> {
        if self.len == 0 {
            return None;
        }
        let evidence = self.items[self.head].take();
        self.head = (self.head + 1) % self.items.len();
        self.len -= 1;
        evidence
    }
}

/// How many times this consumer requeued each message, by message id, for queues whose broker
/// does not count (classic queues have no `x-delivery-count`). It holds at most `capacity`
/// ids; when full, the id counted least recently gives way.
#[derive(Debug)]
pub struct RequeueMemory {
    capacity: usize,
    counts: HashMap<Box<str>, (u32, u64)>,
    /// Ids by the tick of their last count: the first is the least recently counted.
    order: BTreeMap<u64, Box<str>>,
    tick: u64,
}

impl RequeueMemory {
    /// A memory of at most `capacity` ids (at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            counts: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
        }
    }

    /// Requeues counted for `id`.
    pub fn get(&self, id: &str) -> u32 {
        self.counts.get(id).map_or(0, |(n, _)| *n)
    }

    /// Counts one more requeue of `id`, evicting the least recently counted id when full.
    pub fn count(&mut self, id: &str) {
        self.tick += 1;
        if let Some((n, at)) = self.counts.get_mut(id) {
            *n += 1;
            let key = self.order.remove(at).unwrap_or_else(|| id.into());
            *at = self.tick;
            self.order.insert(self.tick, key);
            return;
        }
        if self.counts.len() >= self.capacity
            && let Some((_, evicted)) = self.order.pop_first()
        {
            self.counts.remove(&evicted);
        }
        let key: Box<str> = id.into();
        self.order.insert(self.tick, key.clone());
        self.counts.insert(key, (1, self.tick));
    }

    /// Forgets `id`: it left the queue for good.
    pub fn forget(&mut self, id: &str) {
        if let Some((_, at)) = self.counts.remove(id) {
            self.order.remove(&at);
        }
    }

    /// Ids remembered.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// Whether no id is remembered.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}
