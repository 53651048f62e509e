//! The decision table of the book's design chapter (`docs/src/design.md`), as pure functions, and
//! the settlement machine that carries one delivery from its plan to a terminal [`Outcome`].
//!
//! [`decide_at_gate`] covers the rows before the pipeline, [`decide`] the rows after it.
//! [`Settlement`] then sequences the actions of a plan (handoff publish, ACK, NACK, reject) and
//! takes the evidence of each back through `handle_*`; every action is handed out at most once, so
//! no delivery is settled twice by construction.

use std::time::{Duration, Instant};

use crate::budget::Budget;
use crate::envelope::GateRejection;
use crate::error::FailureKind;
use crate::policy::Policy;

/// What the pipeline (dispatch, extractors, hooks, handler) produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PipelineResult {
    /// The handler returned `Ok(())`.
    Succeeded,
    /// An extractor, a hook or the handler returned an error of this kind.
    Failed {
        /// Kind of the failure.
        kind: FailureKind,
        /// The handler's delay hint.
        retry_after: Option<Duration>,
    },
    /// Dispatch found no handler for the type, schema version or content type: permanent,
    /// decided before any scope opened.
    NotDispatched,
    /// The inbox holds this message id with a different fingerprint: permanent, decided
    /// before the handler ran.
    Conflict,
    /// The handler panicked: retryable.
    Panicked,
    /// The handler ran past its timeout: retryable.
    TimedOut,
    /// Work could not start for an infrastructure reason (a lease held elsewhere).
    Deferred,
    /// A transient transaction error (write conflict, election) that in-process reruns did not
    /// get past within the budget: deferral, not an application attempt.
    Transient,
    /// The inbox shows this message was already handled with the same fingerprint.
    Duplicate,
}

/// Whether the scope's cleanup succeeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CleanupResult {
    /// Every cleanup step succeeded.
    Succeeded,
    /// A cleanup step failed: a success becomes a retryable failure.
    Failed,
}

/// Outcome of the scope's transaction, when one is required.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransactionOutcome {
    /// The scope has no transaction.
    NotRequired,
    /// The commit completed.
    Committed,
    /// The transaction was aborted (or the commit failed definitively): retryable.
    Aborted,
    /// The commit outcome is still unknown after bounded retries: deferral.
    CommitAmbiguous,
    /// The commit failed with a transient transaction error (write conflict, election): the
    /// transaction runs again in-process, then deferral.
    Transient,
    /// The commit was refused because this worker's lease was taken over (its fence is stale):
    /// deferral; the new owner's outcome decides.
    Fenced,
}

/// Whether Lily may still settle the delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Authority {
    /// The channel is open and authority was not revoked.
    Held,
    /// The channel closed or authority was revoked: nothing may be sent.
    Lost,
}

/// Everything [`decide`] looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Situation {
    /// Result of the pipeline.
    pub pipeline: PipelineResult,
    /// Result of the scope cleanup.
    pub cleanup: CleanupResult,
    /// Outcome of the transaction.
    pub transaction: TransactionOutcome,
    /// Application attempt of this delivery, starting at 1.
    pub attempt: u32,
    /// Requeues this message has already had.
    pub requeues: u32,
    /// Whether settlement is still possible.
    pub authority: Authority,
    /// The lane an operator replayed the message from ([`REPLAYED_FROM`]). Replayed from
    /// [`Terminal::Parking`], it is never retried automatically: a retry goes back to parking.
    ///
    /// [`REPLAYED_FROM`]: crate::headers::REPLAYED_FROM
    pub replayed_from: Option<Terminal>,
}

