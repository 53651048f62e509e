//! The MongoDB scope of Lily: a transaction around each handler, a transactional inbox and, when
//! asked for, a fenced lease, wired into the decision table; and a transactional outbox: a
//! handler's messages staged in its transaction ([`Outbox`]) and published by a [`Relay`].
//!
//! ```no_run
//! use lily_mq_core::{QueueHandlerError, Router};
//! use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx};
//! use mongodb::bson::{Document, doc};
//!
//! async fn reserve(tx: MongoTx) -> Result<(), QueueHandlerError> {
//!     let stock = tx.database().collection::<Document>("stock");
//!     let mut session = tx.session().await;
//!     stock
//!         .update_one(doc! { "_id": "sku-1" }, doc! { "$inc": { "reserved": 1 } })
//!         .session(&mut *session)
//!         .await
//!         .map_err(|e| QueueHandlerError::retryable("stock update failed").with_source(e))?;
//!     Ok(()) // Lily commits after the handler and cleanup succeed
//! }
//!
//! # async fn run() -> Result<(), lily_mq_mongo::ConnectError> {
//! let scope = MongoScope::connect(
//!     "mongodb://127.0.0.1:27017/?replicaSet=rs0",
//!     "shop",
//!     MongoConfig::new("stock-service"),
//! )
//! .await?;
//! let router = Router::new().route("order.placed", reserve);
//! // Consumer::new(url, config, router).scope(scope).run(shutdown).await
//! # let _ = (scope, router); Ok(()) }
//! ```
//!
//! # The guarantee
//!
//! Effects written through [`MongoTx`] happen **effectively once per message id and consumer
//! name, within the database named in [`MongoScope::connect`] and the inbox retention**:
//!
//! - the inbox record `(consumer, message_id)` with the message's fingerprint (type, schema
//!   version, SHA-256 of the body) is inserted in the same transaction as the handler's writes,
//!   so either both commit or neither does;
//! - a redelivery (after a crash between commit and ACK, a lost connection, an ambiguous commit)
//!   finds the record and is ACKed without running the handler (counted as a suppressed
//!   duplicate); the same id with a different fingerprint is a conflict and goes to the DLQ;
//! - a second delivery of the message while the first one's transaction is open conflicts on
//!   the inbox record, the transaction's first write: it runs again after a backoff and finds
//!   the first one committed, or defers;
//! - with [`MongoConfig::with_lease`], a lease with a fence that grows with every takeover
//!   keeps that exclusion past the transaction: the commit checks the fence inside the
//!   transaction, so a stale owner cannot commit.
//!
//! Assumptions: producers give one operation one `message_id`; effects outside this database
//! are not covered (use the lease and make them idempotent); a redelivery after the inbox
//! record expired (`inbox_retention`, a TTL index) runs the handler again — keep the retention
//! longer than any redelivery horizon (retry delays × attempts, DLQ replays).

mod connect;
mod deferrals;
mod inbox;
mod lease;
mod observer;
mod outbox;
mod relay;
mod scope;
mod tx;

pub use connect::ConnectError;
pub use lily_mq_core::OutboxReport;
pub use observer::CommitObserver;
pub use outbox::{Outbox, OutboxRecord, OutboxStore, OutboxSummary, StageError};
pub use relay::{Relay, RelayConfig};
pub use scope::{MongoConfig, MongoScope};
pub use tx::{MongoTx, handler_error};

pub use mongodb;

/// Majority writes and majority reads, for every collection of Lily's own.
fn majority() -> mongodb::options::CollectionOptions {
    use mongodb::options::{Acknowledgment, CollectionOptions, ReadConcern, WriteConcern};
    CollectionOptions::builder()
        .write_concern(WriteConcern::builder().w(Acknowledgment::Majority).build())
        .read_concern(ReadConcern::majority())
        .build()
}

/// Locks `mutex`, taking the data back if a holder panicked: what it guards stays valid
/// between statements.
fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
