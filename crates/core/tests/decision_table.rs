//! The decision table of the book's design chapter and its cut-across rules, driven through the
//! public API with time passed in: one test per row, then properties over every situation and every
//! sequence of evidence.

use std::time::{Duration, Instant};

use lily_mq_core::transport::{
    Action, Authority, Cause, CleanupResult, GateRejection, Handoff, HandoffResult, PipelineResult,
    Plan, PropertiesView, SettleResult, Settlement, Situation, decide, decide_at_gate, inspect,
};
use lily_mq_core::{
    FailureKind, Lane, Limits, Outcome, Policy, RequeueCause, Terminal, TransactionOutcome,
    Unresolved,
};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// The default policy: 5 attempts, buckets 5s / 60s / 600s, 5 requeues, 10s budget, 1s reserve.
/// The default policy, borrowed for as long as a test's settlements live.
fn policy() -> &'static Policy {
    static POLICY: std::sync::LazyLock<Policy> = std::sync::LazyLock::new(Policy::default);
    &POLICY
}

fn policy_with(max_attempts: u32, max_requeues: u32) -> Policy {
    let mut p = Policy::default();
    p.max_attempts = max_attempts;
    p.max_requeues = max_requeues;
    p
}

/// A first delivery with clean cleanup, no transaction and authority held.
fn situation(pipeline: PipelineResult) -> Situation {
    Situation {
        pipeline,
        cleanup: CleanupResult::Succeeded,
        transaction: TransactionOutcome::NotRequired,
        attempt: 1,
        requeues: 0,
        authority: Authority::Held,
        replayed_from: None,
    }
}

fn failed(kind: FailureKind) -> PipelineResult {
    PipelineResult::Failed {
        kind,
        retry_after: None,
    }
}

fn failed_after(kind: FailureKind, retry_after: Duration) -> PipelineResult {
    PipelineResult::Failed {
        kind,
        retry_after: Some(retry_after),
    }
}

fn retry(bucket: usize, next_attempt: u32, cause: Cause) -> Plan {
    Plan::Handoff(Handoff {
        lane: Lane::Retry {
            bucket,
            next_attempt,
        },
        kind: Some(FailureKind::Retryable),
        cause,
    })
}

fn dead_letter(kind: FailureKind, cause: Cause) -> Plan {
    Plan::Handoff(Handoff {
        lane: Lane::DeadLetter,
        kind: Some(kind),
        cause,
    })
}

fn parking(cause: Cause) -> Plan {
    Plan::Handoff(Handoff {
        lane: Lane::Parking,
        kind: Some(FailureKind::Indeterminate),
        cause,
    })
}

/// A handoff to the retry bucket 0, as the decision table would choose on a first attempt.
fn some_handoff() -> Handoff {
    Handoff {
        lane: Lane::Retry {
            bucket: 0,
            next_attempt: 2,
        },
        kind: Some(FailureKind::Retryable),
        cause: Cause::Handler,
    }
}

/// An instant comfortably inside the default settlement budget.
fn within_budget(t0: Instant) -> Instant {
    t0 + Duration::from_secs(2)
}

/// An instant past the default settlement budget.
fn past_deadline(t0: Instant) -> Instant {
    t0 + policy().settlement_budget + Duration::from_millis(1)
}

/// Starts a settlement and takes its first action, which must be a publish.
fn start_publish(plan: Plan, requeues: u32, policy: &Policy, t0: Instant) -> Settlement<'_> {
    let mut s = Settlement::start(plan, requeues, policy, t0);
    assert!(
        matches!(s.poll_action(), Some(Action::Publish { .. })),
        "a handoff plan starts with a publish"
    );
    s
}

/// Drains every action still available, proving none is left.
fn assert_no_more_actions(s: &mut Settlement) {
    for _ in 0..3 {
        assert_eq!(s.poll_action(), None);
    }
}

fn gate_view(message_id: Option<&str>) -> PropertiesView<'_> {
    PropertiesView {
        message_id,
        kind: Some("order.placed"),
        content_type: Some("application/json"),
        headers: None,
        not_utf8: None,
        key: None,
    }
}

fn small_limits() -> Limits {
    let mut limits = Limits::default();
    limits.max_body_bytes = 16;
    limits
}

// ---------------------------------------------------------------------------------------------
// Gate rows (before the pipeline)
// ---------------------------------------------------------------------------------------------

#[test]
fn oversized_body_is_rejected_to_the_broker_dlx_without_requeue() {
    let rejection = inspect(&gate_view(Some("m-1")), 17, &small_limits()).unwrap_err();
    assert_eq!(rejection, GateRejection::Oversized { len: 17 });
    let plan = decide_at_gate(&rejection);
    assert_eq!(plan, Plan::Reject);

    let mut s = Settlement::start(plan, 0, policy(), Instant::now());
    assert_eq!(s.poll_action(), Some(Action::Reject));
    s.handle_settled(SettleResult::Written);
    assert_eq!(s.outcome(), Some(Outcome::RejectedToDlx));
    assert_no_more_actions(&mut s);
}

#[test]
fn invalid_envelope_is_dead_lettered_with_invalid_envelope_cause() {
    let rejection = inspect(&gate_view(None), 10, &small_limits()).unwrap_err();
    assert!(matches!(rejection, GateRejection::Invalid(_)));
    assert_eq!(
        decide_at_gate(&rejection),
        Plan::Handoff(Handoff {
            lane: Lane::DeadLetter,
            kind: None,
            cause: Cause::InvalidEnvelope,
        })
    );
}

#[test]
fn unsupported_message_type_is_a_permanent_failure_dead_lettered() {
    // Dispatch reports an unsupported type, schema version or content type as a permanent
    // failure before any scope opens.
    let plan = decide(&situation(PipelineResult::NotDispatched), policy());
    assert_eq!(plan, dead_letter(FailureKind::Permanent, Cause::Dispatch));
}

// ---------------------------------------------------------------------------------------------
// Post-pipeline rows
// ---------------------------------------------------------------------------------------------