/// Where a handoff publishes the failed message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lane {
    /// A retry bucket; the copy carries `next_attempt`.
    Retry {
        /// Index into [`Policy::retry_delays`].
        bucket: usize,
        /// Attempt number written on the copy.
        next_attempt: u32,
    },
    /// The dead-letter queue.
    DeadLetter,
    /// The parking lane: never replayed automatically.
    Parking,
    /// A retry bucket, waited in while `target` fails: the copy keeps its attempt, comes back
    /// after the bucket's delay and goes straight to `target`, without running the handler.
    Held {
        /// Index into [`Policy::retry_delays`].
        bucket: usize,
        /// The lane the copy is bound for.
        target: Terminal,
    },
    /// A retry bucket, waited in while another owner's lease on the message lives: the copy
    /// keeps its attempt and comes back to be handled as before. Neither an application
    /// attempt nor a requeue.
    Wait {
        /// Index into [`Policy::retry_delays`].
        bucket: usize,
    },
}

/// A lane through which a message leaves the work queue for good.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Terminal {
    /// The dead-letter queue.
    DeadLetter,
    /// The parking lane.
    Parking,
}

impl Terminal {
    /// The lane.
    pub const fn lane(self) -> Lane {
        match self {
            Self::DeadLetter => Lane::DeadLetter,
            Self::Parking => Lane::Parking,
        }
    }

    /// The value of the [`HELD_FOR`](crate::headers::HELD_FOR) header.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::DeadLetter => "dead-letter",
            Self::Parking => "parking",
        }
    }

    /// Reads a [`HELD_FOR`](crate::headers::HELD_FOR) or
    /// [`REPLAYED_FROM`](crate::headers::REPLAYED_FROM) header value.
    pub fn parse(text: &str) -> Option<Self> {
        [Self::DeadLetter, Self::Parking]
            .into_iter()
            .find(|t| t.as_str() == text)
    }

    /// The terminal lane `lane` is, or is bound for.
    pub const fn of(lane: Lane) -> Option<Self> {
        match lane {
            Lane::DeadLetter => Some(Self::DeadLetter),
            Lane::Parking => Some(Self::Parking),
            Lane::Held { target, .. } => Some(target),
            Lane::Retry { .. } | Lane::Wait { .. } => None,
        }
    }
}

/// Why a failure takes the path it takes; written to headers and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cause {
    /// The gate refused the envelope.
    InvalidEnvelope,
    /// No handler for the type, schema version or content type.
    Dispatch,
    /// The message id was already handled with another fingerprint.
    Conflict,
    /// The handler, an extractor or a hook failed.
    Handler,
    /// The handler panicked.
    Panic,
    /// The handler timed out.
    Timeout,
    /// Cleanup failed after a successful handler.
    Cleanup,
    /// The transaction was aborted.
    TransactionAborted,
    /// Retryable failure on the last attempt.
    AttemptsExhausted,
    /// The message reached the requeue limit.
    RequeueLimit,
    /// A held copy came back for its lane: the reason it carries is written unchanged.
    Held,
    /// Another owner holds the message's lease: the message waits it out in a retry bucket.
    LeaseHeld,
}

impl Cause {
    /// The name used in headers and logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::InvalidEnvelope => "invalid envelope",
            Self::Dispatch => "dispatch failure",
            Self::Conflict => "inbox conflict",
            Self::Handler => "handler failure",
            Self::Panic => "handler panicked",
            Self::Timeout => "handler timed out",
            Self::Cleanup => "scope cleanup failed",
            Self::TransactionAborted => "transaction aborted",
            Self::AttemptsExhausted => "attempts exhausted",
            Self::RequeueLimit => "requeue limit reached",
            Self::Held => "held",
            Self::LeaseHeld => "waiting out a lease",
        }
    }
}

/// A handoff to publish: mandatory, persistent, confirmed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handoff {
    /// Destination.
    pub lane: Lane,
    /// Kind of the failure, written to the copy's headers (`None` for gate rejections).
    pub kind: Option<FailureKind>,
    /// Why.
    pub cause: Cause,
}

