//! Lily on a three-node cluster whose links are cut on purpose (`scripts/partition.sh`: each
//! node and Lily's process on hosts of their own in network namespaces, cuts and losses as
//! bridge rules that drop packets silently). Orders keep coming while, in a seeded order, Lily's
//! node is isolated, Lily is cut from its node while that node still sees the others, a bridge
//! forms (two nodes cut from each other, the third seeing both), Lily's link to its node loses
//! 30 % of its packets, the work queue's leader is isolated, and Lily's node is cut from the two
//! others while Lily still reaches it (the minority); the cluster heals in between.
//! Then every confirmed order is checked by id, from outside: handled to success (valid) or in
//! the DLQ (refused), or still in a retry bucket, or named unresolved in the report; nothing
//! parked or left in the work queue. Lily consumes over TLS: each node presents a certificate of
//! its own name and address, and Lily checks the one it reconnects to.
//!
//! The timers are the short runs': the broker's heartbeat is 5 s and `net_ticktime` 10 s
//! (`scripts/partition.sh`), so a silent link is noticed within 10 s by the AMQP heartbeat and
//! a node cut from the cluster within 10 s by the Erlang distribution.
//!
//! A third test puts MongoDB through its partitions while a consumer commits an effect per
//! order in its transaction: the primary cut from its majority (Lily still reaching it), then
//! Lily cut from the primary (which keeps its majority); every confirmed order is checked in the
//! database: one effect for a valid order, none for a refused one.
//!
//! The hosts need root: `scripts/test.sh` sets them up and runs this test by name
//! (`--ignored`); `LILY_PARTITION_SEED` picks the order of the shapes (1 unless set).

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::orders::{
    Ending, Handled, expected_dead, planned_failure, progress, publishing, router, router_working,
    settle,
};
use lily::prelude::*;
use lily::publish::{Destination, Outgoing, Publisher};
use lily_mq_mongo::mongodb::bson::{Document, doc};
use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx, handler_error};
use lily_mq_testkit::{Broker, Client, Host, MongoNode, Partitions, eventually, eventually_every};

/// Orders published a second.
const RATE: usize = 200;

/// How long consuming may take to resume once the cluster is whole again.
const WITHIN: Duration = Duration::from_secs(60);

/// The shapes of a partition.
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// The node Lily consumes through, cut from everyone: `pause_minority` pauses it.
    LilysNodeIsolated,
    /// Lily cut from its node, which still sees the other two.
    LilyCutFromItsNode,
    /// Two nodes cut from each other; the third sees both.
    Bridge,
    /// 30 % of the packets between Lily and its node dropped.
    LossyLink,
    /// The work queue's leader cut from everyone (a minority of one, the majority of two).
    LeaderIsolated,
    /// Lily's node cut from the two others, Lily still reaching it: the node is the minority,
    /// and `pause_minority` pauses it once it notices, closing Lily's connection.
    LilysNodeInTheMinority,
}

const SHAPES: [Shape; 6] = [
    Shape::LilysNodeIsolated,
    Shape::LilyCutFromItsNode,
    Shape::Bridge,
    Shape::LossyLink,
    Shape::LeaderIsolated,
    Shape::LilysNodeInTheMinority,
];

/// How Lily learns that its node is gone.
#[derive(Clone, Copy, Debug)]
enum Notice {
    /// The link went silent: two heartbeats without a frame.
    Silence,
    /// The node paused when it found itself in the minority (within `net_ticktime` and a
    /// quarter), and closed the connection.
    Close,
}

/// `SHAPES` in the order `seed` draws (a small xorshift: the order is reproducible).
fn schedule(seed: u64) -> Vec<Shape> {
    let mut state = seed.max(1);
    let mut shapes = SHAPES.to_vec();
    for i in (1..shapes.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let j = usize::try_from(state % (i as u64 + 1)).expect("small");
        shapes.swap(i, j);
    }
    shapes
}

/// Runs `scenario` on a thread moved into the host `lily`'s network, with a runtime of its own,
/// so that every socket Lily and the test open is `lily`'s.
fn on_lily_host<F, Fut>(scenario: F)
where
    F: FnOnce(Partitions) -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let hosts = Partitions::from_env();
    let ran = std::thread::spawn(move || {
        hosts.enter_lily();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .expect("a runtime")
            .block_on(scenario(hosts));
    })
    .join();
    if let Err(panic) = ran {
        std::panic::resume_unwind(panic);
    }
}

