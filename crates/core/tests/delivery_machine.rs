//! The delivery machine, driven without a broker: the paths of the decision table step by step,
//! the requeue count it keeps, its requeue memory, and properties over random evidence.

use std::time::{Duration, Instant};

use lily_mq_core::machine::{
    Action, Arrival, CopyOf, Delivery, HeldCopy, Input, MAX_LEASE_WAITS, RequeueMemory,
    ScopeOpened, Verdict,
};
use lily_mq_core::transport::{
    Authority, Cause, CleanupResult, Evidence, GateRejection, HandoffResult, PipelineResult,
    SettleResult,
};
use lily_mq_core::{
    Committed, FailureKind, Lane, Outcome, Policy, Reason, RequeueCause, Terminal,
    TransactionOutcome, Unresolved,
};

const HELD: Authority = Authority::Held;

fn policy() -> Policy {
    Policy::default()
        .max_attempts(3)
        .max_requeues(4)
        .deferral_delays([Duration::from_millis(100), Duration::from_secs(2)])
}

fn committed(
    outcome: TransactionOutcome,
    deferrals: Option<u32>,
    reason: Option<Reason>,
) -> Committed {
    Committed {
        outcome,
        reason,
        deferrals,
        wait: None,
    }
}

fn arrival(verdict: Verdict) -> Arrival {
    Arrival {
        verdict,
        attempt: 1,
        redelivered: false,
        delivery_count: None,
        local_requeues: Some(0),
        scoped: false,
        held: None,
        replayed_from: None,
        waits: 0,
    }
}

fn failed(kind: FailureKind) -> PipelineResult {
    PipelineResult::Failed {
        kind,
        retry_after: None,
    }
}

fn evidence(d: &mut Delivery<'_>) -> Vec<Evidence> {
    std::iter::from_fn(|| d.poll_evidence()).collect()
}

/// Opens a scoped delivery's scope with a transaction and returns it waiting for its handler.
fn scoped_and_running(p: &Policy, now: Instant) -> Delivery<'_> {
    let mut d = Delivery::new(
        Arrival {
            scoped: true,
            ..arrival(Verdict::Dispatched)
        },
        p,
        || HELD,
        now,
    );
    assert_eq!(d.poll_action(|| HELD), Some(Action::OpenScope));
    d.handle(
        Input::Scope(ScopeOpened::Proceed {
            transaction: true,
            deaths: None,
        }),
        HELD,
        now,
    );
    assert_eq!(d.poll_action(|| HELD), Some(Action::RunHandler));
    d
}

#[test]
fn success_runs_the_handler_then_acks() {
    let (p, now) = (policy(), Instant::now());
    let mut d = Delivery::new(arrival(Verdict::Dispatched), &p, || HELD, now);
    assert_eq!(d.poll_action(|| HELD), Some(Action::RunHandler));
    assert_eq!(
        d.poll_action(|| HELD),
        None,
        "each action is handed out once"
    );
    d.handle(
        Input::Pipeline(PipelineResult::Succeeded, CleanupResult::Succeeded, None),
        HELD,
        now,
    );
    assert_eq!(d.poll_action(|| HELD), Some(Action::Ack));
    d.handle(Input::Settled(SettleResult::Written), HELD, now);
    assert_eq!(d.poll_action(|| HELD), None);
    assert_eq!(d.outcome(), Some(Outcome::Acked));
    assert_eq!(evidence(&mut d), [Evidence::HandlerReturned]);
    assert_eq!(d.reason().as_str(), "ok");
}

#[test]
fn a_scope_commits_after_success_and_aborts_after_failure() {
    let (p, now) = (policy(), Instant::now());
    let mut d = scoped_and_running(&p, now);
    d.handle(
        Input::Pipeline(PipelineResult::Succeeded, CleanupResult::Succeeded, None),
        HELD,
        now,
    );
    assert_eq!(d.poll_action(|| HELD), Some(Action::Commit));
    d.handle(
        Input::Commit(committed(TransactionOutcome::Committed, None, None)),
        HELD,
        now,
    );
    assert_eq!(d.poll_action(|| HELD), Some(Action::Ack));

    let mut d = scoped_and_running(&p, now);
    let reason = Reason::new("stock service down");
    d.handle(
        Input::Pipeline(
            failed(FailureKind::Retryable),
            CleanupResult::Succeeded,
            Some(reason.clone()),
        ),
        HELD,
        now,
    );
    assert_eq!(d.poll_action(|| HELD), Some(Action::Abort));
    d.handle(Input::Aborted, HELD, now);
    let Some(Action::Publish { handoff, copy, .. }) = d.poll_action(|| HELD) else {
        panic!("a retryable failure hands off")
    };
    assert_eq!(copy, CopyOf::Original);
    assert!(matches!(
        handoff.lane,
        Lane::Retry {
            next_attempt: 2,
            ..
        }
    ));
    assert_eq!(d.reason(), &reason);
}