/// Why an original was requeued with NACK.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequeueCause {
    /// The handoff publish failed (returned, nacked, channel error, timeout).
    HandoffFailed,
    /// An infrastructure deferral (lease held, commit ambiguous).
    Deferred,
}

/// Why a delivery ends without settlement evidence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unresolved {
    /// The handoff was confirmed but the original ACK failed or was not possible: the copy is
    /// kept, the original will be redelivered (a duplicate in the retry/DLQ path is possible).
    HandoffConfirmedAckFailed(Lane),
    /// The handoff failed and the budget left no time for the NACK.
    BudgetExhausted,
}

/// A plan for the original delivery, chosen by the decision table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Plan {
    /// ACK the original.
    Ack,
    /// Publish a copy, wait for its confirm, then ACK the original.
    Handoff(Handoff),
    /// NACK the original with requeue.
    Requeue(RequeueCause),
    /// `basic.reject(requeue=false)`: the queue's dead-letter exchange takes it.
    Reject,
    /// Send nothing: authority is lost; the broker will redeliver.
    Abandon,
}

/// The rows before the pipeline.
pub fn decide_at_gate(rejection: &GateRejection) -> Plan {
    match rejection {
        GateRejection::Oversized { .. } => Plan::Reject,
        GateRejection::Invalid(_) => Plan::Handoff(Handoff {
            lane: Lane::DeadLetter,
            kind: None,
            cause: Cause::InvalidEnvelope,
        }),
    }
}

/// The rows after the pipeline.
pub fn decide(s: &Situation, policy: &Policy) -> Plan {
    if s.authority == Authority::Lost {
        return Plan::Abandon;
    }
    let at_limit = s.requeues >= policy.max_requeues;
    let to_dead_letter = |kind, cause| {
        Plan::Handoff(Handoff {
            lane: Lane::DeadLetter,
            kind: Some(kind),
            cause,
        })
    };
    let (kind, retry_after, cause) = match (s.pipeline, s.cleanup, s.transaction) {
        (PipelineResult::Duplicate, _, _) => return Plan::Ack,
        // The effect may have happened: at the limit it waits for an operator, never the DLQ.
        (
            PipelineResult::Succeeded,
            CleanupResult::Succeeded,
            TransactionOutcome::CommitAmbiguous,
        ) if at_limit => {
            return Plan::Handoff(Handoff {
                lane: Lane::Parking,
                kind: Some(FailureKind::Indeterminate),
                cause: Cause::RequeueLimit,
            });
        }
        (PipelineResult::Deferred | PipelineResult::Transient, _, _)
        | (
            PipelineResult::Succeeded,
            CleanupResult::Succeeded,
            TransactionOutcome::CommitAmbiguous
            | TransactionOutcome::Fenced
            | TransactionOutcome::Transient,
        ) => {
            return if at_limit {
                to_dead_letter(FailureKind::Retryable, Cause::RequeueLimit)
            } else {
                Plan::Requeue(RequeueCause::Deferred)
            };
        }
        (
            PipelineResult::Succeeded,
            CleanupResult::Succeeded,
            TransactionOutcome::NotRequired | TransactionOutcome::Committed,
        ) => return Plan::Ack,
        (PipelineResult::Succeeded, CleanupResult::Failed, _) => {
            (FailureKind::Retryable, None, Cause::Cleanup)
        }
        (PipelineResult::Succeeded, CleanupResult::Succeeded, TransactionOutcome::Aborted) => {
            (FailureKind::Retryable, None, Cause::TransactionAborted)
        }
        (PipelineResult::Failed { kind, retry_after }, _, _) => (kind, retry_after, Cause::Handler),
        (PipelineResult::NotDispatched, _, _) => (FailureKind::Permanent, None, Cause::Dispatch),
        (PipelineResult::Conflict, _, _) => (FailureKind::Permanent, None, Cause::Conflict),
        (PipelineResult::Panicked, _, _) => (FailureKind::Retryable, None, Cause::Panic),
        (PipelineResult::TimedOut, _, _) => (FailureKind::Retryable, None, Cause::Timeout),
    };
    if at_limit && kind != FailureKind::Indeterminate {
        return to_dead_letter(kind, Cause::RequeueLimit);
    }
    match kind {
        // The operator who replayed it from parking decides again, not a retry bucket.
        FailureKind::Retryable
            if s.attempt < policy.max_attempts && s.replayed_from == Some(Terminal::Parking) =>
        {
            Plan::Handoff(Handoff {
                lane: Lane::Parking,
                kind: Some(kind),
                cause,
            })
        }
        FailureKind::Retryable if s.attempt < policy.max_attempts => Plan::Handoff(Handoff {
            lane: Lane::Retry {
                bucket: policy.bucket_for(s.attempt, retry_after),
                next_attempt: s.attempt + 1,
            },
            kind: Some(kind),
            cause,
        }),
        FailureKind::Retryable => to_dead_letter(kind, Cause::AttemptsExhausted),
        FailureKind::Permanent => to_dead_letter(kind, cause),
        FailureKind::Indeterminate => Plan::Handoff(Handoff {
            lane: Lane::Parking,
            kind: Some(kind),
            cause,
        }),
    }
}

