//! Fuzz target `machine`: the settlement machine (`lily_mq_core::machine::Delivery`) driven
//! like the transport drives it, with every answer (scope, handler, commit, handoff, ACK,
//! authority, time) chosen by the fuzz bytes, for a message and its redeliveries.
//!
//! Invariants, from the decision table of the book's design chapter and the machine's docs:
//! - every delivery reaches an outcome within a bounded number of steps, each action is handed
//!   out once, and the outcome, once set, never changes;
//! - at most one ACK, requeue or reject per delivery; a reject only for an oversized body;
//! - an ACK after a handoff was chosen only once its copy is confirmed; an ACK without one
//!   only after success (or a duplicate); a returned, nacked, failed, timed-out or blocked
//!   copy is never taken for a confirmed one;
//! - the outcome rests on the evidence reported for it;
//! - no handler runs for a message the gate refused, no handler took, that is a held copy or
//!   that was redelivered past the limit without settling;
//! - copies: sanitized exactly when the gate refused the envelope; a retry copy carries the
//!   next attempt, within the attempts, in an existing bucket, never for a message replayed
//!   from parking;
//! - every requeue follows a hold; at the requeue limit a message is never requeued for a
//!   deferral, and requeued after a failed handoff only once it was held for
//!   `release_held_after` (or shutdown cut a hold short); below the limit, redeliveries end
//!   after at most `max_requeues` requeues.

use std::time::{Duration, Instant};

use lily_mq_core::machine::{Action, Arrival, CopyOf, Delivery, Input, ScopeOpened, Verdict};
use lily_mq_core::transport::{
    Authority, CleanupResult, Evidence, GateRejection, HandoffResult, PipelineResult, SettleResult,
};
use lily_mq_core::{
    Committed, FailureKind, Lane, Outcome, Policy, Reason, RequeueCause, Terminal,
    TransactionOutcome, Unresolved,
};
use lily_mq_fuzz::script::Script;

/// Steps allowed for one delivery; the longest legitimate path (reruns, then holds at the
/// requeue limit until release) takes a few hundred.
const MAX_STEPS: usize = 5_000;

fn main() {
    lily_mq_fuzz::run(check);
}

fn check(data: &[u8]) {
    let mut script = Script::new(data);
    let policy = script.policy();
    assert_eq!(policy.validate(), Ok(()));
    let mut arrival = script.arrival();
    let mut now = Instant::now();
    let mut counted = arrival.local_requeues.unwrap_or(0);
    let mut requeued_below_limit = 0;
    for _ in 0..policy.max_requeues + 3 {
        let at_limit = requeues(&arrival, &policy) >= policy.max_requeues;
        let run = drive(&arrival, &policy, &mut script, &mut now);
        let Outcome::Requeued(cause) = run.outcome else {
            break;
        };
        if at_limit {
            assert_eq!(
                cause,
                RequeueCause::HandoffFailed,
                "deferred at the requeue limit"
            );
            let failed = run
                .first_failure
                .expect("a failed handoff before its requeue");
            assert!(
                run.cut_short || run.requeued_at - failed >= policy.release_held_after,
                "requeued at the limit after {:?} of holding",
                run.requeued_at - failed
            );
        } else {
            requeued_below_limit += 1;
        }
        // The broker redelivers it; the consumer's memory counted the requeue.
        if run.counted {
            counted += 1;
        }
        arrival = Arrival {
            redelivered: true,
            delivery_count: arrival.delivery_count.map(|n| n + 1),
            local_requeues: arrival.local_requeues.map(|_| counted),
            ..arrival
        };
        now += Duration::from_millis(10);
    }
    assert!(
        requeued_below_limit <= policy.max_requeues,
        "{requeued_below_limit} requeues below a limit of {}",
        policy.max_requeues
    );
}

/// The requeues the machine should count at arrival.
fn requeues(a: &Arrival, policy: &Policy) -> u32 {
    match a.local_requeues {
        None => policy.max_requeues,
        Some(local) => (if a.redelivered { local } else { 0 }).max(a.delivery_count.unwrap_or(0)),
    }
}

/// What one delivery did.
struct Run {
    outcome: Outcome,
    counted: bool,
    first_failure: Option<Instant>,
    requeued_at: Instant,
    cut_short: bool,
}

