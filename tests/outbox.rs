//! The outbox's staging against the real broker and mongod: a handler's staged messages exist
//! exactly when its transaction committed, checked by message id in the database.

mod common;

use std::collections::BTreeMap;

use common::config;
use lily::prelude::*;
use lily_mq_mongo::mongodb::bson::{Document, doc};
use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx, Outbox, StageError};
use lily_mq_testkit::{Broker, Client, MongoNode};

const MESSAGES: usize = 300;

async fn scope(database: &str) -> MongoScope {
    MongoScope::connect(
        MongoNode::from_env().url(),
        database,
        MongoConfig::new("e2e"),
    )
    .await
    .expect("mongo scope")
}

/// The outbox's records, by the staged message's id.
async fn staged(scope: &MongoScope) -> BTreeMap<String, Vec<Document>> {
    let mut cursor = scope
        .database()
        .collection::<Document>("lily_outbox")
        .find(doc! {})
        .await
        .expect("find staged");
    let mut found: BTreeMap<String, Vec<Document>> = BTreeMap::new();
    while cursor.advance().await.expect("outbox cursor") {
        let record = cursor.deserialize_current().expect("outbox record");
        let id = record.get_str("message_id").expect("message_id").to_owned();
        found.entry(id).or_default().push(record);
    }
    found
}

/// The event a handled order stages.
fn event(order: &str) -> Outgoing {
    Outgoing::json(
        "stock.reserved",
        &format!("{order}.reserved"),
        &serde_json::json!({ "order": order }),
    )
    .expect("serializes")
    .header("tenant", "acme")
}

/// 300 orders at once, each handler writing its effect and staging one event. A third fail
/// their first attempt after staging (retried later through a bucket), a third meet a
/// transient error after staging (the transaction runs again in process): the aborted tries
/// leave nothing. Each order ends with one effect and one staged event, which reads back as
/// what was staged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_messages_are_staged_exactly_when_its_transaction_commits() {
    let broker = Broker::from_env();
    let queue = Broker::unique("outbox");
    let scope = scope(&MongoNode::database_name("outbox")).await;
    let router = Router::new().route(
        "order.placed",
        |tx: MongoTx, outbox: Outbox, meta: Meta| async move {
            let order = meta.message_id().to_owned();
            tx.database()
                .collection::<Document>("effects")
                .insert_one(doc! { "message_id": &order })
                .session(&mut *tx.session().await)
                .await
                .map_err(|e| lily_mq_mongo::handler_error("effect", e))?;
            outbox
                .stage(&Destination::exchange("stock", "reserved"), &event(&order))
                .await?;
            let n: usize = order
                .trim_start_matches("order-")
                .parse()
                .expect("numbered");
            match (n % 3, meta.attempt()) {
                (0, 1) => Err(QueueHandlerError::retryable(
                    "first attempt fails after staging",
                )),
                (1, _) if first_try(&order) => Err(QueueHandlerError::transient(
                    "a write conflict after staging",
                )),
                _ => Ok(()),
            }
        },
    );
    let running = common::start_with(
        broker.url(),
        config(&queue, QueueKind::Quorum),
        router,
        |c| c.scope(scope.clone()),
    );
    let client = Client::connect(broker.url()).await;
    common::wait_declared(broker.url(), &queue).await;
    for n in 0..MESSAGES {
        client
            .send(&queue, "order.placed", &format!("order-{n}"), b"{}")
            .await;
    }
    common::wait_settled("every order", &queue, 0).await;
    let report = running.stop().await;
    assert!(
        report.totals.retried >= (MESSAGES / 3) as u64,
        "{:?}",
        report.totals
    );

    let found = staged(&scope).await;
    for n in 0..MESSAGES {
        let order = format!("order-{n}");
        let id = format!("{order}.reserved");
        let records = found.get(&id).map_or(&[][..], Vec::as_slice);
        assert_eq!(records.len(), 1, "{id}: staged once");
        let record = &records[0];
        assert_eq!(record.get_str("state"), Ok("staged"));
        assert_eq!(record.get_str("exchange"), Ok("stock"));
        assert_eq!(record.get_str("routing_key"), Ok("reserved"));
        let bytes = &record
            .get_binary_generic("message")
            .expect("message")
            .clone();
        let message = Outgoing::decode(bytes).expect("decodes");
        assert_eq!(message.message_id(), id);
        assert_eq!(message.body(), event(&order).body());
        let effects = scope
            .database()
            .collection::<Document>("effects")
            .count_documents(doc! { "message_id": &order })
            .await
            .expect("count effects");
        assert_eq!(effects, 1, "{order}: one effect");
    }
    assert_eq!(found.len(), MESSAGES, "nothing else staged");
}

/// True the first time `order` asks.
fn first_try(order: &str) -> bool {
    static SEEN: std::sync::Mutex<Option<std::collections::BTreeSet<String>>> =
        std::sync::Mutex::new(None);
    SEEN.lock()
        .unwrap()
        .get_or_insert_with(Default::default)
        .insert(order.to_owned())
}

/// The application's own transaction: what it aborts stages nothing, what it commits stages
/// everything, and a message that could never be published is refused before any write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_application_stages_in_its_own_transaction() {
    let scope = scope(&MongoNode::database_name("outbox-own")).await;
    let outbox = scope.outbox();
    let to = Destination::exchange("stock", "reserved");
    let client = scope.database().client().clone();
    let mut session = client.start_session().await.expect("session");

    session.start_transaction().await.expect("start");
    for order in ["a-1", "a-2"] {
        outbox
            .stage(&mut session, &to, &event(order))
            .await
            .expect("stage");
    }
    session.abort_transaction().await.expect("abort");

    session.start_transaction().await.expect("start");
    for order in ["c-1", "c-2"] {
        outbox
            .stage(&mut session, &to, &event(order))
            .await
            .expect("stage");
    }
    let reserved = event("c-3").header("x-lily-attempt", 1_i64);
    assert!(matches!(
        outbox.stage(&mut session, &to, &reserved).await,
        Err(StageError::Invalid(_))
    ));
    session.commit_transaction().await.expect("commit");

    let found = staged(&scope).await;
    assert_eq!(
        found.keys().cloned().collect::<Vec<_>>(),
        vec!["c-1.reserved".to_owned(), "c-2.reserved".to_owned()]
    );
}
