//! Transactional scopes: per-delivery resources whose outcome feeds the decision table.
//!
//! A [`TransactionalScope`] (the MongoDB scope, for instance) opens before the handler. It may
//! decide the delivery on its own — a duplicate already handled, a conflicting duplicate, a
//! deferral — or hand the handler resources (a session inside a transaction) through
//! [`Resources`], and later commit or abort. Lily commits only after the handler and the
//! cleanup hooks succeeded; the handler never commits or aborts itself.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::decision::TransactionOutcome;
use crate::extract::Meta;
use crate::handler::BoxFuture;
use crate::reason::Reason;
use crate::report::OutboxReport;
use crate::resources::Resources;

/// What opening a scope decided.
pub enum Begin {
    /// Run the handler with these resources, then commit or abort the transaction.
    Proceed {
        /// For the extractors.
        resources: Resources,
        /// The open transaction.
        transaction: Box<dyn OpenTransaction>,
        /// When the scope records durably that this worker began handling the message: how
        /// many earlier handlings of it began and never ended in a settlement (their worker,
        /// or its connection, died with them). `None` when the scope did not record it. Past
        /// the requeue limit, the handler is not run: the message goes to the DLQ.
        deaths: Option<u32>,
    },
    /// Already handled with the same fingerprint: skip the handler and ACK.
    Duplicate,
    /// Already handled with a different fingerprint: permanent failure, handler not run.
    Conflict(Reason),
    /// A transient transaction error (a write conflict, an election) while opening: the whole
    /// transaction runs again in-process after a backoff, within the settlement budget, and is
    /// deferred only if it stays transient; never an application attempt.
    Transient(Reason),
    /// Another owner holds the message's lease, which can expire in `expires_in` at the
    /// latest: the message waits that long in a retry bucket (a delayed copy), without using an
    /// application attempt or a requeue.
    Wait {
        /// Why.
        reason: Reason,
        /// How long until the other owner's lease can expire.
        expires_in: Duration,
    },
    /// Not now (the database unreachable): requeue without using an application attempt.
    Defer {
        /// Why.
        reason: Reason,
        /// Deferrals counted durably so far for this message, when the scope could count.
        deferrals: Option<u32>,
    },
}

/// A transaction opened by a scope.
pub trait OpenTransaction: Send {
    /// Commits within `deadline`, retrying what the database says may be retried.
    fn commit(self: Box<Self>, deadline: Duration) -> BoxFuture<'static, Committed>;
    /// Aborts; errors are the database's to clean up (the transaction times out).
    fn abort(self: Box<Self>) -> BoxFuture<'static, ()>;
}

/// The result of [`OpenTransaction::commit`].
#[derive(Debug)]
pub struct Committed {
    /// The outcome the decision table sees.
    pub outcome: TransactionOutcome,
    /// Why, when not committed.
    pub reason: Option<Reason>,
    /// Deferrals counted durably so far, when the outcome is ambiguous and the scope counted.
    pub deferrals: Option<u32>,
    /// With [`TransactionOutcome::Fenced`]: how long the new owner's lease can live. The
    /// message waits that long in a retry bucket instead of being requeued.
    pub wait: Option<Duration>,
}

/// Per-delivery scope around the handler with a transactional outcome.
pub trait TransactionalScope: Send + Sync + 'static {
    /// Opens the scope for a dispatched delivery, within `deadline`.
    fn begin<'a>(&'a self, meta: &'a Meta, deadline: Duration) -> BoxFuture<'a, Begin>;

    /// The delivery of `meta`, for which [`begin`](Self::begin) was called, ended: `settled`
    /// when this worker wrote its ACK, NACK or reject (the handling ended alive), not when
    /// authority was lost first (its connection died with it, which counts as a death). Called
    /// once, within `deadline`, also when `begin` did not return (its deadline ran out): it may
    /// have recorded the handling all the same. Before a requeue, it is called just before the
    /// NACK is written, as `settled`: the redelivery may begin anywhere at once.
    fn ended<'a>(&'a self, meta: &'a Meta, settled: bool, deadline: Duration) -> BoxFuture<'a, ()> {
        let _ = (meta, settled, deadline);
        Box::pin(std::future::ready(()))
    }

    /// The relay that publishes what handlers stage in the scope's outbox, run beside the
    /// consumer for as long as it runs: asked for once, when the consumer starts. `None` (the
    /// default) runs none.
    fn relay(&self) -> Option<Box<dyn OutboxRelay>> {
        None
    }
}

/// Publishes a scope's outbox beside a consumer ([`TransactionalScope::relay`]).
///
/// The consumer starts it before it consumes and fires `stop` when shutdown begins; the relay
/// then finishes what it began and returns. Shutdown waits for it within the budget (it is
/// dropped when the budget runs out) and writes what it returns in the report.
pub trait OutboxRelay: Send + 'static {
    /// Publishes until `stop` fires. `offered` holds what the consumer lends: an
    /// `Arc<lily_mq_rabbit::Publisher>` on the consumer's broker, connecting on its first
    /// publish, which the consumer closes after the relay returned.
    fn run(
        self: Box<Self>,
        offered: Resources,
        stop: CancellationToken,
    ) -> BoxFuture<'static, OutboxReport>;
}