/// Whether the channel still holds the delivery; `lost` records that it once did not.
fn authority(script: &mut Script<'_>, lost: &mut bool) -> Authority {
    if script.rarely() {
        *lost = true;
        Authority::Lost
    } else {
        Authority::Held
    }
}

fn small_wait(script: &mut Script<'_>) -> Duration {
    Duration::from_millis(u64::from(script.byte()) * 4)
}

fn pipeline(script: &mut Script<'_>) -> PipelineResult {
    let failed = |kind, retry_after| PipelineResult::Failed { kind, retry_after };
    match script.pick(12) {
        0 => PipelineResult::Succeeded,
        1 => failed(FailureKind::Retryable, None),
        2 => failed(FailureKind::Permanent, None),
        3 => failed(FailureKind::Indeterminate, None),
        4 => {
            let hints = [
                Duration::from_secs(1),
                Duration::from_secs(30),
                Duration::from_secs(3600),
            ];
            failed(FailureKind::Retryable, Some(hints[script.pick(3)]))
        }
        5 => PipelineResult::NotDispatched,
        6 => PipelineResult::Conflict,
        7 => PipelineResult::Panicked,
        8 => PipelineResult::TimedOut,
        9 => PipelineResult::Deferred,
        10 => PipelineResult::Transient,
        _ => PipelineResult::Duplicate,
    }
}

fn deferrals(script: &mut Script<'_>) -> Option<u32> {
    match script.byte() {
        b @ 0..=7 => Some(u32::from(b)),
        _ => None,
    }
}

/// Evidence counted so far: (handoffs published, handoffs confirmed).
fn drain(m: &mut Delivery<'_>, counts: &mut (usize, usize)) {
    while let Some(evidence) = m.poll_evidence() {
        match evidence {
            Evidence::HandoffPublished => counts.0 += 1,
            Evidence::HandoffConfirmed => counts.1 += 1,
            _ => {}
        }
    }
}

