//! Lily as the narrow identity a production deployment gives it: a RabbitMQ user whose permissions
//! cover only its own queue names (the security chapter's `set_permissions` lines), a user that
//! cannot configure in Verify mode, a missing permission named at start, and a MongoDB user with
//! `readWrite` on its own database only, against the suite's mongod, which enforces authentication.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{config, declare_permissions, escape, start, start_with};
use lily::prelude::*;
use lily::topology::{Applied, Topology};
use lily_mq_mongo::mongodb::bson::{Document, doc};
use lily_mq_mongo::mongodb::{self, Client as MongoClient};
use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx};
use lily_mq_testkit::{Broker, Client, MongoNode};

/// The security chapter's permissions for a consumer of `queue` in Verify mode: it configures
/// nothing.
fn verify_permissions(queue: &str) -> [String; 3] {
    [
        "^$".to_owned(),
        r"^amq\.default$".to_owned(),
        format!("^{}$", escape(queue)),
    ]
}

/// A broker user with `permissions` on the default vhost; returns its URL.
fn user(broker: &Broker, name: &str, password: &str, permissions: &[String; 3]) -> String {
    let [configure, write, read] = permissions;
    broker.add_user(name, password, [configure, write, read])
}

/// Success, a retry that succeeds on its second attempt, a permanent failure (DLQ), an
/// indeterminate one (parking) and a body that is not JSON (DLQ), five of each.
fn every_lane() -> Router {
    #[derive(serde::Deserialize)]
    struct Order {
        #[allow(dead_code)]
        sku: String,
    }
    Router::new().route(
        "order.placed",
        |meta: Meta, Json(_order): Json<Order>| async move {
            match meta.message_id().split('-').next() {
                Some("retry") if meta.attempt() == 1 => Err(QueueHandlerError::retryable("down")),
                Some("dead") => Err(QueueHandlerError::permanent("malformed order")),
                Some("park") => Err(QueueHandlerError::indeterminate("outcome unknown")),
                _ => Ok(()),
            }
        },
    )
}