#[test]
fn a_handoff_acks_only_after_its_confirm_and_requeues_otherwise() {
    let (p, now) = (policy(), Instant::now());
    for (result, outcome) in [
        (HandoffResult::Confirmed, Outcome::DeadLettered),
        (
            HandoffResult::Returned,
            Outcome::Requeued(RequeueCause::HandoffFailed),
        ),
        (
            HandoffResult::TimedOut,
            Outcome::Requeued(RequeueCause::HandoffFailed),
        ),
    ] {
        let mut d = Delivery::new(arrival(Verdict::Dispatched), &p, || HELD, now);
        d.poll_action(|| HELD);
        d.handle(
            Input::Pipeline(
                failed(FailureKind::Permanent),
                CleanupResult::Succeeded,
                None,
            ),
            HELD,
            now,
        );
        assert!(matches!(
            d.poll_action(|| HELD),
            Some(Action::Publish { .. })
        ));
        d.handle(Input::Handoff(result), HELD, now);
        if result != HandoffResult::Confirmed {
            // The DLQ failed: a held copy, failing the same way, then a backoff.
            assert!(matches!(
                d.poll_action(|| HELD),
                Some(Action::Publish { handoff, .. }) if matches!(handoff.lane, Lane::Held { .. })
            ));
            d.handle(Input::Handoff(result), HELD, now);
            let hold = p.deferral_delay(0);
            assert_eq!(d.poll_action(|| HELD), Some(Action::Hold(hold)));
            d.handle(Input::Held, HELD, now + hold);
        }
        let settle = d.poll_action(|| HELD).expect("a settle action");
        let expected = if result == HandoffResult::Confirmed {
            Action::Ack
        } else {
            Action::Requeue { counted: true }
        };
        assert_eq!(settle, expected);
        d.handle(Input::Settled(SettleResult::Written), HELD, now);
        assert_eq!(d.outcome(), Some(outcome));
    }
}

#[test]
fn no_copy_is_published_once_authority_is_lost() {
    let (p, now) = (policy(), Instant::now());
    let mut d = Delivery::new(arrival(Verdict::Dispatched), &p, || HELD, now);
    d.poll_action(|| HELD);
    d.handle(
        Input::Pipeline(
            failed(FailureKind::Permanent),
            CleanupResult::Succeeded,
            None,
        ),
        HELD,
        now,
    );
    assert_eq!(d.poll_action(|| Authority::Lost), None);
    assert_eq!(d.outcome(), Some(Outcome::AuthorityLost));
    assert_eq!(
        evidence(&mut d),
        [
            Evidence::HandlerReturned,
            Evidence::Planned,
            Evidence::AuthorityLost
        ]
    );
}

#[test]
fn a_refused_envelope_hands_off_sanitized_metadata_and_an_oversized_one_is_rejected() {
    let (p, now) = (policy(), Instant::now());
    let invalid = Reason::new("message_id missing");
    let refused = Verdict::Refused {
        rejection: GateRejection::Invalid(invalid.clone()),
        reason: invalid.clone(),
    };
    let mut d = Delivery::new(arrival(refused), &p, || HELD, now);
    let Some(Action::Publish { handoff, copy, .. }) = d.poll_action(|| HELD) else {
        panic!("an invalid envelope is dead-lettered")
    };
    assert_eq!((handoff.lane, copy), (Lane::DeadLetter, CopyOf::Sanitized));
    assert_eq!(d.reason(), &invalid);

    let oversized = Verdict::Refused {
        rejection: GateRejection::Oversized { len: 10 },
        reason: Reason::new("too big"),
    };
    let mut d = Delivery::new(arrival(oversized), &p, || HELD, now);
    assert_eq!(d.poll_action(|| HELD), Some(Action::Reject));
    d.handle(Input::Settled(SettleResult::Written), HELD, now);
    assert_eq!(d.outcome(), Some(Outcome::RejectedToDlx));
}

