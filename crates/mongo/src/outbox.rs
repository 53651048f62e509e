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
use mongodb::{ClientSession, Collection, Database, IndexModel};

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
            Ok(()) => {
                self.0
                    .staged
                    .store(true, std::sync::atomic::Ordering::Release);
                Ok(())
            }
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

    /// The outbox of `database` whose collections are named with `prefix` (`lily_` unless the
    /// scope's [`MongoConfig::collection_prefix`](crate::MongoConfig::collection_prefix) says
    /// otherwise): for tools that inspect it, like `lily outbox`. Reads and writes at majority.
    pub fn of(database: &Database, prefix: &str) -> Self {
        Self::new(database.collection_with_options(&format!("{prefix}outbox"), crate::majority()))
    }

    /// How many records are in each state, the oldest staged one's age, and the failed ones
    /// by reason (most first).
    ///
    /// # Errors
    /// The database did not answer or refused.
    pub async fn summary(&self) -> mongodb::error::Result<OutboxSummary> {
        let in_state = |state: &str| self.collection.count_documents(doc! { "state": state });
        let (staged, sent, failed) = (
            in_state(STAGED).await?,
            in_state(SENT).await?,
            in_state(FAILED).await?,
        );
        let oldest = self
            .collection
            .find_one(doc! { "state": STAGED })
            .sort(doc! { "_id": 1 })
            .await?
            .and_then(|r| r.get_datetime("staged_at").ok().copied())
            .map(|at| {
                let ms = DateTime::now().timestamp_millis() - at.timestamp_millis();
                std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0))
            });
        let mut by_reason = Vec::new();
        let mut cursor = self
            .collection
            .aggregate([
                doc! { "$match": { "state": FAILED } },
                doc! { "$group": { "_id": "$reason", "n": { "$sum": 1 } } },
                doc! { "$sort": { "n": -1, "_id": 1 } },
            ])
            .await?;
        while cursor.advance().await? {
            let group = cursor.deserialize_current()?;
            let reason = group.get_str("_id").unwrap_or("-").to_owned();
            by_reason.push((reason, count(group.get("n"))));
        }
        Ok(OutboxSummary {
            staged,
            sent,
            failed,
            oldest_staged: oldest,
            failed_by_reason: by_reason,
        })
    }

    /// Every record of `message_id`, oldest first; never the body, only its size.
    ///
    /// # Errors
    /// The database did not answer or refused.
    pub async fn records(&self, message_id: &str) -> mongodb::error::Result<Vec<OutboxRecord>> {
        let mut cursor = self
            .collection
            .find(doc! { "message_id": message_id })
            .sort(doc! { "_id": 1 })
            .await?;
        let mut records = Vec::new();
        while cursor.advance().await? {
            records.push(OutboxRecord::from(&cursor.deserialize_current()?));
        }
        Ok(records)
    }

    /// Stages again the failed records of `message_ids`, or every failed record with `None`,
    /// for the relay to publish anew; how many.
    ///
    /// # Errors
    /// The database did not answer or refused.
    pub async fn retry(&self, message_ids: Option<&[String]>) -> mongodb::error::Result<u64> {
        let filter = match message_ids {
            Some(ids) => doc! { "state": FAILED, "message_id": { "$in": ids } },
            None => doc! { "state": FAILED },
        };
        let update = doc! {
            "$set": { "state": STAGED },
            "$unset": { "reason": "", "failed_at": "", "failures": "" },
        };
        Ok(self
            .collection
            .update_many(filter, update)
            .await?
            .modified_count)
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

/// What an outbox holds ([`OutboxStore::summary`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxSummary {
    /// Records waiting for the relay.
    pub staged: u64,
    /// Records confirmed, kept until their retention ends.
    pub sent: u64,
    /// Records that can never be sent as they are.
    pub failed: u64,
    /// How long the oldest staged record has waited.
    pub oldest_staged: Option<std::time::Duration>,
    /// The failed records by reason, most first.
    pub failed_by_reason: Vec<(String, u64)>,
}

/// One outbox record, without its body ([`OutboxStore::records`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxRecord {
    /// `staged`, `sent` or `failed`.
    pub state: String,
    /// The exchange (empty: the default exchange).
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
    /// The message's type, when the record decodes.
    pub kind: Option<String>,
    /// The body's size in bytes, when the record decodes.
    pub body_bytes: Option<usize>,
    /// When it was staged.
    pub staged_at: Option<DateTime>,
    /// When the broker confirmed it.
    pub sent_at: Option<DateTime>,
    /// Why it failed.
    pub reason: Option<String>,
    /// Tries that failed while others were confirmed.
    pub failures: u32,
}

impl From<&Document> for OutboxRecord {
    fn from(record: &Document) -> Self {
        let text = |key: &str| record.get_str(key).ok().map(str::to_owned);
        let decoded = record
            .get_binary_generic("message")
            .ok()
            .and_then(|bytes| Outgoing::decode(bytes).ok());
        Self {
            state: text("state").unwrap_or_default(),
            exchange: text("exchange").unwrap_or_default(),
            routing_key: text("routing_key").unwrap_or_default(),
            kind: decoded.as_ref().map(|m| m.kind().to_owned()),
            body_bytes: decoded.as_ref().map(|m| m.body().len()),
            staged_at: record.get_datetime("staged_at").ok().copied(),
            sent_at: record.get_datetime("sent_at").ok().copied(),
            reason: text("reason"),
            failures: u32::try_from(count(record.get("failures"))).unwrap_or(u32::MAX),
        }
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

/// A count stored as a 32- or 64-bit integer; 0 when absent or negative.
pub(crate) fn count(value: Option<&mongodb::bson::Bson>) -> u64 {
    match value {
        Some(mongodb::bson::Bson::Int32(n)) => u64::try_from(*n).unwrap_or(0),
        Some(mongodb::bson::Bson::Int64(n)) => u64::try_from(*n).unwrap_or(0),
        _ => 0,
    }
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
