//! The outbox against the real broker and mongod, checked by message id in the database and
//! the queues: a handler's staged messages exist exactly when its transaction committed, and
//! the relay publishes each once, or ends it failed with its reason.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{config, mongo_addr, mongo_via};
use lily::prelude::*;
use lily_mq_mongo::mongodb::bson::{Document, doc};
use lily_mq_mongo::{
    MongoConfig, MongoScope, MongoTx, Outbox, OutboxReport, Relay, RelayConfig, StageError,
};
use lily_mq_testkit::{Broker, Client, MongoNode, TcpProxy};
use tokio_util::sync::CancellationToken;

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

/// 300 orders at once, each handler writing its effect and staging one event to a queue. A
/// third fail their first attempt after staging (retried later through a bucket), a third meet
/// a transient error after staging (the transaction runs again in process): the aborted tries
/// leave nothing. The consumer's own relay publishes what committed. Each order ends with one
/// effect, one record marked sent that reads back as what was staged, and its event in the
/// queue exactly once; the shutdown report says what the relay sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_messages_are_staged_exactly_when_its_transaction_commits() {
    let broker = Broker::from_env();
    let queue = Broker::unique("outbox");
    let events = format!("{queue}.events");
    let client = Client::connect(broker.url()).await;
    client.declare(&events, true).await;
    let scope = scope(&MongoNode::database_name("outbox")).await;
    let to = Destination::queue(&events);
    let router = Router::new().route(
        "order.placed",
        move |tx: MongoTx, outbox: Outbox, meta: Meta| {
            let to = to.clone();
            async move {
                let order = meta.message_id().to_owned();
                tx.database()
                    .collection::<Document>("effects")
                    .insert_one(doc! { "message_id": &order })
                    .session(&mut *tx.session().await)
                    .await
                    .map_err(|e| lily_mq_mongo::handler_error("effect", e))?;
                outbox.stage(&to, &event(&order)).await?;
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
            }
        },
    );
    let running = common::start_with(
        broker.url(),
        config(&queue, QueueKind::Quorum),
        router,
        |c| c.scope(scope.clone()),
    );
    common::wait_declared(broker.url(), &queue).await;
    place_orders(&client, &queue, MESSAGES).await;
    common::wait_settled("every order", &queue, 0).await;
    wait_unstaged(&scope).await;
    let report = running.stop().await;
    assert!(
        report.totals.retried >= (MESSAGES / 3) as u64,
        "{:?}",
        report.totals
    );
    let relayed = report.outbox.expect("the consumer ran the relay");
    assert_eq!(
        (relayed.sent, relayed.failed, relayed.staged),
        (MESSAGES as u64, 0, Some(0)),
        "{relayed:?}"
    );

    let found = staged(&scope).await;
    let published = client.drain_ids(&events).await;
    for n in 0..MESSAGES {
        let order = format!("order-{n}");
        let id = format!("{order}.reserved");
        let records = found.get(&id).map_or(&[][..], Vec::as_slice);
        assert_eq!(records.len(), 1, "{id}: staged once");
        let record = &records[0];
        assert_eq!(record.get_str("state"), Ok("sent"));
        assert_eq!(record.get_str("exchange"), Ok(""));
        assert_eq!(record.get_str("routing_key"), Ok(events.as_str()));
        let bytes = &record
            .get_binary_generic("message")
            .expect("message")
            .clone();
        let message = Outgoing::decode(bytes).expect("decodes");
        assert_eq!(message.message_id(), id);
        assert_eq!(message.body(), event(&order).body());
        assert_eq!(published.get(&id), Some(&1), "{id}: in the queue once");
        let effects = scope
            .database()
            .collection::<Document>("effects")
            .count_documents(doc! { "message_id": &order })
            .await
            .expect("count effects");
        assert_eq!(effects, 1, "{order}: one effect");
    }
    assert_eq!(found.len(), MESSAGES, "nothing else staged");
    assert_eq!(published.len(), MESSAGES, "nothing else published");
    client.delete(&events).await;
}

