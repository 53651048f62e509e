//! The handler's view of the transaction, and how Lily commits or aborts it.

use std::sync::Arc;
use std::time::Duration;

use lily_mq_core::{
    BoxFuture, Committed, Context, FromDelivery, OpenTransaction, QueueHandlerError, Reason,
    TransactionOutcome,
};
use mongodb::error::{TRANSIENT_TRANSACTION_ERROR, UNKNOWN_TRANSACTION_COMMIT_RESULT};
use mongodb::{ClientSession, Database};
use tokio::sync::{Mutex, MutexGuard};
use tracing::warn;

use crate::lease::Lease;

/// The delivery's MongoDB session, inside the transaction Lily opened.
///
/// Write through it with `.session(&mut *tx.session().await)`. Never commit or abort it: Lily
/// commits after the handler and cleanup succeed and aborts otherwise.
#[derive(Clone, Debug)]
pub struct MongoTx(Arc<TxState>);

#[derive(Debug)]
pub(crate) struct TxState {
    pub(crate) session: Mutex<ClientSession>,
    pub(crate) database: Database,
    /// The outbox collection, where [`Outbox`](crate::Outbox) stages messages.
    pub(crate) outbox: mongodb::Collection<mongodb::bson::Document>,
    /// Whether a message was staged in this transaction.
    pub(crate) staged: std::sync::atomic::AtomicBool,
}

impl MongoTx {
    /// The database the scope works in.
    pub fn database(&self) -> &Database {
        &self.0.database
    }

    /// The session, in its transaction. Hold the guard only while issuing operations.
    pub async fn session(&self) -> MutexGuard<'_, ClientSession> {
        self.0.session.lock().await
    }
}

impl FromDelivery for MongoTx {
    fn from_delivery(cx: &Context<'_>) -> Result<Self, QueueHandlerError> {
        cx.resources.get::<TxState>().map(Self).ok_or_else(|| {
            QueueHandlerError::permanent("no MongoDB scope configured for this consumer")
        })
    }
}

/// The handler's error for a MongoDB operation that failed inside the scope: `what` failed.
///
/// An error the driver labels `TransientTransactionError` (a write conflict, an election, a
/// network error or no primary to select inside the transaction) becomes
/// [`QueueHandlerError::transient`]: Lily aborts and runs the whole transaction again after a
/// short backoff, within the settlement budget, then defers. Any other is
/// [`QueueHandlerError::retryable`]. The reason names the server's error code, never a
/// document or a connection string; the driver's error is kept as the source.
///
/// ```no_run
/// # use lily_mq_core::QueueHandlerError;
/// # use lily_mq_mongo::{MongoTx, handler_error};
/// # use mongodb::bson::{Document, doc};
/// async fn reserve(tx: MongoTx) -> Result<(), QueueHandlerError> {
///     let stock = tx.database().collection::<Document>("stock");
///     stock
///         .update_one(doc! { "_id": "sku-1" }, doc! { "$inc": { "reserved": 1 } })
///         .session(&mut *tx.session().await)
///         .await
///         .map_err(|e| handler_error("stock update", e))?;
///     Ok(())
/// }
/// ```
pub fn handler_error(what: &'static str, err: mongodb::error::Error) -> QueueHandlerError {
    if err.contains_label(TRANSIENT_TRANSACTION_ERROR) {
        QueueHandlerError::transient(format!("{what}: transient transaction error"))
    } else {
        QueueHandlerError::retryable(format!("{what}: {}", code_of(&err)))
    }
    .with_source(err)
}

/// The open transaction of one delivery.
pub(crate) struct MongoTransaction {
    pub(crate) state: Arc<TxState>,
    /// Woken when a transaction that staged a message committed.
    pub(crate) relay: Arc<tokio::sync::Notify>,
    pub(crate) lease: Option<Lease>,
    pub(crate) deferrals: crate::deferrals::Deferrals,
    pub(crate) on_committed: Option<(crate::observer::CommitObserver, lily_mq_core::Meta)>,
}

/// The least time given to the bookkeeping after a commit once the budget is spent.
const GRACE: Duration = Duration::from_millis(200);

