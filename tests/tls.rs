//! TLS to RabbitMQ (amqps) and MongoDB against a local CA made by scripts/tls.sh.

mod common;

use std::time::Duration;

use common::{config, start_with};
use lily::prelude::*;
use lily_mq_mongo::mongodb::bson::{Document, doc};
use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx};
use lily_mq_testkit::{Broker, Client, MongoNode, eventually};

/// `(amqps URL, CA PEM, TLS MongoDB URL)` exported by scripts/test.sh.
fn tls_env() -> (String, String, String) {
    let get = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| {
            panic!("{name} is unset: run the suite with scripts/test.sh, which makes a local CA and TLS listeners")
        })
    };
    let dir = get("LILY_TLS_DIR");
    let ca = std::fs::read_to_string(format!("{dir}/ca.pem")).expect("CA certificate");
    (get("LILY_AMQPS_URL"), ca, get("LILY_MONGO_TLS_URL"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_the_local_ca_consumes_and_mongo_tls_commits() {
    let (amqps, ca, mongo_tls) = tls_env();
    let broker = Broker::from_env();
    let queue = Broker::unique("tls");
    let scope = MongoScope::connect(
        &mongo_tls,
        &MongoNode::database_name("tls"),
        MongoConfig::new("tls"),
    )
    .await
    .expect("MongoDB over TLS");
    let router = Router::new().route("order.placed", |tx: MongoTx, meta: Meta| async move {
        let effects = tx.database().collection::<Document>("effects");
        let mut session = tx.session().await;
        effects
            .insert_one(doc! { "message_id": meta.message_id() })
            .session(&mut *session)
            .await
            .map_err(|e| QueueHandlerError::retryable("effect write failed").with_source(e))?;
        Ok(())
    });
    let cfg = config(&queue, QueueKind::Classic).tls_ca_pem(ca);
    let consumer_scope = scope.clone();
    let running = start_with(&amqps, cfg, router, |c| c.scope(consumer_scope));
    common::wait_declared(broker.url(), &queue).await;
    let client = Client::connect(broker.url()).await;
    client.send(&queue, "order.placed", "tls-1", b"{}").await;
    common::wait_settled("ACKed over amqps", &queue, 0).await;
    let report = running.stop().await;
    assert!(report.clean);
    let effects = scope
        .database()
        .collection::<Document>("effects")
        .count_documents(doc! { "message_id": "tls-1" })
        .await
        .expect("count");
    assert_eq!(effects, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_without_trusting_the_local_ca_never_connects() {
    let (amqps, _ca, _) = tls_env();
    let queue = Broker::unique("tls-untrusted");
    let router = Router::new().route("order.placed", |_: Meta| async { Ok(()) });
    let running = start_with(&amqps, config(&queue, QueueKind::Classic), router, |c| c);
    let stats = running.stats.clone();
    let connected = eventually(Duration::from_secs(3), || stats.ready()).await;
    assert!(
        !connected,
        "a certificate from an unknown CA must be refused"
    );
    let report = running.stop().await;
    assert_eq!(report.totals.acked, 0);
}
