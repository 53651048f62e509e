//! The MongoDB scope against the real RabbitMQ node and a real mongod replica set. Every test
//! counts effects in the database; the assertion is the count.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{config, header_str, mongo_addr, mongo_via};
use lily::handler::BoxFuture;
use lily::prelude::*;
use lily::scope::{Begin, TransactionalScope};
use lily_mq_core::machine::MAX_LEASE_WAITS;
use lily_mq_mongo::mongodb::bson::{Bson, DateTime, Document, doc};
use lily_mq_mongo::mongodb::{Client as MongoClient, Database};
use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx};
use lily_mq_testkit::{Broker, Client, MongoNode, TcpProxy, eventually};

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
    scope_with(database, MongoConfig::new("e2e")).await
}

async fn scope_with(database: &str, config: MongoConfig) -> MongoScope {
    let node = MongoNode::from_env();
    MongoScope::connect(node.url(), database, config)
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
        .send(&queue, "order.placed", "order-1", b"{\"qty\":1}")
        .await;
    let dlq = format!("{queue}.dlq");
    common::wait_depths("first handled", WAIT, &[(&queue, 0)]).await;
    client
        .send(&queue, "order.placed", "order-1", b"{\"qty\":1}")
        .await;
    common::wait_depths("duplicate settled", WAIT, &[(&queue, 0)]).await;
    client
        .send(&queue, "order.placed", "order-1", b"{\"qty\":9}")
        .await;
    common::wait_depths("conflict dead-lettered", WAIT, &[(&queue, 0), (&dlq, 1)]).await;
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

/// Two deliveries of one message at once, without leases: the second's inbox insert conflicts
/// with the first's open transaction (a write conflict, labelled `TransientTransactionError`).
/// It opens its scope again in-process, finds the first committed and is suppressed as a
/// duplicate: one effect, no deferral, no requeue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_duplicate_is_suppressed_in_process_not_deferred() {
    let broker = Broker::from_env();
    let queue = Broker::unique("concurrent-dup");
    let database = MongoNode::database_name("dup");
    let scope = scope_with(&database, MongoConfig::new("e2e")).await;
    let router = Router::new().route("order.placed", |tx: MongoTx, meta: Meta| async move {
        record_effect(tx, meta).await?;
        // The transaction stays open a while: the twin's insert meets it.
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(())
    });
    let running = start_scoped(broker.url(), &queue, router, scope.clone());
    let client = Client::connect(broker.url()).await;
    common::wait_declared(broker.url(), &queue).await;
    for _ in 0..2 {
        client
            .send(&queue, "order.placed", "twin-1", b"{\"qty\":1}")
            .await;
    }
    common::wait_depths("both ACKed", WAIT, &[(&queue, 0)]).await;
    let report = running.stop().await;
    assert_eq!(effects(&scope, "twin-1").await, 1, "one effect");
    let t = &report.totals;
    assert_eq!(
        (t.duplicates_suppressed, t.deferred, t.requeued),
        (1, 0, 0),
        "{t:?}"
    );
}

/// A classic-queue message that keeps taking its worker down with it (here: its connection is
/// closed while the handler runs, and the handler then fails) is never settled, and nothing in
/// process memory counts it. The scope counts its redeliveries in MongoDB: past the requeue
/// limit it goes to the DLQ without running again, while the message behind it is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_classic_message_that_keeps_killing_its_worker_is_counted_durably_and_dead_lettered() {
    const MAX_REQUEUES: u32 = 2;
    let broker = Broker::from_env();
    let queue = Broker::unique("killer");
    let database = MongoNode::database_name("killer");
    let scope = scope_with(&database, MongoConfig::new("e2e")).await;
    let calls = Arc::new(Mutex::new(Vec::<String>::new()));
    let release = Arc::new(tokio::sync::Notify::new());
    let (seen, gate) = (Arc::clone(&calls), Arc::clone(&release));
    let router = Router::new().route("order.placed", move |tx: MongoTx, meta: Meta| {
        let (seen, gate) = (Arc::clone(&seen), Arc::clone(&gate));
        async move {
            seen.lock().unwrap().push(meta.message_id().to_owned());
            if meta.message_id() == "killer" {
                // Until its connection is gone: then it fails, as a dying worker would.
                gate.notified().await;
                return Err(QueueHandlerError::retryable("the worker died"));
            }
            record_effect(tx, meta).await
        }
    });
    let policy = common::fast_policy().max_requeues(MAX_REQUEUES);
    // A worker that dies is gone before its message is delivered again: the reconnect waits
    // (0.5 s at least) until the handling whose connection was closed has ended. Reconnecting
    // at once, the redelivery could begin while that handling still ran in this process, which
    // is no death (a duplicate delivery handled meanwhile), and the count came out short.
    // The killer's handler waits for the test, whose `rabbitmqctl` runs take seconds on a
    // loaded machine: it must not time out first (a timeout is a failure, not a death).
    let cfg = config(&queue, QueueKind::Classic)
        .policy(policy)
        .handler_timeout(Duration::from_secs(120))
        .reconnect(Duration::from_secs(1), Duration::from_secs(1));
    let running = common::start_with(broker.url(), cfg, router, |c| c.scope(scope.clone()));
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    for id in ["killer", "fine"] {
        client.send(&queue, "order.placed", id, b"{}").await;
    }
    let killed = || {
        calls
            .lock()
            .unwrap()
            .iter()
            .filter(|id| *id == "killer")
            .count()
    };
    let dlq = format!("{queue}.dlq");
    let consuming = format!("lily:{queue}:consuming");
    let mut rounds = 0;
    while client.depth(&dlq).await == 0 {
        rounds += 1;
        assert!(rounds <= MAX_REQUEUES as usize + 3, "never dead-lettered");
        let running_again = eventually(WAIT, || killed() >= rounds).await;
        if !running_again && client.depth(&dlq).await > 0 {
            break;
        }
        assert!(running_again, "the killer was not delivered again");
        broker.close_connection_named(&consuming);
        // The worker is dead once Lily has seen its connection go. Failing before that, the
        // handler would race the close: its retry copy could be confirmed (on the handoff
        // connection, which lives) before the consuming channel's end is read, and the
        // killer would then run once more from that copy, besides its redelivery.
        let stats = running.stats.clone();
        assert!(
            eventually(WAIT, || !stats.ready()).await,
            "the closed connection was never noticed"
        );
        release.notify_one();
        // Past the reconnect, so a redelivery that went to the DLQ is seen at the loop's check.
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    running
        .wait_for("the message behind it ACKed", WAIT, |t| {
            t.acked >= 1 && t.dead_lettered == 1
        })
        .await;
    let report = running.stop().await;

    assert_eq!(
        killed(),
        MAX_REQUEUES as usize + 1,
        "run once, then once per redelivery up to the limit"
    );
    let dead = client.drain(&dlq).await;
    assert_eq!(dead.len(), 1);
    let properties = &dead[0].delivery.properties;
    assert_eq!(
        properties.message_id().as_ref().map(|id| id.as_str()),
        Some("killer")
    );
    let reason = header_str(properties, "x-lily-reason").unwrap_or_default();
    assert!(reason.contains("without being settled"), "{reason}");
    assert_eq!(effects(&scope, "killer").await, 0);
    assert_eq!(effects(&scope, "fine").await, 1);
    assert_eq!(client.depth(&queue).await, 0);
    assert!(report.incidents.connections_lost >= u64::from(MAX_REQUEUES));
}

