//! One delivery: gate, dispatch, pipeline, decision and settlement.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use lapin::message::Delivery;
use lily_mq_core::machine::{Action, Arrival, CopyOf, Delivery as Machine, Verdict};
use lily_mq_core::transport::{
    Authority, BoxedHandler, EntryId, Evidence, Handoff, HandoffResult, Identity, SettleResult,
};
use lily_mq_core::{Outcome, Reason};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::admit::{Admitted, CopyFacts, Raw, Source, admit, epoch_millis};
use crate::execute::{Effects, Finished, Setup, execute};
use crate::handoff::destination;
use crate::service::Shared;
use crate::session::{Session, Settler};
use crate::sync::lock;

/// The whole work of one delivery of `session`, which the consume loop polls first and a crew
/// worker finishes if need be (see [`crate::inline`], which boxes it).
///
/// The gate, dispatch and the delivery's ledger entry come first, here: the work holds what
/// they made of the delivery instead of the delivery itself, which keeps it small (it is
/// written into its box for every delivery), and work dropped before its first poll is
/// still in the ledger, so it is reported.
///
/// A panic in that first part is a bug in Lily, as one outside the handler's guard is when the
/// work is polled (see [`crate::inline`]): it is logged, the consume loop goes on, and there is
/// no work. The delivery stays unsettled, and the broker delivers it again once the channel
/// closes.
pub(crate) fn work(
    shared: &Arc<Shared>,
    session: &Arc<Session>,
    delivery: Delivery,
) -> Option<impl Future<Output = ()> + Send + 'static> {
    let arrived = match catch_unwind(AssertUnwindSafe(|| arrive(shared, session, delivery))) {
        Ok(arrived) => arrived,
        Err(_) => {
            error!(
                "a delivery panicked at the gate, outside its handler's guard; it stays unsettled"
            );
            return None;
        }
    };
    Some(handle(Arc::clone(shared), Arc::clone(session), arrived))
}

/// A delivery past the gate and dispatch, its ledger entry open.
struct Arrived {
    arrival: Arrival,
    source: Source,
    handler: Option<BoxedHandler>,
    entry: EntryId,
    delivery_tag: u64,
    span: tracing::Span,
}

/// Runs the gate and dispatch over `delivery` and opens its ledger entry.
fn arrive(shared: &Shared, session: &Session, delivery: Delivery) -> Arrived {
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
    let raw = Raw {
        body: data,
        properties,
        exchange,
        routing_key,
        delivery_tag,
        redelivered,
        not_utf8: session.not_utf8(delivery_tag),
    };
    let limits = &shared.config.limits;
    let scoped = shared.scope.is_some();
    let Admitted {
        mut arrival,
        source,
        handler,
    } = admit(
        raw,
        &shared.router,
        limits,
        &shared.queue,
        scoped,
        &shared.config.header_key,
    );
    let valid_id = source.message_id(limits);
    let identity = Identity {
        queue: Arc::clone(&shared.queue),
        message_id: valid_id.map(Box::from),
        delivery_tag,
        attempt: arrival.attempt,
        redelivered,
    };
    let span = info_span!(
        "delivery",
        queue = %shared.queue,
        message_id = valid_id.unwrap_or("-"),
        attempt = arrival.attempt,
        delivery_tag,
        outcome = tracing::field::Empty,
    );
    crate::trace::adopt(&span, source.properties().headers().as_ref());
    let evidence = match arrival.verdict {
        Verdict::Dispatched => Evidence::Dispatched,
        _ => Evidence::Received,
    };
    let entry = lock(&shared.books.ledger).open_at(identity, evidence);
    // Only a redelivery can have been requeued.
    if let (true, Some(id)) = (redelivered, valid_id) {
        arrival.local_requeues = Some(lock(&shared.books.requeues).get(id));
    }
    Arrived {
        arrival,
        source,
        handler,
        entry,
        delivery_tag,
        span,
    }
}