#[test]
fn success_with_clean_cleanup_and_no_transaction_acks() {
    assert_eq!(
        decide(&situation(PipelineResult::Succeeded), policy()),
        Plan::Ack
    );
}

#[test]
fn success_with_committed_transaction_acks() {
    let s = Situation {
        transaction: TransactionOutcome::Committed,
        ..situation(PipelineResult::Succeeded)
    };
    assert_eq!(decide(&s, policy()), Plan::Ack);
}

#[test]
fn acked_success_settles_with_one_ack() {
    let mut s = Settlement::start(Plan::Ack, 0, policy(), Instant::now());
    assert_eq!(s.poll_action(), Some(Action::Ack));
    s.handle_settled(SettleResult::Written);
    assert_eq!(s.outcome(), Some(Outcome::Acked));
    assert_eq!(s.confirmed_handoff(), None);
    assert_no_more_actions(&mut s);
}

#[test]
fn retryable_failure_with_attempts_left_goes_to_the_bucket_of_its_attempt() {
    let p = policy();
    for (attempt, bucket) in [(1, 0), (2, 1), (3, 2), (4, 2)] {
        let s = Situation {
            attempt,
            ..situation(failed(FailureKind::Retryable))
        };
        assert_eq!(
            decide(&s, p),
            retry(bucket, attempt + 1, Cause::Handler),
            "attempt {attempt}"
        );
    }
}

#[test]
fn retry_after_hint_picks_the_shortest_bucket_at_least_as_long() {
    let p = policy();
    let cases = [
        (Duration::from_secs(3), 0),
        (Duration::from_secs(5), 0),
        (Duration::from_secs(30), 1),
        (Duration::from_secs(600), 2),
        (Duration::from_secs(3600), 2),
    ];
    for (hint, bucket) in cases {
        let s = situation(failed_after(FailureKind::Retryable, hint));
        assert_eq!(
            decide(&s, p),
            retry(bucket, 2, Cause::Handler),
            "hint {hint:?}"
        );
    }
}

#[test]
fn retry_after_hint_never_shortens_the_bucket_of_the_attempt() {
    let s = Situation {
        attempt: 3,
        ..situation(failed_after(FailureKind::Retryable, Duration::from_secs(1)))
    };
    assert_eq!(decide(&s, policy()), retry(2, 4, Cause::Handler));
}

#[test]
fn permanent_failure_goes_to_the_dead_letter_queue() {
    let s = Situation {
        attempt: 2,
        ..situation(failed(FailureKind::Permanent))
    };
    assert_eq!(
        decide(&s, policy()),
        dead_letter(FailureKind::Permanent, Cause::Handler)
    );
}

#[test]
fn retryable_failure_on_the_last_attempt_is_dead_lettered_as_attempts_exhausted() {
    let p = policy();
    let s = Situation {
        attempt: p.max_attempts,
        ..situation(failed(FailureKind::Retryable))
    };
    assert_eq!(
        decide(&s, p),
        dead_letter(FailureKind::Retryable, Cause::AttemptsExhausted)
    );
}

#[test]
fn single_attempt_policy_dead_letters_the_first_retryable_failure() {
    let p = policy_with(1, 5);
    assert_eq!(
        decide(&situation(failed(FailureKind::Retryable)), &p),
        dead_letter(FailureKind::Retryable, Cause::AttemptsExhausted)
    );
}

#[test]
fn indeterminate_failure_is_parked_never_retried() {
    for attempt in [1, 5] {
        let s = Situation {
            attempt,
            ..situation(failed(FailureKind::Indeterminate))
        };
        assert_eq!(
            decide(&s, policy()),
            parking(Cause::Handler),
            "attempt {attempt}"
        );
    }
}

#[test]
fn cleanup_failure_turns_success_into_a_retry() {
    let s = Situation {
        cleanup: CleanupResult::Failed,
        ..situation(PipelineResult::Succeeded)
    };
    assert_eq!(decide(&s, policy()), retry(0, 2, Cause::Cleanup));
}

#[test]
fn cleanup_failure_on_the_last_attempt_is_dead_lettered_as_attempts_exhausted() {
    let p = policy();
    let s = Situation {
        cleanup: CleanupResult::Failed,
        attempt: p.max_attempts,
        ..situation(PipelineResult::Succeeded)
    };
    assert_eq!(
        decide(&s, p),
        dead_letter(FailureKind::Retryable, Cause::AttemptsExhausted)
    );
}

#[test]
fn aborted_transaction_is_retried() {
    let s = Situation {
        transaction: TransactionOutcome::Aborted,
        ..situation(PipelineResult::Succeeded)
    };
    assert_eq!(decide(&s, policy()), retry(0, 2, Cause::TransactionAborted));
}

#[test]
fn ambiguous_commit_is_deferred_by_requeue_below_the_limit() {
    let p = policy();
    for requeues in 0..p.max_requeues {
        let s = Situation {
            transaction: TransactionOutcome::CommitAmbiguous,
            requeues,
            ..situation(PipelineResult::Succeeded)
        };
        assert_eq!(
            decide(&s, p),
            Plan::Requeue(RequeueCause::Deferred),
            "requeues {requeues}"
        );
    }
}

#[test]
fn deferred_pipeline_is_requeued_below_the_limit() {
    let p = policy();
    for requeues in 0..p.max_requeues {
        let s = Situation {
            requeues,
            ..situation(PipelineResult::Deferred)
        };
        assert_eq!(
            decide(&s, p),
            Plan::Requeue(RequeueCause::Deferred),
            "requeues {requeues}"
        );
    }
}

#[test]
fn deferral_does_not_consume_an_application_attempt() {
    let p = policy();
    let s = Situation {
        attempt: p.max_attempts,
        ..situation(PipelineResult::Deferred)
    };
    assert_eq!(decide(&s, p), Plan::Requeue(RequeueCause::Deferred));
}