/// Evidence from a handoff publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandoffResult {
    /// The broker confirmed the publish and did not return it.
    Confirmed,
    /// The broker returned the message as unroutable (even if it then confirmed it).
    Returned,
    /// The broker nacked the publish.
    Nacked,
    /// The publish or its confirm failed on the channel, or the adapter failed or panicked.
    Failed,
    /// The exchange published to does not exist: the broker closed the channel with
    /// `NOT_FOUND` naming it, so the publish reached no queue. Handoff copies go through the
    /// default exchange, which always exists; only the exchanges an application publishes to
    /// meet this.
    NoExchange,
    /// No confirm arrived within the budget.
    TimedOut,
    /// The broker blocked the publishing connection (a resource alarm) for the whole budget,
    /// so the copy was never published.
    Blocked,
    /// The broker refused the publish for want of a permission (`ACCESS_REFUSED`, or the
    /// publisher held it back while the broker refuses): the lane fails until the permission
    /// is granted again. The delivery is held, never NACKed below the requeue limit: a NACK
    /// would only bring it back to a refusal and spend its requeues.
    Refused,
}

/// Evidence from writing an ACK, NACK or reject.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SettleResult {
    /// The frame was written to the channel.
    Written,
    /// The channel refused it (closed, poisoned, or the delivery already settled).
    Refused,
}

/// What to do next for a delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Publish the handoff within `deadline`, then report through [`Settlement::handle_handoff`].
    Publish {
        /// The handoff to publish.
        handoff: Handoff,
        /// Time allowed for publish and confirm.
        deadline: Duration,
    },
    /// ACK the original, then report through [`Settlement::handle_settled`].
    Ack,
    /// NACK the original with requeue, then report through [`Settlement::handle_settled`].
    Requeue,
    /// Reject the original without requeue, then report through [`Settlement::handle_settled`].
    Reject,
    /// Wait this long (cut short by shutdown), then report through [`Settlement::handle_held`]:
    /// a failed handoff backs off before its NACK, or before it is tried again at the requeue
    /// limit.
    Hold(Duration),
}

/// The terminal result of one delivery, counted in totals.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The original was ACKed after success (or duplicate suppression).
    Acked,
    /// A retry copy was confirmed and the original ACKed.
    Retried,
    /// A dead-letter copy was confirmed and the original ACKed.
    DeadLettered,
    /// A parking copy was confirmed and the original ACKed.
    Parked,
    /// The dead-letter or parking lane failed; a held copy was confirmed in a retry bucket and
    /// the original ACKed. The copy comes back to try that lane again.
    Held,
    /// Another owner held the message's lease: a copy was confirmed in a retry bucket, to wait
    /// the lease out, and the original ACKed. Not an attempt, not a requeue.
    Waited,
    /// The original was NACKed with requeue.
    Requeued(RequeueCause),
    /// The original was rejected to the broker's dead-letter exchange (broker-native, weaker
    /// evidence than a confirmed handoff).
    RejectedToDlx,
    /// Nothing was sent because authority was lost; the broker will redeliver.
    AuthorityLost,
    /// Settlement is unresolved.
    Unresolved(Unresolved),
}

