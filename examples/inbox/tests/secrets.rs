//! No secret anywhere. The real examples (`inbox serve`, `service`, `publisher`) run with
//! passwords in their AMQP and MongoDB URLs, against users made for this test, while messages
//! carry a marker in their bodies and header values: successes, permanent failures, bodies
//! that do not decode (the marker in the field that fails), a type no handler has, and
//! connections refused for a wrong password. Everything they print is captured: every log
//! level of every crate (`RUST_LOG=trace`, with lapin and amq-protocol at DEBUG, since at TRACE
//! they dump whole frames, and the mongodb driver's own command log at DEBUG), stdout with the
//! shutdown report, and the termination log. `Debug` of configurations and errors is captured
//! in process. Neither password nor the marker may appear anywhere.
//!
//! The `service` and `publisher` binaries are the workspace's, built beside `inbox` by
//! `cargo test --workspace`.

use std::path::PathBuf;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lily::prelude::*;
use lily_mq_mongo::mongodb::Client as MongoClient;
use lily_mq_mongo::mongodb::bson::{Document, doc};
use lily_mq_mongo::{MongoConfig, MongoScope};
use lily_mq_testkit::{Broker, ChildProcess, Client, MongoNode};
use tokio::process::Command;

const MARKER: &str = "MARKER-5d2c-PAYLOAD";
const LOG: &str = "trace,lapin=debug,amq_protocol=debug,amq_protocol_tcp=debug,mongodb=debug";

/// A password no other text contains.
fn password(what: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{what}PW{}x{nanos}", std::process::id())
}