#[test]
fn deferral_at_the_requeue_limit_is_dead_lettered() {
    let p = policy();
    let deferred = situation(PipelineResult::Deferred);
    let fenced = Situation {
        transaction: TransactionOutcome::Fenced,
        ..situation(PipelineResult::Succeeded)
    };
    for s in [deferred, fenced] {
        let at_limit = Situation {
            requeues: p.max_requeues,
            ..s
        };
        assert_eq!(
            decide(&at_limit, p),
            dead_letter(FailureKind::Retryable, Cause::RequeueLimit),
            "{s:?}"
        );
    }
}

#[test]
fn ambiguous_commit_at_the_requeue_limit_is_parked_never_dead_lettered() {
    // The effect may have happened: an operator decides, nothing replays it automatically.
    let p = policy();
    let at_limit = Situation {
        transaction: TransactionOutcome::CommitAmbiguous,
        requeues: p.max_requeues,
        ..situation(PipelineResult::Succeeded)
    };
    assert_eq!(
        decide(&at_limit, p),
        Plan::Handoff(Handoff {
            lane: Lane::Parking,
            kind: Some(FailureKind::Indeterminate),
            cause: Cause::RequeueLimit,
        })
    );
}

#[test]
fn deferred_requeue_settles_with_one_nack_recorded_as_deferred() {
    let mut s = Settlement::start(
        Plan::Requeue(RequeueCause::Deferred),
        0,
        policy(),
        Instant::now(),
    );
    assert_eq!(s.poll_action(), Some(Action::Requeue));
    s.handle_settled(SettleResult::Written);
    assert_eq!(s.outcome(), Some(Outcome::Requeued(RequeueCause::Deferred)));
    assert_no_more_actions(&mut s);
}

#[test]
fn retryable_failure_at_the_requeue_limit_is_dead_lettered_not_retried() {
    let p = policy();
    let s = Situation {
        requeues: p.max_requeues,
        ..situation(failed(FailureKind::Retryable))
    };
    assert_eq!(
        decide(&s, p),
        dead_letter(FailureKind::Retryable, Cause::RequeueLimit)
    );
}

#[test]
fn indeterminate_failure_at_the_requeue_limit_stays_in_the_parking_lane() {
    // The design chapter: a message whose handoffs keep failing ends in the DLQ or the parking
    // lane; an indeterminate effect must never be relabelled as replayable dead letter.
    let p = policy();
    let s = Situation {
        requeues: p.max_requeues,
        ..situation(failed(FailureKind::Indeterminate))
    };
    let plan = decide(&s, p);
    assert!(
        matches!(
            plan,
            Plan::Handoff(Handoff {
                lane: Lane::Parking,
                ..
            })
        ),
        "indeterminate effect at the requeue limit was planned as {plan:?}"
    );
}

#[test]
fn inbox_conflict_is_dead_lettered_as_a_conflict() {
    assert_eq!(
        decide(&situation(PipelineResult::Conflict), policy()),
        dead_letter(FailureKind::Permanent, Cause::Conflict)
    );
}

#[test]
fn duplicate_is_acked() {
    assert_eq!(
        decide(&situation(PipelineResult::Duplicate), policy()),
        Plan::Ack
    );
}

#[test]
fn a_retryable_failure_after_a_replay_from_parking_goes_back_to_parking_not_a_bucket() {
    let p = policy();
    for replayed_from in [None, Some(Terminal::DeadLetter), Some(Terminal::Parking)] {
        let s = Situation {
            replayed_from,
            ..situation(failed(FailureKind::Retryable))
        };
        let lane = match decide(&s, p) {
            Plan::Handoff(h) => h.lane,
            other => panic!("{other:?}"),
        };
        match replayed_from {
            Some(Terminal::Parking) => assert_eq!(lane, Lane::Parking),
            _ => assert!(
                matches!(
                    lane,
                    Lane::Retry {
                        next_attempt: 2,
                        ..
                    }
                ),
                "{lane:?}"
            ),
        }
    }
    // A permanent failure still goes to the DLQ: an operator's lane either way.
    let s = Situation {
        replayed_from: Some(Terminal::Parking),
        ..situation(failed(FailureKind::Permanent))
    };
    assert!(matches!(
        decide(&s, p),
        Plan::Handoff(Handoff {
            lane: Lane::DeadLetter,
            ..
        })
    ));
}

#[test]
fn lost_authority_abandons_and_sends_nothing() {
    let pipelines = [
        PipelineResult::Succeeded,
        failed(FailureKind::Retryable),
        PipelineResult::Deferred,
        PipelineResult::Duplicate,
    ];
    for pipeline in pipelines {
        let s = Situation {
            authority: Authority::Lost,
            replayed_from: None,
            ..situation(pipeline)
        };
        assert_eq!(decide(&s, policy()), Plan::Abandon, "{pipeline:?}");
    }
    let mut s = Settlement::start(Plan::Abandon, 0, policy(), Instant::now());
    assert_eq!(s.outcome(), Some(Outcome::AuthorityLost));
    assert_no_more_actions(&mut s);
}

#[test]
fn handler_panic_is_a_retryable_failure() {
    assert_eq!(
        decide(&situation(PipelineResult::Panicked), policy()),
        retry(0, 2, Cause::Panic)
    );
}

#[test]
fn handler_timeout_is_a_retryable_failure() {
    assert_eq!(
        decide(&situation(PipelineResult::TimedOut), policy()),
        retry(0, 2, Cause::Timeout)
    );
}

// ---------------------------------------------------------------------------------------------
// Settlement: cut-across rules
// ---------------------------------------------------------------------------------------------

#[test]
fn confirmed_handoff_then_written_ack_ends_in_its_lane() {
    let t0 = Instant::now();
    let cases = [
        (retry(0, 2, Cause::Handler), Outcome::Retried),
        (
            dead_letter(FailureKind::Permanent, Cause::Handler),
            Outcome::DeadLettered,
        ),
        (parking(Cause::Handler), Outcome::Parked),
    ];
    for (plan, outcome) in cases {
        let mut s = start_publish(plan, 0, policy(), t0);
        s.handle_handoff(HandoffResult::Confirmed, Authority::Held, within_budget(t0));
        assert_eq!(s.poll_action(), Some(Action::Ack));
        s.handle_settled(SettleResult::Written);
        assert_eq!(s.outcome(), Some(outcome));
        assert_no_more_actions(&mut s);
    }
}

