//! One delivery: gate, dispatch, pipeline, decision and settlement.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use lapin::message::Delivery;
use lily_mq_core::{
    Action, Authority, Begin, BoxedHandler, CleanupResult, DeliveryCancel, EntryId, Evidence,
    GateRejection, Handoff, HandoffResult, Identity, Incoming, IncomingParts, Lane, Meta, Outcome,
    PipelineResult, Plan, PropertiesView, QueueHandlerError, Reason, RequeueCause, Resources,
    SettleResult, Settlement, Situation, TransactionOutcome, as_u32, decide, decide_at_gate,
    headers, inspect, is_token,
};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::consumer::{Shared, lock};
use crate::handoff::{FailureNote, copy_properties, destination, sanitized_properties};
use crate::pipeline;
use crate::session::Session;

const REQUEUE_MEMORY: usize = 10_000;

/// Settles one delivery. At shutdown's abort the work is dropped wherever it is, and its ledger
/// entry stays open and is reported as aborted. There is one exception: a delivery whose ACK is
/// marked ready is let finish, because its frame may be written already. That takes one more poll,
/// since its yield is spent and the rest of its work is synchronous (see [`Session::ack`]).
pub(crate) async fn handle(shared: &Arc<Shared>, session: Arc<Session>, delivery: Delivery) {
    shared.metrics.in_flight.increment(1.0);
    let acking = AtomicBool::new(false);
    // Pinned here, in place: moving the large future into `until_abort` would make this task's
    // state hold it twice.
    let work = std::pin::pin!(settle_delivery(shared, session, delivery, &acking));
    until_abort(work, &shared.abort, &acking).await;
    shared.metrics.in_flight.decrement(1.0);
}

/// Runs `work` until it ends or `abort` fires, and then drops it unless `finishing` is set.
async fn until_abort(
    mut work: std::pin::Pin<&mut impl Future<Output = ()>>,
    abort: &CancellationToken,
    finishing: &AtomicBool,
) {
    // The work is polled first, so work that ends on its first poll never registers a waiter
    // for the abort signal.
    tokio::select! {
        biased;
        () = &mut work => {}
        () = abort.cancelled() => {
            if finishing.load(Ordering::Acquire) {
                work.await;
            }
        }
    }
}

async fn settle_delivery(
    shared: &Arc<Shared>,
    session: Arc<Session>,
    delivery: Delivery,
    acking: &AtomicBool,
) {
    let Delivery {
        delivery_tag,
        exchange,
        routing_key,
        redelivered,
        properties,
        data,
        // Settled on the session's channel instead: see `Session::settle`.
        acker: _,
    } = delivery;
    let view = PropertiesView {
        message_id: properties.message_id().as_ref().map(|s| s.as_str()),
        kind: properties.kind().as_ref().map(|s| s.as_str()),
        content_type: properties.content_type().as_ref().map(|s| s.as_str()),
        headers: properties.headers().as_ref(),
    };
    let limits = &shared.config.limits;
    let gate = match inspect(&view, data.len(), limits) {
        Ok(env) => Gate::Passed {
            attempt: env.attempt,
            schema_version: env.schema_version,
            delivery_count: env.delivery_count,
            route: shared
                .router
                .dispatch(env.kind, env.schema_version, env.content_type)
                .cloned(),
        },
        Err(rejection) => Gate::Refused(rejection),
    };
    let attempt = match &gate {
        Gate::Passed { attempt, .. } => *attempt,
        Gate::Refused(_) => 1,
    };
    // The gate already validated the id of a delivery it passed; a refused one is checked here.
    let message_id = match &gate {
        Gate::Passed { .. } => view.message_id,
        Gate::Refused(_) => view
            .message_id
            .filter(|id| is_token(id, limits.max_message_id_len)),
    };
    let identity = Identity {
        queue: Arc::clone(&shared.queue),
        message_id: message_id.map(Box::from),
        delivery_tag,
        attempt,
        redelivered,
    };
    let span = info_span!(
        "delivery",
        queue = %shared.queue,
        message_id = message_id.unwrap_or("-"),
        attempt,
        delivery_tag,
        outcome = tracing::field::Empty,
    );
    let evidence = match &gate {
        Gate::Passed { route: Ok(_), .. } => Evidence::Dispatched,
        _ => Evidence::Received,
    };
    let entry = lock(&shared.ledger).open_at(identity, evidence);
    let work = Work {
        shared,
        session: &session,
        delivery_tag,
        entry,
        span: span.clone(),
        acking,
    };
    match gate {
        Gate::Refused(rejection) => {
            let copy = Copy::Sanitized {
                body: &data,
                properties: &properties,
                exchange: exchange.as_str(),
                routing_key: routing_key.as_str(),
            };
            let delivery_count = properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get(headers::DELIVERY_COUNT))
                .and_then(as_u32);
            Box::pin(
                work.refuse(rejection, copy, message_id, delivery_count, redelivered)
                    .instrument(span),
            )
            .await;
        }
        Gate::Passed {
            schema_version,
            delivery_count,
            route,
            ..
        } => {
            let incoming = Arc::new(Incoming::from_parts(IncomingParts {
                body: data,
                properties,
                exchange,
                routing_key,
                queue: Arc::clone(&shared.queue),
                delivery_tag,
                redelivered,
                attempt,
                schema_version,
            }));
            work.process(incoming, delivery_count, route, redelivered)
                .instrument(span)
                .await;
        }
    }
}