/// Waits until nothing in `scope`'s outbox is staged, at most 60 s.
async fn wait_unstaged(scope: &MongoScope) {
    let records = scope.database().collection::<Document>("lily_outbox");
    let started = std::time::Instant::now();
    while records
        .count_documents(doc! { "state": "staged" })
        .await
        .expect("count")
        > 0
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "still staged after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// While another owner holds the outbox's lease, the consumer's relay publishes nothing: its
/// shutdown report counts the 50 messages that stay staged and is clean (they are durable, not
/// lost). Once the lease is free, a relay publishes each of them, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shutdown_report_counts_what_stays_staged() {
    const ORDERS: usize = 50;
    let broker = Broker::from_env();
    let queue = Broker::unique("outbox-held");
    let events = format!("{queue}.events");
    let client = Client::connect(broker.url()).await;
    client.declare(&events, true).await;
    let scope = scope(&MongoNode::database_name("outbox-held")).await;
    let lease = doc! { "_id": "outbox", "owner": "elsewhere", "expires_at": mongodb_in(3600) };
    let relays = scope
        .database()
        .collection::<Document>("lily_outbox_relays");
    relays
        .insert_one(lease)
        .await
        .expect("lease held elsewhere");
    let router = staging_router(&events);
    let running = common::start_with(
        broker.url(),
        config(&queue, QueueKind::Classic),
        router,
        |c| c.scope(scope.clone()),
    );
    common::wait_declared(broker.url(), &queue).await;
    place_orders(&client, &queue, ORDERS).await;
    common::wait_settled("every order", &queue, 0).await;
    let report = running.stop().await;
    let relayed = report.outbox.clone().expect("the consumer ran the relay");
    assert_eq!(
        (relayed.sent, relayed.failed, relayed.staged),
        (0, 0, Some(ORDERS as u64)),
        "{relayed:?}"
    );
    assert!(report.clean, "staged messages are not unresolved");
    assert!(
        report
            .termination_summary()
            .contains(&format!("staged={ORDERS}")),
        "{}",
        report.termination_summary()
    );
    assert!(
        client.drain_ids(&events).await.is_empty(),
        "nothing published"
    );

    relays
        .delete_one(doc! { "_id": "outbox" })
        .await
        .expect("lease given up");
    let publisher = Arc::new(Publisher::connect(broker.url()).await.expect("publisher"));
    let total = relay_all(&scope, &publisher, 1).await;
    assert_eq!(total.sent, ORDERS as u64, "{total:?}");
    let published = client.drain_ids(&events).await;
    for n in 0..ORDERS {
        let id = format!("order-{n}.reserved");
        assert_eq!(published.get(&id), Some(&1), "{id}: in the queue once");
    }
    assert_eq!(published.len(), ORDERS);
    Arc::into_inner(publisher)
        .expect("relay done")
        .close()
        .await;
    client.delete(&events).await;
}