#[test]
fn a_message_without_a_valid_id_is_at_the_requeue_limit_from_the_start() {
    let (p, now) = (policy(), Instant::now());
    let refused = Verdict::Refused {
        rejection: GateRejection::Invalid(Reason::new("bad id")),
        reason: Reason::new("bad id"),
    };
    let unknown = Arrival {
        local_requeues: None,
        ..arrival(refused)
    };
    let mut d = Delivery::new(unknown, &p, || HELD, now);
    d.poll_action(|| HELD);
    d.handle(Input::Handoff(HandoffResult::Returned), HELD, now);
    // Its copy waits in a bucket as a held copy; that failing too, it is held and tried again,
    // never requeued at once: nothing could count it, so it could loop for ever.
    assert!(matches!(
        d.poll_action(|| HELD),
        Some(Action::Publish { handoff, .. }) if matches!(handoff.lane, Lane::Held { .. })
    ));
    d.handle(Input::Handoff(HandoffResult::Returned), HELD, now);
    assert_eq!(
        d.poll_action(|| HELD),
        Some(Action::Hold(Duration::from_secs(1)))
    );
    assert_eq!(d.outcome(), None);
}

#[test]
fn requeues_are_the_highest_of_broker_count_local_count_and_durable_deferrals() {
    let (p, now) = (policy(), Instant::now());
    // What a deferral holds for shows the count: 100 ms at 0 requeues, 2 s from 1 on.
    let hold = |arrival: Arrival, deferrals: Option<u32>| {
        let mut d = Delivery::new(
            Arrival {
                scoped: true,
                ..arrival
            },
            &p,
            || HELD,
            now,
        );
        d.poll_action(|| HELD);
        d.handle(
            Input::Scope(ScopeOpened::Defer {
                reason: Reason::new("lease held"),
                deferrals,
            }),
            HELD,
            now,
        );
        d.poll_action(|| HELD)
    };
    let short = Some(Action::Hold(Duration::from_millis(100)));
    let long = Some(Action::Hold(Duration::from_secs(2)));
    let fresh = arrival(Verdict::Dispatched);
    assert_eq!(hold(fresh.clone(), None), short);
    assert_eq!(hold(fresh.clone(), Some(1)), long);
    let quorum = Arrival {
        delivery_count: Some(1),
        ..fresh.clone()
    };
    assert_eq!(hold(quorum, None), long);
    // The local count applies to a redelivery only: a new publish of the same id is new.
    let republished = Arrival {
        local_requeues: Some(1),
        ..fresh.clone()
    };
    assert_eq!(hold(republished, None), short);
    let redelivered = Arrival {
        local_requeues: Some(1),
        redelivered: true,
        ..fresh
    };
    assert_eq!(hold(redelivered, None), long);
}

#[test]
fn a_deferred_requeue_holds_first_and_an_ambiguous_commit_at_the_limit_is_parked() {
    let (p, now) = (policy(), Instant::now());
    let mut d = scoped_and_running(&p, now);
    d.handle(
        Input::Pipeline(PipelineResult::Succeeded, CleanupResult::Succeeded, None),
        HELD,
        now,
    );
    d.poll_action(|| HELD);
    d.handle(
        Input::Commit(committed(
            TransactionOutcome::CommitAmbiguous,
            Some(4),
            Some(Reason::new("commit unknown")),
        )),
        HELD,
        now,
    );
    // Four durable deferrals: the limit. The effect may have happened: parked, not the DLQ.
    let Some(Action::Publish { handoff, .. }) = d.poll_action(|| HELD) else {
        panic!("at the limit an ambiguous commit is handed off")
    };
    assert_eq!(handoff.lane, Lane::Parking);

    let mut d = Delivery::new(
        Arrival {
            scoped: true,
            ..arrival(Verdict::Dispatched)
        },
        &p,
        || HELD,
        now,
    );
    d.poll_action(|| HELD);
    d.handle(
        Input::Scope(ScopeOpened::Defer {
            reason: Reason::new("lease held"),
            deferrals: None,
        }),
        HELD,
        now,
    );
    assert_eq!(
        d.poll_action(|| HELD),
        Some(Action::Hold(Duration::from_millis(100)))
    );
    assert_eq!(d.poll_action(|| HELD), None, "nothing while holding");
    d.handle(Input::Held, HELD, now);
    assert_eq!(
        d.poll_action(|| HELD),
        Some(Action::Requeue { counted: true })
    );
    d.handle(Input::Settled(SettleResult::Written), HELD, now);
    assert_eq!(d.outcome(), Some(Outcome::Requeued(RequeueCause::Deferred)));
}

