//! A MongoDB effect per message, read back from outside Lily: the failover tests (members
//! killed and stepped down) and the partition tests (members cut apart) share it.

use std::collections::BTreeMap;

use lily_mq_mongo::mongodb::bson::{Document, doc};
use lily_mq_mongo::mongodb::{Client as MongoClient, Database};

/// `database` through a client of the set at `url` (not the scope's) that reads at majority.
pub async fn direct(url: &str, database: &str) -> Database {
    let client = MongoClient::with_uri_str(&format!("{url}&readConcernLevel=majority"))
        .await
        .expect("a client of the set");
    client.database(database)
}

/// Every document of `collection` that matches `filter`.
pub async fn documents(mongo: &Database, collection: &str, filter: Document) -> Vec<Document> {
    let mut cursor = mongo
        .collection::<Document>(collection)
        .find(filter)
        .await
        .unwrap_or_else(|e| panic!("read {collection}: {e}"));
    let mut found = Vec::new();
    while cursor.advance().await.expect("a cursor") {
        found.push(cursor.deserialize_current().expect("a document"));
    }
    found
}

/// The entries of collection `ledger`, counted by their `message_id`.
pub async fn effects(mongo: &Database) -> BTreeMap<String, u32> {
    let mut effects = BTreeMap::new();
    for entry in documents(mongo, "ledger", doc! {}).await {
        let id = entry.get_str("message_id").expect("message_id").to_owned();
        *effects.entry(id).or_default() += 1;
    }
    effects
}