/// An idle relay polls every 30 s here, yet events staged by the consumer's deliveries are
/// published at once: a commit that staged a message wakes this process's relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_staged_wakes_the_relay_at_once() {
    const ORDERS: usize = 20;
    let broker = Broker::from_env();
    let queue = Broker::unique("outbox-wake");
    let events = format!("{queue}.events");
    let client = Client::connect(broker.url()).await;
    client.declare(&events, false).await;
    let relay = RelayConfig::default().poll(Duration::from_secs(30));
    let scope = MongoScope::connect(
        MongoNode::from_env().url(),
        &MongoNode::database_name("outbox-wake"),
        MongoConfig::new("e2e").relay(relay),
    )
    .await
    .expect("mongo scope");
    let router = staging_router(&events);
    let running = common::start_with(
        broker.url(),
        config(&queue, QueueKind::Classic),
        router,
        |c| c.scope(scope.clone()),
    );
    running.wait_ready().await;
    // The relay found nothing and sleeps its poll.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let sent = std::time::Instant::now();
    place_orders(&client, &queue, ORDERS).await;
    while client.depth(&events).await < ORDERS as u32 {
        assert!(
            sent.elapsed() < Duration::from_secs(10),
            "not published within 10 s of the commits"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "{ORDERS} events published {:?} after the orders were sent",
        sent.elapsed()
    );
    let report = running.stop().await;
    assert_eq!(
        report.outbox.map(|o| (o.sent, o.staged)),
        Some((ORDERS as u64, Some(0)))
    );
    let ids = client.drain_ids(&events).await;
    assert_eq!(ids.len(), ORDERS);
    assert!(ids.values().all(|n| *n == 1), "{ids:?}");
    client.delete(&events).await;
}

/// mongod stops answering (a proxy forwards nothing, closes nothing) while the consumer's relay
/// polls: shutdown still ends within its budget, and the report has the relay's count, with
/// what stays staged unknown. A relay stuck on its read would be dropped at the budget's end,
/// and the report would have no outbox count at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_database_does_not_hold_the_relay_past_shutdown() {
    let broker = Broker::from_env();
    let queue = Broker::unique("outbox-silent");
    let proxy = TcpProxy::start(mongo_addr()).await;
    let scope = MongoScope::connect(
        &mongo_via(&proxy),
        &MongoNode::database_name("outbox-silent"),
        MongoConfig::new("e2e").relay(RelayConfig::default().poll(Duration::from_millis(20))),
    )
    .await
    .expect("scope through the proxy");
    let router = Router::new().route("order.placed", |_: Meta| async { Ok(()) });
    let running = common::start_within(
        broker.url(),
        config(&queue, QueueKind::Classic),
        router,
        |c| c.scope(scope),
        Duration::from_secs(10),
    );
    running.wait_ready().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.stall(true);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stopping = std::time::Instant::now();
    let report = running.stop().await;
    let took = stopping.elapsed();
    proxy.stall(false);
    assert!(took < Duration::from_secs(10), "shutdown took {took:?}");
    let relayed = report.outbox.expect("the relay returned its count");
    assert_eq!((relayed.sent, relayed.staged), (0, None), "{relayed:?}");
}

/// The database's time `seconds` from now.
fn mongodb_in(seconds: i64) -> lily_mq_mongo::mongodb::bson::DateTime {
    let now = lily_mq_mongo::mongodb::bson::DateTime::now().timestamp_millis();
    lily_mq_mongo::mongodb::bson::DateTime::from_millis(now + seconds * 1000)
}

/// A router whose `order.placed` handler stages the order's event for the queue `events`.
fn staging_router(events: &str) -> Router {
    let to = Destination::queue(events);
    Router::new().route("order.placed", move |outbox: Outbox, meta: Meta| {
        let to = to.clone();
        async move { outbox.stage(&to, &event(meta.message_id())).await }
    })
}

/// Publishes `order-0` … `order-{n-1}` to `queue`.
async fn place_orders(client: &Client, queue: &str, n: usize) {
    for i in 0..n {
        client
            .send(queue, "order.placed", &format!("order-{i}"), b"{}")
            .await;
    }
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

/// What a staged event is meant to meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Routed,
    Unroutable,
    NoExchange,
    TooLarge,
    /// To `amq.fanout`, which the publishing user may not write to.
    Forbidden,
}

