//! The durable count of a message's deferrals, kept in MongoDB so it survives restarts and
//! reaches every worker.

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

    /// Counts one more redelivery of the message and returns how many there were, this one
    /// included; `None` when the database cannot be reached.
    pub(crate) async fn redelivered(&self) -> Option<u32> {
        self.increment("r").await
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
        match doc.get(field) {
            Some(Bson::Int64(n)) => u32::try_from(*n).ok(),
            Some(Bson::Int32(n)) => u32::try_from(*n).ok(),
            _ => None,
        }
    }
}