/// What the scope and the pipeline produced, for the decision table.
struct Scoped {
    pipeline: PipelineResult,
    cleanup: CleanupResult,
    transaction: TransactionOutcome,
    reason: Option<Reason>,
    deferrals: Option<u32>,
}

impl Scoped {
    /// Decided before the handler ran.
    fn decided(pipeline: PipelineResult, reason: Reason) -> Self {
        Self {
            pipeline,
            cleanup: CleanupResult::Succeeded,
            transaction: TransactionOutcome::NotRequired,
            reason: Some(reason),
            deferrals: None,
        }
    }
}

/// What the gate and dispatch made of a delivery.
enum Gate {
    Refused(GateRejection),
    Passed {
        attempt: u32,
        schema_version: u32,
        delivery_count: Option<u32>,
        route: Result<BoxedHandler, QueueHandlerError>,
    },
}

struct Work<'a> {
    shared: &'a Arc<Shared>,
    session: &'a Arc<Session>,
    delivery_tag: u64,
    entry: EntryId,
    /// The delivery's span (disabled, and free, when nothing listens).
    span: tracing::Span,
    /// Set once the ACK is about to be marked ready: from then on, an abort lets the work finish.
    acking: &'a AtomicBool,
}

/// The copy a handoff publishes.
enum Copy<'a> {
    Original(&'a Incoming),
    Sanitized {
        body: &'a [u8],
        properties: &'a BasicProperties,
        exchange: &'a str,
        routing_key: &'a str,
    },
}