impl Outcome {
    /// The outcomes' labels, in the order of [`Outcome::slot`]: the name of the
    /// [`Totals`](crate::Totals) field each is counted in, and the `outcome` label of the
    /// `lily_deliveries_total` metric.
    pub const LABELS: [&'static str; 11] = [
        "acked",
        "retried",
        "dead_lettered",
        "parked",
        "held",
        "requeued",
        "deferred",
        "rejected_at_gate",
        "authority_lost",
        "unresolved",
        "waited",
    ];

    /// This outcome's index in [`Outcome::LABELS`].
    pub const fn slot(self) -> usize {
        match self {
            Self::Acked => 0,
            Self::Retried => 1,
            Self::DeadLettered => 2,
            Self::Parked => 3,
            Self::Held => 4,
            Self::Requeued(RequeueCause::HandoffFailed) => 5,
            Self::Requeued(RequeueCause::Deferred) => 6,
            Self::RejectedToDlx => 7,
            Self::AuthorityLost => 8,
            Self::Unresolved(_) => 9,
            Self::Waited => 10,
        }
    }

    /// This outcome's label.
    pub const fn label(self) -> &'static str {
        Self::LABELS[self.slot()]
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// The action is ready to be handed out.
    Ready(Action),
    /// The action was handed out; waiting for its evidence.
    Waiting(Action),
    Done(Outcome),
}

/// Carries one delivery from its [`Plan`] to an [`Outcome`].
///
/// Drive it with [`poll_action`](Self::poll_action) and the `handle_*` methods. Each action is
/// returned once; evidence for an action that was not handed out is ignored.
#[derive(Clone, Debug)]
pub struct Settlement<'p> {
    stage: Stage,
    budget: Budget,
    handoff: Option<Lane>,
    may_requeue: bool,
    requeue_cause: RequeueCause,
    policy: &'p Policy,
    requeues: u32,
    /// How many times the message waited as a held copy before.
    holds: u32,
    /// Made at the first failed handoff: most settlements never need it.
    failing: Option<Box<Failing>>,
}

/// What a settlement keeps once a handoff failed.
#[derive(Clone, Debug, Default)]
struct Failing {
    /// What follows the hold handed out, and when it was to end.
    after_hold: Option<(AfterHold, Instant)>,
    /// Since when the delivery is held at the requeue limit, and how many holds it had.
    held: Option<(Instant, u32)>,
    /// Whether a held copy was tried for the failed handoff.
    detoured: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AfterHold {
    Requeue,
    Publish(Handoff),
}

/// The first hold at the requeue limit; each next one doubles, up to [`HOLD_MAX`].
const HOLD_MIN: Duration = Duration::from_secs(1);
/// The longest hold at the requeue limit between two tries of the failed handoff.
const HOLD_MAX: Duration = Duration::from_secs(60);
/// The longest hold between two tries of a handoff the broker refused: short, so the lane
/// resumes soon after the permission is granted again (the publisher bounds what the tries
/// cost the broker).
const REFUSED_HOLD_MAX: Duration = Duration::from_secs(2);

impl<'p> Settlement<'p> {
    /// Starts settlement of `plan` at `now`. `requeues` is how many times the message has been
    /// requeued already.
    pub fn start(plan: Plan, requeues: u32, policy: &'p Policy, now: Instant) -> Self {
        let budget = Budget::start(now, policy.settlement_budget, policy.nack_reserve);
        let mut requeue_cause = RequeueCause::HandoffFailed;
        let stage = match plan {
            Plan::Ack => Stage::Ready(Action::Ack),
            Plan::Handoff(handoff) => Stage::Ready(Action::Publish {
                handoff,
                deadline: budget.for_handoff(now),
            }),
            Plan::Requeue(cause) => {
                requeue_cause = cause;
                Stage::Ready(Action::Requeue)
            }
            Plan::Reject => Stage::Ready(Action::Reject),
            Plan::Abandon => Stage::Done(Outcome::AuthorityLost),
        };
        Self {
            stage,
            budget,
            handoff: None,
            may_requeue: requeues < policy.max_requeues,
            requeue_cause,
            policy,
            requeues,
            holds: 0,
            failing: None,
        }
    }

