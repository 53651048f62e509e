//! The transactional outbox: messages staged in the same transaction as the effects that
//! caused them, so they exist exactly when those effects committed, then published by a relay
//! with the publisher's evidence, at least once each.
//!
//! A staged message is one document in `<prefix>outbox`: its destination, its id, the message
//! as [`Outgoing::encode`] wrote it (the body is never read or logged by Lily), its state
//! (`staged`, then `sent` or `failed` with a reason) and when it was staged. Staging order is
//! the order of the documents' `_id`s.

use std::sync::Arc;

use lily_mq_core::{Context, FromDelivery, QueueHandlerError, Reason};
use lily_mq_rabbit::{Destination, Outgoing};
use mongodb::bson::spec::BinarySubtype;
use mongodb::bson::{Binary, DateTime, Document, doc, oid::ObjectId};
use mongodb::{ClientSession, Collection, IndexModel};

use crate::tx::{TxState, code_of};

/// A staged message waits for the relay.
pub(crate) const STAGED: &str = "staged";
/// The broker confirmed it; its TTL index deletes it after the retention.
pub(crate) const SENT: &str = "sent";
/// It can never be sent as it is; its reason says why.
pub(crate) const FAILED: &str = "failed";

/// Why a message was not staged.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// The message could never be published as it is (an id, type or header key over 255
    /// bytes, or one of Lily's own headers): fix the code that builds it.
    #[error("the message cannot be published: {0}")]
    Invalid(Reason),
    /// The database refused or did not answer the insert; the transaction decides (a
    /// `TransientTransactionError` runs it again).
    #[error("outbox insert failed: {}", code_of(.0))]
    Database(#[source] mongodb::error::Error),
}

/// Stages messages in the delivery's transaction: they are written with the handler's effects
/// and its inbox record, or not at all, and the relay publishes them once committed. A deferred
/// or aborted transaction, and a transaction run again, leave nothing of an earlier try.
///
/// ```no_run
/// use lily_mq_core::QueueHandlerError;
/// use lily_mq_mongo::{MongoTx, Outbox, handler_error};
/// use lily_mq_rabbit::{Destination, Outgoing};
/// use mongodb::bson::{Document, doc};
///
/// async fn reserve(tx: MongoTx, outbox: Outbox) -> Result<(), QueueHandlerError> {
///     let stock = tx.database().collection::<Document>("stock");
///     stock
///         .update_one(doc! { "_id": "sku-1" }, doc! { "$inc": { "reserved": 1 } })
///         .session(&mut *tx.session().await)
///         .await
///         .map_err(|e| handler_error("stock update", e))?;
///     let reserved = Outgoing::json("stock.reserved", "o-17.reserved", &"sku-1")
///         .map_err(|e| QueueHandlerError::permanent("event does not serialize").with_source(e))?;
///     outbox.stage(&Destination::exchange("stock", "reserved"), &reserved).await
/// }
/// ```
#[derive(Clone, Debug)]
pub struct Outbox(Arc<TxState>);

impl FromDelivery for Outbox {
    fn from_delivery(cx: &Context<'_>) -> Result<Self, QueueHandlerError> {
        cx.resources.get::<TxState>().map(Self).ok_or_else(|| {
            QueueHandlerError::permanent("no MongoDB scope configured for this consumer")
        })
    }
}

impl Outbox {
    /// Stages `message` for `to` in the delivery's transaction.
    ///
    /// # Errors
    /// A message that could never be published is a permanent failure (the DLQ, with the
    /// reason); a database error is [`handler_error`](crate::handler_error)'s: transient when
    /// the driver says so, retryable otherwise.
    pub async fn stage(
        &self,
        to: &Destination,
        message: &Outgoing,
    ) -> Result<(), QueueHandlerError> {
        let mut session = self.0.session.lock().await;
        match stage(&self.0.outbox, &mut session, to, message).await {
            Ok(()) => Ok(()),
            Err(StageError::Invalid(reason)) => Err(QueueHandlerError::permanent(format!(
                "outbox: the message cannot be published: {reason}"
            ))),
            Err(StageError::Database(err)) => Err(crate::handler_error("outbox insert", err)),
        }
    }
}

/// A scope's outbox, for staging in the application's own transactions
/// ([`MongoScope::outbox`](crate::MongoScope::outbox)).
#[derive(Clone, Debug)]
pub struct OutboxStore {
    collection: Collection<Document>,
}

impl OutboxStore {
    pub(crate) fn new(collection: Collection<Document>) -> Self {
        Self { collection }
    }

    /// Stages `message` for `to` in `session`'s transaction: it commits with it, or is gone
    /// with it. Outside a transaction the message is staged at once, whatever else happens:
    /// start one first.
    ///
    /// # Errors
    /// [`StageError::Invalid`] for a message that could never be published;
    /// [`StageError::Database`] when the insert failed.
    pub async fn stage(
        &self,
        session: &mut ClientSession,
        to: &Destination,
        message: &Outgoing,
    ) -> Result<(), StageError> {
        stage(&self.collection, session, to, message).await
    }
}

async fn stage(
    outbox: &Collection<Document>,
    session: &mut ClientSession,
    to: &Destination,
    message: &Outgoing,
) -> Result<(), StageError> {
    let encoded = message.encode().map_err(StageError::Invalid)?;
    if to.exchange_name().len() > 255 || to.routing_key().len() > 255 {
        return Err(StageError::Invalid(Reason::new(
            "exchange or routing key over 255 bytes",
        )));
    }
    let record = doc! {
        "_id": ObjectId::new(),
        "state": STAGED,
        "exchange": to.exchange_name(),
        "routing_key": to.routing_key(),
        "message_id": message.message_id(),
        "message": Binary { subtype: BinarySubtype::Generic, bytes: encoded },
        "staged_at": DateTime::now(),
    };
    outbox
        .insert_one(record)
        .session(session)
        .await
        .map(|_| ())
        .map_err(StageError::Database)
}

/// The index the relay reads staged messages in staging order by, and the TTL index that
/// deletes sent records at their `expires_at`.
pub(crate) async fn create_indexes(outbox: &Collection<Document>) -> mongodb::error::Result<()> {
    let pending = IndexModel::builder()
        .keys(doc! { "state": 1, "_id": 1 })
        .build();
    let expiring = IndexModel::builder()
        .keys(doc! { "expires_at": 1 })
        .options(
            mongodb::options::IndexOptions::builder()
                .expire_after(std::time::Duration::ZERO)
                .build(),
        )
        .build();
    outbox.create_indexes([pending, expiring]).await.map(|_| ())
}