/// Sends [`every_lane`]'s messages, waits until everything settled and checks each lane by
/// message id from outside, as the administrator.
async fn run_every_lane(url: &str, cfg: ConsumerConfig) {
    let broker = Broker::from_env();
    let queue = cfg.queue.clone();
    let running = start(url, cfg, every_lane());
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    let mut expected_dlq = BTreeMap::new();
    let mut expected_parking = BTreeMap::new();
    for i in 0..5 {
        for kind in ["ok", "retry", "dead", "park"] {
            let id = format!("{kind}-{i}");
            client
                .send(&queue, "order.placed", &id, br#"{"sku":"a-1"}"#)
                .await;
            match kind {
                "dead" => expected_dlq.insert(id, 1),
                "park" => expected_parking.insert(id, 1),
                _ => None,
            };
        }
        let id = format!("garbled-{i}");
        client.send(&queue, "order.placed", &id, b"{not json").await;
        expected_dlq.insert(id, 1);
    }
    running
        .wait_for("every message settled", Duration::from_secs(60), |t| {
            t.acked >= 10 && t.retried >= 5 && t.dead_lettered >= 10 && t.parked >= 5
        })
        .await;
    let report = running.stop().await;
    assert!(report.clean, "{report:?}");
    let topology = Topology::new(
        &queue,
        QueueKind::Classic,
        &common::fast_policy().retry_delays,
    );
    assert_eq!(
        client.drain_ids(&topology.dead_letter_queue()).await,
        expected_dlq
    );
    assert_eq!(
        client.drain_ids(&topology.parking_queue()).await,
        expected_parking
    );
    assert!(client.drain_ids(&queue).await.is_empty());
    for (bucket, _) in topology.buckets() {
        assert!(client.drain_ids(bucket).await.is_empty(), "{bucket}");
    }
    let t = report.totals;
    assert_eq!((t.acked, t.dead_lettered, t.parked), (10, 10, 5), "{t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_with_only_its_own_queue_names_runs_every_lane() {
    let broker = Broker::from_env();
    for kind in [QueueKind::Classic, QueueKind::Quorum] {
        let queue = Broker::unique("least-privilege");
        let name = format!("{queue}-user");
        let url = user(&broker, &name, "lp-s3cret", &declare_permissions(&queue));
        run_every_lane(&url, config(&queue, kind)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_mode_runs_as_a_user_that_cannot_configure() {
    let broker = Broker::from_env();
    for kind in [QueueKind::Classic, QueueKind::Quorum] {
        let queue = Broker::unique("verify-only");
        let cfg = config(&queue, kind).topology(TopologyMode::Verify);
        // The operator declares the topology as a user that may.
        let admin = lapin::Connection::connect(broker.url(), Default::default())
            .await
            .expect("connect");
        let topology = Topology::new(&queue, kind, &common::fast_policy().retry_delays)
            .delivery_limit(cfg.delivery_limit);
        let channel = admin.create_channel().await.expect("channel");
        let applied = topology.apply(&channel, TopologyMode::Declare).await;
        assert_eq!(applied.expect("declared"), Applied::Complete);

        let name = format!("{queue}-user");
        let url = user(&broker, &name, "v-s3cret", &verify_permissions(&queue));
        // What it can check: existence, and it says what it could not.
        let own = lapin::Connection::connect(&url, Default::default())
            .await
            .expect("the user connects");
        let channel = own.create_channel().await.expect("channel");
        let Applied::ExistenceOnly(missing) = topology
            .apply(&channel, TopologyMode::Verify)
            .await
            .expect("the queues exist")
        else {
            panic!("a user that cannot configure cannot have checked the arguments")
        };
        // The first queue it declares again is the DLQ, which needs `configure` alone.
        assert_eq!(missing.permission, "configure");
        assert!(
            missing
                .resource
                .starts_with(&format!("queue '{queue}.dlq'")),
            "{missing}"
        );
        run_every_lane(&url, cfg).await;
    }
}

/// Starts a consumer of `queue` as a user with `permissions` and returns the error it ends
/// with, which must come at start.
async fn start_error(queue: &str, mode: TopologyMode, permissions: &[String; 3]) -> String {
    let broker = Broker::from_env();
    let name = format!("{queue}-{}", permissions.join("").len());
    let url = user(&broker, &name, "pw-NEVER-SHOWN", permissions);
    let cfg = config(queue, QueueKind::Classic).topology(mode);
    let running = start(&url, cfg, every_lane());
    let ended = tokio::time::timeout(Duration::from_secs(15), running.ended())
        .await
        .expect("a missing permission fails at start, not after retries");
    let err = ended.expect_err("a missing permission is an error");
    assert!(matches!(err, lily::Error::Permission { .. }), "{err:?}");
    let shown = format!("{err} / {err:?}");
    assert!(!shown.contains("NEVER-SHOWN"), "{shown}");
    err.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_permission_fails_at_start_naming_the_permission_and_the_resource() {
    let broker = Broker::from_env();
    let queue = Broker::unique("no-perm");
    let q = escape(&queue);
    let [configure, write, read] = declare_permissions(&queue);

    // No configure: the first declaration, the dead-letter exchange.
    let err = start_error(
        &queue,
        TopologyMode::Declare,
        &["^$".into(), write.clone(), read.clone()],
    )
    .await;
    assert!(
        err.contains("the configure permission on exchange '")
            && err.contains(&format!("{queue}.dlx'")),
        "{err}"
    );

    // No write on the default exchange: a retry bucket dead-letters through it.
    let err = start_error(
        &queue,
        TopologyMode::Declare,
        &[
            configure.clone(),
            format!(r"^{q}\.(dlq|dlx)$"),
            read.clone(),
        ],
    )
    .await;
    assert!(
        err.contains("the write permission on exchange 'amq.default'") && err.contains(".retry."),
        "{err}"
    );

    // No read on the dead-letter exchange: binding the DLQ to it.
    let err = start_error(
        &queue,
        TopologyMode::Declare,
        &[configure, write, format!(r"^{q}(\.retry\.[0-9a-z]+)?$")],
    )
    .await;
    assert!(
        err.contains("the read permission on exchange '")
            && err.contains(&format!("bind queue '{queue}.dlq'")),
        "{err}"
    );

    // Verify mode needs no configure, but reads the work queue and writes handoffs.
    let queue = Broker::unique("no-perm-verify");
    let admin = lapin::Connection::connect(broker.url(), Default::default())
        .await
        .expect("connect");
    let channel = admin.create_channel().await.expect("channel");
    Topology::new(
        &queue,
        QueueKind::Classic,
        &common::fast_policy().retry_delays,
    )
    .apply(&channel, TopologyMode::Declare)
    .await
    .expect("declared");
    let [none, write, read] = verify_permissions(&queue);
    let err = start_error(
        &queue,
        TopologyMode::Verify,
        &[none.clone(), write.clone(), "^$".into()],
    )
    .await;
    assert!(
        err.contains(&format!("the read permission on queue '{queue}'")) && err.contains("consume"),
        "{err}"
    );
    let err = start_error(&queue, TopologyMode::Verify, &[none, "^$".into(), read]).await;
    assert!(
        err.contains("the write permission on exchange 'amq.default'")
            && err.contains("publish handoff copies"),
        "{err}"
    );
}

/// A MongoDB user of `database` with `role` on it only; returns its URL.
async fn mongo_user(database: &str, role: &str, password: &str) -> String {
    MongoNode::from_env()
        .add_user(database, role, password)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mongo_scope_runs_as_a_user_with_read_write_on_its_own_database_only() {
    let broker = Broker::from_env();
    let database = MongoNode::database_name("least-privilege");
    let url = mongo_user(&database, "readWrite", "m-s3cret").await;
    let scope = MongoScope::connect(&url, &database, MongoConfig::new("lp"))
        .await
        .expect("the scope needs readWrite on its database only");
    // The user really is that narrow: another database is out of its reach.
    let own = MongoClient::with_uri_str(&url).await.expect("client");
    let elsewhere = own
        .database("admin")
        .collection::<Document>("system.users")
        .count_documents(doc! {})
        .await;
    let err = elsewhere.expect_err("readWrite on one database reads no other");
    assert!(err.to_string().contains("not authorized"), "{err}");

    let queue = Broker::unique("mongo-lp");
    let router = Router::new().route("order.placed", |tx: MongoTx, meta: Meta| async move {
        let mut session = tx.session().await;
        tx.database()
            .collection::<Document>("effects")
            .insert_one(doc! { "message_id": meta.message_id() })
            .session(&mut *session)
            .await
            .map_err(|e| QueueHandlerError::retryable("effect write failed").with_source(e))?;
        Ok(())
    });
    let consumer_scope = scope.clone();
    let running = start_with(
        broker.url(),
        config(&queue, QueueKind::Classic),
        router,
        |c| c.scope(consumer_scope),
    );
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    for i in 0..20 {
        let id = format!("m-{i}");
        client.send(&queue, "order.placed", &id, b"{}").await;
    }
    running
        .wait_for("20 committed", Duration::from_secs(30), |t| t.acked >= 20)
        .await;
    let report = running.stop().await;
    assert!(report.clean);
    let effects = scope.database().collection::<Document>("effects");
    for i in 0..20 {
        let n = effects
            .count_documents(doc! { "message_id": format!("m-{i}") })
            .await
            .expect("count");
        assert_eq!(n, 1, "m-{i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mongo_user_without_write_is_refused_at_start_naming_the_action_and_the_database() {
    let database = MongoNode::database_name("read-only");
    let url = mongo_user(&database, "read", "r-NEVER-SHOWN").await;
    let err = MongoScope::connect(&url, &database, MongoConfig::new("ro"))
        .await
        .expect_err("creating the inbox's indexes needs readWrite");
    let shown = format!("{err} / {err:?}");
    assert!(
        shown.contains(&format!("not authorized on {database}")) && shown.contains("createIndexes"),
        "{shown}"
    );
    assert!(!shown.contains("NEVER-SHOWN"), "{shown}");
    assert!(matches!(
        *err.driver().kind,
        mongodb::error::ErrorKind::Command(ref c) if c.code_name == "Unauthorized"
    ));
}