/// The number in the environment variable `name`, or `default`.
fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The topology of quorum queue `queue` with the tests' retry delays.
fn quorum_topology(queue: &str) -> lily::topology::Topology {
    lily::topology::Topology::new(
        queue,
        QueueKind::Quorum,
        &common::fast_policy().retry_delays,
    )
}

/// The node Lily's consuming connection is open on, waited for while it reconnects.
async fn lilys_node(hosts: &Partitions, connection: &str) -> usize {
    let mut found = None;
    eventually(Duration::from_secs(60), || {
        found = hosts.serving(connection);
        found.is_some()
    })
    .await;
    found.unwrap_or_else(|| panic!("no node has Lily's connection {connection}"))
}

/// The partition tests share the one set of hosts: one at a time ([`on_lily_host`]).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
#[ignore = "needs the partition hosts (root, network namespaces): scripts/test.sh runs it"]
fn partitions_of_every_shape_lose_no_confirmed_order() {
    on_lily_host(partitions);
}

#[test]
#[ignore = "needs the partition hosts (root, network namespaces): scripts/test.sh runs it"]
fn shutdown_while_cut_from_the_broker_ends_within_its_budget_and_names_what_it_could_not_settle() {
    on_lily_host(shutdown_while_cut);
}

/// Lily, 50 deliveries in flight (each handled in 1 s; a fifth refused, to the DLQ, a fifth
/// failing their first attempt, to a retry bucket), is cut from its node and told to stop
/// at once: the link is silent, so no ACK it writes can be confirmed. It must still end within
/// its budget, and its report must name what it could not settle; once healed, a second
/// consumer takes what the broker gives back, and every order is accounted for by id.
async fn shutdown_while_cut(hosts: Partitions) {
    const ORDERS: usize = 400;
    const BUDGET: Duration = Duration::from_secs(5);
    hosts.heal();
    hosts.await_whole().await;
    let queue = Broker::unique("partition-stop");
    let handled = Handled::default();
    let slow = router_working(&handled, Duration::from_secs(1));
    let config = common::config(&queue, QueueKind::Quorum)
        .prefetch(50)
        .concurrency(50)
        .addresses([hosts.address(1), hosts.address(2)]);
    let running = common::start_within(&hosts.url(0), config.clone(), slow, |c| c, BUDGET);
    running.wait_ready().await;
    let publisher = Publisher::connect(&hosts.url(1)).await.expect("publisher");
    let messages = (0..ORDERS).map(|i| {
        Outgoing::bytes(
            "order.placed",
            &format!("order-{i}"),
            "application/json",
            format!(r#"{{"n":{i}}}"#).into_bytes(),
        )
    });
    let published = publisher
        .publish_all(&Destination::queue(&queue), messages)
        .await;
    let refused: Vec<_> = published.iter().filter(|p| !p.is_confirmed()).collect();
    assert!(
        refused.is_empty(),
        "{} orders not confirmed, the first: {:?}",
        refused.len(),
        refused.first()
    );
    publisher.close().await;
    progress(&handled, 100, WITHIN, "before the cut").await;

    let node = lilys_node(&hosts, &format!("lily:{queue}:consuming")).await;
    hosts.cut(Host::Lily, Host::Node(node));
    let stopping = Instant::now();
    let report = running.stop().await;
    let took = stopping.elapsed();
    hosts.heal();
    hosts.await_whole().await;
    eprintln!(
        "partition: shutdown cut from n{}: ended in {:.1} s (budget {BUDGET:?}), {} unresolved, \
         forced {}",
        node + 1,
        took.as_secs_f64(),
        report.unresolved.len(),
        report.forced
    );
    assert!(
        took <= BUDGET + Duration::from_secs(2),
        "shutdown took {took:?} against a budget of {BUDGET:?}"
    );
    assert!(
        !report.unresolved.is_empty(),
        "ACKs written to a silent link were reported settled: {:?}",
        report.totals
    );

    // What the broker gives back goes to a second consumer once the cluster is whole.
    let again = common::start(&hosts.url(node), config, router(&handled));
    let topology = quorum_topology(&queue);
    settle(&handled, ORDERS, &topology, || hosts.depths(node)).await;
    let second = again.stop().await;
    let client = Client::connect(&hosts.url(node)).await;
    let mut ending = Ending::read(&client, &topology, &second).await;
    ending.unresolved.extend(
        report
            .unresolved
            .iter()
            .filter_map(|u| u.message_id.clone()),
    );
    ending.assert_accounted(
        "shutdown cut from the broker",
        &handled,
        (ORDERS, ORDERS),
        &second,
    );
}

async fn partitions(hosts: Partitions) {
    let seed = env_or("LILY_PARTITION_SEED", 1);
    // Each partition lasts 20 s (`LILY_PARTITION_HOLD_S`). A silent link must be noticed
    // within two heartbeats (the connection is closed after two without a frame) and 10 s; a
    // node in the minority notices within `net_ticktime` and a quarter, then pauses and closes
    // Lily's connection within 10 s more (20 s on 4.0, which pauses about 7 s after noticing).
    let hold = Duration::from_secs(env_or("LILY_PARTITION_HOLD_S", 20));
    let silence_within = hosts.heartbeat() * 2 + Duration::from_secs(10);
    let pause = if hosts.version().starts_with("3.") {
        10
    } else {
        20
    };
    let close_within = hosts.ticktime() * 5 / 4 + Duration::from_secs(pause);
    hosts.heal();
    hosts.await_whole().await;
    let queue = Broker::unique("partition");
    let connection = format!("lily:{queue}:consuming");
    let handled = Handled::default();
    // Over TLS: each node presents a certificate of its own address, which Lily checks at every
    // reconnection to another node.
    let config = common::config(&queue, QueueKind::Quorum)
        .policy(common::fast_policy().max_requeues(10))
        .prefetch(50)
        .concurrency(50)
        .addresses([hosts.tls_address(1), hosts.tls_address(2)])
        .tls_ca_pem(hosts.ca_pem());
    let running = common::start(&hosts.tls_url(0), config, router(&handled));
    running.wait_ready().await;
    let topology = quorum_topology(&queue);
    let (stop, publisher) = publishing(hosts.urls(), 1, &queue, RATE);
    progress(&handled, 300, WITHIN, "before the first partition").await;

    // `LILY_PARTITION_ONLY=LossyLink,Bridge` keeps those shapes of the schedule (a loop on one).
    let only = std::env::var("LILY_PARTITION_ONLY").unwrap_or_default();
    let shapes: Vec<Shape> = schedule(seed)
        .into_iter()
        .filter(|s| only.is_empty() || only.split(',').any(|o| o == format!("{s:?}")))
        .collect();
    eprintln!(
        "partition: RabbitMQ {}, seed {seed}, shapes {shapes:?}",
        hosts.version()
    );
    let mut noticed_shapes = 0;
    for shape in shapes {
        let node = lilys_node(&hosts, &connection).await;
        let started = Instant::now();
        let (a, b) = ((node + 1) % 3, (node + 2) % 3);
        let notice = match shape {
            Shape::LilysNodeIsolated => {
                hosts.isolate(Host::Node(node));
                Some(Notice::Silence)
            }
            Shape::LilyCutFromItsNode => {
                hosts.cut(Host::Lily, Host::Node(node));
                Some(Notice::Silence)
            }
            Shape::Bridge => {
                hosts.cut(Host::Node(a), Host::Node(b));
                None
            }
            Shape::LossyLink => {
                hosts.loss(Host::Lily, Host::Node(node), 30);
                None
            }
            Shape::LeaderIsolated => {
                let leader = hosts.leader(&queue).expect("the work queue has a leader");
                hosts.isolate(Host::Node(leader));
                (leader == node).then_some(Notice::Silence)
            }
            Shape::LilysNodeInTheMinority => {
                hosts.cut(Host::Node(node), Host::Node(a));
                hosts.cut(Host::Node(node), Host::Node(b));
                Some(Notice::Close)
            }
        };
        let noticed = match notice {
            None => None,
            Some(notice) => {
                let within = match notice {
                    Notice::Silence => silence_within,
                    Notice::Close => close_within,
                };
                let stats = running.stats.clone();
                // Polled often: the reconnection that follows takes a few hundred ms.
                let seen =
                    eventually_every(Duration::from_millis(10), within, || !stats.ready()).await;
                assert!(
                    seen,
                    "{shape:?}: Lily did not notice that its node is gone ({notice:?}) within \
                     {within:?}"
                );
                noticed_shapes += 1;
                Some(started.elapsed())
            }
        };
        // While partitioned, Lily consumes on the majority side when it reaches it: when 50
        // more orders than at the cut were handled, consuming had resumed.
        let before = handled.succeeded();
        let mut resumed = None;
        while started.elapsed() < hold {
            if resumed.is_none() && handled.succeeded() >= before + 50 {
                resumed = Some(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let during = handled.succeeded() - before;
        hosts.heal();
        let restarted = hosts.await_whole().await;
        let healed = Instant::now();
        progress(&handled, 200, WITHIN, &format!("after {shape:?}")).await;
        eprintln!(
            "partition: {shape:?} (Lily on n{}): noticed {noticed:?}, {during} orders handled \
             while partitioned (50 of them {resumed:?} after the cut), consuming again {:.1} s \
             after healing{}",
            node + 1,
            healed.elapsed().as_secs_f64(),
            if restarted.is_empty() {
                String::new()
            } else {
                format!(", nodes restarted (paused, or recording a partition): {restarted:?}")
            }
        );
    }

    stop.store(true, Ordering::Release);
    let sent = publisher.await.expect("publisher");
    settle(&handled, sent.0, &topology, || hosts.depths(0)).await;
    let report = running.stop().await;
    let client = Client::connect(&hosts.url(0)).await;
    Ending::read(&client, &topology, &report)
        .await
        .assert_accounted("partition", &handled, sent, &report);
    assert!(
        report.incidents.connections_lost >= noticed_shapes,
        "Lily's node was gone {noticed_shapes} times, yet its connection was lost {} times",
        report.incidents.connections_lost
    );
}

#[test]
#[ignore = "needs the partition hosts (root, network namespaces): scripts/test.sh runs it"]
fn a_mongo_primary_cut_from_its_majority_or_from_lily_leaves_every_effect_once() {
    on_lily_host(mongo_partitions);
}

/// The shapes of a partition of the replica set.
#[derive(Clone, Copy, Debug)]
enum MongoShape {
    /// The primary cut from both secondaries, Lily still reaching all three: the two elect a
    /// new primary, and the old one steps down once it misses them.
    PrimaryCutFromItsMajority,
    /// Lily cut from the primary, which keeps its majority: no election, and no primary Lily
    /// can reach until the heal.
    LilyCutFromThePrimary,
}

/// Orders published a second in the MongoDB run (majority commits on three members take
/// longer than an ACK).
const MONGO_RATE: usize = 50;

/// The effect: one `ledger` entry per valid order, written in the delivery's transaction and
/// marked with `run`; the outcomes of [`router`] otherwise (a fifth refused, a fifth failing
/// their first attempt).
fn ledger_router(handled: &Handled, run: &str) -> Router {
    let (handled, run) = (handled.clone(), run.to_owned());
    Router::new().route("order.placed", move |tx: MongoTx, meta: Meta| {
        let (handled, run) = (handled.clone(), run.clone());
        async move {
            let id = meta.message_id().to_owned();
            let result = if let Some(failure) = planned_failure(&id, meta.attempt()) {
                Err(failure)
            } else {
                let attempt = i64::from(meta.attempt());
                let entry = doc! { "message_id": &id, "attempt": attempt, "run": run };
                tx.database()
                    .collection::<Document>("ledger")
                    .insert_one(entry)
                    .session(&mut *tx.session().await)
                    .await
                    .map(drop)
                    .map_err(|e| handler_error("ledger insert", e))
            };
            handled.record(&id, result.is_ok());
            result
        }
    })
}

async fn mongo_partitions(hosts: Partitions) {
    let hold = Duration::from_secs(env_or("LILY_PARTITION_HOLD_S", 20));
    hosts.heal();
    hosts.await_whole().await;
    let set = hosts.mongo_set();
    set.await_healthy(Duration::from_secs(60)).await;
    let queue = Broker::unique("partition-mongo");
    let database = MongoNode::database_name("partition");
    let commits = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let committed = Arc::clone(&commits);
    let scope_config = MongoConfig::new("partition")
        .on_committed(move |_| committed.lock().unwrap().push(Instant::now()));
    let scope = MongoScope::connect(set.url(), &database, scope_config)
        .await
        .expect("the scope connects to the set");
    let handled = Handled::default();
    // The handler timeout is the library's (30 s), above the driver's wait for a primary.
    let config = common::config(&queue, QueueKind::Quorum)
        .policy(common::fast_policy().max_requeues(10))
        .prefetch(50)
        .concurrency(20)
        .handler_timeout(Duration::from_secs(30))
        .addresses([hosts.address(1), hosts.address(2)]);
    let running = common::start_with(
        &hosts.url(0),
        config,
        ledger_router(&handled, &database),
        |c| c.scope(scope),
    );
    running.wait_ready().await;
    let topology = quorum_topology(&queue);
    let (stop, publisher) = publishing(hosts.urls(), 1, &queue, MONGO_RATE);
    progress(&handled, 100, WITHIN, "before the first partition").await;

    let committed_since = |t: Instant| commits.lock().unwrap().iter().filter(|c| **c > t).count();
    for shape in [
        MongoShape::PrimaryCutFromItsMajority,
        MongoShape::LilyCutFromThePrimary,
    ] {
        let primary = set.await_primary(Duration::from_secs(30)).await;
        let started = Instant::now();
        match shape {
            MongoShape::PrimaryCutFromItsMajority => {
                for other in (0..set.len()).filter(|m| *m != primary) {
                    hosts.cut(Host::Member(primary), Host::Member(other));
                }
            }
            MongoShape::LilyCutFromThePrimary => hosts.cut(Host::Lily, Host::Member(primary)),
        }
        let mut resumed = None;
        while started.elapsed() < hold {
            if resumed.is_none() && committed_since(started) >= 20 {
                resumed = Some(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let during = committed_since(started);
        hosts.heal();
        let healed = Instant::now();
        set.await_healthy(Duration::from_secs(60)).await;
        progress(&handled, 100, WITHIN, &format!("after {shape:?}")).await;
        let first_commit = commits
            .lock()
            .unwrap()
            .iter()
            .find(|c| **c > healed)
            .copied();
        eprintln!(
            "partition: {shape:?} (primary m{primary}, election timeout {:?}): {during} commits \
             while partitioned (20 of them {resumed:?} after the cut); after healing, the first \
             commit {:?} and 100 more orders handled {:.1} s after; totals {:?}",
            hosts.election_timeout(),
            first_commit.map(|c| c - healed),
            healed.elapsed().as_secs_f64(),
            running.stats.totals()
        );
    }

    stop.store(true, Ordering::Release);
    let sent = publisher.await.expect("publisher");
    settle(&handled, sent.0, &topology, || hosts.depths(0)).await;
    let report = running.stop().await;
    let client = Client::connect(&hosts.url(0)).await;
    let ending = Ending::read(&client, &topology, &report).await;
    ending.assert_accounted("partition mongo", &handled, sent, &report);

    // In the database, read at majority once the set is whole: one effect for each valid
    // order (none or one for an order named unresolved), none for a refused one, none for an
    // order never published.
    let mongo = common::ledger::direct(set.url(), &database).await;
    let effects = common::ledger::effects(&mongo).await;
    let mut wrong = Vec::new();
    for n in 0..sent.0 {
        let id = format!("order-{n}");
        let count = effects.get(&id).copied().unwrap_or(0);
        let named = ending.unresolved.contains(&id);
        let expected = if expected_dead(n) { 0 } else { 1 };
        if count != expected && !(named && count < expected) {
            wrong.push(format!("{id}: {count} effects"));
        }
    }
    wrong.extend(
        effects
            .keys()
            .filter(|id| {
                id.trim_start_matches("order-")
                    .parse::<usize>()
                    .map_or(true, |n| n >= sent.1)
            })
            .map(|id| format!("{id}: an effect, never published")),
    );
    let rolled_back = set
        .rolled_back()
        .iter()
        .filter(|d| d.get_str("run") == Ok(database.as_str()))
        .count();
    eprintln!(
        "partition mongo: {} effects for {} orders confirmed; {rolled_back} ledger entries \
         rolled back by the old primary, each done again",
        effects.values().sum::<u32>(),
        sent.0
    );
    assert!(
        wrong.is_empty(),
        "{} orders without exactly their effect, the first: {:#?}",
        wrong.len(),
        &wrong[..wrong.len().min(20)]
    );
}