fn drive(arrival: &Arrival, policy: &Policy, script: &mut Script<'_>, now: &mut Instant) -> Run {
    let refused = matches!(arrival.verdict, Verdict::Refused { .. });
    let oversized = matches!(
        arrival.verdict,
        Verdict::Refused {
            rejection: GateRejection::Oversized { .. },
            ..
        }
    );
    let mut runs_handler = arrival.verdict == Verdict::Dispatched && arrival.held.is_none();
    let mut lost = false;
    let mut m = Delivery::new(
        arrival.clone(),
        policy,
        || authority(script, &mut lost),
        *now,
    );
    // Whether the latest result makes a plain ACK right.
    let mut ack_ok = false;
    let mut transaction = false;
    let mut publishes = 0;
    let mut last_publish: Option<(Lane, HandoffResult, Authority)> = None;
    let mut confirmed: Vec<Lane> = Vec::new();
    let mut settled: Option<(Action, SettleResult)> = None;
    let mut holds = 0;
    let mut evidence = (0, 0);
    let mut run = Run {
        outcome: Outcome::Acked,
        counted: false,
        first_failure: None,
        requeued_at: *now,
        cut_short: false,
    };
    let mut steps = 0;
    let outcome = loop {
        steps += 1;
        assert!(steps <= MAX_STEPS, "no outcome after {MAX_STEPS} steps");
        drain(&mut m, &mut evidence);
        if let Some(lane) = m.confirmed_handoff() {
            assert!(confirmed.contains(&lane), "{lane:?} taken for confirmed");
        }
        let action = m.poll_action(|| authority(script, &mut lost));
        let Some(action) = action else {
            break m
                .outcome()
                .expect("the machine waits for nothing but has no outcome");
        };
        assert_eq!(m.outcome(), None, "an action after the outcome");
        assert_eq!(
            m.poll_action(|| Authority::Held),
            None,
            "an action handed out twice"
        );
        match action {
            Action::OpenScope => {
                assert!(
                    runs_handler && arrival.scoped,
                    "a scope opened for {arrival:?}"
                );
                let deaths = [
                    None,
                    Some(0),
                    Some(policy.max_requeues.saturating_sub(1)),
                    Some(policy.max_requeues),
                ][script.pick(4)];
                let opened = match script.pick(7) {
                    0 => ScopeOpened::Proceed {
                        transaction: true,
                        deaths,
                    },
                    1 => ScopeOpened::Proceed {
                        transaction: false,
                        deaths,
                    },
                    6 => ScopeOpened::Wait {
                        reason: Reason::new("lease held"),
                        expires_in: Duration::from_millis(u64::from(script.byte()) * 400),
                    },
                    2 => ScopeOpened::Duplicate,
                    3 => ScopeOpened::Conflict(Reason::new("fingerprint differs")),
                    4 => ScopeOpened::Transient(Reason::new("write conflict")),
                    _ => ScopeOpened::Defer {
                        reason: Reason::new("lease held"),
                        deferrals: deferrals(script),
                    },
                };
                ack_ok = opened == ScopeOpened::Duplicate;
                if let ScopeOpened::Proceed {
                    transaction: t,
                    deaths,
                } = opened
                {
                    transaction = t;
                    // Its handlings died up to the limit: the handler does not run again.
                    runs_handler &= deaths.is_none_or(|n| n == 0 || n < policy.max_requeues);
                }
                *now += small_wait(script);
                m.handle(Input::Scope(opened), authority(script, &mut lost), *now);
            }
            Action::RunHandler => {
                assert!(runs_handler, "the handler ran for {arrival:?}");
                let result = pipeline(script);
                let cleanup = if script.pick(4) == 3 {
                    CleanupResult::Failed
                } else {
                    CleanupResult::Succeeded
                };
                let success =
                    (result, cleanup) == (PipelineResult::Succeeded, CleanupResult::Succeeded);
                ack_ok = result == PipelineResult::Duplicate || (success && !transaction);
                *now += small_wait(script);
                let reason = Some(Reason::new("handler said so"));
                m.handle(
                    Input::Pipeline(result, cleanup, reason),
                    authority(script, &mut lost),
                    *now,
                );
            }
            Action::Commit => {
                let outcome = [
                    TransactionOutcome::Committed,
                    TransactionOutcome::Aborted,
                    TransactionOutcome::CommitAmbiguous,
                    TransactionOutcome::Transient,
                    TransactionOutcome::Fenced,
                    TransactionOutcome::NotRequired,
                ][script.pick(6)];
                ack_ok = matches!(
                    outcome,
                    TransactionOutcome::Committed | TransactionOutcome::NotRequired
                );
                *now += small_wait(script);
                let committed = Committed {
                    outcome,
                    reason: None,
                    deferrals: deferrals(script),
                    wait: (outcome == TransactionOutcome::Fenced && script.pick(2) == 1)
                        .then(|| Duration::from_millis(u64::from(script.byte()) * 400)),
                };
                m.handle(Input::Commit(committed), authority(script, &mut lost), *now);
            }
            Action::Abort => {
                *now += small_wait(script);
                m.handle(Input::Aborted, authority(script, &mut lost), *now);
            }
            Action::Hold(wait) => {
                holds += 1;
                // Shutdown may cut a hold short.
                let cut = script.pick(8) == 7;
                run.cut_short |= cut;
                *now += if cut { wait / 3 } else { wait };
                m.handle(Input::Held, Authority::Held, *now);
            }
            Action::Backoff(wait) => {
                *now += wait / 2 + wait / 2 * u32::from(script.byte()) / 255;
                transaction = false;
                m.handle(Input::Held, Authority::Held, *now);
            }
            Action::Publish {
                handoff,
                copy,
                deadline,
            } => {
                publishes += 1;
                assert!(!oversized, "a copy of an oversized body");
                assert_eq!(
                    copy == CopyOf::Sanitized,
                    refused,
                    "{copy:?} for {arrival:?}"
                );
                match handoff.lane {
                    Lane::Retry {
                        bucket,
                        next_attempt,
                    } => {
                        assert!(bucket < policy.retry_delays.len());
                        assert_eq!(next_attempt, arrival.attempt + 1);
                        assert!(next_attempt <= policy.max_attempts);
                        assert_ne!(arrival.replayed_from, Some(Terminal::Parking));
                    }
                    Lane::Held { bucket, .. } | Lane::Wait { bucket } => {
                        assert!(bucket < policy.retry_delays.len());
                    }
                    Lane::DeadLetter | Lane::Parking => {}
                }
                let result = [
                    HandoffResult::Confirmed,
                    HandoffResult::Returned,
                    HandoffResult::Nacked,
                    HandoffResult::Failed,
                    HandoffResult::TimedOut,
                    HandoffResult::Blocked,
                    HandoffResult::Refused,
                ][script.pick(7)];
                *now += match result {
                    HandoffResult::TimedOut | HandoffResult::Blocked => deadline,
                    _ => small_wait(script).min(deadline),
                };
                let authority = authority(script, &mut lost);
                if result == HandoffResult::Confirmed {
                    confirmed.push(handoff.lane);
                } else if run.first_failure.is_none() {
                    run.first_failure = Some(*now);
                }
                last_publish = Some((handoff.lane, result, authority));
                m.handle(Input::Handoff(result), authority, *now);
            }
            Action::Ack | Action::Requeue { .. } | Action::Reject => {
                assert_eq!(settled, None, "a second settle action: {action:?}");
                match action {
                    Action::Ack if publishes > 0 => assert!(
                        matches!(
                            last_publish,
                            Some((_, HandoffResult::Confirmed, Authority::Held))
                        ),
                        "ACK after {last_publish:?}"
                    ),
                    Action::Ack => assert!(ack_ok, "ACK without a handoff after a failure"),
                    Action::Requeue { counted } => {
                        assert!(holds > 0, "a requeue that did not back off");
                        assert_eq!(counted, arrival.local_requeues.is_some());
                        run.counted = counted;
                        run.requeued_at = *now;
                    }
                    _ => assert!(oversized, "a reject for {arrival:?}"),
                }
                let result = if script.rarely() {
                    SettleResult::Refused
                } else {
                    SettleResult::Written
                };
                settled = Some((action, result));
                m.handle(Input::Settled(result), Authority::Held, *now);
            }
        }
    };
    drain(&mut m, &mut evidence);
    assert_eq!(evidence.0, publishes, "one HandoffPublished per publish");
    assert_eq!(
        evidence.1,
        confirmed.len(),
        "one HandoffConfirmed per confirm"
    );
    check_outcome(outcome, settled, last_publish, &confirmed, lost);
    assert!(m.reason().as_str().len() <= Reason::MAX_LEN);
    // Late or stray reports change nothing.
    for _ in 0..4 {
        match script.pick(4) {
            0 => m.handle(Input::Settled(SettleResult::Written), Authority::Held, *now),
            1 => m.handle(
                Input::Handoff(HandoffResult::Confirmed),
                Authority::Held,
                *now,
            ),
            2 => m.handle(Input::Held, Authority::Held, *now),
            _ => m.handle(Input::Aborted, Authority::Held, *now),
        }
        assert_eq!(
            m.outcome(),
            Some(outcome),
            "the outcome changed after it was set"
        );
        assert_eq!(m.poll_action(|| Authority::Held), None);
    }
    run.outcome = outcome;
    run
}

