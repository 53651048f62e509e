//! What the sessions and delivery tasks share: the service's fixed setup, its books and its
//! shutdown signals, and the metrics it reports.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lily_mq_core::machine::RequeueMemory;
use lily_mq_core::transport::Ledger;
use lily_mq_core::{DynHook, Incidents, Outcome, Router, TransactionalScope};
use metrics::{Counter, Gauge, Histogram};
use tokio_util::sync::CancellationToken;

use crate::config::ConsumerConfig;
use crate::connect::Dialer;
use crate::copy::handoff::HandoffPublisher;
use crate::topology::Topology;

/// Everything the sessions and delivery tasks share: the service's fixed setup, its books, its
/// shutdown signals.
pub(crate) struct Shared {
    /// Dials the consuming connection.
    pub(crate) dialer: Dialer,
    pub(crate) publisher: Arc<HandoffPublisher>,
    pub(crate) config: ConsumerConfig,
    pub(crate) router: Router,
    pub(crate) hooks: Vec<Arc<dyn DynHook>>,
    pub(crate) scope: Option<Arc<dyn TransactionalScope>>,
    pub(crate) topology: Topology,
    pub(crate) queue: Arc<str>,
    pub(crate) books: Books,
    pub(crate) signals: Signals,
    pub(crate) ready: Arc<AtomicBool>,
    pub(crate) sessions: AtomicU64,
    pub(crate) metrics: Metrics,
}

/// What the consumer records: the evidence ledger, the requeue memory and the connection's
/// incidents.
pub(crate) struct Books {
    pub(crate) ledger: Arc<Mutex<Ledger>>,
    pub(crate) requeues: Mutex<RequeueMemory>,
    pub(crate) incidents: Mutex<Incidents>,
}

/// The shutdown signals.
pub(crate) struct Signals {
    /// Set when aborting starts: nothing is sent for any delivery after it.
    pub(crate) revoked: Revoked,
    /// Parent of every handler's cancellation token: fires when cooperating starts, or with
    /// `revoked` at the latest.
    pub(crate) handlers: CancellationToken,
    /// Fires right after `revoked` and the ledger's marking of the open deliveries: delivery
    /// tasks stop where they are.
    pub(crate) abort: CancellationToken,
}

impl Signals {
    pub(crate) fn new() -> Self {
        Self {
            revoked: Revoked::default(),
            handlers: CancellationToken::new(),
            abort: CancellationToken::new(),
        }
    }

    /// Revokes the authority to settle, and cancels the handlers with it.
    pub(crate) fn revoke(&self) {
        self.revoked.0.store(true, Ordering::SeqCst);
        self.handlers.cancel();
    }
}

/// Whether the authority to settle was revoked. Every delivery reads it at least twice, so it
/// is a flag: a [`CancellationToken`]'s check takes the token's lock, and nothing waits for
/// this one.
#[derive(Debug, Default)]
pub(crate) struct Revoked(AtomicBool);

impl Revoked {
    pub(crate) fn is_revoked(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Handles into the `metrics` facade, registered once per consumer.
pub(crate) struct Metrics {
    outcomes: [Counter; Outcome::LABELS.len()],
    pub(crate) in_flight: Gauge,
    pub(crate) handler_duration: Histogram,
    pub(crate) settlement_latency: Histogram,
    pub(crate) connections_lost: Counter,
    pub(crate) unparseable_frames: Counter,
}

impl Metrics {
    pub(crate) fn new(queue: &str) -> Self {
        let q = queue.to_owned();
        Self {
            outcomes: Outcome::LABELS.map(|o| {
                metrics::counter!("lily_deliveries_total", "queue" => q.clone(), "outcome" => o)
            }),
            in_flight: metrics::gauge!("lily_in_flight_deliveries", "queue" => q.clone()),
            handler_duration: metrics::histogram!("lily_handler_duration_seconds", "queue" => q.clone()),
            settlement_latency: metrics::histogram!("lily_settlement_latency_seconds", "queue" => q.clone()),
            connections_lost: metrics::counter!("lily_connections_lost_total", "queue" => q.clone()),
            unparseable_frames: metrics::counter!("lily_unparseable_frames_total", "queue" => q),
        }
    }

    pub(crate) fn count(&self, outcome: Outcome) {
        self.outcomes[outcome.slot()].increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::Signals;

    #[test]
    fn revoking_sets_the_flag_and_cancels_every_handler() {
        let signals = Signals::new();
        let handler = signals.handlers.child_token();
        assert!(!signals.revoked.is_revoked());
        signals.revoke();
        assert!(
            signals.revoked.is_revoked(),
            "settlements would still be written"
        );
        assert!(handler.is_cancelled(), "a handler was not told to stop");
        assert!(
            !signals.abort.is_cancelled(),
            "the abort follows the ledger's marking"
        );
    }
}
