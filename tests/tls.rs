//! TLS to RabbitMQ (amqps) and MongoDB against a local CA made by scripts/tls.sh.

mod common;

use std::time::Duration;

use common::{config, start_with};
use lily::prelude::*;
use lily_mq_mongo::mongodb::bson::{Document, doc};
use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx};
use lily_mq_testkit::{Broker, Client, MongoNode};

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is unset: run the suite with scripts/test.sh, which makes a local CA and TLS listeners")
    })
}

/// A file scripts/tls.sh wrote.
fn tls_file(name: &str) -> String {
    let dir = env("LILY_TLS_DIR");
    std::fs::read_to_string(format!("{dir}/{name}")).expect("scripts/tls.sh wrote it")
}

/// The client certificate `name` (`client`, `expired` or `rogue`) of scripts/tls.sh.
fn certificate(name: &str) -> ClientCertificate {
    ClientCertificate::from_pem(
        tls_file(&format!("{name}.pem")),
        tls_file(&format!("{name}.key")),
    )
}

/// `(amqps URL, CA PEM, TLS MongoDB URL)` exported by scripts/test.sh. The MongoDB URL
/// presents the client certificate.
fn tls_env() -> (String, String, String) {
    (
        env("LILY_AMQPS_URL"),
        tls_file("ca.pem"),
        env("LILY_MONGO_TLS_URL"),
    )
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
    let cfg = config(&queue, QueueKind::Classic)
        .tls_ca_pem(ca)
        .tls_client_cert(certificate("client"));
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
async fn amqps_without_trusting_the_local_ca_fails_at_start_naming_it() {
    let (amqps, _ca, _) = tls_env();
    let queue = Broker::unique("tls-untrusted");
    let router = Router::new().route("order.placed", |_: Meta| async { Ok(()) });
    let cfg = config(&queue, QueueKind::Classic).tls_client_cert(certificate("client"));
    let running = start_with(&amqps, cfg, router, |c| c);
    let err = running.ended().await.expect_err("an unknown CA is refused");
    assert!(
        matches!(err, lily::Error::Tls { .. })
            && err
                .to_string()
                .contains("the broker's certificate is not trusted"),
        "{err}"
    );
}

/// A consumer and a publisher presenting `presented` end at start with this error.
async fn refused_with(presented: Option<&str>) -> (String, String) {
    let (amqps, ca, _) = tls_env();
    let queue = Broker::unique("mtls");
    let mut cfg = config(&queue, QueueKind::Classic).tls_ca_pem(ca.clone());
    let mut publisher = PublisherConfig::default().tls_ca_pem(ca);
    if let Some(name) = presented {
        cfg = cfg.tls_client_cert(certificate(name));
        publisher = publisher.tls_client_cert(certificate(name));
    }
    let router = Router::new().route("order.placed", |_: Meta| async { Ok(()) });
    let running = start_with(&amqps, cfg, router, |c| c);
    let consumer = tokio::time::timeout(Duration::from_secs(10), running.ended())
        .await
        .expect("a refused certificate fails at start, not after retries")
        .expect_err("refused");
    assert!(matches!(consumer, lily::Error::Tls { .. }), "{consumer:?}");
    // The broker may reset the connection before its alert is read; an application retries a
    // failed connect, and the refusal is named once the alert arrives.
    let mut publisher_err = None;
    for _ in 0..5 {
        let err = Publisher::connect_with(&amqps, publisher.clone())
            .await
            .expect_err("refused");
        let named = matches!(err, lily::Error::Tls { .. });
        publisher_err = Some(err);
        if named {
            break;
        }
    }
    let publisher = publisher_err.expect("tried");
    assert!(
        matches!(publisher, lily::Error::Tls { .. }),
        "{publisher:?}"
    );
    for shown in [format!("{consumer:?}"), format!("{publisher:?}")] {
        assert!(
            !shown.contains("guest:guest") && !shown.contains("PRIVATE KEY"),
            "{shown}"
        );
    }
    (consumer.to_string(), publisher.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_refuses_a_missing_wrong_or_expired_client_certificate_with_a_clear_error() {
    for (presented, says) in [
        (None, "none was presented and the broker requires one"),
        (Some("rogue"), "it is not signed by a CA the broker trusts"),
        (Some("expired"), "it has expired"),
    ] {
        let (consumer, publisher) = refused_with(presented).await;
        for err in [consumer, publisher] {
            assert!(
                err.contains("the broker refused the client certificate") && err.contains(says),
                "{presented:?}: {err}"
            );
        }
    }
}

#[test]
fn a_client_certificate_that_is_not_pem_is_refused_by_validation_and_never_shown() {
    let bad = ClientCertificate::from_pem("not a certificate", "-----BEGIN PRIVATE KEY-----x");
    let err = ConsumerConfig::new("orders")
        .tls_client_cert(bad.clone())
        .validate()
        .expect_err("refused");
    assert!(err.to_string().contains("tls_client"), "{err}");
    let key_only = ClientCertificate::from_pem(tls_file("client.pem"), "secret key text");
    let err = ConsumerConfig::new("orders")
        .tls_client_cert(key_only.clone())
        .validate()
        .expect_err("refused");
    assert!(err.to_string().contains("key"), "{err}");
    let shown = format!(
        "{key_only:?} {:?}",
        ConsumerConfig::new("o").tls_client_cert(key_only.clone())
    );
    assert!(
        !shown.contains("secret key text") && !shown.contains("BEGIN"),
        "{shown}"
    );
}

/// `LILY_MONGO_TLS_URL` presenting `file` as its client certificate, or none, failing fast.
fn mongo_presenting(file: Option<&str>) -> String {
    let url = env("LILY_MONGO_TLS_URL");
    let dir = env("LILY_TLS_DIR");
    let (base, _) = url
        .split_once("&tlsCertificateKeyFile=")
        .expect("the TLS URL presents a certificate");
    let presented = file.map_or(String::new(), |f| {
        format!("&tlsCertificateKeyFile={dir}/{f}")
    });
    format!("{base}{presented}&serverSelectionTimeoutMS=2000")
}

/// mongod refuses a client certificate by closing the connection, with no alert for the
/// client to read: the driver can only say the TLS connection was closed. Lily says what is
/// wrong with the certificate the URL names, and mongod's log agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mongo_tls_refuses_a_missing_wrong_or_expired_client_certificate_with_a_clear_error() {
    let log = MongoNode::from_env().dir().join("mongod.log");
    let log_len = || std::fs::metadata(&log).map_or(0, |m| m.len() as usize);
    for (file, says, why) in [
        (
            None,
            "no client certificate was presented",
            "no SSL certificate provided by peer",
        ),
        (
            Some("rogue-combined.pem"),
            "was issued by CN=lily-rogue-ca, not by the CA in",
            "unable to verify the first certificate",
        ),
        (
            Some("expired-combined.pem"),
            "is valid from Jan  1 00:00:00 2020 +00:00 to Jan  2 00:00:00 2020 +00:00, not now",
            "certificate has expired",
        ),
    ] {
        let before = log_len();
        let err = MongoScope::connect(
            &mongo_presenting(file),
            &MongoNode::database_name("mtls"),
            MongoConfig::new("mtls"),
        )
        .await
        .expect_err("refused");
        let shown = err.to_string();
        assert!(
            shown.starts_with("MongoDB closed the TLS connection: ") && shown.contains(says),
            "{file:?}: {shown}"
        );
        let logged = std::fs::read(&log).expect("mongod.log");
        let logged = String::from_utf8_lossy(&logged[before..]);
        assert!(logged.contains(why), "{file:?}: mongod logged {logged}");
    }
    MongoScope::connect(
        &mongo_presenting(Some("client-combined.pem")),
        &MongoNode::database_name("mtls"),
        MongoConfig::new("mtls"),
    )
    .await
    .expect("the CA's client certificate is taken");
}
