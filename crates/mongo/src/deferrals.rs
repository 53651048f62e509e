//! The durable count of a message's deferrals, kept in MongoDB so it survives restarts and
//! reaches every worker, and beside it the evidence that a worker died while handling it.
//!
//! A handling of a redelivered message marks the document with a token of its own (`h`) when
//! it begins, outside any transaction, once the inbox insert showed no other handling of the
//! message lives; the worker unmarks it once it settled the delivery. A mark found at the
//! beginning of the next handling was left by a handling that never ended in a settlement: its
//! worker, or its worker's connection, died with it. Those are counted (`d`). Lily's own
//! deferrals and waits settle their delivery, so they never count.

use mongodb::Collection;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::options::ReturnDocument;

/// Durable deferral count of one message.
#[derive(Clone, Debug)]
pub(crate) struct Deferrals {
    collection: Collection<Document>,
    key: Document,
}

impl Deferrals {
    /// The count of the message `key` in `collection`.
    pub(crate) fn new(collection: Collection<Document>, key: Document) -> Self {
        Self { collection, key }
    }

    /// Counts one more deferral; `None` when the database cannot be reached.
    pub(crate) async fn count(&self) -> Option<u32> {
        // The count is of deferrals so far; the decision compares it with max_requeues.
        self.increment("n").await.map(|n| n.saturating_sub(1))
    }

    /// Marks the message as being handled under `token` and returns how many earlier
    /// handlings left their mark (died); `None` when the database cannot be reached. The mark
    /// of `token` itself (the same handling's transaction run again) is no death.
    pub(crate) async fn began(&self, token: &str) -> Option<u32> {
        let other = doc! { "$and": [{ "$ifNull": ["$h", false] }, { "$ne": ["$h", token] }] };
        let left = doc! { "$cond": [other, 1_i64, 0_i64] };
        let update = vec![doc! { "$set": {
            "d": { "$add": [{ "$ifNull": ["$d", 0_i64] }, left] },
            "h": token,
            "at": "$$NOW",
        } }];
        let doc = self
            .collection
            .find_one_and_update(doc! { "_id": self.key.clone() }, update)
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await
            .ok()??;
        count(doc.get("d"))
    }

    /// Removes the mark `token` left: that handling ended in a settlement.
    pub(crate) async fn ended(&self, token: &str) {
        let _ = self
            .collection
            .update_one(
                doc! { "_id": self.key.clone(), "h": token },
                doc! { "$unset": { "h": "" } },
            )
            .await;
    }

    async fn increment(&self, field: &str) -> Option<u32> {
        let update = doc! { "$inc": { field: 1_i64 }, "$set": { "at": DateTime::now() } };
        let doc = self
            .collection
            .find_one_and_update(doc! { "_id": self.key.clone() }, update)
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await
            .ok()??;
        count(doc.get(field))
    }
}

fn count(value: Option<&Bson>) -> Option<u32> {
    match value? {
        Bson::Int64(n) => u32::try_from(*n).ok(),
        Bson::Int32(n) => u32::try_from(*n).ok(),
        _ => None,
    }
}
