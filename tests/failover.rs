//! MongoDB failover under Lily, on the private three-member replica set: the primary SIGKILLed
//! while handlers run and commits are in flight, stepped down during commits, and gone with a
//! secondary so that no primary exists for several seconds (the last two with a lease per
//! message). Deliveries flow at a steady rate through a consumer at realistic prefetch and
//! concurrency with the library's default policy; afterwards every message is checked by id in
//! the database: exactly one effect, no valid message in the DLQ or parking lane, no attempt
//! spent, its deferrals within the requeue limit, and an effect for every message whose write
//! an old primary rolled back (it was never acknowledged). Each test prints its figures: time
//! from the fault to the first commit after it, the longest time without a commit, deliveries
//! deferred, and the commit rate before and after the fault. A fourth test reads the primary's
//! profiler: Lily's own writes and reads ask for a majority whatever the URL says. In the
//! three fault runs each handler also stages an event in its transaction, and the consumer's
//! outbox relay publishes it through the failover: each is staged once, marked sent and
//! published at least once.
//!
//! The set's members elect within about two seconds here (`electionTimeoutMillis` lowered to
//! 1 000 by the test command; at the default of 10 000 see the guide's MongoDB chapter).

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::ledger::{direct, documents, effects};
use lily::prelude::*;
use lily_mq_mongo::mongodb::Database;
use lily_mq_mongo::mongodb::bson::{Bson, Document, doc};
use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx, Outbox, handler_error};
use lily_mq_testkit::{Broker, Client, MongoNode, MongoSet};

/// One failover at a time: every test of this file puts the same set through a fault.
static SET: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Messages per run, and how many are published a second.
const N: usize = 1500;
const RATE: usize = 250;
const PUBLISHERS: usize = 5;
/// The consumer's window and handlers at once.
const PREFETCH: u16 = 50;
const CONCURRENCY: usize = 20;
/// How long a handler holds its transaction open after its write: commits and running
/// handlers are both in flight when the fault comes.
const HANDLER_WORK: Duration = Duration::from_millis(20);
/// Patience, not a bound Lily promises: a loaded machine stretches every figure.
const SETTLED_WITHIN: Duration = Duration::from_secs(300);
const WAIT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// SIGKILL of the primary; it is started again once another member is primary.
    KillPrimary,
    /// `replSetStepDown` of the primary (for 10 s).
    StepDown,
    /// A secondary killed, then the primary: no majority, so no primary, for
    /// [`NO_PRIMARY_FOR`]; then both started again.
    NoPrimary,
}

const NO_PRIMARY_FOR: Duration = Duration::from_secs(6);

/// The effect: one ledger entry per message, written in the delivery's transaction, and with
/// `outbox` an event `<message id>.event` staged in it for `events`, which the consumer's relay
/// publishes.
async fn ledger(
    tx: MongoTx,
    meta: Meta,
    runs: &AtomicUsize,
    outbox: Option<(Outbox, &Destination)>,
) -> Result<(), QueueHandlerError> {
    runs.fetch_add(1, Ordering::Relaxed);
    let ledger = tx.database().collection::<Document>("ledger");
    ledger
        .insert_one(doc! { "message_id": meta.message_id(), "attempt": i64::from(meta.attempt()) })
        .session(&mut *tx.session().await)
        .await
        .map_err(|e| handler_error("ledger insert", e))?;
    if let Some((outbox, events)) = outbox {
        let id = format!("{}.event", meta.message_id());
        let event = Outgoing::bytes("ledger.written", &id, "application/json", b"{}".to_vec());
        outbox.stage(events, &event).await?;
    }
    tokio::time::sleep(HANDLER_WORK).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_primary_killed_mid_transaction_and_mid_commit_leaves_every_effect_once() {
    survive("kill", QueueKind::Classic, Fault::KillPrimary, false).await;
}

/// With leases: acquisitions, renewals and fence checks go through the election too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_primary_stepped_down_during_commits_leaves_every_effect_once() {
    survive("stepdown", QueueKind::Quorum, Fault::StepDown, true).await;
}

/// With leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seconds_without_any_primary_leave_every_effect_once() {
    survive("noprimary", QueueKind::Quorum, Fault::NoPrimary, true).await;
}