/// Settles one delivery. At shutdown's abort the work is dropped wherever it is, and its ledger
/// entry stays open and is reported as aborted. There is one exception: a delivery whose ACK is
/// marked ready is let finish, because its frame may be written already. That takes at most the
/// ACK hold (5–6 ms while the queue holds a backlog, 2–3 ms otherwise) and a few polls, and the
/// rest of its work is synchronous (see [`Session::ack`]).
///
/// This and [`settle`] return `async` blocks rather than being `async fn`s: an `async fn`
/// keeps its arguments twice in its future, once as passed and once as its own variables.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps its arguments twice"
)]
fn handle(
    shared: Arc<Shared>,
    session: Arc<Session>,
    arrived: Arrived,
) -> impl Future<Output = ()> + Send {
    async move {
        shared.metrics.in_flight.increment(1.0);
        let acking = AtomicBool::new(false);
        // Pinned here, in place: moving the large future into `until_abort` would make this
        // task's state hold it twice.
        let work = std::pin::pin!(settle(&shared, session, arrived, &acking));
        until_abort(work, &shared.signals.abort, &acking).await;
        shared.metrics.in_flight.decrement(1.0);
    }
}

/// Runs `work` until it ends or `abort` fires, and then drops it unless `finishing` is set.
async fn until_abort(
    mut work: std::pin::Pin<&mut impl Future<Output = ()>>,
    abort: &CancellationToken,
    finishing: &AtomicBool,
) {
    // The work is polled first, so work that ends on its first poll never registers a waiter
    // for the abort signal, and neither does work that is finishing: the abort lets it end.
    let mut aborted = std::pin::pin!(abort.cancelled());
    std::future::poll_fn(|cx| {
        if work.as_mut().poll(cx).is_ready() {
            return Poll::Ready(());
        }
        if finishing.load(Ordering::Acquire) {
            // Its own wake-up brings it back.
            return Poll::Pending;
        }
        // Once the abort fires, the work is dropped where it is.
        aborted.as_mut().poll(cx)
    })
    .await;
}

/// Runs the delivery's machine to its outcome and records it.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps its arguments twice"
)]
fn settle<'a>(
    shared: &'a Arc<Shared>,
    session: Arc<Session>,
    arrived: Arrived,
    acking: &'a AtomicBool,
) -> impl Future<Output = ()> + Send + 'a {
    async move {
        let setup = Setup::new(
            &shared.config,
            &shared.router,
            &shared.hooks,
            shared.scope.as_deref(),
            &shared.signals.handlers,
        );
        let settler = session.settler(
            arrived.delivery_tag,
            &shared.publisher,
            &shared.signals.revoked,
        );
        let source = &arrived.source;
        let mut work = Work {
            shared,
            settler,
            entry: arrived.entry,
            message_id: source.message_id(&shared.config.limits),
            source,
            acking,
        };
        let span = &arrived.span;
        // Pinned in place: instrumenting the future itself would move it into the wrapper.
        let run = std::pin::pin!(async {
            let handler = arrived.handler.as_ref();
            let finished = execute(&setup, arrived.arrival, source, handler, &mut work).await;
            work.finish(&finished, span);
        });
        run.instrument(span.clone()).await;
    }
}

struct Work<'a> {
    shared: &'a Arc<Shared>,
    settler: Settler<'a>,
    entry: EntryId,
    /// The valid message id, if any: the key of its requeue count.
    message_id: Option<&'a str>,
    /// The message, for its copies.
    source: &'a Source,
    /// Set once the ACK is about to be marked ready: from then on, an abort lets the work finish.
    acking: &'a AtomicBool,
}

