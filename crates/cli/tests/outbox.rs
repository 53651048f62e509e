#![cfg(feature = "outbox")]
//! `lily outbox` against the real mongod: what the outbox holds, one message's records without
//! its body, and a failed record staged again.

use std::process::Command;

use lily_mq_mongo::mongodb::bson::{Document, doc};
use lily_mq_mongo::{MongoConfig, MongoScope};
use lily_mq_rabbit::{Destination, Outgoing};
use lily_mq_testkit::MongoNode;

const BODY_MARK: &str = "body-never-printed";

fn lily(database: &str, args: &[&str]) -> (String, i32) {
    let out = Command::new(env!("CARGO_BIN_EXE_lily"))
        .arg("outbox")
        .args(args)
        .args(["--database", database])
        .env("LILY_MONGO_URL", MongoNode::from_env().url())
        .output()
        .expect("run lily");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains(BODY_MARK), "a body in the output: {text}");
    assert!(
        !text.contains("abcdef0123456789"),
        "a password in the output"
    );
    (text, out.status.code().unwrap_or(-1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_show_and_retry_read_and_stage_again_without_a_body() {
    let database = MongoNode::database_name("cli-outbox");
    let scope = MongoScope::connect(
        MongoNode::from_env().url(),
        &database,
        MongoConfig::new("cli"),
    )
    .await
    .expect("scope");
    let client = scope.database().client().clone();
    let mut session = client.start_session().await.expect("session");
    session.start_transaction().await.expect("start");
    for id in ["e-1", "e-2", "e-3"] {
        let message = Outgoing::bytes("stock.reserved", id, "text/plain", BODY_MARK.into());
        scope
            .outbox()
            .stage(
                &mut session,
                &Destination::exchange("stock", "reserved"),
                &message,
            )
            .await
            .expect("stage");
    }
    session.commit_transaction().await.expect("commit");
    // What the relay writes for a message no queue takes.
    let reason = "returned: no queue bound to exchange 'stock' for routing key 'reserved'";
    scope
        .database()
        .collection::<Document>("lily_outbox")
        .update_one(
            doc! { "message_id": "e-2" },
            doc! { "$set": { "state": "failed", "reason": reason } },
        )
        .await
        .expect("fail e-2");

    let (list, code) = lily(&database, &["list"]);
    assert_eq!(code, 0, "{list}");
    assert!(list.starts_with("staged 2 (oldest "), "{list}");
    assert!(list.contains("sent 0, failed 1"), "{list}");
    assert!(list.contains(&format!("1  {reason}")), "{list}");

    let (show, code) = lily(&database, &["show", "e-2"]);
    assert_eq!(code, 0, "{show}");
    assert!(
        show.starts_with("e-2: failed, exchange 'stock', routing key 'reserved', type stock.reserved, body 18 bytes"),
        "{show}"
    );
    assert!(show.contains(reason), "{show}");
    let (_, code) = lily(&database, &["show", "e-9"]);
    assert_eq!(code, 1, "an unknown id");

    let (dry, code) = lily(&database, &["retry", "--all-failed", "--dry-run"]);
    assert_eq!(
        (dry.as_str(), code),
        ("would stage again 1 failed record(s)\n", 0)
    );
    let (retried, code) = lily(&database, &["retry", "e-2", "e-3"]);
    assert_eq!(
        (retried.as_str(), code),
        ("staged again 1 failed record(s)\n", 0)
    );
    let (list, _) = lily(&database, &["list", "--json"]);
    let value: serde_json::Value = serde_json::from_str(&list).expect("json");
    assert_eq!(
        (value["staged"].as_u64(), value["failed"].as_u64()),
        (Some(3), Some(0)),
        "{list}"
    );
}