#[test]
fn requeue_counts_are_forgotten_only_when_a_redelivered_message_leaves_for_good() {
    let (p, now) = (policy(), Instant::now());
    let run = |redelivered: bool, ok: bool| {
        let mut d = Delivery::new(
            Arrival {
                redelivered,
                ..arrival(Verdict::Dispatched)
            },
            &p,
            || HELD,
            now,
        );
        d.poll_action(|| HELD);
        let result = if ok {
            PipelineResult::Succeeded
        } else {
            PipelineResult::Deferred
        };
        d.handle(
            Input::Pipeline(result, CleanupResult::Succeeded, None),
            HELD,
            now,
        );
        if !ok {
            d.poll_action(|| HELD);
            d.handle(Input::Held, HELD, now);
        }
        d.poll_action(|| HELD);
        d.handle(Input::Settled(SettleResult::Written), HELD, now);
        d.forgets_requeues()
    };
    assert!(run(true, true));
    assert!(!run(false, true));
    assert!(
        !run(true, false),
        "requeued again: the count is still needed"
    );
}

#[test]
fn the_requeue_memory_evicts_the_least_recently_counted_id() {
    let mut memory = RequeueMemory::new(3);
    for id in ["a", "b", "c"] {
        memory.count(id);
    }
    memory.count("a");
    memory.count("d"); // full: "b" was counted least recently
    assert_eq!(["a", "b", "c", "d"].map(|id| memory.get(id)), [2, 0, 1, 1]);
    memory.forget("a");
    assert_eq!((memory.get("a"), memory.len()), (0, 2));
    memory.count("e");
    memory.count("f"); // "c" is now the oldest
    assert_eq!(memory.get("c"), 0);
    assert_eq!(memory.len(), 3);
}

#[test]
fn a_transient_transaction_error_runs_the_whole_transaction_again() {
    let (p, now) = (policy(), Instant::now());
    let mut d = scoped_and_running(&p, now);
    let conflict = Reason::new("write conflict");
    d.handle(
        Input::Pipeline(
            PipelineResult::Transient,
            CleanupResult::Succeeded,
            Some(conflict),
        ),
        HELD,
        now,
    );
    assert_eq!(d.poll_action(|| HELD), Some(Action::Abort));
    d.handle(Input::Aborted, HELD, now);
    let Some(Action::Backoff(wait)) = d.poll_action(|| HELD) else {
        panic!("a backoff before the transaction runs again")
    };
    let now = now + wait;
    d.handle(Input::Held, HELD, now);
    assert_eq!(d.poll_action(|| HELD), Some(Action::OpenScope));
    d.handle(
        Input::Scope(ScopeOpened::Proceed {
            transaction: true,
            deaths: None,
        }),
        HELD,
        now,
    );
    assert_eq!(d.poll_action(|| HELD), Some(Action::RunHandler));
    d.handle(
        Input::Pipeline(PipelineResult::Succeeded, CleanupResult::Succeeded, None),
        HELD,
        now,
    );
    assert_eq!(d.poll_action(|| HELD), Some(Action::Commit));
    // The commit conflicts this time: once more.
    d.handle(
        Input::Commit(committed(TransactionOutcome::Transient, None, None)),
        HELD,
        now,
    );
    let Some(Action::Backoff(second)) = d.poll_action(|| HELD) else {
        panic!("a backoff after a transient commit")
    };
    assert!(second > wait, "the backoff grows");
    d.handle(Input::Held, HELD, now + second);
    assert_eq!(d.poll_action(|| HELD), Some(Action::OpenScope));
}

#[test]
fn a_message_whose_handlings_died_up_to_the_limit_is_not_run_again() {
    let (p, now) = (policy(), Instant::now());
    let opened = |deaths| {
        let mut d = Delivery::new(
            Arrival {
                scoped: true,
                redelivered: true,
                ..arrival(Verdict::Dispatched)
            },
            &p,
            || HELD,
            now,
        );
        assert_eq!(d.poll_action(|| HELD), Some(Action::OpenScope));
        d.handle(
            Input::Scope(ScopeOpened::Proceed {
                transaction: true,
                deaths: Some(deaths),
            }),
            HELD,
            now,
        );
        d
    };
    // Below the limit it runs.
    let mut d = opened(p.max_requeues - 1);
    assert_eq!(d.poll_action(|| HELD), Some(Action::RunHandler));
    // No death is no evidence, whatever the limit.
    let none = policy().max_requeues(0);
    let mut d = Delivery::new(
        Arrival {
            scoped: true,
            redelivered: true,
            ..arrival(Verdict::Dispatched)
        },
        &none,
        || HELD,
        now,
    );
    assert_eq!(d.poll_action(|| HELD), Some(Action::OpenScope));
    let proceed = ScopeOpened::Proceed {
        transaction: true,
        deaths: Some(0),
    };
    d.handle(Input::Scope(proceed), HELD, now);
    assert_eq!(d.poll_action(|| HELD), Some(Action::RunHandler));
    // At it, its worker died with it each time: the transaction is aborted, the handler not
    // run, and the message goes to the DLQ.
    let mut d = opened(p.max_requeues);
    assert_eq!(d.poll_action(|| HELD), Some(Action::Abort));
    d.handle(Input::Aborted, HELD, now);
    let Some(Action::Publish { handoff, .. }) = d.poll_action(|| HELD) else {
        panic!("straight to a handoff")
    };
    assert_eq!(handoff.lane, Lane::DeadLetter);
    assert!(d.reason().as_str().contains("without being settled"));
}