    /// For a copy that was held `holds` times already: its next held copy waits in a longer
    /// bucket (the last one repeats).
    #[must_use]
    pub fn held_before(mut self, holds: u32) -> Self {
        self.holds = holds;
        self
    }

    /// The retry bucket a held copy waits in, if the policy has buckets.
    fn hold_bucket(&self) -> Option<usize> {
        let last = self.policy.retry_delays.len().checked_sub(1)?;
        Some(usize::try_from(self.holds).unwrap_or(usize::MAX).min(last))
    }

    /// The next action, handed out once.
    pub fn poll_action(&mut self) -> Option<Action> {
        match self.stage {
            Stage::Ready(action) => {
                self.stage = Stage::Waiting(action);
                Some(action)
            }
            Stage::Waiting(_) | Stage::Done(_) => None,
        }
    }

    /// Takes the evidence of the handoff publish.
    pub fn handle_handoff(&mut self, result: HandoffResult, authority: Authority, now: Instant) {
        let Stage::Waiting(Action::Publish { handoff, .. }) = self.stage else {
            return;
        };
        self.stage = match (result, authority) {
            (HandoffResult::Confirmed, Authority::Held) => {
                self.handoff = Some(handoff.lane);
                Stage::Ready(Action::Ack)
            }
            (HandoffResult::Confirmed, Authority::Lost) => {
                self.handoff = Some(handoff.lane);
                Stage::Done(Outcome::Unresolved(Unresolved::HandoffConfirmedAckFailed(
                    handoff.lane,
                )))
            }
            (_, Authority::Lost) => Stage::Done(Outcome::AuthorityLost),
            _ if self.budget.remaining(now).is_zero() => {
                Stage::Done(Outcome::Unresolved(Unresolved::BudgetExhausted))
            }
            _ => self.after_failed(handoff, result == HandoffResult::Refused, now),
        };
    }

    /// After a failed handoff, with authority and budget left:
    ///
    /// - a copy bound for the DLQ or parking goes to wait in a retry bucket instead (a held
    ///   copy), once: it leaves the queue, so a failing lane never fills the prefetch and never
    ///   blocks the queue's head;
    /// - below the requeue limit, a hold (the deferral delay) and then the NACK;
    /// - at the limit, holds with growing backoff between tries of the handoff, and a NACK once
    ///   the delivery was held for [`Policy::release_held_after`] (before the broker's
    ///   `consumer_timeout` would close the channel) or when shutdown cuts a hold short;
    /// - when the broker `refused` the publish (a permission), as at the limit whatever the
    ///   requeues, each hold at most [`REFUSED_HOLD_MAX`]: a NACK would bring the delivery
    ///   back only to be refused again, spending its requeues towards the delivery limit.
    fn after_failed(&mut self, handoff: Handoff, refused: bool, now: Instant) -> Stage {
        let bucket = self.hold_bucket();
        let failing = self.failing.get_or_insert_default();
        if let (Some(target), Some(bucket), false) =
            (Terminal::of(handoff.lane), bucket, failing.detoured)
        {
            failing.detoured = true;
            return Stage::Ready(Action::Publish {
                handoff: Handoff {
                    lane: Lane::Held { bucket, target },
                    ..handoff
                },
                deadline: self.budget.for_handoff(now),
            });
        }
        if self.may_requeue && !refused {
            let delay = self.policy.deferral_delay(self.requeues);
            failing.after_hold = Some((AfterHold::Requeue, now + delay));
            return Stage::Ready(Action::Hold(delay));
        }
        let (since, holds) = *failing.held.get_or_insert((now, 0));
        let release = since + self.policy.release_held_after;
        if now >= release {
            return Stage::Ready(Action::Requeue);
        }
        failing.held = Some((since, holds + 1));
        let retry = match Terminal::of(handoff.lane) {
            Some(target) => Handoff {
                lane: target.lane(),
                ..handoff
            },
            None => handoff,
        };
        let longest = if refused { REFUSED_HOLD_MAX } else { HOLD_MAX };
        let delay = HOLD_MIN
            .saturating_mul(1 << holds.min(6))
            .min(longest)
            .min(release - now);
        failing.after_hold = Some((AfterHold::Publish(retry), now + delay));
        Stage::Ready(Action::Hold(delay))
    }

