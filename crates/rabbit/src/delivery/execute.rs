//! The delivery loop: runs one delivery's machine to its outcome, carrying out each action it
//! asks for and reporting the evidence back. The scope, the hooks and the handler run here, the
//! same for every caller; what reaches the broker goes through [`Effects`]: the consumer's are
//! its channel, its handoff publisher and its ledger, the [`testing`](crate::testing)
//! consumer's a recording stand-in.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lily_mq_core::machine::{Action, Arrival, CopyOf, Delivery as Machine, Input, ScopeOpened};
use lily_mq_core::transport::{
    Authority, BoxedHandler, DeliveryCancel, Handoff, HandoffResult, SettleResult,
};
use lily_mq_core::{
    Begin, DynHook, Lane, Meta, Outcome, Policy, Reason, Resources, Router, TransactionalScope,
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::config::ConsumerConfig;
use crate::delivery::admit::Source;
use crate::delivery::pipeline;

/// What carrying out a delivery's actions takes besides the scope and the handler.
pub(crate) trait Effects {
    /// Whether the delivery's channel still holds the authority to settle it.
    fn authority(&self) -> Authority;

    /// Now, on the clock the machine's budget runs on.
    fn now(&self) -> Instant;

    /// Takes the evidence the machine gathered since the last call (for the ledger).
    fn note(&self, machine: &mut Machine<'_>);

    /// Waits `wait` before the machine goes on: a deferral's hold, or with `backoff` the pause
    /// between two runs of a transaction.
    fn wait(&mut self, wait: Duration, backoff: bool) -> impl Future<Output = ()> + Send;

    /// Publishes the copy `handoff` asks for; `reason` is the machine's.
    fn publish(
        &mut self,
        handoff: Handoff,
        reason: &Reason,
        copy: CopyOf,
        deadline: Duration,
    ) -> impl Future<Output = HandoffResult> + Send;

    /// Writes the ACK, the NACK with requeue or the reject.
    fn settle(&mut self, action: Action) -> impl Future<Output = SettleResult> + Send;

    /// The pipeline took `took`.
    fn handler_ran(&self, took: Duration) {
        let _ = took;
    }

    /// The scope found the message handled already: it is ACKed without the handler.
    fn duplicate_suppressed(&self) {}
}

/// What every delivery of a consumer shares.
pub(crate) struct Setup<'a> {
    pub(crate) policy: &'a Policy,
    pub(crate) scope: Option<&'a dyn TransactionalScope>,
    pub(crate) hooks: &'a [Arc<dyn DynHook>],
    pub(crate) state: &'a Resources,
    pub(crate) handler_timeout: Duration,
    /// Parent of each handler's cancellation token.
    pub(crate) handlers: &'a CancellationToken,
}

impl<'a> Setup<'a> {
    /// What `config`, `router`, `hooks` and `scope` give each delivery; `handlers` is the parent
    /// of each handler's cancellation token.
    pub(crate) fn new(
        config: &'a ConsumerConfig,
        router: &'a Router,
        hooks: &'a [Arc<dyn DynHook>],
        scope: Option<&'a dyn TransactionalScope>,
        handlers: &'a CancellationToken,
    ) -> Self {
        Self {
            policy: &config.policy,
            scope,
            hooks,
            state: router.state(),
            handler_timeout: config.handler_timeout,
            handlers,
        }
    }
}

/// How a delivery ended.
pub(crate) struct Finished {
    pub(crate) outcome: Outcome,
    /// The lane of the confirmed handoff, kept even when the ACK that followed failed.
    pub(crate) confirmed_handoff: Option<Lane>,
    pub(crate) reason: Reason,
    /// Whether its count in the requeue memory can go.
    pub(crate) forgets_requeues: bool,
    /// When it began to settle (its first publish, ACK, NACK or reject), if it did.
    pub(crate) settling_since: Option<Instant>,
}

/// Runs the machine of a delivery that arrived as `arrival` to its outcome.
pub(crate) async fn execute(
    setup: &Setup<'_>,
    arrival: Arrival,
    source: &Source,
    handler: Option<&BoxedHandler>,
    effects: &mut impl Effects,
) -> Finished {
    let budget = setup.policy.settlement_budget;
    let start = effects.now();
    let mut machine = Machine::new(arrival, setup.policy, || effects.authority(), start);
    let mut resources = Resources::new();
    let mut transaction = None;
    // Whether the scope was opened and not yet told the handling ended: it may have recorded
    // that this worker began handling the message, even when its deadline ran out first.
    let mut opened = false;
    // The time of the latest input to the machine; settlement is timed from there.
    let mut last = start;
    let mut settling_since = None;
    loop {
        let action = machine.poll_action(|| effects.authority());
        effects.note(&mut machine);
        let Some(action) = action else { break };
        match action {
            Action::OpenScope => {
                let (Some(scope), Source::Passed(incoming)) = (setup.scope, source) else {
                    unreachable!("the machine opens a scope only for a dispatched delivery")
                };
                let meta = Meta::new(Arc::clone(incoming));
                opened = true;
                let begun = match scope.begin(&meta, budget).await {
                    Begin::Proceed {
                        resources: r,
                        transaction: t,
                        deaths,
                    } => {
                        resources = r;
                        transaction = Some(t);
                        ScopeOpened::Proceed {
                            transaction: true,
                            deaths,
                        }
                    }
                    Begin::Wait { reason, expires_in } => ScopeOpened::Wait { reason, expires_in },
                    Begin::Duplicate => {
                        effects.duplicate_suppressed();
                        ScopeOpened::Duplicate
                    }
                    Begin::Conflict(reason) => ScopeOpened::Conflict(reason),
                    Begin::Defer { reason, deferrals } => ScopeOpened::Defer { reason, deferrals },
                    Begin::Transient(reason) => ScopeOpened::Transient(reason),
                };
                last = effects.now();
                machine.handle(Input::Scope(begun), effects.authority(), last);
            }
            Action::RunHandler => {
                let (Some(handler), Source::Passed(incoming)) = (handler, source) else {
                    unreachable!("the machine runs a handler only for a dispatched delivery")
                };
                let cancel = DeliveryCancel::new(setup.handlers);
                // The machine's last input was just now: the clock is not read again for it.
                let began = last;
                let out = pipeline::run(
                    handler,
                    setup.hooks,
                    incoming,
                    &cancel,
                    &resources,
                    setup.state,
                    setup.handler_timeout,
                )
                .await;
                last = effects.now();
                effects.handler_ran(last.saturating_duration_since(began));
                let authority = effects.authority();
                machine.handle(
                    Input::Pipeline(out.result, out.cleanup, out.reason),
                    authority,
                    last,
                );
            }
            Action::Commit => {
                let committed = match transaction.take() {
                    Some(t) => t.commit(budget).await,
                    None => unreachable!("the machine commits only an open transaction"),
                };
                last = effects.now();
                machine.handle(Input::Commit(committed), effects.authority(), last);
            }
            Action::Abort => {
                // Bounded: a database that stopped answering must not hold the delivery (an
                // abandoned transaction ends on the server's own timeout).
                if let Some(t) = transaction.take()
                    && tokio::time::timeout(budget, t.abort()).await.is_err()
                {
                    warn!("the transaction's abort did not complete within the budget");
                }
                last = effects.now();
                machine.handle(Input::Aborted, effects.authority(), last);
            }
            Action::Backoff(longest) => {
                effects.wait(longest, true).await;
                last = effects.now();
                machine.handle(Input::Held, effects.authority(), last);
            }
            Action::Hold(delay) => {
                effects.wait(delay, false).await;
                last = effects.now();
                machine.handle(Input::Held, effects.authority(), last);
            }
            Action::Publish {
                handoff,
                copy,
                deadline,
            } => {
                settling_since.get_or_insert(last);
                let reason = machine.reason().clone();
                let result = effects.publish(handoff, &reason, copy, deadline).await;
                match result {
                    HandoffResult::Confirmed => {}
                    // Named once, with the permission, when the refusal starts; every try of
                    // every held delivery would repeat it every few seconds.
                    HandoffResult::Refused => {
                        debug!(handoff = ?handoff.lane, ?result, "handoff failed");
                    }
                    _ => warn!(handoff = ?handoff.lane, ?result, "handoff failed"),
                }
                last = effects.now();
                machine.handle(Input::Handoff(result), effects.authority(), last);
            }
            Action::Ack | Action::Requeue { .. } | Action::Reject => {
                settling_since.get_or_insert(last);
                // A requeued delivery can come back at once, to any worker, and its next
                // handling would count this one's mark as a death: the mark goes first.
                if let (Action::Requeue { .. }, true, Some(scope), Source::Passed(incoming)) =
                    (&action, opened, setup.scope, source)
                {
                    opened = false;
                    let meta = Meta::new(Arc::clone(incoming));
                    scope.ended(&meta, true, budget).await;
                }
                let result = effects.settle(action).await;
                machine.handle(Input::Settled(result), effects.authority(), last);
            }
        }
    }
    let outcome = machine.outcome().unwrap_or(Outcome::AuthorityLost);
    if let (true, Some(scope), Source::Passed(incoming)) = (opened, setup.scope, source) {
        // Ended in a settlement, the handling this worker began is no death.
        let settled = !matches!(outcome, Outcome::AuthorityLost | Outcome::Unresolved(_));
        let meta = Meta::new(Arc::clone(incoming));
        scope.ended(&meta, settled, budget).await;
    }
    Finished {
        outcome,
        confirmed_handoff: machine.confirmed_handoff(),
        reason: machine.reason().clone(),
        forgets_requeues: machine.forgets_requeues(),
        settling_since,
    }
}