/// A worker whose connection dies again and again takes its whole window with it: every
/// message waiting in its prefetch comes back redelivered, each time, though its handler never
/// ran. Only a handling that began and never settled is evidence that a message kills its
/// worker: here the window is redelivered more often than the requeue limit, and still every
/// message ends with exactly one effect and none in the DLQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_workers_window_is_not_counted_as_killing_it() {
    const N: usize = 60;
    const CLOSES: usize = 5;
    let broker = Broker::from_env();
    let queue = Broker::unique("window");
    let database = MongoNode::database_name("window");
    let scope = scope_with(&database, MongoConfig::new("e2e")).await;
    let calls = Counter::default();
    let seen = calls.clone();
    let router = Router::new().route("order.placed", move |tx: MongoTx, meta: Meta| {
        let seen = seen.clone();
        async move {
            seen.bump();
            record_effect(tx, meta).await?;
            // Slow, one at a time: the rest of the window waits in the prefetch. Slow enough
            // that the closes (each a `rabbitmqctl` run, seconds on a loaded machine) come
            // while the window is still there.
            tokio::time::sleep(Duration::from_millis(500)).await;
            Ok(())
        }
    });
    let policy = common::fast_policy().max_requeues(2);
    let cfg = config(&queue, QueueKind::Classic)
        .policy(policy)
        .prefetch(50)
        .concurrency(1);
    let running = common::start_with(broker.url(), cfg, router, |c| c.scope(scope.clone()));
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    let ids: Vec<String> = (0..N).map(|i| format!("window-{i}")).collect();
    for id in &ids {
        client.send(&queue, "order.placed", id, b"{}").await;
    }
    let consuming = format!("lily:{queue}:consuming");
    for close in 0..CLOSES {
        assert!(
            eventually(WAIT, || broker.channels_of(&consuming).is_some()).await,
            "consuming again before close {close}"
        );
        broker.close_connection_named(&consuming);
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    common::wait_depths("drained", WAIT, &[(&queue, 0)]).await;
    let report = running.stop().await;

    for id in &ids {
        assert_eq!(effects(&scope, id).await, 1, "{id}: exactly one effect");
    }
    assert!(
        client.drain_ids(&format!("{queue}.dlq")).await.is_empty(),
        "no valid message in the DLQ: {:?}",
        report.totals
    );
    let t = &report.totals;
    assert!(
        t.authority_lost >= CLOSES as u64,
        "the window went back each time: {t:?}"
    );
    assert!(report.incidents.connections_lost >= CLOSES as u64);
}

fn start_scoped(url: &str, queue: &str, router: Router, scope: MongoScope) -> common::Running {
    common::start_with(url, config(queue, QueueKind::Classic), router, |c| {
        c.scope(scope)
    })
}

// ---------------------------------------------------------------------------------------------
// Failure-shaped tests: a stale lease owner, an ambiguous commit, a lease held elsewhere, the
// database unreachable, a handler failure inside the transaction. Each counts effects in the
// database through a direct connection (never through the proxy under test).
// ---------------------------------------------------------------------------------------------

/// The effect, tagged with the worker that wrote it.
async fn write_effect(tx: &MongoTx, meta: &Meta, worker: &str) -> Result<(), QueueHandlerError> {
    let effects = tx.database().collection::<Document>("effects");
    let mut session = tx.session().await;
    effects
        .insert_one(doc! {
            "message_id": meta.message_id(),
            "attempt": i64::from(meta.attempt()),
            "worker": worker,
        })
        .session(&mut *session)
        .await
        .map_err(|e| QueueHandlerError::retryable("effect write failed").with_source(e))?;
    Ok(())
}

/// A direct connection to the test database, for counting.
async fn direct(database: &str) -> Database {
    let client = MongoClient::with_uri_str(MongoNode::from_env().url())
        .await
        .expect("direct mongo client");
    client.database(database)
}

/// Every effect written for `message_id`.
async fn effect_docs(db: &Database, message_id: &str) -> Vec<Document> {
    let mut cursor = db
        .collection::<Document>("effects")
        .find(doc! { "message_id": message_id })
        .await
        .expect("find effects");
    let mut docs = Vec::new();
    while cursor.advance().await.expect("effects cursor") {
        docs.push(cursor.deserialize_current().expect("effect document"));
    }
    docs
}

fn int(doc: &Document, key: &str) -> i64 {
    match doc.get(key) {
        Some(Bson::Int64(n)) => *n,
        Some(Bson::Int32(n)) => i64::from(*n),
        other => panic!("{key} is not an integer: {other:?}"),
    }
}

/// Short deferrals, a short settlement budget, `max_requeues` requeues.
fn deferring_policy(max_requeues: u32) -> Policy {
    common::fast_policy()
        .max_requeues(max_requeues)
        .deferral_delays([Duration::from_millis(200)])
        .settlement_budget(Duration::from_secs(2), Duration::from_millis(500))
}

fn scoped_config(queue: &str, policy: Policy) -> ConsumerConfig {
    config(queue, QueueKind::Classic).policy(policy)
}

/// Delegates to the MongoDB scope and records when each delivery opened it: the spacing of
/// redeliveries, observed from the consumer's side.
#[derive(Clone)]
struct Timed {
    inner: MongoScope,
    begins: Arc<Mutex<Vec<Instant>>>,
}

impl TransactionalScope for Timed {
    fn begin<'a>(&'a self, meta: &'a Meta, deadline: Duration) -> BoxFuture<'a, Begin> {
        self.begins.lock().unwrap().push(Instant::now());
        self.inner.begin(meta, deadline)
    }
}

async fn assert_dlq_empty(client: &Client, queue: &str) {
    assert!(
        client
            .take(&format!("{queue}.dlq"), Duration::from_millis(200))
            .await
            .is_none(),
        "nothing may reach the DLQ"
    );
}

/// Counts handler calls.
#[derive(Clone, Default)]
struct Counter(Arc<AtomicU32>);