/// A workspace binary beside this package's `inbox`.
fn sibling(name: &str) -> PathBuf {
    let inbox = PathBuf::from(env!("CARGO_BIN_EXE_inbox"));
    let path = inbox.with_file_name(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo test --workspace`, or build it first",
        path.display()
    );
    path
}

/// Properties of a message of `kind` carrying the marker in two header values.
fn marked(id: &str, kind: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    for key in ["customer-note", "x-lily-reason"] {
        headers.insert(
            key.into(),
            AMQPValue::LongString(LongString::from(MARKER.as_bytes().to_vec())),
        );
    }
    BasicProperties::default()
        .with_message_id(id.into())
        .with_type(kind.into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_headers(headers)
}

/// Everything a child printed, after it exited: stderr and stdout.
async fn finish(mut child: ChildProcess, signal: bool) -> String {
    if signal {
        child.signal("TERM");
    }
    let _ = child.exit(Duration::from_secs(30)).await;
    format!("{}\n{}", child.log(), child.stdout().await)
}

/// Fails, showing where, if `text` holds a password or the marker.
fn assert_clean(what: &str, text: &str, secrets: &[&str]) {
    for secret in secrets {
        if let Some(at) = text.find(secret) {
            let from = text[..at].rfind('\n').map_or(0, |n| n + 1);
            let line = text[from..].lines().next().unwrap_or_default();
            panic!("{what} shows a secret ({secret}) in: {line}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_body_or_header_value_appears_in_any_output() {
    let broker = Broker::from_env();
    let client = Client::connect(broker.url()).await;
    let amqp_pw = password("amqp");
    let mongo_pw = password("mongo");
    let secrets = [amqp_pw.as_str(), mongo_pw.as_str(), MARKER];
    let user = Broker::unique("secrets");
    let amqp = broker.add_user(&user, &amqp_pw, [".*", ".*", ".*"]);
    let database = MongoNode::database_name("secrets");
    let mongo = MongoNode::from_env()
        .add_user(&database, "readWrite", &mongo_pw)
        .await;
    MongoClient::with_uri_str(MongoNode::from_env().url())
        .await
        .expect("admin")
        .database(&database)
        .collection::<Document>("stock")
        .insert_one(doc! { "_id": "SKU-S", "available": 1000 })
        .await
        .expect("seed stock");
    let termination = std::env::temp_dir().join(format!("{user}.termination-log"));
    std::fs::write(&termination, "").expect("termination log");
    let mut outputs = Vec::new();

    // inbox serve: AMQP and MongoDB, each URL with its password.
    let queue = Broker::unique("secrets-inbox");
    let mut inbox = Command::new(env!("CARGO_BIN_EXE_inbox"));
    inbox
        .arg("serve")
        .env("LILY_AMQP_URL", &amqp)
        .env("LILY_MONGO_URL", &mongo)
        .env("LILY_MONGO_DB", &database)
        .env("LILY_QUEUE", &queue)
        .env("LILY_TERMINATION_LOG", &termination)
        .env("RUST_LOG", LOG);
    let inbox = ChildProcess::spawn(inbox);
    inbox
        .wait_for_line(": consuming", Duration::from_secs(30))
        .await;
    let order = |id: &str, sku: &str, quantity: &str| {
        format!(r#"{{"order_id":"{id}","sku":"{sku}","quantity":{quantity},"note":"{MARKER}"}}"#)
    };
    for i in 0..5 {
        let id = format!("ok-{i}");
        let body = order(&id, "SKU-S", "1");
        client
            .publish(&queue, body.as_bytes(), marked(&id, "stock.reserved"))
            .await;
        let id = format!("unknown-sku-{i}");
        let body = order(&id, "SKU-NONE", "1");
        client
            .publish(&queue, body.as_bytes(), marked(&id, "stock.reserved"))
            .await;
        // The marker is the value that fails to decode.
        let id = format!("bad-{i}");
        let body = order(&id, "SKU-S", &format!("\"{MARKER}\""));
        client
            .publish(&queue, body.as_bytes(), marked(&id, "stock.reserved"))
            .await;
    }
    client
        .publish(&queue, b"{}", marked("odd-type", MARKER))
        .await;
    let dlq = format!("{queue}.dlq");
    let settled = lily_mq_testkit::eventually(Duration::from_secs(60), || {
        broker.messages(&dlq) == 11 && broker.messages(&queue) == 0
    })
    .await;
    assert!(settled, "not everything settled:\n{}", inbox.log());
    let inbox_out = finish(inbox, true).await;
    assert!(
        inbox_out.contains("\"schema\"") && inbox_out.contains("mongodb::command"),
        "the run printed its report, and the driver logged its commands:\n{inbox_out}"
    );
    assert!(
        inbox_out.contains(" lapin") || inbox_out.contains("lapin::"),
        "lapin logged at DEBUG"
    );
    outputs.push(("inbox serve", inbox_out));
    let termination_text = std::fs::read_to_string(&termination).expect("termination log");
    assert!(
        !termination_text.is_empty(),
        "the termination log was written"
    );
    outputs.push(("the termination log", termination_text));
    // The DLQ copies' own texts: the reasons Lily wrote.
    let copies = client.drain(&dlq).await;
    let reasons: Vec<String> = copies
        .iter()
        .filter_map(|m| {
            m.properties
                .headers()
                .as_ref()?
                .inner()
                .get("x-lily-reason")
                .cloned()
        })
        .map(|v| format!("{v:?}"))
        .collect();
    assert_eq!(reasons.len(), 11);
    outputs.push(("the DLQ reasons", reasons.join("\n")));

    // service: AMQP only; a permanent failure and a body that does not decode.
    let queue = Broker::unique("secrets-service");
    let mut service = Command::new(sibling("service"));
    service
        .env("LILY_AMQP_URL", &amqp)
        .env("LILY_QUEUE", &queue)
        .env("LILY_HEALTH_ADDR", "127.0.0.1:0")
        .env("RUST_LOG", LOG);
    let service = ChildProcess::spawn(service);
    service
        .wait_for_line(": consuming", Duration::from_secs(30))
        .await;
    for (id, body) in [
        ("s-ok", format!(r#"{{"quantity":2,"note":"{MARKER}"}}"#)),
        ("s-zero", format!(r#"{{"quantity":0,"note":"{MARKER}"}}"#)),
        ("s-bad", format!(r#"{{"quantity":"{MARKER}"}}"#)),
    ] {
        client
            .publish(&queue, body.as_bytes(), marked(id, "order.placed"))
            .await;
    }
    let dlq = format!("{queue}.dlq");
    let settled = lily_mq_testkit::eventually(Duration::from_secs(30), || {
        broker.messages(&dlq) == 2 && broker.messages(&queue) == 0
    })
    .await;
    assert!(settled, "the service did not settle:\n{}", service.log());
    outputs.push(("service", finish(service, true).await));

    // publisher: the URL with its password.
    let queue = Broker::unique("secrets-publisher");
    client.declare(&queue, false).await;
    let mut publisher = Command::new(sibling("publisher"));
    publisher
        .env("LILY_AMQP_URL", &amqp)
        .env("LILY_QUEUE", &queue)
        .env("LILY_COUNT", "20")
        .env("RUST_LOG", LOG);
    outputs.push((
        "publisher",
        finish(ChildProcess::spawn(publisher), false).await,
    ));

    // Refused: a wrong AMQP password, then a wrong MongoDB password. The wrong ones are
    // secrets too.
    let wrong_amqp = amqp.replace(&amqp_pw, &password("wrongamqp"));
    let wrong_mongo = mongo.replace(&mongo_pw, &password("wrongmongo"));
    for (what, amqp_url, mongo_url) in [
        ("inbox, wrong AMQP password", &wrong_amqp, &mongo),
        ("inbox, wrong MongoDB password", &amqp, &wrong_mongo),
    ] {
        let mut inbox = Command::new(env!("CARGO_BIN_EXE_inbox"));
        inbox
            .arg("serve")
            .env("LILY_AMQP_URL", amqp_url)
            .env("LILY_MONGO_URL", mongo_url)
            .env("LILY_MONGO_DB", &database)
            .env("LILY_QUEUE", Broker::unique("secrets-refused"))
            .env("RUST_LOG", LOG);
        let out = finish(ChildProcess::spawn(inbox), false).await;
        assert!(
            out.contains("refused") || out.contains("Authentication failed"),
            "{what}: {out}"
        );
        let wrong = if what.contains("AMQP") {
            &wrong_amqp
        } else {
            &wrong_mongo
        };
        let wrong_pw = wrong
            .split(':')
            .nth(2)
            .and_then(|s| s.split('@').next())
            .unwrap_or("");
        assert_clean(what, &out, &[wrong_pw]);
        outputs.push((what, out));
    }

    // Debug and Display of configurations and errors, in process.
    let certificate =
        ClientCertificate::from_pem(MARKER, format!("-----BEGIN PRIVATE KEY-----{MARKER}"));
    let consumer_config = ConsumerConfig::new("orders").tls_client_cert(certificate.clone());
    let publisher_config = PublisherConfig::default().tls_client_cert(certificate);
    let mut shown = vec![
        format!("{consumer_config:?}"),
        format!("{publisher_config:?}"),
        format!("{:?}", MongoConfig::new("secrets")),
    ];
    let refused = Publisher::connect(&wrong_amqp)
        .await
        .expect_err("wrong password");
    shown.push(format!("{refused} {refused:?}"));
    let unreachable = amqp.replace(&broker.addr().port().to_string(), "1");
    let unreachable = Publisher::connect(&unreachable)
        .await
        .expect_err("nothing listens");
    shown.push(format!("{unreachable} {unreachable:?}"));
    let consumer = Consumer::new(
        wrong_amqp.clone(),
        ConsumerConfig::new("secrets-q"),
        Router::new(),
    );
    let ended = consumer
        .run(Shutdown::default())
        .await
        .expect_err("wrong password");
    shown.push(format!("{ended} {ended:?}"));
    let garbled = Consumer::new(
        format!("amqp://u:{amqp_pw}@[bad"),
        ConsumerConfig::new("q"),
        Router::new(),
    );
    let ended = garbled.run(Shutdown::default()).await.expect_err("bad URL");
    shown.push(format!("{ended} {ended:?}"));
    let mongo_refused = MongoScope::connect(
        &format!("{wrong_mongo}&serverSelectionTimeoutMS=2000"),
        &database,
        MongoConfig::new("secrets"),
    )
    .await
    .expect_err("wrong password");
    shown.push(format!("{mongo_refused} {mongo_refused:?}"));
    outputs.push(("Debug and Display", shown.join("\n")));

    let _ = std::fs::remove_file(&termination);
    for (what, text) in &outputs {
        assert_clean(what, text, &secrets);
    }
}