impl Work<'_> {
    fn note(&self, evidence: Evidence) {
        lock(&self.shared.ledger).note(self.entry, evidence);
    }

    fn authority(&self) -> Authority {
        if self.session.consuming_open() && !self.shared.revoked.is_cancelled() {
            Authority::Held
        } else {
            Authority::Lost
        }
    }

    /// Settles a delivery the gate refused: a reject to the DLX (oversized) or a dead-letter
    /// handoff carrying only sanitized metadata.
    async fn refuse(
        self,
        rejection: GateRejection,
        copy: Copy<'_>,
        message_id: Option<&str>,
        delivery_count: Option<u32>,
        redelivered: bool,
    ) {
        let limits = &self.shared.config.limits;
        let plan = decide_at_gate(&rejection);
        let reason = match rejection {
            GateRejection::Oversized { len } => Reason::new(format!(
                "body of {len} bytes is over the {} byte limit",
                limits.max_body_bytes
            )),
            GateRejection::Invalid(reason) => reason,
        };
        // Without a valid id the message cannot be counted across requeues: no requeue.
        let requeues = match message_id {
            Some(id) => self.local_requeues(id).max(delivery_count.unwrap_or(0)),
            None => self.shared.config.policy.max_requeues,
        };
        let (outcome, lane) = self.settle(plan, requeues, &reason, copy, message_id).await;
        if let (Some(id), true) = (message_id, redelivered) {
            self.forget_requeues(id, outcome);
        }
        self.finish(outcome, lane, &reason);
    }

    async fn process(
        self,
        incoming: Arc<Incoming>,
        delivery_count: Option<u32>,
        route: Result<BoxedHandler, QueueHandlerError>,
        redelivered: bool,
    ) {
        let scoped = match route {
            Err(err) => Scoped::decided(PipelineResult::NotDispatched, err.reason().clone()),
            Ok(handler) => self.run_scoped(&handler, &incoming).await,
        };
        let Scoped {
            pipeline,
            cleanup,
            transaction,
            reason,
            deferrals,
        } = scoped;
        let local = if redelivered {
            self.local_requeues(incoming.message_id())
        } else {
            0
        };
        let requeues = delivery_count
            .unwrap_or(0)
            .max(local)
            .max(deferrals.unwrap_or(0));
        let situation = Situation {
            pipeline,
            cleanup,
            transaction,
            attempt: incoming.attempt(),
            requeues,
            authority: self.authority(),
        };
        let plan = decide(&situation, &self.shared.config.policy);
        if plan == Plan::Requeue(RequeueCause::Deferred) {
            // Give what the deferral waits for time to change; shutdown cuts the wait short.
            let delay = self.shared.config.policy.deferral_delay(requeues);
            let wait = Box::pin(tokio::time::sleep(delay));
            tokio::select! {
                () = wait => {}
                () = self.shared.handlers_cancel.cancelled() => {}
            }
        }
        let reason = reason.unwrap_or_else(|| Reason::new("ok"));
        let (outcome, lane) = self
            .settle(
                plan,
                requeues,
                &reason,
                Copy::Original(&incoming),
                Some(incoming.message_id()),
            )
            .await;
        if redelivered {
            self.forget_requeues(incoming.message_id(), outcome);
        }
        self.finish(outcome, lane, &reason);
    }

    /// Opens the transactional scope (if any), runs the pipeline inside it, then commits when
    /// the handler and cleanup succeeded and aborts otherwise.
    async fn run_scoped(&self, handler: &BoxedHandler, incoming: &Arc<Incoming>) -> Scoped {
        let budget = self.shared.config.policy.settlement_budget;
        let (resources, transaction) = match &self.shared.scope {
            None => (Resources::new(), None),
            Some(scope) => match scope.begin(&Meta::new(Arc::clone(incoming)), budget).await {
                Begin::Proceed {
                    resources,
                    transaction,
                } => (resources, Some(transaction)),
                Begin::Duplicate => {
                    lock(&self.shared.ledger).count_duplicate();
                    return Scoped::decided(
                        PipelineResult::Duplicate,
                        Reason::new("duplicate suppressed by the inbox"),
                    );
                }
                Begin::Conflict(reason) => {
                    return Scoped::decided(PipelineResult::Conflict, reason);
                }
                Begin::Defer { reason, deferrals } => {
                    let mut scoped = Scoped::decided(PipelineResult::Deferred, reason);
                    scoped.deferrals = deferrals;
                    return scoped;
                }
            },
        };
        let cancel = DeliveryCancel::new(&self.shared.handlers_cancel);
        let started = Instant::now();
        let out = pipeline::run(
            handler,
            &self.shared.hooks,
            incoming,
            &cancel,
            &resources,
            self.shared.config.handler_timeout,
        )
        .await;
        let ended = Instant::now();
        self.shared
            .metrics
            .handler_duration
            .record((ended - started).as_secs_f64());
        self.note(Evidence::HandlerReturned);
        let mut scoped = Scoped {
            pipeline: out.result,
            cleanup: out.cleanup,
            transaction: TransactionOutcome::NotRequired,
            reason: out.reason,
            deferrals: None,
        };
        if let Some(transaction) = transaction {
            if (out.result, out.cleanup) == (PipelineResult::Succeeded, CleanupResult::Succeeded) {
                let committed = transaction.commit(budget).await;
                scoped.transaction = committed.outcome;
                scoped.deferrals = committed.deferrals;
                if committed.reason.is_some() {
                    scoped.reason = committed.reason;
                }
            } else {
                transaction.abort().await;
                scoped.transaction = TransactionOutcome::Aborted;
            }
        }
        scoped
    }

    /// Carries `plan` out. `requeue_key` names the message in the classic-queue requeue count.
    async fn settle(
        &self,
        plan: Plan,
        requeues: u32,
        reason: &Reason,
        copy: Copy<'_>,
        requeue_key: Option<&str>,
    ) -> (Outcome, Option<Lane>) {
        let started = Instant::now();
        match plan {
            Plan::Abandon => self.note(Evidence::AuthorityLost),
            Plan::Ack => {} // the ACK follows at once; its outcome closes the entry
            _ => self.note(Evidence::Planned),
        }
        let policy = &self.shared.config.policy;
        let mut settlement = Settlement::start(plan, requeues, policy, started);
        while let Some(action) = settlement.poll_action() {
            match action {
                Action::Publish { handoff, deadline } => {
                    let result = if self.authority() == Authority::Lost {
                        self.note(Evidence::AuthorityLost);
                        HandoffResult::Failed
                    } else {
                        self.note(Evidence::HandoffPublished);
                        // Boxed: the publish future is large and most deliveries never
                        // hand off; keeping it inline would grow every delivery's task.
                        let result = Box::pin(self.publish(handoff, reason, &copy, deadline)).await;
                        if result == HandoffResult::Confirmed {
                            self.note(Evidence::HandoffConfirmed);
                        } else {
                            self.note(Evidence::HandoffFailed);
                            warn!(handoff = ?handoff.lane, ?result, "handoff failed");
                        }
                        result
                    };
                    settlement.handle_handoff(result, self.authority(), Instant::now());
                }
                Action::Ack | Action::Requeue | Action::Reject => {
                    if let (Action::Requeue, Some(key)) = (action, requeue_key) {
                        // Counted before the NACK is written: the redelivery can arrive before
                        // this task runs again.
                        self.count_requeue(key);
                    }
                    let result = self.write(action).await;
                    // A written frame closes the entry right after; a refused one is recorded.
                    if result == SettleResult::Refused {
                        self.note(Evidence::AuthorityLost);
                    }
                    settlement.handle_settled(result);
                }
            }
        }
        let outcome = settlement.outcome().unwrap_or(Outcome::AuthorityLost);
        self.shared
            .metrics
            .settlement_latency
            .record(started.elapsed().as_secs_f64());
        (outcome, settlement.confirmed_handoff())
    }

    async fn publish(
        &self,
        handoff: Handoff,
        reason: &Reason,
        copy: &Copy<'_>,
        deadline: Duration,
    ) -> HandoffResult {
        let Some(queue) = destination(&self.shared.topology, handoff.lane) else {
            return HandoffResult::Failed;
        };
        let reason = Reason::new(format!("{}: {reason}", handoff.cause.as_str()));
        let publisher = &self.shared.publisher;
        let id = publisher.next_id();
        let note = FailureNote {
            lane: handoff.lane,
            kind: handoff.kind.map_or("rejected", |k| k.as_str()),
            reason: &reason,
            source_queue: &self.shared.queue,
            id,
        };
        let (body, properties) = match copy {
            Copy::Original(incoming) => (incoming.body(), copy_properties(incoming, &note)),
            Copy::Sanitized {
                body,
                properties,
                exchange,
                routing_key,
            } => (
                *body,
                sanitized_properties(
                    properties,
                    exchange,
                    routing_key,
                    &note,
                    &self.shared.config.limits,
                ),
            ),
        };
        publisher
            .publish(&queue, id, body, properties, deadline)
            .await
    }

    /// Queues the ACK, NACK or reject on the delivery's channel; see [`Session::ack`] and
    /// [`Session::settle`]. Refused at once when authority is revoked.
    async fn write(&self, action: Action) -> SettleResult {
        if self.shared.revoked.is_cancelled() {
            return SettleResult::Refused;
        }
        match action {
            Action::Ack => {
                self.acking.store(true, Ordering::Release);
                self.session
                    .ack(self.delivery_tag, &self.shared.revoked)
                    .await
            }
            _ => self.session.settle(self.delivery_tag, action),
        }
    }

    fn local_requeues(&self, message_id: &str) -> u32 {
        lock(&self.shared.requeues)
            .get(message_id)
            .copied()
            .unwrap_or(0)
    }

    fn count_requeue(&self, message_id: &str) {
        let mut counts = lock(&self.shared.requeues);
        if counts.len() >= REQUEUE_MEMORY && !counts.contains_key(message_id) {
            let evict = counts.keys().next().cloned();
            if let Some(key) = evict {
                counts.remove(&key);
            }
        }
        *counts.entry(message_id.into()).or_insert(0) += 1;
    }

    /// Drops the requeue count of a message that left the queue for good.
    fn forget_requeues(&self, message_id: &str, outcome: Outcome) {
        if !matches!(outcome, Outcome::Requeued(_)) {
            lock(&self.shared.requeues).remove(message_id);
        }
    }

    fn finish(&self, outcome: Outcome, lane: Option<Lane>, reason: &Reason) {
        self.span.record("outcome", tracing::field::debug(&outcome));
        match outcome {
            Outcome::Acked => debug!("settled"),
            Outcome::Unresolved(_) | Outcome::AuthorityLost => {
                warn!(?outcome, reason = %reason, "settlement unresolved");
            }
            _ => info!(?outcome, reason = %reason, "settled"),
        }
        self.shared.metrics.count(outcome);
        let mut ledger = lock(&self.shared.ledger);
        match outcome {
            Outcome::Acked | Outcome::Retried | Outcome::DeadLettered | Outcome::Parked => {
                let handoff = lane
                    .and_then(|lane| destination(&self.shared.topology, lane))
                    .map(String::into_boxed_str);
                ledger.close_acked(self.entry, outcome, self.session.id, handoff);
            }
            _ => ledger.close(self.entry, outcome, || match outcome {
                Outcome::Unresolved(u) => Reason::new(format!("{u:?}: {reason}")),
                Outcome::AuthorityLost => Reason::new("authority lost; the broker will redeliver"),
                _ => reason.clone(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Work that marks itself finishing and then yields once, as an ACK does.
    async fn ack_like(finishing: &AtomicBool, ended: &AtomicBool) {
        finishing.store(true, Ordering::Release);
        tokio::task::yield_now().await;
        ended.store(true, Ordering::Release);
    }

    #[tokio::test]
    async fn an_abort_lets_work_that_is_finishing_end() {
        let abort = CancellationToken::new();
        abort.cancel();
        let (finishing, ended) = (AtomicBool::new(false), AtomicBool::new(false));
        let work = std::pin::pin!(ack_like(&finishing, &ended));
        until_abort(work, &abort, &finishing).await;
        assert!(ended.load(Ordering::Acquire));
    }

    #[tokio::test]
    async fn an_abort_drops_other_work_where_it_is() {
        let abort = CancellationToken::new();
        abort.cancel();
        let (finishing, ended) = (AtomicBool::new(false), AtomicBool::new(false));
        let work = async {
            tokio::task::yield_now().await;
            ended.store(true, Ordering::Release);
        };
        until_abort(std::pin::pin!(work), &abort, &finishing).await;
        assert!(!ended.load(Ordering::Acquire));
    }
}