    /// The hold is over. A hold at the requeue limit that shutdown cut short releases the
    /// delivery (NACK) instead of trying its handoff again.
    pub fn handle_held(&mut self, now: Instant) {
        let (Stage::Waiting(Action::Hold(_)), Some(failing)) = (self.stage, &mut self.failing)
        else {
            return;
        };
        let Some((after, until)) = failing.after_hold.take() else {
            return;
        };
        self.stage = match after {
            AfterHold::Publish(handoff) if now >= until => {
                failing.detoured = false;
                let policy = self.policy;
                self.budget = Budget::start(now, policy.settlement_budget, policy.nack_reserve);
                Stage::Ready(Action::Publish {
                    handoff,
                    deadline: self.budget.for_handoff(now),
                })
            }
            AfterHold::Publish(_) | AfterHold::Requeue => Stage::Ready(Action::Requeue),
        };
    }

    /// Takes the evidence of an ACK, NACK or reject.
    pub fn handle_settled(&mut self, result: SettleResult) {
        let Stage::Waiting(action) = self.stage else {
            return;
        };
        let outcome = match (action, result, self.handoff) {
            (Action::Publish { .. } | Action::Hold(_), ..) => return,
            (_, SettleResult::Refused, Some(lane)) => {
                Outcome::Unresolved(Unresolved::HandoffConfirmedAckFailed(lane))
            }
            (_, SettleResult::Refused, None) => Outcome::AuthorityLost,
            (Action::Ack, SettleResult::Written, Some(Lane::Retry { .. })) => Outcome::Retried,
            (Action::Ack, SettleResult::Written, Some(Lane::DeadLetter)) => Outcome::DeadLettered,
            (Action::Ack, SettleResult::Written, Some(Lane::Parking)) => Outcome::Parked,
            (Action::Ack, SettleResult::Written, Some(Lane::Held { .. })) => Outcome::Held,
            (Action::Ack, SettleResult::Written, Some(Lane::Wait { .. })) => Outcome::Waited,
            (Action::Ack, SettleResult::Written, None) => Outcome::Acked,
            (Action::Requeue, SettleResult::Written, _) => Outcome::Requeued(self.requeue_cause),
            (Action::Reject, SettleResult::Written, _) => Outcome::RejectedToDlx,
        };
        self.stage = Stage::Done(outcome);
    }

    /// The terminal outcome, once reached.
    pub fn outcome(&self) -> Option<Outcome> {
        match self.stage {
            Stage::Done(outcome) => Some(outcome),
            _ => None,
        }
    }

    /// The confirmed handoff lane, kept even when the ACK that follows fails.
    pub fn confirmed_handoff(&self) -> Option<Lane> {
        self.handoff
    }

    /// The settlement budget.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }
}
