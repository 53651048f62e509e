//! The real `inbox` binary as a child process, crashed with `std::process::abort()` at the two
//! points that matter to a transactional inbox, against the real local RabbitMQ node and the
//! real mongod replica set. Every test counts the effects in the database.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use lily_mq_mongo::mongodb::bson::{Bson, Document, doc};
use lily_mq_mongo::mongodb::{self, Database};
use lily_mq_testkit::{Broker, ChildProcess, Client, MongoNode};
use serde_json::Value;
use tokio::process::Command;

const SKU: &str = "SKU-T";
const SEEDED: i64 = 10;
const QUANTITY: i64 = 3;

/// A running `inbox serve` and what it printed.
struct Service(ChildProcess);

impl Service {
    fn start(queue: &str, database: &str, env: &[(&str, &str)]) -> Self {
        let broker = Broker::from_env();
        let node = MongoNode::from_env();
        let mut command = Command::new(env!("CARGO_BIN_EXE_inbox"));
        command
            .arg("serve")
            .env("LILY_AMQP_URL", broker.url())
            .env("LILY_MONGO_URL", node.url())
            .env("LILY_MONGO_DB", database)
            .env("LILY_QUEUE", queue)
            .env("RUST_LOG", "warn,lily_mq_rabbit=info")
            .env_remove("INBOX_FAULT")
            .envs(env.iter().copied());
        Self(ChildProcess::spawn(command))
    }

    fn log(&self) -> String {
        self.0.log()
    }

    /// Waits until the consumer is consuming.
    async fn ready(&self) {
        self.0
            .wait_for_line("consuming", Duration::from_secs(30))
            .await;
    }

    fn sigterm(&self) {
        self.0.signal("TERM");
    }

    async fn exit(&mut self, timeout: Duration) -> ExitStatus {
        self.0.exit(timeout).await.0
    }

    /// The shutdown report the service printed on stdout (after it exited).
    async fn report(&mut self) -> Value {
        let text = self.0.stdout().await;
        serde_json::from_str(&text).unwrap_or_else(|e| {
            panic!(
                "report is not JSON ({e}): {text:?}\nstderr:\n{}",
                self.log()
            )
        })
    }
}

fn props(id: &str) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(id.into())
        .with_type("stock.reserved".into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
}

fn body(order_id: &str) -> Vec<u8> {
    serde_json::json!({ "order_id": order_id, "sku": SKU, "quantity": QUANTITY })
        .to_string()
        .into_bytes()
}

async fn database(name: &str) -> Database {
    let node = MongoNode::from_env();
    let client = mongodb::Client::with_uri_str(node.url())
        .await
        .expect("mongo client");
    let database = client.database(name);
    database
        .collection::<Document>("stock")
        .insert_one(doc! { "_id": SKU, "available": SEEDED })
        .await
        .expect("seed stock");
    database
}

async fn ledger_entries(database: &Database, message_id: &str) -> u64 {
    database
        .collection::<Document>("ledger")
        .count_documents(doc! { "message_id": message_id })
        .await
        .expect("count ledger")
}

async fn inbox_records(database: &Database, message_id: &str) -> u64 {
    database
        .collection::<Document>("lily_inbox")
        .count_documents(doc! { "_id.m": message_id })
        .await
        .expect("count inbox")
}

async fn available(database: &Database) -> i64 {
    let stock = database
        .collection::<Document>("stock")
        .find_one(doc! { "_id": SKU })
        .await
        .expect("read stock")
        .expect("stock document");
    match stock.get("available") {
        Some(Bson::Int64(n)) => *n,
        Some(Bson::Int32(n)) => i64::from(*n),
        other => panic!("available is {other:?}"),
    }
}