#[test]
fn a_lease_held_elsewhere_is_waited_out_in_a_bucket_without_a_requeue() {
    let (p, now) = (policy(), Instant::now());
    let waiting = |waits, expires_in| {
        let mut d = Delivery::new(
            Arrival {
                scoped: true,
                redelivered: true,
                // At the requeue limit already: a wait does not look at it.
                local_requeues: Some(p.max_requeues),
                waits,
                ..arrival(Verdict::Dispatched)
            },
            &p,
            || HELD,
            now,
        );
        assert_eq!(d.poll_action(|| HELD), Some(Action::OpenScope));
        d.handle(
            Input::Scope(ScopeOpened::Wait {
                reason: Reason::new("lease held by another owner"),
                expires_in,
            }),
            HELD,
            now,
        );
        d
    };
    // The shortest bucket at least as long as the lease's rest, else the longest.
    for (expires_in, bucket) in [
        (Duration::ZERO, 0),
        (p.retry_delays[0], 0),
        (p.retry_delays[0] + Duration::from_millis(1), 1),
        (Duration::from_secs(100_000), p.retry_delays.len() - 1),
    ] {
        let mut d = waiting(0, expires_in);
        let Some(Action::Publish { handoff, .. }) = d.poll_action(|| HELD) else {
            panic!("a delayed copy")
        };
        assert_eq!(handoff.lane, Lane::Wait { bucket });
        assert_eq!(handoff.cause, Cause::LeaseHeld);
        d.handle(Input::Handoff(HandoffResult::Confirmed), HELD, now);
        assert_eq!(d.poll_action(|| HELD), Some(Action::Ack));
        d.handle(Input::Settled(SettleResult::Written), HELD, now);
        assert_eq!(d.outcome(), Some(Outcome::Waited));
    }
    // Past the most waits it is a deferral again, counted, here at the limit: the DLQ.
    let mut d = waiting(MAX_LEASE_WAITS, Duration::from_secs(1));
    let Some(Action::Publish { handoff, .. }) = d.poll_action(|| HELD) else {
        panic!("a handoff")
    };
    assert_eq!(handoff.lane, Lane::DeadLetter);
}

#[test]
fn a_commit_fenced_by_a_newer_owner_waits_out_its_lease() {
    let (p, now) = (policy(), Instant::now());
    let mut d = Delivery::new(
        Arrival {
            scoped: true,
            ..arrival(Verdict::Dispatched)
        },
        &p,
        || HELD,
        now,
    );
    assert_eq!(d.poll_action(|| HELD), Some(Action::OpenScope));
    d.handle(
        Input::Scope(ScopeOpened::Proceed {
            transaction: true,
            deaths: None,
        }),
        HELD,
        now,
    );
    assert_eq!(d.poll_action(|| HELD), Some(Action::RunHandler));
    d.handle(
        Input::Pipeline(PipelineResult::Succeeded, CleanupResult::Succeeded, None),
        HELD,
        now,
    );
    assert_eq!(d.poll_action(|| HELD), Some(Action::Commit));
    d.handle(
        Input::Commit(Committed {
            wait: Some(p.retry_delays[0]),
            ..committed(TransactionOutcome::Fenced, None, None)
        }),
        HELD,
        now,
    );
    let Some(Action::Publish { handoff, .. }) = d.poll_action(|| HELD) else {
        panic!("a delayed copy")
    };
    assert_eq!(handoff.lane, Lane::Wait { bucket: 0 });
    assert!(d.reason().as_str().contains("stale fence"));
}