impl Counter {
    fn bump(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn get(&self) -> u32 {
        self.0.load(Ordering::SeqCst)
    }
}

/// A router whose handler counts its calls, optionally sleeps, then writes the effect as
/// `worker`.
fn effect_router(worker: &'static str, calls: &Counter, slow: Duration) -> Router {
    let calls = calls.clone();
    Router::new().route("order.placed", move |tx: MongoTx, meta: Meta| {
        let calls = calls.clone();
        async move {
            calls.bump();
            write_effect(&tx, &meta, worker).await?;
            tokio::time::sleep(slow).await;
            Ok(())
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_owner_cut_off_mid_handler_is_fenced_and_the_redelivery_commits_once() {
    let broker = Broker::from_env();
    let queue = Broker::unique("takeover");
    let database = MongoNode::database_name("takeover");
    let db = direct(&database).await;
    let node = MongoNode::from_env();
    let consumer = "e2e-takeover";

    // A consumes through a proxy it can be cut off by; its lease lives 1 s, extended at most
    // 1 s, so it expires while A's 4 s handler is still running.
    let amqp = TcpProxy::start(broker.addr()).await;
    let a_commits = Counter::default();
    let committed = a_commits.clone();
    let scope_a = MongoScope::connect(
        node.url(),
        &database,
        MongoConfig::new(consumer)
            .lease_ttl(Duration::from_secs(1), Duration::from_secs(1))
            .on_committed(move |_| committed.bump()),
    )
    .await
    .expect("scope A");
    let a_calls = Counter::default();
    let running_a = common::start_with(
        &amqp.url(broker.url()),
        scoped_config(&queue, deferring_policy(100)).handler_timeout(Duration::from_secs(20)),
        effect_router("A", &a_calls, Duration::from_secs(4)),
        |c| c.scope(scope_a),
    );
    common::wait_declared(broker.url(), &queue).await;
    let client = Client::connect(broker.url()).await;
    let stats_a = running_a.stats.clone();
    assert!(eventually(WAIT, || stats_a.ready()).await, "A consuming");
    client
        .send(&queue, "order.placed", "takeover-1", b"{\"qty\":1}")
        .await;
    assert!(
        eventually(WAIT, || a_calls.get() == 1).await,
        "A is inside its handler"
    );

    // B consumes directly, fast, with the default lease TTL.
    let scope_b = scope_with(&database, MongoConfig::new(consumer).with_lease()).await;
    let b_calls = Counter::default();
    let running_b = start_scoped_with(
        broker.url(),
        scoped_config(&queue, deferring_policy(100)),
        effect_router("B", &b_calls, Duration::ZERO),
        scope_b,
    );
    let stats_b = running_b.stats.clone();
    assert!(eventually(WAIT, || stats_b.ready()).await, "B consuming");

    // A's connection dies and cannot come back: the broker redelivers to B.
    amqp.refuse(true);
    amqp.cut();

    running_b
        .wait_for("B committed and acked", WAIT, |t| t.acked == 1)
        .await;
    running_a
        .wait_for("A's delivery ended without authority", WAIT, |t| {
            t.authority_lost == 1
        })
        .await;
    let report_b = running_b.stop().await;
    let report_a = running_a.stop().await;

    let docs = effect_docs(&db, "takeover-1").await;
    assert_eq!(docs.len(), 1, "exactly one effect: {docs:?}");
    assert_eq!(
        docs[0].get_str("worker").ok(),
        Some("B"),
        "the effect is B's: A's commit was fenced"
    );
    assert_eq!(a_calls.get(), 1, "A ran its handler once");
    assert_eq!(a_commits.get(), 0, "A, the stale owner, never committed");
    assert_eq!(report_a.totals.acked, 0);
    assert!(b_calls.get() >= 1);
    assert!(
        report_b.totals.waited + report_b.totals.deferred >= 1,
        "B waited for A's lease and transaction: {:?}",
        report_b.totals
    );
    assert_eq!(
        report_b.totals.dead_lettered + report_a.totals.dead_lettered,
        0
    );
    assert_no_lease_left(&db).await;
    assert_dlq_empty(&client, &queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_owner_still_holding_its_delivery_defers_instead_of_retrying() {
    // The same message id published twice (a producer retry): A handles copy 1 slowly, its
    // lease expires, B takes copy 2 over. A still holds its delivery, so its fenced commit must
    // be a deferral (the design chapter: a stale owner cannot commit, which is a deferral), not a retryable
    // failure that consumes an application attempt.
    let broker = Broker::from_env();
    let queue = Broker::unique("stale");
    let database = MongoNode::database_name("stale");
    let db = direct(&database).await;
    let node = MongoNode::from_env();
    let consumer = "e2e-stale";

    let scope_a = MongoScope::connect(
        node.url(),
        &database,
        MongoConfig::new(consumer).lease_ttl(Duration::from_secs(1), Duration::from_secs(1)),
    )
    .await
    .expect("scope A");
    let a_calls = Counter::default();
    let running_a = start_scoped_with(
        broker.url(),
        scoped_config(&queue, deferring_policy(100))
            .prefetch(1)
            .concurrency(1)
            .handler_timeout(Duration::from_secs(20)),
        effect_router("A", &a_calls, Duration::from_secs(4)),
        scope_a,
    );
    common::wait_declared(broker.url(), &queue).await;
    let client = Client::connect(broker.url()).await;
    let stats_a = running_a.stats.clone();
    assert!(eventually(WAIT, || stats_a.ready()).await, "A consuming");
    client
        .send(&queue, "order.placed", "stale-1", b"{\"qty\":1}")
        .await;
    assert!(
        eventually(WAIT, || a_calls.get() == 1).await,
        "A is inside its handler"
    );
    // A's prefetch is full: the second copy waits for B.
    client
        .send(&queue, "order.placed", "stale-1", b"{\"qty\":1}")
        .await;
    let scope_b = scope_with(&database, MongoConfig::new(consumer).with_lease()).await;
    let b_calls = Counter::default();
    let running_b = start_scoped_with(
        broker.url(),
        scoped_config(&queue, deferring_policy(100)),
        effect_router("B", &b_calls, Duration::ZERO),
        scope_b,
    );

    // Both copies end acked: B's by its commit, A's after its deferral as a duplicate.
    let (sa, sb) = (running_a.stats.clone(), running_b.stats.clone());
    let settled = eventually(WAIT, || {
        let (a, b) = (sa.totals(), sb.totals());
        a.acked + b.acked + a.retried + b.retried + a.dead_lettered + b.dead_lettered >= 2
            && sa.in_flight() + sb.in_flight() == 0
    })
    .await;
    assert!(settled, "A {:?} B {:?}", sa.totals(), sb.totals());
    // A retry copy (if any) comes back after 1 s: let it settle too.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let report_a = running_a.stop().await;
    let report_b = running_b.stop().await;

    let docs = effect_docs(&db, "stale-1").await;
    assert_eq!(docs.len(), 1, "exactly one effect: {docs:?}");
    assert_eq!(docs[0].get_str("worker").ok(), Some("B"), "{docs:?}");
    assert_eq!(a_calls.get(), 1, "A ran its handler once");
    assert_eq!(
        report_a.totals.retried, 0,
        "A's stale commit was a deferral, not an application retry: A {:?}",
        report_a.totals
    );
    assert!(
        report_a.totals.waited >= 1,
        "A's fenced commit waited out B's lease in a bucket: A {:?}",
        report_a.totals
    );
    assert_eq!(
        report_a.totals.requeued + report_a.totals.deferred,
        0,
        "a wait is no requeue: A {:?}",
        report_a.totals
    );
    assert_eq!(
        report_a.totals.dead_lettered + report_b.totals.dead_lettered,
        0
    );
    assert_no_lease_left(&db).await;
    assert_dlq_empty(&client, &queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_outliving_a_lease_renewal_still_commits() {
    // The lease is renewed (outside the transaction) while the handler runs; the commit's
    // fence check writes the fence document inside the transaction. The worker's own renewal
    // must not make its commit fail.
    let broker = Broker::from_env();
    let queue = Broker::unique("renewal");
    let database = MongoNode::database_name("renewal");
    let db = direct(&database).await;
    let scope = MongoScope::connect(
        MongoNode::from_env().url(),
        &database,
        MongoConfig::new("e2e-renewal")
            .lease_ttl(Duration::from_millis(300), Duration::from_secs(30)),
    )
    .await
    .expect("scope");
    let calls = Counter::default();
    let running = start_scoped_with(
        broker.url(),
        scoped_config(&queue, deferring_policy(3)),
        effect_router("only", &calls, Duration::from_millis(700)),
        scope,
    );
    common::wait_declared(broker.url(), &queue).await;
    let client = Client::connect(broker.url()).await;
    client
        .send(&queue, "order.placed", "renewal-1", b"{\"qty\":1}")
        .await;
    common::wait_settled("ACKed", &queue, 0).await;
    let report = running.stop().await;

    let dead = client
        .take(&format!("{queue}.dlq"), Duration::from_millis(200))
        .await
        .map(|m| header_str(&m.delivery.properties, "x-lily-reason").unwrap_or_default());
    let docs = effect_docs(&db, "renewal-1").await;
    assert_eq!(
        docs.len(),
        1,
        "the effect committed; totals {:?}, handler calls {}, dead-lettered with {dead:?}",
        report.totals,
        calls.get()
    );
    assert_eq!(report.totals.acked, 1, "{:?}", report.totals);
    assert_eq!(report.totals.retried, 0, "{:?}", report.totals);
    assert_eq!(calls.get(), 1, "committed on the first attempt");
    assert_no_lease_left(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_commit_reply_defers_and_the_redelivery_is_suppressed_as_duplicate() {
    let broker = Broker::from_env();
    let queue = Broker::unique("ambiguous");
    let database = MongoNode::database_name("ambiguous");
    let db = direct(&database).await;
    let proxy = TcpProxy::start(mongo_addr()).await;
    let scope = MongoScope::connect(
        &mongo_via(&proxy),
        &database,
        MongoConfig::new("e2e-ambiguous")
            .lease_ttl(Duration::from_secs(1), Duration::from_secs(30)),
    )
    .await
    .expect("scope through the proxy");
    let policy = deferring_policy(50);
    let budget = policy.settlement_budget;
    let calls = Counter::default();
    let running = start_scoped_with(
        broker.url(),
        scoped_config(&queue, policy),
        effect_router("only", &calls, Duration::ZERO),
        scope,
    );
    common::wait_declared(broker.url(), &queue).await;
    let client = Client::connect(broker.url()).await;

    // The commit reaches mongod; its reply never comes back, and mongod stays unreachable for
    // longer than the settlement budget, so the commit's bounded retries end unknown.
    proxy.drop_reply_after(b"commitTransaction", budget * 2);
    client
        .send(&queue, "order.placed", "ambiguous-1", b"{\"qty\":1}")
        .await;
    common::wait_settled("ACKed", &queue, 0).await;
    let report = running.stop().await;

    assert!(proxy.tripped(), "the commit's reply was dropped");
    let docs = effect_docs(&db, "ambiguous-1").await;
    assert_eq!(
        docs.len(),
        1,
        "the commit happened once, server-side: {docs:?}"
    );
    assert_eq!(calls.get(), 1, "the redelivery did not run the handler");
    let t = &report.totals;
    assert!(t.deferred >= 1, "the unknown commit deferred: {t:?}");
    assert_eq!(t.duplicates_suppressed, 1, "{t:?}");
    assert_eq!(t.acked, 1, "{t:?}");
    assert_eq!(t.retried + t.dead_lettered + t.parked, 0, "{t:?}");
    assert_dlq_empty(&client, &queue).await;
}

/// A lease a live owner keeps renewing for ever: the message waits it out in a retry bucket,
/// spaced by the bucket, never requeued, up to `MAX_LEASE_WAITS` waits; then it defers, counted,
/// and reaches the DLQ at the requeue limit. Nothing loops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_held_by_a_live_owner_waits_in_a_bucket_then_dead_letters_at_the_limit() {
    let broker = Broker::from_env();
    let queue = Broker::unique("held");
    let database = MongoNode::database_name("held");
    let db = direct(&database).await;
    let consumer = "e2e-held";
    let key = doc! { "c": consumer, "m": "held-1" };
    let far = DateTime::from_millis(DateTime::now().timestamp_millis() + 3_600_000);
    db.collection::<Document>("lily_leases")
        .insert_one(doc! {
            "_id": key.clone(),
            "owner": "someone-else",
            "fence": 7_i64,
            "expires_at": far,
            "acquired_at": DateTime::now(),
        })
        .await
        .expect("insert a live lease");
    let scope = scope_with(&database, MongoConfig::new(consumer).with_lease()).await;
    let timed = Timed {
        inner: scope,
        begins: Arc::default(),
    };
    let begins = Arc::clone(&timed.begins);
    let max_requeues = 3;
    let bucket = Duration::from_millis(150);
    let policy = deferring_policy(max_requeues)
        .retry_delays([bucket])
        .deferral_delays([
            Duration::from_millis(300),
            Duration::from_millis(500),
            Duration::from_millis(700),
        ]);
    let calls = Counter::default();
    let running = start_scoped_with(
        broker.url(),
        scoped_config(&queue, policy.clone()),
        effect_router("nobody", &calls, Duration::ZERO),
        timed,
    );
    common::wait_declared(broker.url(), &queue).await;
    let client = Client::connect(broker.url()).await;
    client
        .send(&queue, "order.placed", "held-1", b"{\"qty\":1}")
        .await;
    let dlq = format!("{queue}.dlq");
    assert!(
        eventually(Duration::from_secs(60), || broker.messages(&dlq) == 1).await,
        "dead-lettered at the requeue limit"
    );
    // Nothing keeps spinning after the DLQ handoff.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let report = running.stop().await;

    assert_eq!(effect_docs(&db, "held-1").await.len(), 0, "no effect");
    assert_eq!(calls.get(), 0, "the handler never ran");
    let t = &report.totals;
    assert_eq!(t.waited, u64::from(MAX_LEASE_WAITS), "{t:?}");
    assert_eq!(t.deferred, u64::from(max_requeues), "{t:?}");
    assert_eq!(t.acked + t.retried, 0, "{t:?}");
    let begins = begins.lock().unwrap().clone();
    assert_eq!(
        begins.len(),
        (MAX_LEASE_WAITS + max_requeues) as usize + 1,
        "one delivery per wait and per deferral plus the last: never a hot loop"
    );
    for (i, pair) in begins.windows(2).enumerate() {
        let gap = pair[1] - pair[0];
        assert!(
            gap >= bucket,
            "delivery {} came {gap:?} after the previous one, before the bucket's {bucket:?}",
            i + 1
        );
    }
    let lease = db
        .collection::<Document>("lily_leases")
        .find_one(doc! { "_id": key })
        .await
        .expect("read lease")
        .expect("lease");
    assert_eq!(lease.get_str("owner").ok(), Some("someone-else"));
    assert_eq!(
        int(&lease, "fence"),
        7,
        "the live owner's lease was not touched"
    );
    let dead = client
        .take(&dlq, Duration::from_secs(2))
        .await
        .expect("the message ends in the DLQ");
    let reason = header_str(&dead.delivery.properties, "x-lily-reason").unwrap_or_default();
    assert!(
        reason.contains("requeue limit reached") && reason.contains("lease held"),
        "{reason}"
    );
    assert_eq!(client.depth(&queue).await, 0);
}

/// Many messages whose leases a dead worker left (expiring in ten seconds) among as many
/// free ones, at prefetch 50: the free ones are handled at once, the held ones wait their
/// leases out in a retry bucket without a single requeue, then each is handled once. Nothing
/// reaches the DLQ; checked by id in the database and by draining every queue.
async fn a_dead_owners_leases_are_waited_out_without_blocking_the_rest(kind: QueueKind) {
    const N: usize = 60;
    let broker = Broker::from_env();
    let queue = Broker::unique("dead-owner");
    let database = MongoNode::database_name("deadowner");
    let db = direct(&database).await;
    let consumer = "e2e-dead-owner";
    // The dead owner's leases expire in 10 s: the free messages must all be done before any
    // held one could be taken, however long publishing takes on a loaded machine.
    let expires = DateTime::from_millis(DateTime::now().timestamp_millis() + 10_000);
    let held: Vec<String> = (0..N).map(|i| format!("held-{i}")).collect();
    let free: Vec<String> = (0..N).map(|i| format!("free-{i}")).collect();
    for id in &held {
        db.collection::<Document>("lily_leases")
            .insert_one(doc! {
                "_id": { "c": consumer, "m": id },
                "owner": "a-dead-worker",
                "fence": 1_i64,
                "expires_at": expires,
                "acquired_at": DateTime::now(),
            })
            .await
            .expect("insert a dead owner's lease");
    }
    let scope = scope_with(&database, MongoConfig::new(consumer).with_lease()).await;
    // Few requeues allowed, quick deferrals: a deferral by requeue would reach the DLQ long
    // before the leases expire.
    let policy = deferring_policy(2).retry_delays([Duration::from_secs(1), Duration::from_secs(4)]);
    let calls = Counter::default();
    let running = start_scoped_with(
        broker.url(),
        config(&queue, kind)
            .policy(policy)
            .prefetch(50)
            .concurrency(50),
        effect_router("W", &calls, Duration::ZERO),
        scope,
    );
    common::wait_declared(broker.url(), &queue).await;
    let client = Client::connect(broker.url()).await;
    let started = Instant::now();
    for (h, f) in held.iter().zip(&free) {
        client.send(&queue, "order.placed", h, b"{\"qty\":1}").await;
        client.send(&queue, "order.placed", f, b"{\"qty\":1}").await;
    }
    let effects_of = |ids: Vec<String>| {
        let db = db.clone();
        async move {
            let mut n = 0;
            for id in &ids {
                n += effect_docs(&db, id).await.len();
            }
            n
        }
    };
    // The free ones do not wait for the held ones.
    let mut free_done = false;
    while started.elapsed() < Duration::from_secs(9) {
        if effects_of(free.clone()).await == N {
            free_done = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(free_done, "the free messages waited behind the held ones");
    let mut all_done = false;
    while started.elapsed() < Duration::from_secs(40) {
        if effects_of(held.clone()).await == N {
            all_done = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        all_done,
        "the held messages were not all handled once their leases expired"
    );
    common::wait_depths("every queue empty", WAIT, &[(&queue, 0)]).await;
    let report = running.stop().await;

    for id in held.iter().chain(&free) {
        assert_eq!(
            effect_docs(&db, id).await.len(),
            1,
            "{id}: exactly one effect"
        );
    }
    let t = &report.totals;
    assert!(t.waited >= N as u64, "every held message waited: {t:?}");
    assert_eq!(t.requeued + t.deferred + t.dead_lettered, 0, "{t:?}");
    for lane in [format!("{queue}.dlq"), format!("{queue}.parking")] {
        assert!(client.drain_ids(&lane).await.is_empty(), "{lane} is empty");
    }
    assert!(client.drain_ids(&queue).await.is_empty());
    assert_no_lease_left(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_owners_leases_are_waited_out_without_blocking_the_rest_on_classic() {
    a_dead_owners_leases_are_waited_out_without_blocking_the_rest(QueueKind::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_owners_leases_are_waited_out_without_blocking_the_rest_on_quorum() {
    a_dead_owners_leases_are_waited_out_without_blocking_the_rest(QueueKind::Quorum).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_unreachable_defers_without_acking_then_handles_once_when_back() {
    let broker = Broker::from_env();
    let queue = Broker::unique("mongo-down");
    let database = MongoNode::database_name("mongo-down");
    let db = direct(&database).await;
    let proxy = TcpProxy::start(mongo_addr()).await;
    let scope = MongoScope::connect(&mongo_via(&proxy), &database, MongoConfig::new("e2e-down"))
        .await
        .expect("scope through the proxy");
    let calls = Counter::default();
    let running = start_scoped_with(
        broker.url(),
        scoped_config(&queue, deferring_policy(30)),
        effect_router("only", &calls, Duration::ZERO),
        scope,
    );
    common::wait_declared(broker.url(), &queue).await;
    let client = Client::connect(broker.url()).await;

    proxy.refuse(true);
    proxy.cut();
    client
        .send(&queue, "order.placed", "down-1", b"{\"qty\":1}")
        .await;
    running
        .wait_for("deferrals while the database is down", WAIT, |t| {
            t.deferred >= 2
        })
        .await;
    let stats = running.stats.clone();
    let acked_while_down = eventually(Duration::from_secs(2), || {
        let t = stats.totals();
        t.acked + t.retried + t.dead_lettered > 0
    })
    .await;
    assert!(
        !acked_while_down,
        "nothing settled as success while the database is down: {:?}",
        stats.totals()
    );
    assert_eq!(effect_docs(&db, "down-1").await.len(), 0);
    assert_eq!(
        calls.get(),
        0,
        "the handler never ran without its transaction"
    );

    proxy.refuse(false);
    common::wait_settled("handled once the database is back", &queue, 0).await;
    let report = running.stop().await;

    let docs = effect_docs(&db, "down-1").await;
    assert_eq!(docs.len(), 1, "handled exactly once: {docs:?}");
    assert_eq!(calls.get(), 1);
    let t = &report.totals;
    assert!(t.deferred >= 2, "{t:?}");
    assert_eq!(
        t.retried + t.dead_lettered + t.duplicates_suppressed,
        0,
        "{t:?}"
    );
    assert!(proxy.refused() >= 1, "the outage was real");
    assert_dlq_empty(&client, &queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_failure_aborts_its_transaction_and_the_retry_writes_the_only_effect() {
    let broker = Broker::from_env();
    let queue = Broker::unique("abort");
    let database = MongoNode::database_name("abort");
    let db = direct(&database).await;
    let scope = MongoScope::connect(
        MongoNode::from_env().url(),
        &database,
        MongoConfig::new("e2e-abort"),
    )
    .await
    .expect("scope");
    let calls = Counter::default();
    let seen = calls.clone();
    let router = Router::new().route("order.placed", move |tx: MongoTx, meta: Meta| {
        let seen = seen.clone();
        async move {
            seen.bump();
            write_effect(&tx, &meta, "handler").await?;
            if meta.attempt() == 1 {
                // The effect is written inside the transaction; this failure must undo it.
                return Err(QueueHandlerError::retryable("downstream hiccup"));
            }
            Ok(())
        }
    });
    let running = start_scoped_with(
        broker.url(),
        scoped_config(&queue, deferring_policy(3)),
        router,
        scope,
    );
    common::wait_declared(broker.url(), &queue).await;
    let client = Client::connect(broker.url()).await;
    client
        .send(&queue, "order.placed", "abort-1", b"{\"qty\":1}")
        .await;
    common::wait_settled("retried, then ACKed", &queue, 0).await;
    let report = running.stop().await;

    let docs = effect_docs(&db, "abort-1").await;
    assert_eq!(docs.len(), 1, "attempt 1's effect was aborted: {docs:?}");
    assert_eq!(int(&docs[0], "attempt"), 2, "the effect is attempt 2's");
    assert_eq!(calls.get(), 2);
    let t = &report.totals;
    assert_eq!(
        t.deferred, 0,
        "the aborted transaction left nothing behind for the retry to wait on: {t:?}"
    );
    assert_eq!(t.duplicates_suppressed + t.dead_lettered, 0, "{t:?}");
    assert_dlq_empty(&client, &queue).await;
}

/// No lease or fence document is left once its message settled.
async fn assert_no_lease_left(db: &Database) {
    for name in ["lily_leases", "lily_fences"] {
        let left = db
            .collection::<Document>(name)
            .count_documents(doc! {})
            .await
            .expect("count lease documents");
        assert_eq!(left, 0, "{name} keeps {left} documents of settled messages");
    }
}

/// Many leased deliveries at once, committed, retried then committed, or dead-lettered: each
/// message ends where its outcome says, checked by id, and the lease and fence collections are
/// empty afterwards (they used to keep one document each per message, forever).
async fn leases_leave_nothing_behind(kind: QueueKind) {
    const N: usize = 240;
    let broker = Broker::from_env();
    let queue = Broker::unique("leases");
    let database = MongoNode::database_name("leases");
    let db = direct(&database).await;
    let scope = scope_with(&database, MongoConfig::new("e2e-leases").with_lease()).await;
    // Every third message fails once (retried, then committed), every third is refused for
    // good (the DLQ), the rest commit at once.
    let fate = |id: &str| {
        id.trim_start_matches("lease-")
            .parse::<usize>()
            .unwrap_or(0)
            % 3
    };
    let router = Router::new().route("order.placed", move |tx: MongoTx, meta: Meta| async move {
        write_effect(&tx, &meta, "handler").await?;
        match fate(meta.message_id()) {
            0 if meta.attempt() == 1 => Err(QueueHandlerError::retryable("downstream hiccup")),
            1 => Err(QueueHandlerError::permanent("refused")),
            _ => Ok(()),
        }
    });
    let cfg = config(&queue, kind).prefetch(50).concurrency(50);
    let running = start_scoped_with(broker.url(), cfg, router, scope);
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    let ids: Vec<String> = (0..N).map(|i| format!("lease-{i}")).collect();
    for id in &ids {
        client
            .send(&queue, "order.placed", id, b"{\"qty\":1}")
            .await;
    }
    let refused: Vec<&String> = ids.iter().filter(|id| fate(id) == 1).collect();
    common::wait_settled("every message settled", &queue, refused.len() as u64).await;
    let report = running.stop().await;
    assert!(report.unresolved.is_empty(), "{:?}", report.unresolved);

    let dead = client.drain_ids(&format!("{queue}.dlq")).await;
    let expected: std::collections::BTreeMap<String, usize> =
        refused.iter().map(|id| ((*id).clone(), 1)).collect();
    assert_eq!(
        dead, expected,
        "exactly the refused ids, once each, in the DLQ"
    );
    for id in &ids {
        let docs = effect_docs(&db, id).await;
        let want = usize::from(fate(id) != 1);
        assert_eq!(docs.len(), want, "{id}: effects {docs:?}");
    }
    assert_no_lease_left(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_leave_nothing_behind_on_a_classic_queue() {
    leases_leave_nothing_behind(QueueKind::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_leave_nothing_behind_on_a_quorum_queue() {
    leases_leave_nothing_behind(QueueKind::Quorum).await;
}

fn start_scoped_with(
    url: &str,
    config: ConsumerConfig,
    router: Router,
    scope: impl TransactionalScope,
) -> common::Running {
    common::start_with(url, config, router, |c| c.scope(scope))
}

/// A delivery dropped while its handler runs (shutdown forced mid-handler) takes its lease's
/// renewal with it: no orphaned renewal keeps extending the lease, which would make the
/// redelivery defer as if a live owner still held it, all the way to the DLQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_delivery_stops_renewing_its_lease() {
    let broker = Broker::from_env();
    let queue = Broker::unique("orphan");
    let database = MongoNode::database_name("orphan");
    let db = direct(&database).await;
    let scope = MongoScope::connect(
        MongoNode::from_env().url(),
        &database,
        MongoConfig::new("e2e-orphan")
            .lease_ttl(Duration::from_millis(300), Duration::from_secs(60)),
    )
    .await
    .expect("scope");
    let router = Router::new().route("order.placed", |_tx: MongoTx| async {
        std::future::pending::<Result<(), QueueHandlerError>>().await
    });
    let cfg = config(&queue, QueueKind::Classic).handler_timeout(Duration::from_secs(300));
    let running = start_scoped_with(broker.url(), cfg, router, scope);
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    client.send(&queue, "order.placed", "held-1", b"{}").await;

    let leases = db.collection::<Document>("lily_leases");
    let expiry = || async {
        leases
            .find_one(doc! {})
            .await
            .expect("read the lease")
            .and_then(|lease| lease.get_datetime("expires_at").ok().copied())
    };
    let started = Instant::now();
    while expiry().await.is_none() {
        assert!(started.elapsed() < WAIT, "the handler never took the lease");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.shutdown.force(Trigger::Api);
    let report = running.stop().await;
    assert_eq!(report.unresolved.len(), 1, "{:?}", report.unresolved);

    // Renewed every 100 ms while the handler ran; after the drop, never again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first = expiry().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        expiry().await,
        first,
        "the lease kept being renewed after its delivery was dropped"
    );
}

/// A scope reaching `database` through a proxy, and a router whose handler writes its effect,
/// then stalls the proxy (the database goes silent before the commit or the abort) and returns
/// `outcome`.
async fn silent_after_handler(
    database: &str,
    outcome: Result<(), QueueHandlerError>,
) -> (Arc<TcpProxy>, MongoScope, Router) {
    let proxy = Arc::new(TcpProxy::start(mongo_addr()).await);
    let scope = MongoScope::connect(&mongo_via(&proxy), database, MongoConfig::new("e2e-silent"))
        .await
        .expect("scope through the proxy");
    let stall = Arc::clone(&proxy);
    // Handed to the one handler call that fails or succeeds; later calls succeed.
    let outcome = Arc::new(Mutex::new(Some(outcome)));
    let router = Router::new().route("order.placed", move |tx: MongoTx, meta: Meta| {
        let (stall, outcome) = (Arc::clone(&stall), Arc::clone(&outcome));
        async move {
            write_effect(&tx, &meta, "silent").await?;
            stall.stall(true);
            outcome.lock().unwrap().take().unwrap_or(Ok(()))
        }
    });
    (proxy, scope, router)
}

/// The database stops answering right when a handler fails: the transaction's abort cannot
/// complete. The delivery still goes on to its retry within the budget instead of waiting on
/// the abort for as long as the database is silent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_the_database_never_answers_does_not_hold_the_delivery() {
    let broker = Broker::from_env();
    let queue = Broker::unique("silent-abort");
    let database = MongoNode::database_name("silent-abort");
    let (proxy, scope, router) = silent_after_handler(
        &database,
        Err(QueueHandlerError::retryable("downstream down")),
    )
    .await;
    let policy = common::fast_policy()
        .retry_delays([Duration::from_secs(600)])
        .settlement_budget(Duration::from_secs(2), Duration::from_millis(500));
    let running = start_scoped_with(broker.url(), scoped_config(&queue, policy), router, scope);
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    client.send(&queue, "order.placed", "silent-1", b"{}").await;
    let stats = running.stats.clone();
    let retried = eventually(Duration::from_secs(15), || stats.totals().retried == 1).await;
    proxy.stall(false);
    assert!(
        retried,
        "the delivery waited on the abort: {:?}",
        stats.totals()
    );
    let report = running.stop().await;
    assert!(report.clean, "{:?}", report.unresolved);
}

/// The database stops answering right after a handler succeeded: the commit times out and its
/// outcome is unknown, and so would be the deferral count and the lease release after it. All
/// of it is bounded: the delivery is deferred within the budget instead of waiting on a silent
/// database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_the_database_never_answers_defers_within_the_budget() {
    let broker = Broker::from_env();
    let queue = Broker::unique("silent-commit");
    let database = MongoNode::database_name("silent-commit");
    let db = direct(&database).await;
    let (proxy, scope, router) = silent_after_handler(&database, Ok(())).await;
    let running = start_scoped_with(
        broker.url(),
        scoped_config(&queue, deferring_policy(50)),
        router,
        scope,
    );
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    client.send(&queue, "order.placed", "silent-1", b"{}").await;
    let stats = running.stats.clone();
    let deferred = eventually(Duration::from_secs(15), || stats.totals().deferred >= 1).await;
    proxy.stall(false);
    assert!(
        deferred,
        "the delivery waited on the database: {:?}",
        stats.totals()
    );
    let report = running.stop().await;
    assert_eq!(report.totals.dead_lettered, 0, "{:?}", report.totals);
    // Whether the buffered commit reached the database once it answered again is the
    // database's to say; the effect never exists twice.
    let docs = effect_docs(&db, "silent-1").await;
    assert!(docs.len() <= 1, "the effect exists at most once: {docs:?}");
}

/// The database goes away while twenty handlers, each holding its message's lease, wait to
/// commit: the commits, their deferral counts and the lease releases all fail, so every lease
/// stays in the database, unexpired (30 s), its release unanswered. When the database is back,
/// each message's next handling in this process takes its own abandoned lease over at once
/// instead of waiting it out in a bucket as it would another owner's: nothing waits, and every
/// message has its effect exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_left_behind_by_an_outage_are_taken_over_by_the_next_handling_at_once() {
    const N: usize = 20;
    let broker = Broker::from_env();
    let queue = Broker::unique("abandoned");
    let database = MongoNode::database_name("abandoned");
    let db = direct(&database).await;
    // Created first: the first handlings' transactions never commit, so twenty redeliveries
    // would create it at once, conflict, and spend attempts.
    db.create_collection("effects")
        .await
        .expect("create effects");
    let proxy = Arc::new(TcpProxy::start(mongo_addr()).await);
    let scope = MongoScope::connect(
        &mongo_via(&proxy),
        &database,
        MongoConfig::new("e2e-abandoned").with_lease(),
    )
    .await
    .expect("scope through the proxy");
    // Each message's first handling writes its effect, then waits for the outage.
    let first_runs = Counter::default();
    let gone = Arc::new(tokio::sync::Notify::new());
    let seen = Arc::new(Mutex::new(std::collections::HashSet::<String>::new()));
    let router = {
        let (first_runs, gone, seen) = (first_runs.clone(), Arc::clone(&gone), Arc::clone(&seen));
        Router::new().route("order.placed", move |tx: MongoTx, meta: Meta| {
            let (first_runs, gone, seen) =
                (first_runs.clone(), Arc::clone(&gone), Arc::clone(&seen));
            async move {
                write_effect(&tx, &meta, "abandoned").await?;
                if seen.lock().unwrap().insert(meta.message_id().to_owned()) {
                    let outage = gone.notified();
                    first_runs.bump();
                    outage.await;
                }
                Ok(())
            }
        })
    };
    let cfg = scoped_config(&queue, deferring_policy(100))
        .concurrency(N)
        .handler_timeout(Duration::from_secs(120));
    let running = start_scoped_with(broker.url(), cfg, router, scope);
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    let ids: Vec<String> = (0..N).map(|i| format!("abandoned-{i}")).collect();
    for id in &ids {
        client.send(&queue, "order.placed", id, b"{}").await;
    }
    assert!(
        eventually(WAIT, || first_runs.get() as usize == N).await,
        "every handler took its lease and ran: {}",
        first_runs.get()
    );
    let leases = db.collection::<Document>("lily_leases");
    let held = leases.count_documents(doc! {}).await.expect("count leases");
    assert_eq!(held, N as u64, "one lease per message");

    proxy.refuse(true);
    proxy.cut();
    gone.notify_waiters();
    // Every delivery deferred at least once while the database was away.
    running
        .wait_for("the commits deferred", WAIT, |t| t.deferred >= N as u64)
        .await;
    let left = leases.count_documents(doc! {}).await.expect("count leases");
    assert_eq!(left, N as u64, "the releases never reached the database");
    proxy.refuse(false);

    let stats = running.stats.clone();
    let handled = eventually(WAIT, || stats.totals().acked >= N as u64).await;
    let report = running.stop().await;
    let t = &report.totals;
    assert!(handled, "every message handled: {t:?}");
    assert_eq!(t.waited, 0, "a delivery waited out its own lease: {t:?}");
    assert_eq!(
        t.retried + t.dead_lettered,
        0,
        "an outage spent attempts: {t:?}"
    );
    for id in &ids {
        let docs = effect_docs(&db, id).await;
        assert_eq!(docs.len(), 1, "{id}: exactly one effect: {docs:?}");
    }
    assert_dlq_empty(&client, &queue).await;
    assert_eq!(client.depth(&queue).await, 0);
    assert_eq!(
        leases.count_documents(doc! {}).await.expect("count leases"),
        0,
        "every lease released in the end"
    );
}

/// Twenty messages at once; the first lease acquisition's write reaches the database and takes
/// the lease, but its answer is withheld (the connection stays open and silent for 5 s) until
/// the handling's budget (2 s) gives up on it and defers the delivery. The scope remembers the
/// acquisition it gave up on, so the message's next handling takes that lease over at once
/// instead of waiting out a lease nobody holds (30 s) in a bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_taken_by_an_acquisition_given_up_on_is_taken_over_at_once() {
    const N: usize = 20;
    let broker = Broker::from_env();
    let queue = Broker::unique("given-up");
    let database = MongoNode::database_name("given_up");
    let db = direct(&database).await;
    // Created first: twenty transactions creating it at once would conflict, spending attempts.
    db.create_collection("effects")
        .await
        .expect("create effects");
    let proxy = Arc::new(TcpProxy::start(mongo_addr()).await);
    let scope = MongoScope::connect(
        &mongo_via(&proxy),
        &database,
        MongoConfig::new("e2e-given-up").with_lease(),
    )
    .await
    .expect("scope through the proxy");
    // The command that acquires a lease: `findAndModify` on `lily_leases`, as BSON spells it.
    proxy.silence_reply_after(
        b"findAndModify\x00\x0c\x00\x00\x00lily_leases",
        Duration::from_secs(5),
    );
    let router = Router::new().route("order.placed", |tx: MongoTx, meta: Meta| async move {
        write_effect(&tx, &meta, "given-up").await
    });
    let cfg = scoped_config(&queue, deferring_policy(100)).concurrency(N);
    let running = start_scoped_with(broker.url(), cfg, router, scope);
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    let ids: Vec<String> = (0..N).map(|i| format!("given-up-{i}")).collect();
    for id in &ids {
        client.send(&queue, "order.placed", id, b"{}").await;
    }
    let stats = running.stats.clone();
    let handled = eventually(WAIT, || stats.totals().acked >= N as u64).await;
    let report = running.stop().await;
    let t = &report.totals;
    assert!(handled, "every message handled: {t:?}");
    assert!(proxy.tripped(), "an acquisition's answer was withheld");
    assert!(
        t.deferred >= 1,
        "the handling gave up on its acquisition: {t:?}"
    );
    assert_eq!(
        t.waited, 0,
        "a delivery waited out a lease it had taken: {t:?}"
    );
    assert_eq!(t.retried + t.dead_lettered, 0, "attempts spent: {t:?}");
    for id in &ids {
        let docs = effect_docs(&db, id).await;
        assert_eq!(docs.len(), 1, "{id}: exactly one effect: {docs:?}");
    }
    assert_dlq_empty(&client, &queue).await;
    assert_eq!(client.depth(&queue).await, 0);
    let leases = db.collection::<Document>("lily_leases");
    assert_eq!(
        leases.count_documents(doc! {}).await.expect("count leases"),
        0,
        "every lease released in the end"
    );
}

/// Twenty messages, each failing its first attempt, so each handling releases its lease
/// without a commit; every delete of a fence document is cut before it reaches the database
/// (and so is the driver's retry of it). The lease, which carries the fence count, must not
/// go without its fence document: had it gone, each message's retry would take a lease
/// counting from one again, below the fence document left behind, and fail its fence check at
/// every commit, waiting in a bucket each time until its waits ran out. Kept, and abandoned,
/// it is taken over by the retry at once, its fence raised past the document's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_whose_fence_could_not_be_deleted_keeps_its_count() {
    const N: usize = 20;
    let broker = Broker::from_env();
    let queue = Broker::unique("fence-kept");
    let database = MongoNode::database_name("fence_kept");
    let db = direct(&database).await;
    db.create_collection("effects")
        .await
        .expect("create effects");
    let proxy = Arc::new(TcpProxy::start(mongo_addr()).await);
    let scope = MongoScope::connect(
        &mongo_via(&proxy),
        &database,
        MongoConfig::new("e2e-fence-kept").with_lease(),
    )
    .await
    .expect("scope through the proxy");
    // `delete` on `lily_fences`, as BSON spells the command's first element.
    proxy.cut_when_sent(Some(b"delete\x00\x0c\x00\x00\x00lily_fences"));
    // Every first attempt fails once all twenty run, so their releases come together, long
    // before the first retry copy is back (10 s) and can meet the cut itself.
    let first_runs = Counter::default();
    let router = {
        let first_runs = first_runs.clone();
        Router::new().route("order.placed", move |tx: MongoTx, meta: Meta| {
            let first_runs = first_runs.clone();
            async move {
                write_effect(&tx, &meta, "fence-kept").await?;
                if meta.attempt() > 1 {
                    return Ok(());
                }
                first_runs.bump();
                eventually(WAIT, || first_runs.get() as usize >= N).await;
                Err(QueueHandlerError::retryable("downstream hiccup"))
            }
        })
    };
    let policy = deferring_policy(100).retry_delays([Duration::from_secs(10)]);
    let cfg = scoped_config(&queue, policy)
        .concurrency(N)
        .handler_timeout(Duration::from_secs(120));
    let running = start_scoped_with(broker.url(), cfg, router, scope);
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    let ids: Vec<String> = (0..N).map(|i| format!("fence-kept-{i}")).collect();
    for id in &ids {
        client.send(&queue, "order.placed", id, b"{}").await;
    }
    // Every first attempt released its lease (the fence's delete cut) before its retry copy
    // went out; the copies come back later, with the deletes allowed again.
    running
        .wait_for("every first attempt handed to a retry bucket", WAIT, |t| {
            t.retried >= N as u64
        })
        .await;
    proxy.cut_when_sent(None);
    assert!(proxy.cut_sends() >= 1, "a fence's delete was cut");
    let stats = running.stats.clone();
    let handled = eventually(WAIT, || stats.totals().acked >= N as u64).await;
    let report = running.stop().await;
    let t = &report.totals;
    assert!(handled, "every message handled: {t:?}");
    assert_eq!(t.waited, 0, "a retry failed its fence check: {t:?}");
    assert_eq!(t.dead_lettered, 0, "{t:?}");
    for id in &ids {
        let docs = effect_docs(&db, id).await;
        assert_eq!(docs.len(), 1, "{id}: exactly one effect: {docs:?}");
    }
    assert_dlq_empty(&client, &queue).await;
    assert_eq!(client.depth(&queue).await, 0);
    for name in ["lily_leases", "lily_fences"] {
        let left = db
            .collection::<Document>(name)
            .count_documents(doc! {})
            .await;
        assert_eq!(
            left.expect("count"),
            0,
            "{name}: every document gone in the end"
        );
    }
}

/// Ten redelivered messages at once; the write that marks a handling as begun reaches the
/// database, but its answer is withheld (3 s) past the scope's budget (2 s), again and again, so
/// those handlings are given up on and deferred. Their workers live and settled them: the marks
/// they may have left are theirs to remove, and no later handling may count them as deaths (a
/// message "killing its worker" would reach the DLQ after as many as the requeue limit, spread
/// over workers that each count only their own requeues).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handling_given_up_on_while_marking_it_is_no_death() {
    const N: usize = 10;
    let broker = Broker::from_env();
    let queue = Broker::unique("given-up-mark");
    let database = MongoNode::database_name("given_up_mark");
    let db = direct(&database).await;
    db.create_collection("effects")
        .await
        .expect("create effects");
    let router = || {
        Router::new().route("order.placed", |tx: MongoTx, meta: Meta| async move {
            write_effect(&tx, &meta, "given-up-mark").await
        })
    };
    let cfg = || scoped_config(&queue, deferring_policy(100)).concurrency(N);
    // Declared by a first start; then the messages are sent and come back redelivered, as
    // after a worker's death.
    let first = start_scoped_with(broker.url(), cfg(), router(), scope(&database).await);
    first.wait_ready().await;
    first.stop().await;
    let client = Client::connect(broker.url()).await;
    let ids: Vec<String> = (0..N).map(|i| format!("given-up-mark-{i}")).collect();
    for id in &ids {
        client.send(&queue, "order.placed", id, b"{}").await;
    }
    let holder = Client::connect(broker.url()).await;
    let (_held, n) = holder.hold(&queue, N as u16).await;
    assert_eq!(n as usize, N, "every message held once");
    holder.close().await;

    let proxy = Arc::new(TcpProxy::start(mongo_addr()).await);
    let scope = MongoScope::connect(&mongo_via(&proxy), &database, MongoConfig::new("e2e-mark"))
        .await
        .expect("scope through the proxy");
    // The command that marks a handling: `findAndModify` on `lily_deferrals`.
    const MARK: &[u8] = b"findAndModify\x00\x0f\x00\x00\x00lily_deferrals";
    let trips = {
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move {
            let mut trips = 0;
            while trips < N {
                proxy.silence_reply_after(MARK, Duration::from_secs(3));
                while !proxy.tripped() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                trips += 1;
            }
        })
    };
    let running = start_scoped_with(broker.url(), cfg(), router(), scope);
    let stats = running.stats.clone();
    let handled = eventually(WAIT, || stats.totals().acked >= N as u64).await;
    trips.abort();
    let report = running.stop().await;
    let t = &report.totals;
    assert!(handled, "every message handled: {t:?}");
    assert!(proxy.tripped(), "a mark's answer was withheld");
    assert!(t.deferred >= 1, "a handling was given up on: {t:?}");
    assert_eq!(t.dead_lettered, 0, "{t:?}");
    for id in &ids {
        let docs = effect_docs(&db, id).await;
        assert_eq!(docs.len(), 1, "{id}: exactly one effect: {docs:?}");
    }
    assert_dlq_empty(&client, &queue).await;
    assert_eq!(client.depth(&queue).await, 0);
    // The evidence of deaths, read from the database: none, as no worker died.
    let dead = db
        .collection::<Document>("lily_deferrals")
        .count_documents(doc! { "d": { "$gt": 0 } })
        .await
        .expect("count deaths");
    assert_eq!(dead, 0, "deaths counted though every worker lived: {t:?}");
}

/// Takes one unit of the shared stock and records the effect, inside the transaction. Every
/// delivery updates the same document, so concurrent transactions conflict.
async fn take_stock(tx: MongoTx, meta: Meta) -> Result<(), QueueHandlerError> {
    let fail = |e: lily_mq_mongo::mongodb::error::Error| {
        if e.contains_label(lily_mq_mongo::mongodb::error::TRANSIENT_TRANSACTION_ERROR) {
            QueueHandlerError::transient("stock update: write conflict").with_source(e)
        } else {
            QueueHandlerError::retryable("stock update failed").with_source(e)
        }
    };
    let database = tx.database();
    let mut session = tx.session().await;
    database
        .collection::<Document>("stock")
        .update_one(doc! { "_id": "sku" }, doc! { "$inc": { "taken": 1_i64 } })
        .session(&mut *session)
        .await
        .map_err(fail)?;
    database
        .collection::<Document>("effects")
        .insert_one(doc! { "message_id": meta.message_id() })
        .session(&mut *session)
        .await
        .map_err(fail)?;
    Ok(())
}

/// Many deliveries update the same document inside their transactions at once, so write
/// conflicts are everywhere. A transient transaction error runs the whole transaction again
/// in-process: every message takes its unit exactly once, none uses an application attempt, none
/// reaches the DLQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_conflicts_run_the_transaction_again_instead_of_using_attempts() {
    const ORDERS: usize = 100;
    let broker = Broker::from_env();
    let queue = Broker::unique("contended");
    let database = MongoNode::database_name("contended");
    let db = direct(&database).await;
    db.collection::<Document>("stock")
        .insert_one(doc! { "_id": "sku", "taken": 0_i64 })
        .await
        .expect("seed the stock");
    let scope = scope(&database).await;
    let router = Router::new().route("order.placed", take_stock);
    let cfg = config(&queue, QueueKind::Classic)
        .prefetch(20)
        .concurrency(20);
    let running = start_scoped_with(broker.url(), cfg, router, scope);
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    for i in 0..ORDERS {
        client
            .send(&queue, "order.placed", &format!("c-{i}"), b"{}")
            .await;
    }
    common::wait_settled("every order ACKed", &queue, 0).await;
    let report = running.stop().await;
    let t = &report.totals;
    assert_eq!(
        (t.acked, t.retried, t.dead_lettered),
        (ORDERS as u64, 0, 0),
        "{t:?}"
    );
    assert!(report.clean, "{:?}", report.unresolved);
    let stock = db
        .collection::<Document>("stock")
        .find_one(doc! { "_id": "sku" })
        .await
        .expect("read the stock")
        .expect("the stock");
    assert_eq!(int(&stock, "taken"), ORDERS as i64, "{stock:?}");
    for i in 0..ORDERS {
        let id = format!("c-{i}");
        assert_eq!(effect_docs(&db, &id).await.len(), 1, "{id}");
    }
    assert_dlq_empty(&client, &queue).await;
}

/// An operator replays the DLQ into the work queue as it is, copies and headers untouched (a
/// shovel, a script): the copies keep the message's identity, so the inbox decides. A
/// conflicting body is a conflict again, never a second effect; a message that failed for good
/// runs once now that its cause is fixed; replaying it a second time by mistake is a suppressed
/// duplicate. Checked from outside: the effects in the database and the queues, by id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaying_the_dlq_keeps_identity_so_the_inbox_prevents_a_second_effect() {
    let broker = Broker::from_env();
    let queue = Broker::unique("replay");
    let scope = scope(&MongoNode::database_name("replay")).await;
    let broken = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rule = Arc::clone(&broken);
    let router = Router::new().route("order.placed", move |tx: MongoTx, meta: Meta| {
        let broken = rule.load(Ordering::Acquire);
        async move {
            if broken {
                return Err(QueueHandlerError::permanent("rejected by a business rule"));
            }
            record_effect(tx, meta).await
        }
    });
    let running = start_scoped(broker.url(), &queue, router, scope.clone());
    let client = Client::connect(broker.url()).await;
    common::wait_declared(broker.url(), &queue).await;
    let dlq = format!("{queue}.dlq");

    client
        .send(&queue, "order.placed", "order-a", b"{\"qty\":1}")
        .await;
    // ACKed (so committed): nothing ready or unacknowledged, the DLQ empty.
    common::wait_settled("order-a handled", &queue, 0).await;
    client
        .send(&queue, "order.placed", "order-a", b"{\"qty\":9}")
        .await;
    common::wait_settled("the conflict dead-lettered", &queue, 1).await;
    broken.store(true, Ordering::Release);
    client
        .send(&queue, "order.placed", "order-b", b"{\"qty\":2}")
        .await;
    common::wait_settled("the failure dead-lettered", &queue, 2).await;
    broken.store(false, Ordering::Release);

    // The replay: every copy back into the work queue, as it is; order-b's copy kept aside for a
    // second replay by mistake.
    let copies = client.drain(&dlq).await;
    assert_eq!(copies.len(), 2);
    let mut again = None;
    for copy in &copies {
        let properties = copy.delivery.properties.clone();
        if properties.message_id().as_ref().map(|id| id.as_str()) == Some("order-b") {
            again = Some((copy.delivery.data.clone(), properties.clone()));
        }
        client
            .publish(&queue, &copy.delivery.data, properties)
            .await;
    }
    common::wait_settled("the conflict dead-lettered again", &queue, 1).await;
    let (body, properties) = again.expect("order-b's copy");
    client.publish(&queue, &body, properties).await;
    common::wait_settled("the second replay settled", &queue, 1).await;
    let report = running.stop().await;

    assert_eq!(effects(&scope, "order-a").await, 1, "order-a: one effect");
    assert_eq!(effects(&scope, "order-b").await, 1, "order-b: one effect");
    assert_eq!(
        report.totals.duplicates_suppressed, 1,
        "{:?}",
        report.totals
    );
    let left = client.drain(&dlq).await;
    assert_eq!(left.len(), 1);
    let properties = &left[0].delivery.properties;
    assert_eq!(
        properties.message_id().as_ref().map(|id| id.as_str()),
        Some("order-a")
    );
    assert!(
        header_str(properties, "x-lily-reason")
            .unwrap_or_default()
            .contains("inbox conflict")
    );
    assert_eq!(left[0].delivery.data, b"{\"qty\":9}");
}

/// The failure matrix's row "the dedup record expires before a delayed redelivery": Lily does
/// not block it. The inbox record lives `inbox_retention` (a TTL index on `at`); once mongod's
/// TTL monitor has removed it, as this test does by hand, a redelivery runs the handler again.
/// The boundary the MongoDB chapter states: keep the retention longer than the redelivery horizon.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_after_its_inbox_record_expired_runs_again() {
    let broker = Broker::from_env();
    let queue = Broker::unique("expired");
    let database = MongoNode::database_name("expired");
    let retention = Duration::from_secs(3600);
    let scope = scope_with(
        &database,
        MongoConfig::new("e2e").inbox_retention(retention),
    )
    .await;
    let router = Router::new().route("order.placed", record_effect);
    let running = start_scoped(broker.url(), &queue, router, scope.clone());
    let client = Client::connect(broker.url()).await;
    common::wait_declared(broker.url(), &queue).await;
    let db = direct(&database).await;

    // The record expires through a TTL index of exactly the retention.
    let inbox = db.collection::<Document>("lily_inbox");
    let mut indexes = inbox.list_indexes().await.expect("list indexes");
    let mut ttl = None;
    while indexes.advance().await.expect("index cursor") {
        let index = indexes.deserialize_current().expect("index");
        if index.keys == doc! { "at": 1 } {
            ttl = index.options.and_then(|o| o.expire_after);
        }
    }
    assert_eq!(ttl, Some(retention));

    client
        .send(&queue, "order.placed", "late-1", b"{\"qty\":1}")
        .await;
    common::wait_depths("handled", WAIT, &[(&queue, 0)]).await;
    assert_eq!(effects(&scope, "late-1").await, 1);
    let removed = inbox.delete_many(doc! {}).await.expect("expire");
    assert_eq!(removed.deleted_count, 1, "one inbox record");
    client
        .send(&queue, "order.placed", "late-1", b"{\"qty\":1}")
        .await;
    common::wait_depths("redelivery handled", WAIT, &[(&queue, 0)]).await;
    running.stop().await;
    assert_eq!(
        effects(&scope, "late-1").await,
        2,
        "past the retention the inbox cannot recognise the message"
    );
}