/// Waits until the broker holds nothing for `queue`: the delivery was settled and its ACK
/// processed.
async fn wait_settled(broker: &Broker, queue: &str, service: &Service, timeout: Duration) {
    let start = Instant::now();
    loop {
        let (b, q) = (broker.clone(), queue.to_owned());
        let n = tokio::task::spawn_blocking(move || b.messages(&q))
            .await
            .expect("list_queues");
        if n == 0 {
            return;
        }
        assert!(
            start.elapsed() < timeout,
            "{queue} still holds {n} message(s) after {timeout:?}; stderr:\n{}",
            service.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn assert_aborted(status: ExitStatus, service: &Service, fault: &str) {
    assert!(
        !status.success() && status.signal() == Some(6),
        "the service must die by SIGABRT, got {status:?}; stderr:\n{}",
        service.log()
    );
    assert!(
        service.log().contains(&format!("INBOX_FAULT={fault}")),
        "the fault fired; stderr:\n{}",
        service.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_commit_before_ack_is_suppressed_as_a_duplicate_on_redelivery() {
    let broker = Broker::from_env();
    let queue = Broker::unique("inbox-commit");
    let db_name = MongoNode::database_name("inbox_commit");
    let db = database(&db_name).await;
    let client = Client::connect(broker.url()).await;

    // The first process commits, then dies before its ACK.
    let mut first = Service::start(&queue, &db_name, &[("INBOX_FAULT", "abort_after_commit")]);
    first.ready().await;
    client.publish(&queue, &body("T-1"), props("res-1")).await;
    let status = first.exit(Duration::from_secs(30)).await;
    assert_aborted(status, &first, "abort_after_commit");
    assert_eq!(
        ledger_entries(&db, "res-1").await,
        1,
        "the effect committed"
    );
    assert_eq!(
        inbox_records(&db, "res-1").await,
        1,
        "with its inbox record"
    );
    assert_eq!(available(&db).await, SEEDED - QUANTITY);

    // The broker redelivers the unacknowledged message to the next process.
    let mut second = Service::start(&queue, &db_name, &[]);
    second.ready().await;
    wait_settled(&broker, &queue, &second, Duration::from_secs(30)).await;
    second.sigterm();
    let status = second.exit(Duration::from_secs(30)).await;
    let report = second.report().await;
    assert_eq!(status.code(), Some(0), "clean exit; report:\n{report:#}");
    assert_eq!(report["clean"], true, "{report:#}");
    assert_eq!(
        report["totals"]["duplicates_suppressed"], 1,
        "the redelivery found the inbox record: {report:#}"
    );
    assert_eq!(report["totals"]["acked"], 1, "{report:#}");
    assert_eq!(report["totals"]["dead_lettered"], 0, "{report:#}");

    assert_eq!(
        ledger_entries(&db, "res-1").await,
        1,
        "exactly one ledger entry"
    );
    assert_eq!(
        available(&db).await,
        SEEDED - QUANTITY,
        "stock decremented once"
    );
    assert_eq!(client.depth(&queue).await, 0, "queue empty");
    assert_eq!(broker.messages(&queue), 0, "nothing unacknowledged");
    assert_eq!(client.depth(&format!("{queue}.dlq")).await, 0, "DLQ empty");
    db.drop().await.expect("drop test database");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_in_handler_before_commit_leaves_nothing_and_the_redelivery_does_it_once() {
    let broker = Broker::from_env();
    let queue = Broker::unique("inbox-handler");
    let db_name = MongoNode::database_name("inbox_handler");
    let db = database(&db_name).await;
    let client = Client::connect(broker.url()).await;
    // The abandoned transaction holds the inbox key until mongod aborts it (10 s with
    // transactionLifetimeLimitSeconds=10), and the dead worker's lease until its TTL: the
    // redelivery defers, once a second, until both are gone.
    let policy = [
        ("LILY_LEASE_TTL_MS", "2000"),
        ("LILY_DEFERRAL_MS", "1000"),
        ("LILY_MAX_REQUEUES", "60"),
    ];

    // The first process dies inside the handler, after its writes, before the commit.
    let mut env = policy.to_vec();
    env.push(("INBOX_FAULT", "abort_in_handler"));
    let mut first = Service::start(&queue, &db_name, &env);
    first.ready().await;
    client.publish(&queue, &body("T-2"), props("res-2")).await;
    let status = first.exit(Duration::from_secs(30)).await;
    assert_aborted(status, &first, "abort_in_handler");
    assert_eq!(ledger_entries(&db, "res-2").await, 0, "nothing committed");
    assert_eq!(inbox_records(&db, "res-2").await, 0, "no inbox record");
    assert_eq!(available(&db).await, SEEDED, "stock untouched");

    let started = Instant::now();
    let mut second = Service::start(&queue, &db_name, &policy);
    second.ready().await;
    // Meeting the dead worker's lease, the redelivery waits it out in a retry bucket and comes
    // back: the work queue may be empty meanwhile, so the effect is what ends the wait.
    while ledger_entries(&db, "res-2").await == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "res-2 was never handled; stderr:\n{}",
            second.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    wait_settled(&broker, &queue, &second, Duration::from_secs(60)).await;
    let took = started.elapsed();
    second.sigterm();
    let status = second.exit(Duration::from_secs(30)).await;
    let report = second.report().await;
    assert_eq!(status.code(), Some(0), "clean exit; report:\n{report:#}");
    assert_eq!(report["clean"], true, "{report:#}");
    assert_eq!(report["totals"]["acked"], 1, "{report:#}");
    assert_eq!(report["totals"]["duplicates_suppressed"], 0, "{report:#}");
    assert_eq!(report["totals"]["dead_lettered"], 0, "{report:#}");
    assert_eq!(report["totals"]["retried"], 0, "{report:#}");
    let deferred = report["totals"]["deferred"].as_u64().expect("deferred");
    let waited = report["totals"]["waited"].as_u64().expect("waited");
    assert!(
        waited + deferred >= 1,
        "the dead worker's lease or its abandoned transaction kept the redelivery waiting: \
         {report:#}"
    );
    assert_eq!(report["totals"]["requeued"], 0, "{report:#}");
    eprintln!("redelivery settled after {took:?}, {waited} wait(s), {deferred} deferral(s)");

    assert_eq!(
        ledger_entries(&db, "res-2").await,
        1,
        "the effect happened once"
    );
    assert_eq!(inbox_records(&db, "res-2").await, 1);
    assert_eq!(
        available(&db).await,
        SEEDED - QUANTITY,
        "stock decremented once"
    );
    assert_eq!(client.depth(&queue).await, 0, "queue empty");
    assert_eq!(client.depth(&format!("{queue}.dlq")).await, 0, "DLQ empty");
    db.drop().await.expect("drop test database");
}