async fn survive(name: &str, kind: QueueKind, fault: Fault, lease: bool) {
    let _one_at_a_time = SET.lock().await;
    let set = MongoSet::from_env();
    set.await_healthy(Duration::from_secs(60)).await;
    let broker = Broker::from_env();
    let queue = Broker::unique(&format!("failover-{name}"));
    let database = MongoNode::database_name(&format!("failover-{name}"));
    let commits = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let committed = Arc::clone(&commits);
    let mut config = MongoConfig::new("failover")
        .on_committed(move |_| committed.lock().unwrap().push(Instant::now()));
    if lease {
        config = config.with_lease();
    }
    // The URL asks for acknowledgement by the primary alone: Lily's writes must not take it.
    let scope = MongoScope::connect(&format!("{}&w=1", set.url()), &database, config)
        .await
        .expect("the scope connects to the set");
    let policy = Policy::default();
    let cfg = ConsumerConfig::new(&queue)
        .queue_kind(kind)
        .prefetch(PREFETCH)
        .concurrency(CONCURRENCY)
        .reconnect(Duration::from_millis(100), Duration::from_millis(500));
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    // Each message's event goes through the outbox, published by the consumer's relay.
    let client = Client::connect(broker.url()).await;
    let events = format!("{queue}.events");
    client.declare(&events, true).await;
    let to = Destination::queue(&events);
    let router = Router::new().route(
        "order.placed",
        move |tx: MongoTx, outbox: Outbox, meta: Meta| {
            let (runs, to) = (Arc::clone(&counted), to.clone());
            async move { ledger(tx, meta, &runs, Some((outbox, &to))).await }
        },
    );
    let running = common::start_with(broker.url(), cfg, router, |c| c.scope(scope));
    running.wait_ready().await;
    let ids: Vec<String> = (0..N).map(|i| format!("{queue}-{i}")).collect();
    // PUBLISHERS publishers, each at its share of the rate, each send awaiting its confirm.
    let publishing: Vec<_> = (0..PUBLISHERS)
        .map(|p| {
            let (url, queue) = (broker.url().to_owned(), queue.clone());
            let ids: Vec<String> = ids.iter().skip(p).step_by(PUBLISHERS).cloned().collect();
            tokio::spawn(async move {
                let client = Client::connect(&url).await;
                let every = Duration::from_secs(1) * PUBLISHERS as u32 / RATE as u32;
                let mut tick = tokio::time::interval(every);
                for id in &ids {
                    tick.tick().await;
                    client
                        .send(&queue, "order.placed", id, b"{\"qty\":1}")
                        .await;
                }
            })
        })
        .collect();

    // The fault, once a quarter of the messages committed.
    let count = || commits.lock().unwrap().len();
    assert!(
        lily_mq_testkit::eventually(Duration::from_secs(60), || count() >= N / 4).await,
        "commits before the fault: {}",
        count()
    );
    let primary = set.await_primary(Duration::from_secs(5)).await;
    // When the primary was lost: every commit after it went to another primary.
    let at;
    match fault {
        Fault::KillPrimary => {
            set.kill(primary);
            at = Instant::now();
            set.await_primary(Duration::from_secs(60)).await;
            set.start(primary);
        }
        Fault::StepDown => {
            set.step_down(10).await;
            at = Instant::now();
        }
        Fault::NoPrimary => {
            set.kill((primary + 1) % set.len());
            set.kill(primary);
            at = Instant::now();
            tokio::time::sleep(NO_PRIMARY_FOR).await;
            set.start((primary + 1) % set.len());
            set.start(primary);
        }
    }
    for publisher in publishing {
        publisher.await.expect("publisher");
    }
    let mongo = direct(set.url(), &database).await;
    let settled = wait_settled(&mongo, &client, &queue, &ids).await;
    set.await_healthy(Duration::from_secs(60)).await;
    let outbox = mongo.collection::<Document>("lily_outbox");
    let started = Instant::now();
    while outbox
        .count_documents(doc! { "state": { "$ne": "sent" } })
        .await
        .expect("count outbox")
        > 0
    {
        assert!(
            started.elapsed() < WAIT,
            "outbox records not sent after {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let report = running.stop().await;

    // Figures.
    let commits = commits.lock().unwrap().clone();
    let first_after = commits.iter().find(|t| **t > at).copied();
    let longest_gap = commits
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    let rate = |from: Instant, to: Instant| {
        let n = commits.iter().filter(|t| **t >= from && **t < to).count();
        n as f64 / (to - from).as_secs_f64()
    };
    let t = &report.totals;
    println!(
        "failover {name} ({fault:?}, {kind:?}): first commit {:?} after the primary was lost, \
         longest time without a commit {longest_gap:?}; handler runs {} for {N} messages; \
         deferred {}, retried {}, waited {}, duplicates suppressed {}; commits/s in the 5 s before {:.0}, \
         in the 10 s from the first commit after {:.0}; every effect {settled:?} after the \
         last publish",
        first_after.map(|first| first - at),
        runs.load(Ordering::Relaxed),
        t.deferred,
        t.retried,
        t.waited,
        t.duplicates_suppressed,
        rate(at - Duration::from_secs(5), at),
        first_after.map_or(0.0, |first| rate(first, first + Duration::from_secs(10))),
    );

    // Every message by id: exactly one effect.
    let effects = effects(&mongo).await;
    let wrong: Vec<String> = ids
        .iter()
        .filter_map(|id| match effects.get(id).copied().unwrap_or(0) {
            1 => None,
            n => Some(format!("{id}: {n} effects")),
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "not exactly once: {wrong:?}; totals {t:?}"
    );
    for lane in ["dlq", "parking"] {
        let dead = client.drain_ids(&format!("{queue}.{lane}")).await;
        assert!(
            dead.is_empty(),
            "valid messages in the {lane}: {dead:?}; totals {t:?}"
        );
    }
    assert_eq!(client.depth(&queue).await, 0, "the work queue drained");
    // Every message's event: staged once, marked sent, published at least once.
    let mut staged = BTreeMap::<String, u32>::new();
    for record in documents(&mongo, "lily_outbox", doc! {}).await {
        let id = record.get_str("message_id").expect("message_id").to_owned();
        assert_eq!(record.get_str("state"), Ok("sent"), "{id}");
        *staged.entry(id).or_default() += 1;
    }
    let published = client.drain_ids(&events).await;
    let mut twice = 0;
    for id in &ids {
        let event = format!("{id}.event");
        assert_eq!(staged.get(&event), Some(&1), "{event}: staged once");
        let copies = published.get(&event).copied().unwrap_or(0);
        assert!(copies >= 1, "{event}: never published");
        twice += usize::from(copies > 1);
    }
    assert_eq!(staged.len(), N, "no other event staged");
    assert_eq!(published.len(), N, "no other event published");
    let relayed = report.outbox.clone().expect("the consumer ran the relay");
    assert_eq!(relayed.staged, Some(0), "{relayed:?}");
    println!(
        "failover {name}: outbox {} events each published, {twice} of them more than once; \
         the relay counted {} sent",
        N, relayed.sent
    );
    // An election is no failure of the handler: it spends no attempt (no retry copy); the
    // transaction runs again in process instead.
    assert_eq!(t.retried, 0, "an election spent attempts: {t:?}");
    // A lease whose release the election left unanswered is this process's own: its next
    // handling of the message takes it over at once, never waiting out its TTL (30 s) in a
    // bucket as it would another owner's.
    assert_eq!(t.waited, 0, "a delivery waited out its own lease: {t:?}");
    // Deferrals stayed within the requeue limit, counted durably per message.
    let most = most_deferrals(&mongo).await;
    assert!(
        most <= i64::from(policy.max_requeues),
        "a message was deferred {most} times, past the limit of {}",
        policy.max_requeues
    );
    // What a member rolled back was never acknowledged at majority: each such ledger entry's
    // message has its effect once all the same (checked above), done again after the election.
    // A rolled-back outbox record (`<id>.event`) was never read by the relay, which reads at
    // majority; its event was staged again with the transaction (checked above).
    let rolled_back: Vec<String> = set
        .rolled_back()
        .iter()
        .filter_map(|doc| doc.get_str("message_id").ok())
        .filter(|id| id.starts_with(&format!("{queue}-")) && !id.ends_with(".event"))
        .map(str::to_owned)
        .collect();
    println!(
        "failover {name}: {} ledger entries rolled back (never acknowledged), each done again",
        rolled_back.len()
    );
    for id in &rolled_back {
        assert_eq!(
            effects.get(id),
            Some(&1),
            "{id}: rolled back and not done again"
        );
    }
    assert!(
        report.error.is_none(),
        "the consumer kept running: {report:?}"
    );
}

/// Waits until every id has its effect and the queue is empty; how long that took. When they do
/// not within [`SETTLED_WITHIN`], fails naming each id without its effect, with what the
/// database holds for it (its inbox record, its deferral count) and the queues' depths.
async fn wait_settled(mongo: &Database, client: &Client, queue: &str, ids: &[String]) -> Duration {
    let started = Instant::now();
    loop {
        let done: Vec<String> = mongo
            .collection::<Document>("ledger")
            .distinct("message_id", doc! {})
            .await
            .map(|ids| {
                ids.into_iter()
                    .filter_map(|id| id.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        if done.len() >= ids.len() && client.depth(queue).await == 0 {
            return started.elapsed();
        }
        if started.elapsed() >= SETTLED_WITHIN {
            let mut missing = Vec::new();
            for id in ids.iter().filter(|id| !done.contains(id)) {
                let key = doc! { "_id": { "c": "failover", "m": id } };
                let inbox = mongo
                    .collection::<Document>("lily_inbox")
                    .find_one(key.clone())
                    .await;
                let deferrals = mongo
                    .collection::<Document>("lily_deferrals")
                    .find_one(key)
                    .await;
                missing.push(format!("{id}: inbox {inbox:?}, deferrals {deferrals:?}"));
            }
            let depths: Vec<(String, u64)> = Broker::from_env()
                .depths()
                .into_iter()
                .filter(|(name, _)| name.starts_with(queue))
                .collect();
            panic!(
                "{} of {} effects after {SETTLED_WITHIN:?}; without an effect: {missing:#?}; \
                 queues: {depths:?}",
                done.len(),
                ids.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The most deferrals any message of the run had (the scope's durable count).
async fn most_deferrals(mongo: &Database) -> i64 {
    let counts = documents(mongo, "lily_deferrals", doc! {}).await;
    let count = |counted: &Document| match counted.get("n") {
        Some(Bson::Int64(n)) => *n,
        Some(Bson::Int32(n)) => i64::from(*n),
        _ => 0,
    };
    counts.iter().map(|c| count(c) - 1).fold(0, i64::max)
}

/// Lily's own writes and reads outside the transaction ask for a majority though the URL asks
/// for acknowledgement by the primary alone (`w=1`): the primary's profiler shows each command
/// as it arrived. Lease acquisitions (`findAndModify` on `lily_leases`) carry `w: majority`;
/// the read of a duplicate's inbox record (`find` on `lily_inbox`) carries read concern
/// `majority`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lilys_own_writes_and_reads_ask_for_a_majority_whatever_the_url_says() {
    let _one_at_a_time = SET.lock().await;
    let set = MongoSet::from_env();
    set.await_healthy(Duration::from_secs(60)).await;
    let broker = Broker::from_env();
    let queue = Broker::unique("majority");
    let database = MongoNode::database_name("majority");
    let mongo = direct(set.url(), &database).await;
    mongo
        .run_command(doc! { "profile": 2 })
        .await
        .expect("profile every operation");
    let config = MongoConfig::new("majority").with_lease();
    let scope = MongoScope::connect(&format!("{}&w=1", set.url()), &database, config)
        .await
        .expect("the scope connects to the set");
    let runs = Arc::new(AtomicUsize::new(0));
    let router = Router::new().route("order.placed", move |tx: MongoTx, meta: Meta| {
        let runs = Arc::clone(&runs);
        async move { ledger(tx, meta, &runs, None).await }
    });
    let cfg = ConsumerConfig::new(&queue);
    let running = common::start_with(broker.url(), cfg, router, |c| c.scope(scope));
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    // Each id twice: the second delivery finds the first's inbox record and reads it.
    for round in 0..2 {
        for i in 0..5 {
            client
                .send(&queue, "order.placed", &format!("{queue}-{i}"), b"{}")
                .await;
        }
        running
            .wait_for("both rounds settled", WAIT, |t| t.acked >= 5 * (round + 1))
            .await;
    }
    let report = running.stop().await;
    assert_eq!(
        report.totals.duplicates_suppressed, 5,
        "{:?}",
        report.totals
    );
    mongo
        .run_command(doc! { "profile": 0 })
        .await
        .expect("profiling off");

    let profiled = |filter| documents(&mongo, "system.profile", filter);
    let acquisitions = profiled(doc! {
        "ns": format!("{database}.lily_leases"),
        "command.findAndModify": { "$exists": true },
    })
    .await;
    assert!(
        acquisitions.len() >= 10,
        "lease acquisitions profiled: {acquisitions:?}"
    );
    for entry in &acquisitions {
        let asked = entry
            .get_document("command")
            .and_then(|c| c.get_document("writeConcern"))
            .and_then(|w| w.get_str("w"));
        assert_eq!(asked, Ok("majority"), "a lease acquisition: {entry:?}");
    }
    let reads = profiled(doc! {
        "ns": format!("{database}.lily_inbox"),
        "command.find": { "$exists": true },
    })
    .await;
    assert!(reads.len() >= 5, "inbox reads profiled: {reads:?}");
    for entry in &reads {
        let level = entry
            .get_document("command")
            .and_then(|c| c.get_document("readConcern"))
            .and_then(|r| r.get_str("level"));
        assert_eq!(level, Ok("majority"), "an inbox read: {entry:?}");
    }
}