#[test]
fn a_transient_error_while_opening_the_scope_opens_it_again_then_defers() {
    let (p, start) = (policy(), Instant::now());
    let mut d = Delivery::new(
        Arrival {
            scoped: true,
            ..arrival(Verdict::Dispatched)
        },
        &p,
        || HELD,
        start,
    );
    let mut now = start;
    let mut reruns = 0;
    let last = loop {
        assert_eq!(d.poll_action(|| HELD), Some(Action::OpenScope));
        d.handle(
            Input::Scope(ScopeOpened::Transient(Reason::new(
                "inbox insert: write conflict",
            ))),
            HELD,
            now,
        );
        match d.poll_action(|| HELD) {
            Some(Action::Backoff(wait)) => {
                reruns += 1;
                now += wait;
                d.handle(Input::Held, HELD, now);
            }
            other => break other,
        }
    };
    assert!(reruns > 1, "opened again in-process first");
    assert!(now < start + p.settlement_budget, "within the budget");
    assert!(
        matches!(last, Some(Action::Hold(_))),
        "then deferred: {last:?}"
    );

    // A concurrent delivery that committed meanwhile: the rerun finds the duplicate.
    let mut d = Delivery::new(
        Arrival {
            scoped: true,
            ..arrival(Verdict::Dispatched)
        },
        &p,
        || HELD,
        start,
    );
    d.poll_action(|| HELD);
    d.handle(
        Input::Scope(ScopeOpened::Transient(Reason::new("conflict"))),
        HELD,
        start,
    );
    let Some(Action::Backoff(wait)) = d.poll_action(|| HELD) else {
        panic!("a backoff first")
    };
    d.handle(Input::Held, HELD, start + wait);
    assert_eq!(d.poll_action(|| HELD), Some(Action::OpenScope));
    d.handle(Input::Scope(ScopeOpened::Duplicate), HELD, start + wait);
    assert_eq!(d.poll_action(|| HELD), Some(Action::Ack));
}

#[test]
fn a_transaction_still_transient_at_the_budget_is_deferred_without_using_an_attempt() {
    let (p, start) = (policy(), Instant::now());
    let mut d = scoped_and_running(&p, start);
    let mut now = start;
    let mut reruns = 0;
    let last_attempt = loop {
        d.handle(
            Input::Pipeline(PipelineResult::Transient, CleanupResult::Succeeded, None),
            HELD,
            now,
        );
        assert_eq!(d.poll_action(|| HELD), Some(Action::Abort));
        d.handle(Input::Aborted, HELD, now);
        match d.poll_action(|| HELD) {
            Some(Action::Backoff(wait)) => {
                reruns += 1;
                now += wait;
                d.handle(Input::Held, HELD, now);
                assert_eq!(d.poll_action(|| HELD), Some(Action::OpenScope));
                d.handle(
                    Input::Scope(ScopeOpened::Proceed {
                        transaction: true,
                        deaths: None,
                    }),
                    HELD,
                    now,
                );
                assert_eq!(d.poll_action(|| HELD), Some(Action::RunHandler));
            }
            other => break other,
        }
    };
    assert!(reruns > 0);
    assert!(
        now < start + p.settlement_budget,
        "reruns stay within the budget"
    );
    assert!(
        matches!(last_attempt, Some(Action::Hold(_))),
        "deferred, not handed off: {last_attempt:?}"
    );
}