fn check_outcome(
    outcome: Outcome,
    settled: Option<(Action, SettleResult)>,
    last_publish: Option<(Lane, HandoffResult, Authority)>,
    confirmed: &[Lane],
    lost: bool,
) {
    let written = |a: fn(&Action) -> bool| matches!(settled, Some((action, SettleResult::Written)) if a(&action));
    let handed_off = |lane: fn(&Lane) -> bool| {
        written(|a| *a == Action::Ack)
            && matches!(
                last_publish,
                Some((l, HandoffResult::Confirmed, Authority::Held)) if lane(&l)
            )
    };
    let ok = match outcome {
        Outcome::Acked => written(|a| *a == Action::Ack) && confirmed.is_empty(),
        Outcome::Retried => handed_off(|l| matches!(l, Lane::Retry { .. })),
        Outcome::DeadLettered => handed_off(|l| *l == Lane::DeadLetter),
        Outcome::Parked => handed_off(|l| *l == Lane::Parking),
        Outcome::Held => handed_off(|l| matches!(l, Lane::Held { .. })),
        Outcome::Waited => handed_off(|l| matches!(l, Lane::Wait { .. })),
        Outcome::Requeued(_) => written(|a| matches!(a, Action::Requeue { .. })),
        Outcome::RejectedToDlx => written(|a| *a == Action::Reject),
        Outcome::AuthorityLost => {
            lost || (matches!(settled, Some((_, SettleResult::Refused))) && confirmed.is_empty())
        }
        Outcome::Unresolved(Unresolved::HandoffConfirmedAckFailed(lane)) => {
            confirmed.contains(&lane)
        }
        Outcome::Unresolved(Unresolved::BudgetExhausted) => {
            matches!(last_publish, Some((_, r, _)) if r != HandoffResult::Confirmed)
        }
    };
    assert!(
        ok,
        "{outcome:?} after settle {settled:?}, last publish {last_publish:?}"
    );
}
