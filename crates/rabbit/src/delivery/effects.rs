//! What the settlement machine asks of one delivery ([`Effects`]), carried out: the settle
//! frames through the delivery's [`Settler`], its copies through the handoff publisher, waits,
//! and the records in the ledger, the requeue memory and the metrics.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lily_mq_core::machine::{Action, CopyOf, Delivery as Machine};
use lily_mq_core::transport::{Authority, EntryId, Handoff, HandoffResult, SettleResult};
use lily_mq_core::{Outcome, Reason};
use tracing::{Instrument, debug, info, info_span, warn};

use super::admit::{CopyFacts, Source, epoch_millis};
use super::execute::{Effects, Finished};
use crate::channel::Settler;
use crate::copy::handoff::destination;
use crate::service::Shared;
use crate::sync::lock;

/// What the settlement machine asks of one delivery, carried out on the broker and in the books.
pub(super) struct Work<'a> {
    pub(super) shared: &'a Arc<Shared>,
    pub(super) settler: Settler<'a>,
    pub(super) entry: EntryId,
    /// The valid message id, if any: the key of its requeue count.
    pub(super) message_id: Option<&'a str>,
    /// The message, for its copies.
    pub(super) source: &'a Source,
    /// Set once the ACK is about to be marked ready: from then on, an abort lets the work finish.
    pub(super) acking: &'a AtomicBool,
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

    /// Queues the ACK, NACK or reject on the delivery's channel; see [`Settler::apply`].
    async fn settle(&mut self, action: Action) -> SettleResult {
        match action {
            Action::Ack => self.acking.store(true, Ordering::Release),
            Action::Requeue { counted: true } => {
                if let Some(id) = self.message_id {
                    // Counted before the NACK is written: the redelivery can arrive before
                    // this task runs again.
                    lock(&self.shared.books.requeues).count(id);
                }
            }
            _ => {}
        }
        self.settler.apply(action).await
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
    pub(super) fn finish(&self, finished: &Finished, span: &tracing::Span) {
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
