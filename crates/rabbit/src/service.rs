//! What the sessions and delivery tasks share: the service's fixed setup, its books and its
//! shutdown signals, and the metrics it reports.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use lily_mq_core::machine::RequeueMemory;
use lily_mq_core::{DynHook, Ledger, Outcome, Router, TransactionalScope};
use metrics::{Counter, Gauge, Histogram};
use tokio_util::sync::CancellationToken;

use crate::config::ConsumerConfig;
use crate::connect::Endpoint;
use crate::publisher::Publisher;
use crate::topology::Topology;

/// Everything the sessions and delivery tasks share.
pub(crate) struct Shared {
    pub(crate) endpoint: Endpoint,
    pub(crate) publisher: Arc<Publisher>,
    pub(crate) config: ConsumerConfig,
    pub(crate) router: Router,
    pub(crate) hooks: Vec<Arc<dyn DynHook>>,
    pub(crate) scope: Option<Arc<dyn TransactionalScope>>,
    pub(crate) topology: Topology,
    pub(crate) queue: Arc<str>,
    pub(crate) ledger: Arc<Mutex<Ledger>>,
    pub(crate) requeues: Mutex<RequeueMemory>,
    /// Parent of every handler's cancellation token: fires when cooperating starts.
    pub(crate) handlers_cancel: CancellationToken,
    /// Fires when aborting starts: nothing is sent for any delivery after it.
    pub(crate) revoked: CancellationToken,
    /// Fires right after `revoked`: delivery tasks stop where they are.
    pub(crate) abort: CancellationToken,
    pub(crate) ready: Arc<AtomicBool>,
    pub(crate) sessions: AtomicU64,
    pub(crate) metrics: Metrics,
}

/// Handles into the `metrics` facade, registered once per consumer.
pub(crate) struct Metrics {
    outcomes: [Counter; 9],
    pub(crate) in_flight: Gauge,
    pub(crate) handler_duration: Histogram,
    pub(crate) settlement_latency: Histogram,
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
            settlement_latency: metrics::histogram!("lily_settlement_latency_seconds", "queue" => q),
        }
    }

    pub(crate) fn count(&self, outcome: Outcome) {
        self.outcomes[outcome.slot()].increment(1);
    }
}