#[test]
fn publish_deadline_leaves_the_nack_reserve() {
    let p = policy();
    let plan = Plan::Handoff(some_handoff());
    let mut s = Settlement::start(plan, 0, p, Instant::now());
    assert_eq!(
        s.poll_action(),
        Some(Action::Publish {
            handoff: some_handoff(),
            deadline: p.settlement_budget - p.nack_reserve,
        })
    );
}

#[test]
fn handoff_returned_as_unroutable_nacks_original_once() {
    let t0 = Instant::now();
    let mut s = start_publish(Plan::Handoff(some_handoff()), 0, policy(), t0);
    s.handle_handoff(HandoffResult::Returned, Authority::Held, within_budget(t0));
    assert_eq!(s.confirmed_handoff(), None);
    backs_off_then_requeues(&mut s, within_budget(t0));
    s.handle_settled(SettleResult::Written);
    assert_eq!(
        s.outcome(),
        Some(Outcome::Requeued(RequeueCause::HandoffFailed))
    );
    assert_no_more_actions(&mut s);
}

#[test]
fn handoff_nacked_failed_timed_out_or_blocked_nacks_original_once() {
    let t0 = Instant::now();
    for result in [
        HandoffResult::Nacked,
        HandoffResult::Failed,
        HandoffResult::TimedOut,
        HandoffResult::Blocked,
    ] {
        let mut s = start_publish(Plan::Handoff(some_handoff()), 0, policy(), t0);
        s.handle_handoff(result, Authority::Held, within_budget(t0));
        backs_off_then_requeues(&mut s, within_budget(t0));
        s.handle_settled(SettleResult::Written);
        assert_eq!(
            s.outcome(),
            Some(Outcome::Requeued(RequeueCause::HandoffFailed)),
            "{result:?}"
        );
    }
}

#[test]
fn handoff_failure_past_the_deadline_sends_nothing_and_is_unresolved() {
    let t0 = Instant::now();
    let deadline = t0 + policy().settlement_budget;
    for now in [deadline, past_deadline(t0)] {
        let mut s = start_publish(Plan::Handoff(some_handoff()), 0, policy(), t0);
        s.handle_handoff(HandoffResult::TimedOut, Authority::Held, now);
        assert_no_more_actions(&mut s);
        assert_eq!(
            s.outcome(),
            Some(Outcome::Unresolved(Unresolved::BudgetExhausted))
        );
    }
}

#[test]
fn handoff_failure_in_the_nack_reserve_still_nacks_once() {
    let t0 = Instant::now();
    let p = policy();
    let in_reserve = t0 + p.settlement_budget - p.nack_reserve / 2;
    let mut s = start_publish(Plan::Handoff(some_handoff()), 0, p, t0);
    s.handle_handoff(HandoffResult::TimedOut, Authority::Held, in_reserve);
    backs_off_then_requeues(&mut s, in_reserve);
}

/// A first failed handoff: the deferral delay's hold, then one NACK and nothing else.
fn backs_off_then_requeues(s: &mut Settlement, now: Instant) {
    let hold = policy().deferral_delay(0);
    assert_eq!(s.poll_action(), Some(Action::Hold(hold)));
    assert_no_more_actions(s);
    s.handle_held(now + hold);
    assert_eq!(s.poll_action(), Some(Action::Requeue));
    assert_no_more_actions(s);
}

/// The lane of the publish `s` hands out next.
fn next_publish_lane(s: &mut Settlement) -> Lane {
    match s.poll_action() {
        Some(Action::Publish { handoff, .. }) => handoff.lane,
        other => panic!("expected a publish, got {other:?}"),
    }
}

#[test]
fn a_failed_dead_letter_handoff_waits_in_a_retry_bucket_as_a_held_copy() {
    let t0 = Instant::now();
    let p = policy();
    let plan = dead_letter(FailureKind::Permanent, Cause::Handler);
    let mut s = start_publish(plan, 0, p, t0);
    s.handle_handoff(HandoffResult::Returned, Authority::Held, within_budget(t0));
    let held = Lane::Held {
        bucket: 0,
        target: Terminal::DeadLetter,
    };
    assert_eq!(next_publish_lane(&mut s), held);
    s.handle_handoff(HandoffResult::Confirmed, Authority::Held, within_budget(t0));
    assert_eq!(s.poll_action(), Some(Action::Ack));
    s.handle_settled(SettleResult::Written);
    assert_eq!(s.outcome(), Some(Outcome::Held));
    assert_eq!(s.confirmed_handoff(), Some(held));

    // A copy held before waits longer; the last bucket repeats.
    let mut s = Settlement::start(parking(Cause::Handler), 0, p, t0).held_before(7);
    s.poll_action();
    s.handle_handoff(HandoffResult::Nacked, Authority::Held, within_budget(t0));
    assert_eq!(
        next_publish_lane(&mut s),
        Lane::Held {
            bucket: p.retry_delays.len() - 1,
            target: Terminal::Parking,
        }
    );
}

#[test]
fn a_failed_retry_handoff_backs_off_before_its_requeue() {
    let t0 = Instant::now();
    let p = policy();
    let mut s = start_publish(retry(0, 2, Cause::Handler), 1, p, t0);
    s.handle_handoff(HandoffResult::Returned, Authority::Held, within_budget(t0));
    // No held copy for a retry: it is a bucket already.
    let hold = p.deferral_delay(1);
    assert_eq!(s.poll_action(), Some(Action::Hold(hold)));
    assert_eq!(s.poll_action(), None);
    s.handle_held(within_budget(t0) + hold);
    assert_eq!(s.poll_action(), Some(Action::Requeue));
    s.handle_settled(SettleResult::Written);
    assert_eq!(
        s.outcome(),
        Some(Outcome::Requeued(RequeueCause::HandoffFailed))
    );
}