/// Stages `fates.len()` events in one transaction, `event-<n>` meeting `fates[n]`.
async fn stage_events(scope: &MongoScope, queue: &str, fates: &[Fate]) {
    let outbox = scope.outbox();
    let mongo = scope.database().client().clone();
    let mut session = mongo.start_session().await.expect("session");
    session.start_transaction().await.expect("start");
    for (n, fate) in fates.iter().enumerate() {
        let (to, size) = match fate {
            Fate::Routed => (Destination::queue(queue), 10),
            Fate::Unroutable => (Destination::queue(&format!("{queue}.nowhere")), 10),
            Fate::NoExchange => (Destination::exchange(&format!("{queue}.no-such"), "k"), 10),
            Fate::TooLarge => (Destination::queue(queue), 4096),
            Fate::Forbidden => (Destination::exchange("amq.fanout", "k"), 10),
        };
        let body = serde_json::json!({ "n": n, "pad": "x".repeat(size) });
        let message =
            Outgoing::json("stock.reserved", &format!("event-{n}"), &body).expect("serializes");
        outbox
            .stage(&mut session, &to, &message)
            .await
            .expect("stage");
    }
    session.commit_transaction().await.expect("commit");
}

/// Runs `relays` relays until nothing is staged and they are idle; their reports summed.
async fn relay_all(scope: &MongoScope, publisher: &Arc<Publisher>, relays: usize) -> OutboxReport {
    let stop = CancellationToken::new();
    let tasks: Vec<_> = (0..relays)
        .map(|_| {
            let config = RelayConfig::default()
                .max_body(1024)
                .poll(Duration::from_millis(50));
            let relay = Relay::new(scope, Arc::clone(publisher), config);
            tokio::spawn(relay.run(stop.clone()))
        })
        .collect();
    wait_unstaged(scope).await;
    // Idle now: nothing more may be published or marked.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    let mut total = OutboxReport::default();
    for task in tasks {
        let report = task.await.expect("relay task");
        total.sent += report.sent;
        total.failed += report.failed;
        assert_eq!(report.staged, Some(0));
    }
    total
}

/// Checks each event's record and copies in `found` against its fate.
async fn check_fates(scope: &MongoScope, fates: &[Fate], found: &BTreeMap<String, usize>) {
    let records = scope.database().collection::<Document>("lily_outbox");
    for (n, fate) in fates.iter().enumerate() {
        let id = format!("event-{n}");
        let record = records
            .find_one(doc! { "message_id": &id })
            .await
            .expect("find")
            .expect("record kept");
        let state = record.get_str("state").expect("state");
        let reason = record.get_str("reason").unwrap_or("");
        let copies = found.get(&id).copied().unwrap_or(0);
        let expected = match fate {
            Fate::Routed => {
                assert_eq!(copies, 1, "{id}: in the queue once");
                assert_eq!(state, "sent", "{id}");
                assert!(record.get_datetime("expires_at").is_ok(), "{id} expires");
                continue;
            }
            Fate::Unroutable => "returned",
            Fate::NoExchange => "does not exist",
            Fate::TooLarge => "maximum message size",
            Fate::Forbidden => "access refused: the write permission on exchange 'amq.fanout'",
        };
        assert_eq!(copies, 0, "{id} ({fate:?}) in no queue");
        assert_eq!(state, "failed", "{id} ({fate:?})");
        assert!(reason.contains(expected), "{id} ({fate:?}): {reason}");
    }
    let routed = fates.iter().filter(|f| **f == Fate::Routed).count();
    assert_eq!(
        found.keys().filter(|id| id.starts_with("event-")).count(),
        routed,
        "nothing else"
    );
}