impl Effects for Work<'_> {
    fn authority(&self) -> Authority {
        self.settler.authority()
    }

    fn now(&self) -> Instant {
        Instant::now()
    }

    /// Records the machine's evidence in the ledger, under one lock.
    fn note(&self, machine: &mut Machine<'_>) {
        let mut ledger = None;
        while let Some(evidence) = machine.poll_evidence() {
            ledger
                .get_or_insert_with(|| lock(&self.shared.books.ledger))
                .note(self.entry, evidence);
        }
    }

    async fn wait(&mut self, wait: Duration, backoff: bool) {
        if backoff {
            // A random part of it, at least half: transactions that conflicted must not meet
            // again in step.
            tokio::time::sleep(jittered(wait)).await;
        } else {
            // Give what the deferral waits for time to change; shutdown cuts it short.
            let wait = Box::pin(tokio::time::sleep(wait));
            tokio::select! {
                () = wait => {}
                () = self.shared.signals.handlers.cancelled() => {}
            }
        }
    }

    fn publish(
        &mut self,
        handoff: Handoff,
        reason: &Reason,
        copy: CopyOf,
        deadline: Duration,
    ) -> impl Future<Output = HandoffResult> + Send {
        // Boxed: the publish future is large and most deliveries never hand off; keeping it
        // inline would grow every delivery's task.
        Box::pin(self.hand_off(handoff, reason.clone(), copy, deadline))
    }

    /// Queues the ACK, NACK or reject on the delivery's channel; see [`Settler`].
    async fn settle(&mut self, action: Action) -> SettleResult {
        match action {
            Action::Ack => {
                self.acking.store(true, Ordering::Release);
                self.settler.ack().await
            }
            Action::Requeue { counted } => {
                if let (true, Some(id)) = (counted, self.message_id) {
                    // Counted before the NACK is written: the redelivery can arrive before
                    // this task runs again.
                    lock(&self.shared.books.requeues).count(id);
                }
                self.settler.requeue()
            }
            _ => self.settler.reject(),
        }
    }

    fn handler_ran(&self, took: Duration) {
        self.shared
            .metrics
            .handler_duration
            .record(took.as_secs_f64());
    }

    fn duplicate_suppressed(&self) {
        lock(&self.shared.books.ledger).count_duplicate();
    }
}

impl Work<'_> {
    async fn hand_off(
        &self,
        handoff: Handoff,
        reason: Reason,
        copy: CopyOf,
        deadline: Duration,
    ) -> HandoffResult {
        let Some(queue) = destination(&self.shared.topology, handoff.lane) else {
            return HandoffResult::Failed;
        };
        let facts = CopyFacts {
            source_queue: &self.shared.queue,
            id: self.settler.next_handoff_id(),
            at_millis: epoch_millis(),
            limits: &self.shared.config.limits,
            key: &self.shared.config.header_key,
        };
        let (body, properties) = self.source.copy(handoff, &reason, copy, &facts);
        // From the copy built to its verdict: how long the broker took to confirm it.
        let span = info_span!("handoff", to = %queue, result = tracing::field::Empty);
        let result = self
            .settler
            .publish(&queue, facts.id, body, properties, deadline)
            .instrument(span.clone())
            .await;
        span.record("result", tracing::field::debug(result));
        result
    }

    /// Records the outcome: span, log, metrics, settlement latency, requeue memory, ledger.
    fn finish(&self, finished: &Finished, span: &tracing::Span) {
        let Finished {
            outcome,
            confirmed_handoff: lane,
            ref reason,
            forgets_requeues,
            settling_since,
        } = *finished;
        if let Some(since) = settling_since {
            self.shared
                .metrics
                .settlement_latency
                .record(since.elapsed().as_secs_f64());
        }
        if let (true, Some(id)) = (forgets_requeues, self.message_id) {
            lock(&self.shared.books.requeues).forget(id);
        }
        span.record("outcome", tracing::field::debug(&outcome));
        match outcome {
            Outcome::Acked => debug!("settled"),
            Outcome::Unresolved(_) | Outcome::AuthorityLost => {
                warn!(?outcome, reason = %reason, "settlement unresolved");
            }
            _ => info!(?outcome, reason = %reason, "settled"),
        }
        self.shared.metrics.count(outcome);
        let mut ledger = lock(&self.shared.books.ledger);
        match outcome {
            Outcome::Acked
            | Outcome::Retried
            | Outcome::DeadLettered
            | Outcome::Parked
            | Outcome::Held => {
                let handoff = lane
                    .and_then(|lane| destination(&self.shared.topology, lane))
                    .map(String::into_boxed_str);
                ledger.close_acked(self.entry, outcome, self.settler.session_id(), handoff);
            }
            _ => ledger.close(self.entry, outcome, || match outcome {
                Outcome::Unresolved(u) => Reason::new(format!("{u:?}: {reason}")),
                Outcome::AuthorityLost => Reason::new("authority lost; the broker will redeliver"),
                _ => reason.clone(),
            }),
        }
    }
}

/// Between half of `longest` and all of it, at random.
fn jittered(longest: Duration) -> Duration {
    use std::hash::{BuildHasher, RandomState};
    // A fresh random hash of the clock: good enough to spread a few retries apart.
    let random = RandomState::new().hash_one(Instant::now());
    let half = longest / 2;
    half + half.mul_f64((random % 1024) as f64 / 1024.0)
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