impl OpenTransaction for MongoTransaction {
    fn commit(self: Box<Self>, deadline: Duration) -> BoxFuture<'static, Committed> {
        Box::pin(async move {
            let this = *self;
            let end = tokio::time::Instant::now() + deadline;
            let committed = match tokio::time::timeout(deadline, this.commit_inner(deadline)).await
            {
                Ok(committed) => committed,
                Err(_) => ambiguous("commit did not finish within the settlement budget"),
            };
            // What follows is bounded too: a database that stopped answering must not hold the
            // delivery (an unknown count leaves the count the delivery already had; a lease not
            // released expires after its TTL, its renewal stopped).
            let left = || {
                end.saturating_duration_since(tokio::time::Instant::now())
                    .max(GRACE)
            };
            let committed = if committed.outcome == TransactionOutcome::CommitAmbiguous {
                Committed {
                    deferrals: tokio::time::timeout(left(), this.deferrals.count())
                        .await
                        .ok()
                        .flatten(),
                    ..committed
                }
            } else {
                committed
            };
            if let Some(lease) = this.lease {
                let committed = committed.outcome == TransactionOutcome::Committed;
                let _ = tokio::time::timeout(left(), lease.release(committed)).await;
            }
            if committed.outcome == TransactionOutcome::Committed
                && this.state.staged.load(std::sync::atomic::Ordering::Acquire)
            {
                this.relay.notify_one();
            }
            if let (TransactionOutcome::Committed, Some((observer, meta))) =
                (committed.outcome, &this.on_committed)
            {
                observer(meta);
            }
            committed
        })
    }

    fn abort(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let this = *self;
            let _ = this.state.session.lock().await.abort_transaction().await;
            if let Some(lease) = this.lease {
                lease.release(false).await;
            }
        })
    }
}

impl MongoTransaction {
    async fn commit_inner(&self, deadline: Duration) -> Committed {
        let started = tokio::time::Instant::now();
        let mut session = self.state.session.lock().await;
        if let Some(lease) = &self.lease {
            match lease.check_fence(&mut session).await {
                Ok(true) => {}
                Ok(false) => {
                    let _ = session.abort_transaction().await;
                    return Committed {
                        outcome: TransactionOutcome::Fenced,
                        reason: Some(Reason::new(
                            "lease taken over by a newer owner (stale fence)",
                        )),
                        deferrals: None,
                        wait: Some(lease.ttl),
                    };
                }
                Err(err) => {
                    let _ = session.abort_transaction().await;
                    return aborted(&err, "fence check failed");
                }
            }
        }
        let mut backoff = Duration::from_millis(50);
        loop {
            match session.commit_transaction().await {
                Ok(()) => {
                    return Committed {
                        outcome: TransactionOutcome::Committed,
                        reason: None,
                        deferrals: None,
                        wait: None,
                    };
                }
                // The driver documents that a commit with this label may be retried as is.
                Err(err) if err.contains_label(UNKNOWN_TRANSACTION_COMMIT_RESULT) => {
                    warn!(error = %err, "commit outcome unknown; retrying the commit");
                    if started.elapsed() + backoff >= deadline {
                        return ambiguous("commit outcome still unknown after bounded retries");
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(err) => return aborted(&err, "commit failed"),
            }
        }
    }
}

fn ambiguous(reason: &'static str) -> Committed {
    Committed {
        outcome: TransactionOutcome::CommitAmbiguous,
        reason: Some(Reason::new(reason)),
        deferrals: None,
        wait: None,
    }
}

/// A definite abort. A `TransientTransactionError` means the whole transaction may run again:
/// the retry path does exactly that.
fn aborted(err: &mongodb::error::Error, what: &'static str) -> Committed {
    let transient = err.contains_label(TRANSIENT_TRANSACTION_ERROR);
    Committed {
        // A transient error (a write conflict, an election) runs the transaction again.
        outcome: if transient {
            TransactionOutcome::Transient
        } else {
            TransactionOutcome::Aborted
        },
        reason: Some(Reason::new(if transient {
            format!("{what}: transient transaction error")
        } else {
            format!("{what}: {}", code_of(err))
        })),
        deferrals: None,
        wait: None,
    }
}

/// A short description of a driver error that never carries connection strings or documents.
pub(crate) fn code_of(err: &mongodb::error::Error) -> String {
    use mongodb::error::ErrorKind;
    match err.kind.as_ref() {
        ErrorKind::Command(e) => format!("server error {} ({})", e.code, e.code_name),
        ErrorKind::Write(_) => "write error".to_owned(),
        ErrorKind::ServerSelection { .. } => "no server available".to_owned(),
        ErrorKind::Io(_) => "network error".to_owned(),
        ErrorKind::ConnectionPoolCleared { .. } => "connection pool cleared".to_owned(),
        _ => "database error".to_owned(),
    }
}