/// 400 events staged, interleaved: routed to a queue, unroutable (no queue bound) and over the
/// relay's body limit. Two relays run at once. Each routed event is in the queue exactly once
/// (the lease keeps the second relay from publishing alongside the first) and marked sent with
/// its expiry; each other one ends failed with its reason, in no queue; and nothing loops: both
/// relays are idle once the last one is marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_publish_each_staged_message_once_and_end_what_cannot_be_sent() {
    let broker = Broker::from_env();
    let queue = Broker::unique("relayed");
    let client = Client::connect(broker.url()).await;
    client.declare(&queue, true).await;
    let scope = scope(&MongoNode::database_name("relay")).await;
    let fates: Vec<_> = (0..400)
        .map(|n| match n % 6 {
            1 => Fate::Unroutable,
            4 => Fate::TooLarge,
            _ => Fate::Routed,
        })
        .collect();
    stage_events(&scope, &queue, &fates).await;
    let publisher = Arc::new(Publisher::connect(broker.url()).await.expect("publisher"));
    let total = relay_all(&scope, &publisher, 2).await;
    let routed = fates.iter().filter(|f| **f == Fate::Routed).count() as u64;
    assert_eq!(
        (total.sent, total.failed),
        (routed, 400 - routed),
        "{total:?}"
    );
    check_fates(&scope, &fates, &client.drain_ids(&queue).await).await;
    Arc::into_inner(publisher)
        .expect("relays done")
        .close()
        .await;
    client.delete(&queue).await;
}

/// Events to an exchange that does not exist interleaved with routed ones: each of those ends
/// failed (`NOT_FOUND`), never retried, and the routed ones are each in the queue exactly once.
/// The broker closes the channel a publish to a missing exchange goes on, failing whatever else
/// is in flight on it, so the relay sends the first message to an exchange it has not seen
/// confirm alone, and the rest of the batch without what is addressed to a missing one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_to_a_missing_exchange_end_failed_and_the_rest_are_published() {
    let broker = Broker::from_env();
    let queue = Broker::unique("relayed-x");
    let client = Client::connect(broker.url()).await;
    client.declare(&queue, false).await;
    let scope = scope(&MongoNode::database_name("relay-x")).await;
    let fates: Vec<_> = (0..200)
        .map(|n| {
            if n % 10 == 3 {
                Fate::NoExchange
            } else {
                Fate::Routed
            }
        })
        .collect();
    stage_events(&scope, &queue, &fates).await;
    let publisher = Arc::new(Publisher::connect(broker.url()).await.expect("publisher"));
    let total = relay_all(&scope, &publisher, 1).await;
    assert_eq!((total.sent, total.failed), (180, 20), "{total:?}");
    check_fates(&scope, &fates, &client.drain_ids(&queue).await).await;
    Arc::into_inner(publisher)
        .expect("relays done")
        .close()
        .await;
    client.delete(&queue).await;
}

/// The publishing user may write to the default exchange only: events to `amq.fanout`,
/// interleaved with routed ones, end failed with the refused permission named, and each routed
/// one is in the queue exactly once (the publishes the refusal's channel close failed with it
/// are tried again, not failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_the_broker_refuses_end_failed_naming_the_permission() {
    let broker = Broker::from_env();
    let queue = Broker::unique("relayed-403");
    let client = Client::connect(broker.url()).await;
    client.declare(&queue, false).await;
    let user = Broker::unique("relay-user");
    let url = broker.add_user(&user, "relay-password", ["^$", r"^amq\.default$", "^$"]);
    let scope = scope(&MongoNode::database_name("relay-403")).await;
    let fates: Vec<_> = (0..100)
        .map(|n| {
            if n % 5 == 2 {
                Fate::Forbidden
            } else {
                Fate::Routed
            }
        })
        .collect();
    stage_events(&scope, &queue, &fates).await;
    let publisher = Arc::new(Publisher::connect(&url).await.expect("publisher"));
    let total = relay_all(&scope, &publisher, 1).await;
    assert_eq!((total.sent, total.failed), (80, 20), "{total:?}");
    check_fates(&scope, &fates, &client.drain_ids(&queue).await).await;
    Arc::into_inner(publisher)
        .expect("relays done")
        .close()
        .await;
    broker.ctl(&["delete_user", &user]);
    client.delete(&queue).await;
}

