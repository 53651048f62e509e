//! The transactional inbox: `(consumer, message_id)` with a semantic fingerprint.

use mongodb::bson::{Bson, DateTime, Document, doc};
use sha2::{Digest, Sha256};

use lily_mq_core::Meta;

/// Inbox key of a message for a consumer.
pub(crate) fn key(consumer: &str, message_id: &str) -> Document {
    doc! { "c": consumer, "m": message_id }
}

/// Type, schema version and SHA-256 of the body: what makes two deliveries "the same intent".
pub(crate) fn fingerprint(meta: &Meta, body: &[u8]) -> String {
    let mut hash = Sha256::new();
    hash.update(meta.kind().as_bytes());
    hash.update([0]);
    hash.update(meta.schema_version().to_be_bytes());
    hash.update([0]);
    hash.update(body);
    let digest = hash.finalize();
    let mut hex = String::with_capacity(64);
    for byte in digest {
        hex.push(char::from(b"0123456789abcdef"[usize::from(byte >> 4)]));
        hex.push(char::from(b"0123456789abcdef"[usize::from(byte & 15)]));
    }
    hex
}

/// The inbox document inserted with the handler's writes.
pub(crate) fn record(key: Document, meta: &Meta, fingerprint: &str) -> Document {
    doc! {
        "_id": key,
        "fingerprint": fingerprint,
        "type": meta.kind(),
        "schema_version": i64::from(meta.schema_version()),
        "at": DateTime::now(),
    }
}

/// The fingerprint stored in an inbox document.
pub(crate) fn stored_fingerprint(doc: &Document) -> Option<&str> {
    match doc.get("fingerprint") {
        Some(Bson::String(s)) => Some(s),
        _ => None,
    }
}
