//! The MongoDB scope against the real RabbitMQ node and a real mongod replica set. Every test
//! counts effects in the database; the assertion is the count.

mod common;

use std::time::Duration;

use common::{config, header_str, props, start};
use lily::prelude::*;
use lily_mq_mongo::mongodb::bson::{Document, doc};
use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx};
use lily_mq_testkit::{Broker, Client, MongoNode};

const WAIT: Duration = Duration::from_secs(60);

/// The effect: one ledger entry per handled order, written through the transaction.
async fn record_effect(tx: MongoTx, meta: Meta) -> Result<(), QueueHandlerError> {
    let effects = tx.database().collection::<Document>("effects");
    let mut session = tx.session().await;
    effects
        .insert_one(doc! { "message_id": meta.message_id(), "attempt": i64::from(meta.attempt()) })
        .session(&mut *session)
        .await
        .map_err(|e| QueueHandlerError::retryable("effect write failed").with_source(e))?;
    Ok(())
}

async fn scope(database: &str) -> MongoScope {
    let node = MongoNode::from_env();
    MongoScope::connect(node.url(), database, MongoConfig::new("e2e"))
        .await
        .expect("mongo scope")
}

async fn effects(scope: &MongoScope, message_id: &str) -> u64 {
    scope
        .database()
        .collection::<Document>("effects")
        .count_documents(doc! { "message_id": message_id })
        .await
        .expect("count effects")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_with_same_fingerprint_is_suppressed_and_conflict_goes_to_dlq() {
    let broker = Broker::from_env();
    let queue = Broker::unique("inbox");
    let scope = scope(&MongoNode::database_name("inbox")).await;
    let router = Router::new().route("order.placed", record_effect);
    let consumer_scope = scope.clone();
    let running = start_scoped(broker.url(), &queue, router, consumer_scope);
    let client = Client::connect(broker.url()).await;
    common::wait_declared(broker.url(), &queue).await;

    client
        .publish(&queue, b"{\"qty\":1}", props("order-1", "order.placed"))
        .await;
    running
        .wait_for("first handled", WAIT, |t| t.acked == 1)
        .await;
    client
        .publish(&queue, b"{\"qty\":1}", props("order-1", "order.placed"))
        .await;
    running
        .wait_for("duplicate suppressed", WAIT, |t| {
            t.acked == 2 && t.duplicates_suppressed == 1
        })
        .await;
    client
        .publish(&queue, b"{\"qty\":9}", props("order-1", "order.placed"))
        .await;
    running
        .wait_for("conflict dead-lettered", WAIT, |t| t.dead_lettered == 1)
        .await;
    let report = running.stop().await;

    assert_eq!(
        effects(&scope, "order-1").await,
        1,
        "the effect happened exactly once"
    );
    assert_eq!(report.totals.duplicates_suppressed, 1);
    let dead = client
        .take(&format!("{queue}.dlq"), Duration::from_secs(2))
        .await
        .expect("conflict in the DLQ");
    assert!(
        header_str(&dead.delivery.properties, "x-lily-reason")
            .unwrap_or_default()
            .contains("inbox conflict"),
    );
}

fn start_scoped(url: &str, queue: &str, router: Router, scope: MongoScope) -> common::Running {
    common::start_with(url, config(queue, QueueKind::Classic), router, |c| {
        c.scope(scope)
    })
}