#[test]
fn without_retry_buckets_a_failed_dead_letter_handoff_backs_off_and_requeues() {
    let t0 = Instant::now();
    let mut p = policy_with(1, 3);
    p.retry_delays.clear();
    let mut s = start_publish(
        dead_letter(FailureKind::Permanent, Cause::Handler),
        0,
        &p,
        t0,
    );
    s.handle_handoff(HandoffResult::Returned, Authority::Held, within_budget(t0));
    assert_eq!(s.poll_action(), Some(Action::Hold(p.deferral_delay(0))));
}

#[test]
fn at_the_requeue_limit_a_failing_lane_is_tried_again_with_backoff_then_released() {
    let t0 = Instant::now();
    let p = policy().clone().release_held_after(Duration::from_secs(20));
    let plan = dead_letter(FailureKind::Retryable, Cause::RequeueLimit);
    let mut s = start_publish(plan, p.max_requeues, &p, t0);
    let mut now = within_budget(t0);
    s.handle_handoff(HandoffResult::Returned, Authority::Held, now);
    let mut holds = Vec::new();
    loop {
        // The held copy fails too.
        assert!(matches!(next_publish_lane(&mut s), Lane::Held { .. }));
        s.handle_handoff(HandoffResult::Returned, Authority::Held, now);
        match s.poll_action() {
            Some(Action::Hold(hold)) => {
                holds.push(hold.as_secs());
                now += hold;
                s.handle_held(now);
                // Then the lane itself again, with a fresh budget.
                match s.poll_action() {
                    Some(Action::Publish { handoff, deadline }) => {
                        assert_eq!(handoff.lane, Lane::DeadLetter);
                        assert_eq!(deadline, p.settlement_budget - p.nack_reserve);
                    }
                    other => panic!("unexpected {other:?}"),
                }
                s.handle_handoff(HandoffResult::Returned, Authority::Held, now);
            }
            // Released: held as long as allowed.
            Some(Action::Requeue) => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    // 1 + 2 + 4 + 8 s, then what is left of the 20 s since the first failure.
    assert_eq!(holds, vec![1, 2, 4, 8, 5]);
    s.handle_settled(SettleResult::Written);
    assert_eq!(
        s.outcome(),
        Some(Outcome::Requeued(RequeueCause::HandoffFailed))
    );
}

#[test]
fn a_refused_handoff_below_the_requeue_limit_is_held_and_tried_again_never_nacked() {
    let t0 = Instant::now();
    let p = policy().clone().release_held_after(Duration::from_secs(30));
    let plan = dead_letter(FailureKind::Permanent, Cause::Handler);
    let mut s = start_publish(plan, 0, &p, t0);
    let mut now = within_budget(t0);
    s.handle_handoff(HandoffResult::Refused, Authority::Held, now);
    let mut holds = Vec::new();
    for _ in 0..6 {
        // The held copy is refused too: the refused right is write on the default exchange.
        assert!(matches!(next_publish_lane(&mut s), Lane::Held { .. }));
        s.handle_handoff(HandoffResult::Refused, Authority::Held, now);
        let Some(Action::Hold(hold)) = s.poll_action() else {
            panic!("a refused handoff is held, never NACKed below the limit");
        };
        holds.push(hold.as_secs());
        now += hold;
        s.handle_held(now);
        assert_eq!(next_publish_lane(&mut s), Lane::DeadLetter);
        s.handle_handoff(HandoffResult::Refused, Authority::Held, now);
    }
    // Short holds, so the lane resumes within seconds of the permission coming back.
    assert_eq!(holds, vec![1, 2, 2, 2, 2, 2]);
    // Granted again: the copy goes to its lane and the original is ACKed.
    assert!(matches!(next_publish_lane(&mut s), Lane::Held { .. }));
    s.handle_handoff(HandoffResult::Confirmed, Authority::Held, now);
    assert_eq!(s.poll_action(), Some(Action::Ack));
    s.handle_settled(SettleResult::Written);
    assert_eq!(s.outcome(), Some(Outcome::Held));
}

#[test]
fn a_handoff_refused_for_release_held_after_ends_in_one_nack() {
    let t0 = Instant::now();
    let p = policy().clone().release_held_after(Duration::from_secs(10));
    let plan = dead_letter(FailureKind::Permanent, Cause::Handler);
    let mut s = start_publish(plan, 0, &p, t0);
    let mut now = within_budget(t0);
    s.handle_handoff(HandoffResult::Refused, Authority::Held, now);
    let mut holds = Vec::new();
    loop {
        assert!(matches!(next_publish_lane(&mut s), Lane::Held { .. }));
        s.handle_handoff(HandoffResult::Refused, Authority::Held, now);
        match s.poll_action() {
            Some(Action::Hold(hold)) => {
                holds.push(hold.as_secs());
                now += hold;
                s.handle_held(now);
                assert_eq!(next_publish_lane(&mut s), Lane::DeadLetter);
                s.handle_handoff(HandoffResult::Refused, Authority::Held, now);
            }
            Some(Action::Requeue) => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    // 1 + 2 + 2 + 2 s, then what is left of the 10 s: the documented bound on a held delivery.
    assert_eq!(holds, vec![1, 2, 2, 2, 2, 1]);
    s.handle_settled(SettleResult::Written);
    assert_eq!(
        s.outcome(),
        Some(Outcome::Requeued(RequeueCause::HandoffFailed))
    );
}

#[test]
fn a_hold_at_the_requeue_limit_cut_short_by_shutdown_releases_the_delivery() {
    let t0 = Instant::now();
    let p = policy();
    let plan = dead_letter(FailureKind::Retryable, Cause::RequeueLimit);
    let mut s = start_publish(plan, p.max_requeues, p, t0);
    let now = within_budget(t0);
    s.handle_handoff(HandoffResult::Returned, Authority::Held, now);
    next_publish_lane(&mut s);
    s.handle_handoff(HandoffResult::Returned, Authority::Held, now);
    assert_eq!(s.poll_action(), Some(Action::Hold(Duration::from_secs(1))));
    s.handle_held(now + Duration::from_millis(100));
    assert_eq!(s.poll_action(), Some(Action::Requeue));
}

#[test]
fn handoff_failure_with_authority_lost_sends_nothing() {
    let t0 = Instant::now();
    let mut s = start_publish(Plan::Handoff(some_handoff()), 0, policy(), t0);
    s.handle_handoff(HandoffResult::Failed, Authority::Lost, within_budget(t0));
    assert_no_more_actions(&mut s);
    assert_eq!(s.outcome(), Some(Outcome::AuthorityLost));
}

#[test]
fn confirmed_handoff_with_refused_ack_keeps_the_confirmation_and_never_republishes() {
    let t0 = Instant::now();
    let handoff = some_handoff();
    let mut s = start_publish(Plan::Handoff(handoff), 0, policy(), t0);
    s.handle_handoff(HandoffResult::Confirmed, Authority::Held, within_budget(t0));
    assert_eq!(s.confirmed_handoff(), Some(handoff.lane));
    assert_eq!(s.poll_action(), Some(Action::Ack));
    s.handle_settled(SettleResult::Refused);

    let unresolved = Some(Outcome::Unresolved(Unresolved::HandoffConfirmedAckFailed(
        handoff.lane,
    )));
    assert_eq!(s.outcome(), unresolved);
    assert_eq!(s.confirmed_handoff(), Some(handoff.lane));
    // More evidence, even a second confirm, never brings back a publish or an ack.
    s.handle_handoff(HandoffResult::Confirmed, Authority::Held, within_budget(t0));
    s.handle_settled(SettleResult::Written);
    assert_no_more_actions(&mut s);
    assert_eq!(s.outcome(), unresolved);
}

#[test]
fn confirmed_handoff_with_authority_lost_is_unresolved_without_ack() {
    let t0 = Instant::now();
    let handoff = some_handoff();
    let mut s = start_publish(Plan::Handoff(handoff), 0, policy(), t0);
    s.handle_handoff(HandoffResult::Confirmed, Authority::Lost, within_budget(t0));
    assert_no_more_actions(&mut s);
    assert_eq!(
        s.outcome(),
        Some(Outcome::Unresolved(Unresolved::HandoffConfirmedAckFailed(
            handoff.lane
        )))
    );
}

#[test]
fn confirmed_handoff_with_authority_lost_keeps_the_confirmed_lane() {
    // The design chapter: a confirmed handoff stays confirmed; `confirmed_handoff` is "kept even
    // when the ACK that follows fails". Losing authority is the ACK not being possible.
    let t0 = Instant::now();
    let handoff = some_handoff();
    let mut s = start_publish(Plan::Handoff(handoff), 0, policy(), t0);
    s.handle_handoff(HandoffResult::Confirmed, Authority::Lost, within_budget(t0));
    assert_eq!(s.confirmed_handoff(), Some(handoff.lane));
}

#[test]
fn refused_ack_without_a_handoff_is_recorded_as_authority_lost() {
    let mut s = Settlement::start(Plan::Ack, 0, policy(), Instant::now());
    assert_eq!(s.poll_action(), Some(Action::Ack));
    s.handle_settled(SettleResult::Refused);
    assert_eq!(s.outcome(), Some(Outcome::AuthorityLost));
    assert_no_more_actions(&mut s);
}

#[test]
fn each_action_is_handed_out_exactly_once() {
    let t0 = Instant::now();
    let mut s = Settlement::start(Plan::Handoff(some_handoff()), 0, policy(), t0);
    assert!(matches!(s.poll_action(), Some(Action::Publish { .. })));
    assert_eq!(s.poll_action(), None, "publish handed out twice");
    s.handle_handoff(HandoffResult::Confirmed, Authority::Held, within_budget(t0));
    assert_eq!(s.poll_action(), Some(Action::Ack));
    assert_eq!(s.poll_action(), None, "ack handed out twice");
    assert_eq!(s.outcome(), None);
    s.handle_settled(SettleResult::Written);
    assert_eq!(s.outcome(), Some(Outcome::Retried));
    assert_eq!(s.poll_action(), None);
}

#[test]
fn evidence_for_an_action_not_handed_out_is_ignored() {
    let t0 = Instant::now();
    let plan = Plan::Handoff(some_handoff());

    // A handoff result before the publish was handed out.
    let mut s = Settlement::start(plan, 0, policy(), t0);
    s.handle_handoff(HandoffResult::Confirmed, Authority::Held, within_budget(t0));
    s.handle_settled(SettleResult::Written);
    assert_eq!(s.outcome(), None);
    assert_eq!(s.confirmed_handoff(), None);
    assert!(matches!(s.poll_action(), Some(Action::Publish { .. })));

    // A settle result while the publish is outstanding.
    s.handle_settled(SettleResult::Written);
    assert_eq!(s.outcome(), None);
    assert_eq!(s.poll_action(), None);

    // A settle result for the ack before the ack was handed out.
    s.handle_handoff(HandoffResult::Confirmed, Authority::Held, within_budget(t0));
    s.handle_settled(SettleResult::Refused);
    assert_eq!(s.outcome(), None);
    // A second handoff result while the ack is outstanding.
    assert_eq!(s.poll_action(), Some(Action::Ack));
    s.handle_handoff(HandoffResult::Failed, Authority::Lost, within_budget(t0));
    assert_eq!(s.outcome(), None);
    s.handle_settled(SettleResult::Written);
    assert_eq!(s.outcome(), Some(Outcome::Retried));
}

#[test]
fn evidence_before_an_ack_is_handed_out_is_ignored() {
    let mut s = Settlement::start(Plan::Ack, 0, policy(), Instant::now());
    s.handle_settled(SettleResult::Refused);
    assert_eq!(s.outcome(), None);
    assert_eq!(s.poll_action(), Some(Action::Ack));
    s.handle_settled(SettleResult::Written);
    assert_eq!(s.outcome(), Some(Outcome::Acked));
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

fn failure_kind() -> impl Strategy<Value = FailureKind> {
    prop_oneof![
        Just(FailureKind::Retryable),
        Just(FailureKind::Permanent),
        Just(FailureKind::Indeterminate),
    ]
}

fn pipeline_result() -> impl Strategy<Value = PipelineResult> {
    let hint = proptest::option::of((0u64..2_000).prop_map(Duration::from_secs));
    prop_oneof![
        Just(PipelineResult::Succeeded),
        (failure_kind(), hint)
            .prop_map(|(kind, retry_after)| PipelineResult::Failed { kind, retry_after }),
        Just(PipelineResult::NotDispatched),
        Just(PipelineResult::Conflict),
        Just(PipelineResult::Panicked),
        Just(PipelineResult::TimedOut),
        Just(PipelineResult::Deferred),
        Just(PipelineResult::Duplicate),
    ]
}

fn authority() -> impl Strategy<Value = Authority> {
    prop_oneof![Just(Authority::Held), Just(Authority::Lost)]
}

fn situation_strategy() -> impl Strategy<Value = Situation> {
    let cleanup = prop_oneof![Just(CleanupResult::Succeeded), Just(CleanupResult::Failed)];
    let transaction = prop_oneof![
        Just(TransactionOutcome::NotRequired),
        Just(TransactionOutcome::Committed),
        Just(TransactionOutcome::Aborted),
        Just(TransactionOutcome::CommitAmbiguous),
        Just(TransactionOutcome::Fenced),
    ];
    (
        pipeline_result(),
        cleanup,
        transaction,
        1u32..20,
        0u32..20,
        authority(),
        proptest::option::of(prop_oneof![
            Just(Terminal::DeadLetter),
            Just(Terminal::Parking)
        ]),
    )
        .prop_map(
            |(pipeline, cleanup, transaction, attempt, requeues, authority, replayed_from)| {
                Situation {
                    pipeline,
                    cleanup,
                    transaction,
                    attempt,
                    requeues,
                    authority,
                    replayed_from,
                }
            },
        )
}

fn lane() -> impl Strategy<Value = Lane> {
    prop_oneof![
        (0usize..3, 2u32..10).prop_map(|(bucket, next_attempt)| Lane::Retry {
            bucket,
            next_attempt
        }),
        Just(Lane::DeadLetter),
        Just(Lane::Parking),
    ]
}

fn plan_strategy() -> impl Strategy<Value = Plan> {
    let handoff = (lane(), proptest::option::of(failure_kind())).prop_map(|(lane, kind)| {
        Plan::Handoff(Handoff {
            lane,
            kind,
            cause: Cause::Handler,
        })
    });
    prop_oneof![
        Just(Plan::Ack),
        handoff,
        Just(Plan::Requeue(RequeueCause::Deferred)),
        Just(Plan::Requeue(RequeueCause::HandoffFailed)),
        Just(Plan::Reject),
        Just(Plan::Abandon),
    ]
}

/// One input to a settlement: take the next action, or report evidence.
#[derive(Clone, Copy, Debug)]
enum Input {
    Poll,
    Handoff(HandoffResult, Authority, Duration),
    Settled(SettleResult),
}

fn handoff_result() -> impl Strategy<Value = HandoffResult> {
    prop_oneof![
        Just(HandoffResult::Confirmed),
        Just(HandoffResult::Returned),
        Just(HandoffResult::Nacked),
        Just(HandoffResult::Failed),
        Just(HandoffResult::TimedOut),
        Just(HandoffResult::Blocked),
    ]
}

fn input() -> impl Strategy<Value = Input> {
    // Offsets from t0 on both sides of the 10s default deadline.
    let offset = (0u64..20_000).prop_map(Duration::from_millis);
    let settle = prop_oneof![Just(SettleResult::Written), Just(SettleResult::Refused)];
    prop_oneof![
        2 => Just(Input::Poll),
        1 => (handoff_result(), authority(), offset)
            .prop_map(|(r, a, at)| Input::Handoff(r, a, at)),
        1 => settle.prop_map(Input::Settled),
    ]
}

fn is_settling(action: &Action) -> bool {
    matches!(action, Action::Ack | Action::Requeue | Action::Reject)
}

fn handoff_failure() -> impl Strategy<Value = HandoffResult> {
    prop_oneof![
        Just(HandoffResult::Returned),
        Just(HandoffResult::Nacked),
        Just(HandoffResult::Failed),
        Just(HandoffResult::TimedOut),
        Just(HandoffResult::Blocked),
    ]
}

fn failing_pipeline() -> impl Strategy<Value = PipelineResult> {
    prop_oneof![
        failure_kind().prop_map(failed),
        Just(PipelineResult::NotDispatched),
        Just(PipelineResult::Conflict),
        Just(PipelineResult::Panicked),
        Just(PipelineResult::TimedOut),
        Just(PipelineResult::Deferred),
    ]
}

/// A delivery's actions: below the requeue limit, a publish, a held copy's publish, a hold
/// and the NACK; at the limit, three per hold until the release (15 minutes, the longest hold
/// a minute).
const MAX_ACTIONS_PER_DELIVERY: usize = 3 * 25 + 2;

/// What one delivery of a message whose every handoff fails ends in.
struct Delivery {
    plan: Plan,
    actions: usize,
    outcome: Outcome,
    /// The time spent in holds.
    held: Duration,
}

/// Runs one delivery through decide and settlement; every handoff fails with `failure`, every
/// settle frame is written.
fn deliver_with_failing_handoffs(
    s: &Situation,
    p: &Policy,
    failure: HandoffResult,
    t0: Instant,
) -> Delivery {
    let plan = decide(s, p);
    let mut settlement = Settlement::start(plan, s.requeues, p, t0);
    let mut actions = 0;
    let (mut now, mut held) = (t0, Duration::ZERO);
    // A bounded loop reports a runaway settlement instead of hanging.
    for _ in 0..MAX_ACTIONS_PER_DELIVERY + 1 {
        let Some(action) = settlement.poll_action() else {
            break;
        };
        actions += 1;
        match action {
            Action::Publish { .. } => {
                now += Duration::from_millis(1);
                settlement.handle_handoff(failure, Authority::Held, now);
            }
            Action::Hold(hold) => {
                held += hold;
                now += hold;
                settlement.handle_held(now);
            }
            Action::Ack | Action::Requeue | Action::Reject => {
                settlement.handle_settled(SettleResult::Written);
            }
        }
    }
    let outcome = settlement
        .outcome()
        .expect("a delivery always reaches an outcome");
    Delivery {
        plan,
        actions,
        outcome,
        held,
    }
}

proptest! {
    #[test]
    fn decide_never_requeues_or_retries_past_its_bounds(
        s in situation_strategy(),
        max_attempts in 1u32..10,
        max_requeues in 0u32..10,
    ) {
        let p = policy_with(max_attempts, max_requeues);
        let plan = decide(&s, &p);
        prop_assert_eq!(plan == Plan::Abandon, s.authority == Authority::Lost);
        prop_assert_ne!(plan, Plan::Reject, "reject is a gate-only path");
        if let Plan::Requeue(_) = plan {
            prop_assert!(s.requeues < max_requeues, "requeue at {} of {}", s.requeues, max_requeues);
        }
        if let Plan::Handoff(Handoff { lane: Lane::Retry { bucket, next_attempt }, kind, .. }) = plan {
            prop_assert!(s.attempt < max_attempts);
            prop_assert!(s.requeues < max_requeues);
            prop_assert_eq!(next_attempt, s.attempt + 1);
            prop_assert!(bucket < p.retry_delays.len());
            prop_assert_eq!(kind, Some(FailureKind::Retryable));
            prop_assert_ne!(s.replayed_from, Some(Terminal::Parking), "replayed from parking");
        }
        // A replay from parking changes where a retry goes, nothing else.
        if s.replayed_from == Some(Terminal::Parking) {
            let unreplayed = decide(&Situation { replayed_from: None, ..s }, &p);
            match unreplayed {
                Plan::Handoff(Handoff { lane: Lane::Retry { .. }, kind, cause }) => {
                    prop_assert_eq!(plan, Plan::Handoff(Handoff { lane: Lane::Parking, kind, cause }));
                }
                other => prop_assert_eq!(plan, other),
            }
        }
    }

    #[test]
    fn settlement_hands_out_one_settling_action_and_one_publish_and_its_outcome_is_final(
        plan in plan_strategy(),
        requeues in 0u32..8,
        inputs in proptest::collection::vec(input(), 0..24),
    ) {
        let p = policy();
        let t0 = Instant::now();
        let mut s = Settlement::start(plan, requeues, p, t0);
        let mut publishes = 0;
        let mut settling = 0;
        let mut outcome = s.outcome();
        for input in inputs {
            match input {
                Input::Poll => match s.poll_action() {
                    Some(Action::Publish { .. }) => publishes += 1,
                    Some(Action::Hold(_)) => {}
                    Some(action) => {
                        prop_assert!(is_settling(&action));
                        settling += 1;
                    }
                    None => {}
                },
                Input::Handoff(result, authority, at) => s.handle_handoff(result, authority, t0 + at),
                Input::Settled(result) => s.handle_settled(result),
            }
            // The handoff, then at most its held copy: a hold comes before any other publish.
            prop_assert!(publishes <= 2, "publish handed out {} times", publishes);
            prop_assert!(settling <= 1, "{} settling actions handed out", settling);
            if outcome.is_some() {
                prop_assert_eq!(s.outcome(), outcome, "outcome changed after it was final");
            }
            outcome = s.outcome();
        }
    }

    #[test]
    fn failing_handoffs_cannot_requeue_forever(
        pipeline in failing_pipeline(),
        failure in handoff_failure(),
        attempt in 1u32..10,
        max_requeues in 0u32..10,
    ) {
        let p = policy_with(5, max_requeues);
        let t0 = Instant::now();
        let mut requeues = 0;
        let mut deliveries = 0;
        let last = loop {
            deliveries += 1;
            prop_assert!(deliveries <= max_requeues + 1, "delivery {} of a hot loop", deliveries);
            let s = Situation { requeues, attempt, ..situation(pipeline) };
            let delivery = deliver_with_failing_handoffs(&s, &p, failure, t0);
            prop_assert!(delivery.actions <= MAX_ACTIONS_PER_DELIVERY);
            if requeues >= max_requeues {
                break delivery;
            }
            // Below the limit every requeue after a failed handoff backs off as a deferral
            // does (the machine holds a deferral before its plan).
            prop_assert!(matches!(delivery.outcome, Outcome::Requeued(_)));
            if let Plan::Handoff(_) = delivery.plan {
                prop_assert!(delivery.held >= p.deferral_delay(requeues));
            }
            requeues += 1;
        };
        // At the limit the delivery was held, trying its lane, until its release: one NACK
        // per `release_held_after`, never a hot loop.
        prop_assert_eq!(last.outcome, Outcome::Requeued(RequeueCause::HandoffFailed));
        // (Less the millisecond each failed publish took.)
        let publishes = Duration::from_millis(last.actions as u64);
        prop_assert!(last.held + publishes >= p.release_held_after, "released after {:?}", last.held);
        prop_assert_eq!(requeues, max_requeues);
        match last.plan {
            Plan::Handoff(Handoff { lane: Lane::DeadLetter, cause, .. }) => {
                prop_assert_eq!(cause, Cause::RequeueLimit);
            }
            Plan::Handoff(Handoff { lane: Lane::Parking, .. }) => {}
            other => prop_assert!(false, "terminal plan {:?} is not a DLQ or parking handoff", other),
        }
    }
}