#[test]
fn a_transient_error_without_a_transaction_is_an_ordinary_retry() {
    let (p, now) = (policy(), Instant::now());
    let mut d = Delivery::new(arrival(Verdict::Dispatched), &p, || HELD, now);
    d.poll_action(|| HELD);
    d.handle(
        Input::Pipeline(PipelineResult::Transient, CleanupResult::Succeeded, None),
        HELD,
        now,
    );
    let Some(Action::Publish { handoff, .. }) = d.poll_action(|| HELD) else {
        panic!("a retry handoff")
    };
    assert!(matches!(handoff.lane, Lane::Retry { .. }));
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    /// One piece of evidence the executor could report, chosen at random.
    #[derive(Clone, Debug)]
    struct Script {
        arrival: Arrival,
        opened: ScopeOpened,
        pipeline: PipelineResult,
        cleanup: CleanupResult,
        commit: (TransactionOutcome, Option<u32>),
        handoff: HandoffResult,
        settled: SettleResult,
        authority: Vec<bool>,
    }

    fn reason() -> Reason {
        Reason::new("why")
    }

    fn verdict() -> impl Strategy<Value = Verdict> {
        prop_oneof![
            Just(Verdict::Dispatched),
            Just(Verdict::Undispatched(reason())),
            Just(Verdict::Refused {
                rejection: GateRejection::Invalid(reason()),
                reason: reason()
            }),
            Just(Verdict::Refused {
                rejection: GateRejection::Oversized { len: 1 },
                reason: reason()
            }),
        ]
    }

    fn kind() -> impl Strategy<Value = FailureKind> {
        prop_oneof![
            Just(FailureKind::Retryable),
            Just(FailureKind::Permanent),
            Just(FailureKind::Indeterminate),
        ]
    }

    fn script() -> impl Strategy<Value = Script> {
        let arrival = (
            verdict(),
            1u32..5,
            any::<bool>(),
            proptest::option::of(0u32..6),
            proptest::option::of(0u32..6),
            any::<bool>(),
            proptest::option::weighted(0.2, (any::<bool>(), 0u32..4)),
        )
            .prop_map(
                |(verdict, attempt, redelivered, delivery_count, local_requeues, scoped, held)| {
                    Arrival {
                        verdict,
                        attempt,
                        redelivered,
                        delivery_count,
                        local_requeues,
                        scoped,
                        waits: 0,
                        replayed_from: None,
                        held: held.map(|(parking, holds)| HeldCopy {
                            target: if parking {
                                Terminal::Parking
                            } else {
                                Terminal::DeadLetter
                            },
                            kind: Some(FailureKind::Permanent),
                            holds,
                        }),
                    }
                },
            );
        let opened = prop_oneof![
            any::<bool>().prop_map(|transaction| ScopeOpened::Proceed {
                transaction,
                deaths: None
            }),
            Just(ScopeOpened::Duplicate),
            Just(ScopeOpened::Conflict(reason())),
            Just(ScopeOpened::Transient(reason())),
            proptest::option::of(0u32..6).prop_map(|deferrals| ScopeOpened::Defer {
                reason: reason(),
                deferrals
            }),
        ];
        let pipeline = prop_oneof![
            Just(PipelineResult::Succeeded),
            kind().prop_map(|kind| PipelineResult::Failed {
                kind,
                retry_after: None
            }),
            Just(PipelineResult::Panicked),
            Just(PipelineResult::TimedOut),
            Just(PipelineResult::Deferred),
            Just(PipelineResult::Transient),
        ];
        let cleanup = prop_oneof![Just(CleanupResult::Succeeded), Just(CleanupResult::Failed)];
        let commit = (
            prop_oneof![
                Just(TransactionOutcome::Committed),
                Just(TransactionOutcome::Aborted),
                Just(TransactionOutcome::CommitAmbiguous),
                Just(TransactionOutcome::Fenced),
                Just(TransactionOutcome::Transient),
            ],
            proptest::option::of(0u32..6),
        );
        let handoff = prop_oneof![
            Just(HandoffResult::Confirmed),
            Just(HandoffResult::Returned),
            Just(HandoffResult::Nacked),
            Just(HandoffResult::Failed),
            Just(HandoffResult::TimedOut),
            Just(HandoffResult::Blocked),
            Just(HandoffResult::Refused),
        ];
        let settled = prop_oneof![Just(SettleResult::Written), Just(SettleResult::Refused)];
        (
            arrival,
            opened,
            pipeline,
            cleanup,
            commit,
            handoff,
            settled,
            proptest::collection::vec(proptest::bool::weighted(0.9), 12),
        )
            .prop_map(
                |(arrival, opened, pipeline, cleanup, commit, handoff, settled, authority)| {
                    Script {
                        arrival,
                        opened,
                        pipeline,
                        cleanup,
                        commit,
                        handoff,
                        settled,
                        authority,
                    }
                },
            )
    }

    fn is_requeue(action: &Action) -> bool {
        matches!(action, Action::Requeue { .. })
    }

    /// What the executor did, in order.
    #[derive(Debug, Default)]
    struct Trace {
        actions: Vec<Action>,
        confirmed: bool,
        written: Vec<Action>,
    }

    /// Runs the machine to its end with the script's evidence.
    fn drive(s: &Script, policy: &Policy) -> (Trace, Option<Outcome>) {
        let start = Instant::now();
        let mut d = Delivery::new(s.arrival.clone(), policy, || HELD, start);
        let mut trace = Trace::default();
        let mut authority = s.authority.iter().cycle();
        let mut now = start;
        // A refused handoff is tried every few seconds until `release_held_after`.
        for _ in 0..2000 {
            let auth = if *authority.next().unwrap() {
                Authority::Held
            } else {
                Authority::Lost
            };
            let Some(action) = d.poll_action(|| auth) else {
                break;
            };
            trace.actions.push(action);
            match action {
                Action::OpenScope => d.handle(Input::Scope(s.opened.clone()), auth, now),
                Action::RunHandler => {
                    d.handle(Input::Pipeline(s.pipeline, s.cleanup, None), auth, now)
                }
                Action::Commit => d.handle(
                    Input::Commit(committed(s.commit.0, s.commit.1, None)),
                    auth,
                    now,
                ),
                Action::Abort => d.handle(Input::Aborted, auth, now),
                Action::Hold(delay) | Action::Backoff(delay) => {
                    now += delay;
                    d.handle(Input::Held, HELD, now);
                }
                Action::Publish { .. } => {
                    trace.confirmed = s.handoff == HandoffResult::Confirmed;
                    d.handle(Input::Handoff(s.handoff), auth, now);
                }
                Action::Ack | Action::Requeue { .. } | Action::Reject => {
                    if s.settled == SettleResult::Written {
                        trace.written.push(action);
                    }
                    d.handle(Input::Settled(s.settled), HELD, now);
                }
            }
        }
        assert_eq!(d.poll_action(|| HELD), None, "the machine came to rest");
        (trace, d.outcome())
    }

    proptest! {
        #[test]
        fn every_delivery_ends_and_settles_at_most_once(s in script()) {
            let p = policy();
            let (trace, outcome) = drive(&s, &p);
            prop_assert!(outcome.is_some(), "no outcome after {:?}", trace.actions);
            let settles = trace
                .actions
                .iter()
                .filter(|a| matches!(a, Action::Ack | Action::Requeue { .. } | Action::Reject))
                .count();
            prop_assert!(settles <= 1, "settled {settles} times: {:?}", trace.actions);
        }

        #[test]
        fn every_outcome_rests_on_its_evidence(s in script()) {
            let p = policy();
            let (trace, outcome) = drive(&s, &p);
            let wrote = |a: Action| trace.written.contains(&a);
            match outcome.unwrap() {
                Outcome::Acked => prop_assert!(wrote(Action::Ack) && !trace.confirmed),
                Outcome::Retried
                | Outcome::DeadLettered
                | Outcome::Parked
                | Outcome::Held
                | Outcome::Waited => {
                    prop_assert!(trace.confirmed && wrote(Action::Ack));
                }
                Outcome::Requeued(_) => {
                    let requeue_written = trace.written.iter().any(is_requeue);
                    prop_assert!(requeue_written);
                }
                Outcome::RejectedToDlx => prop_assert!(wrote(Action::Reject)),
                Outcome::Unresolved(Unresolved::HandoffConfirmedAckFailed(_)) => {
                    prop_assert!(trace.confirmed && trace.written.is_empty());
                }
                Outcome::AuthorityLost | Outcome::Unresolved(_) => {
                    prop_assert!(trace.written.is_empty());
                }
            }
        }

        #[test]
        fn a_deferred_requeue_is_held_first_and_within_bounds(s in script()) {
            let p = policy();
            let (trace, outcome) = drive(&s, &p);
            // The longest deferral delay; a failing lane at the requeue limit backs off to a
            // minute.
            let longest = Duration::from_secs(60);
            for action in &trace.actions {
                if let Action::Hold(delay) = action {
                    prop_assert!(*delay <= longest);
                }
            }
            if outcome == Some(Outcome::Requeued(RequeueCause::Deferred)) {
                let held = trace.actions.iter().any(|a| matches!(a, Action::Hold(_)));
                prop_assert!(held, "requeued without a hold: {:?}", trace.actions);
            }
        }

        #[test]
        fn a_message_that_cannot_be_counted_is_requeued_only_after_a_long_hold(s in script()) {
            let p = policy();
            let s = Script {
                arrival: Arrival {
                    local_requeues: None,
                    ..s.arrival
                },
                ..s
            };
            let (trace, _) = drive(&s, &p);
            // Only a release at the limit requeues it, after holding it that long.
            if trace.actions.iter().any(is_requeue) {
                let held: Duration = trace
                    .actions
                    .iter()
                    .filter_map(|a| match a {
                        Action::Hold(delay) => Some(*delay),
                        _ => None,
                    })
                    .sum();
                prop_assert!(held >= p.release_held_after, "{:?}", trace.actions);
            }
        }
    }
}