/// A relay whose marks never reach the database (its connection is cut as each one is sent):
/// it publishes its first batch, then writes those marks again and publishes nothing more (no
/// duplicate while it lives). Killed, a second relay takes over when the first's lease expires
/// and publishes every message, the first batch again with the same ids. Downstream, a Lily
/// consumer with the MongoDB scope has each event's effect once: its inbox suppresses the
/// second copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_killed_between_confirm_and_mark_publishes_again_and_the_inbox_absorbs_it() {
    const EVENTS: usize = 200;
    /// The relay's batch.
    const BATCH: u64 = 100;
    let broker = Broker::from_env();
    let downstream = Broker::unique("outbox-down");
    let effects_db = MongoNode::database_name("outbox-down");
    let down_scope = scope(&effects_db).await;
    let router = Router::new().route("stock.reserved", |tx: MongoTx, meta: Meta| async move {
        tx.database()
            .collection::<Document>("effects")
            .insert_one(doc! { "message_id": meta.message_id() })
            .session(&mut *tx.session().await)
            .await
            .map_err(|e| lily_mq_mongo::handler_error("effect", e))?;
        Ok(())
    });
    let consumer = common::start_with(
        broker.url(),
        config(&downstream, QueueKind::Quorum),
        router,
        |c| c.scope(down_scope.clone()),
    );
    common::wait_declared(broker.url(), &downstream).await;
    let upstream_db = MongoNode::database_name("outbox-up");
    let upstream = scope(&upstream_db).await;
    let fates = vec![Fate::Routed; EVENTS];
    stage_events(&upstream, &downstream, &fates).await;

    let publisher = Arc::new(
        Publisher::connect_with(
            broker.url(),
            PublisherConfig::default().confirm_timeout(Duration::from_secs(1)),
        )
        .await
        .expect("publisher"),
    );
    let config = || {
        RelayConfig::default()
            .lease_ttl(Duration::from_secs(3))
            .poll(Duration::from_millis(50))
    };
    // The first relay reaches mongod through a proxy that cuts every mark as it is sent.
    let proxy = TcpProxy::start(mongo_addr()).await;
    proxy.cut_when_sent(Some(b"sent_at"));
    let proxied = MongoScope::connect(&mongo_via(&proxy), &upstream_db, MongoConfig::new("e2e"))
        .await
        .expect("scope through the proxy");
    let first = Relay::new(&proxied, Arc::clone(&publisher), config());
    let first = tokio::spawn(first.run(CancellationToken::new()));
    consumer
        .wait_for("the first batch downstream", Duration::from_secs(60), |t| {
            t.acked + t.duplicates_suppressed >= BATCH
        })
        .await;
    // The relay writes the marks again instead of publishing anything more.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t = consumer.stats.totals();
    assert_eq!(
        (t.acked, t.duplicates_suppressed),
        (BATCH, 0),
        "nothing published twice while the relay lives"
    );
    first.abort();
    let _ = first.await;
    assert!(proxy.cut_sends() > 0, "the marks were cut");
    let records = upstream.database().collection::<Document>("lily_outbox");
    assert_eq!(
        records
            .count_documents(doc! { "state": "staged" })
            .await
            .expect("count"),
        EVENTS as u64,
        "published, not marked"
    );

    let second = relay_all(&upstream, &publisher, 1).await;
    assert_eq!(second.sent, EVENTS as u64, "{second:?}");
    common::wait_settled("downstream", &downstream, 0).await;
    let report = consumer.stop().await;
    assert!(
        report.totals.duplicates_suppressed >= BATCH,
        "the first batch came twice: {:?}",
        report.totals
    );
    let effects = down_scope.database().collection::<Document>("effects");
    for n in 0..EVENTS {
        let id = format!("event-{n}");
        let count = effects
            .count_documents(doc! { "message_id": &id })
            .await
            .expect("count effects");
        assert_eq!(count, 1, "{id}: one effect downstream");
    }
    Arc::into_inner(publisher)
        .expect("relays done")
        .close()
        .await;
}
