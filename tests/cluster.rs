//! Lily on a three-node RabbitMQ cluster with quorum queues, while the node leading the work
//! queue and then the node leading a retry bucket go down mid-flight (`stop_app`, and kill -9
//! of the VM) and come back. Checked from outside, by message id: every id ends handled and
//! ACKed, in the DLQ when it should, still in a retry bucket, or named unresolved in the
//! report; nothing stays in the work queue, and every DLQ-bound id is in the DLQ or a bucket (a
//! handoff taken as confirmed without evidence would lose it there).

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lily::prelude::*;
use lily_mq_testkit::{Broker, Client, Cluster, eventually};

/// The faults take nodes of the one cluster down: one scenario at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Orders published a second, until both faults are over.
const RATE: usize = 250;

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// `rabbitmqctl stop_app`, then `start_app`.
    StopApp,
    /// kill -9 of the node's VM, then a start with its data.
    Kill,
}

/// Each call's success, by message id.
type Calls = BTreeMap<String, Vec<bool>>;

/// What the handler did, by message id.
#[derive(Clone, Default)]
struct Handled(Arc<Mutex<Calls>>);

impl Handled {
    fn succeeded(&self) -> usize {
        let all = self.0.lock().unwrap();
        all.values().filter(|r| r.contains(&true)).count()
    }

    fn ok_count(&self, id: &str) -> usize {
        let all = self.0.lock().unwrap();
        all.get(id)
            .map_or(0, |r| r.iter().filter(|ok| **ok).count())
    }

    fn calls(&self, id: &str) -> usize {
        self.0.lock().unwrap().get(id).map_or(0, Vec::len)
    }
}

/// Order `n`: 1 in 5 fails for good (DLQ), 1 in 5 fails its first attempt (a retry bucket),
/// the rest succeed.
fn expected_dead(n: usize) -> bool {
    n.is_multiple_of(5)
}

fn router(handled: &Handled) -> Router {
    let handled = handled.clone();
    Router::new().route("order.placed", move |meta: Meta| {
        let handled = handled.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            let id = meta.message_id().to_owned();
            let n: usize = id.trim_start_matches("order-").parse().unwrap_or(0);
            let result = if expected_dead(n) {
                Err(QueueHandlerError::permanent("refused by the test"))
            } else if n % 5 == 1 && meta.attempt() == 1 {
                Err(QueueHandlerError::retryable("first attempt fails"))
            } else {
                Ok(())
            };
            handled
                .0
                .lock()
                .unwrap()
                .entry(id)
                .or_default()
                .push(result.is_ok());
            result
        }
    })
}

/// Publishes orders at `RATE` a second, 25 to a batch, each batch confirmed, until `stop`;
/// returns how many were confirmed and how many were tried (a batch that failed last may have
/// reached the queue in part). A batch whose publish or confirms fail (its node went down) is
/// published again through the next node, so an id may be published twice but never not at
/// all.
async fn publish_until(cluster: Cluster, queue: String, stop: Arc<AtomicBool>) -> (usize, usize) {
    let mut node = 2;
    let mut publisher: Option<Publisher> = None;
    let to = Destination::queue(&queue);
    let batch = 25;
    let started = Instant::now();
    let mut n = 0;
    let mut tried = 0;
    while !stop.load(Ordering::Acquire) {
        let due = started + Duration::from_secs_f64(n as f64 / RATE as f64);
        tokio::time::sleep_until(due.into()).await;
        let Some(open) = &publisher else {
            publisher = Publisher::connect(&cluster.url(node)).await.ok();
            if publisher.is_none() {
                node = (node + 1) % 3;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            continue;
        };
        tried = tried.max(n + batch);
        let messages = (n..n + batch).map(|i| {
            let body = format!(r#"{{"n":{i}}}"#).into_bytes();
            Outgoing::bytes(
                "order.placed",
                &format!("order-{i}"),
                "application/json",
                body,
            )
        });
        let published = open.publish_all(&to, messages).await;
        if published.iter().all(Published::is_confirmed) {
            n += batch;
        } else {
            publisher = None;
            node = (node + 1) % 3;
        }
    }
    (n, tried)
}

/// Takes `node` down as `fault` says.
fn take_down(cluster: &Cluster, node: usize, fault: Fault) {
    match fault {
        Fault::StopApp => cluster.stop_app(node),
        Fault::Kill => cluster.kill(node),
    }
}

/// Brings `node` back after `fault`.
fn bring_back(cluster: &Cluster, node: usize, fault: Fault) {
    match fault {
        Fault::StopApp => cluster.start_app(node),
        Fault::Kill => cluster.restart(node),
    }
}

/// Waits until `more` further orders than now were handled to success: consuming goes on.
async fn progress(handled: &Handled, more: usize, what: &str) {
    let target = handled.succeeded() + more;
    let resumed = eventually(Duration::from_secs(90), || handled.succeeded() >= target).await;
    assert!(
        resumed,
        "{what}: consuming did not resume ({} succeeded, waiting for {target})",
        handled.succeeded()
    );
}

/// One scenario: Lily consumes through node 0 (the URL), with nodes 1 and 2 as further
/// addresses; the leaders are placed by `locator`.
async fn leader_loss(fault: Fault, locator: LeaderLocator) {
    let _one = ONE_AT_A_TIME.lock().await;
    let cluster = Cluster::from_env();
    cluster.heal();
    let queue = Broker::unique(&format!("cluster-{fault:?}-{locator:?}").to_lowercase());
    let handled = Handled::default();
    let policy = common::fast_policy().max_requeues(10);
    let config = common::config(&queue, QueueKind::Quorum)
        .policy(policy)
        .prefetch(50)
        .concurrency(50)
        .addresses([cluster.address(1), cluster.address(2)])
        .leader_locator(Some(locator));
    let running = common::start(&cluster.url(0), config, router(&handled));
    running.wait_ready().await;
    let topology = lily::topology::Topology::new(
        &queue,
        QueueKind::Quorum,
        &common::fast_policy().retry_delays,
    );
    let bucket = topology.bucket(0).expect("a bucket").to_owned();
    let dlq = topology.dead_letter_queue();
    let parking = topology.parking_queue();

    let stop = Arc::new(AtomicBool::new(false));
    let publisher = tokio::spawn(publish_until(
        cluster.clone(),
        queue.clone(),
        Arc::clone(&stop),
    ));

    // Mid-flight: the node leading the work queue goes down, consuming resumes elsewhere.
    progress(&handled, 300, "before the first fault").await;
    let first = cluster.leader(&queue).expect("the work queue has a leader");
    if locator == LeaderLocator::ClientLocal {
        // Declared through Lily's connection: the node going down is the one Lily is on.
        assert_eq!(first, 0, "client-local placed the leader on Lily's node");
    }
    eprintln!("{fault:?}: node {first} leads {queue}; taking it down");
    take_down(&cluster, first, fault);
    progress(&handled, 200, "with the work queue's leader down").await;
    let moved = cluster.leader(&queue);
    assert!(
        moved.is_some_and(|n| n != first),
        "the work queue got no other leader: {moved:?}"
    );
    bring_back(&cluster, first, fault);
    assert!(
        cluster.await_members(&queue).await,
        "node {first} did not catch up"
    );

    // Then the node leading the first retry bucket, while copies go to it.
    let second = cluster.leader(&bucket).expect("the bucket has a leader");
    eprintln!("{fault:?}: node {second} leads {bucket}; taking it down");
    take_down(&cluster, second, fault);
    progress(&handled, 200, "with the bucket's leader down").await;
    bring_back(&cluster, second, fault);
    assert!(
        cluster.await_members(&bucket).await,
        "node {second} did not catch up"
    );
    progress(&handled, 100, "with every node back").await;

    // Orders kept coming through both faults. Now every one must settle: nothing left in the
    // work queue or the buckets.
    stop.store(true, Ordering::Release);
    let (orders, tried) = publisher.await.expect("publisher");
    let empty = |depths: &BTreeMap<String, u64>| {
        std::iter::once(queue.as_str())
            .chain(topology.buckets().map(|(b, _)| b))
            .all(|q| depths.get(q) == Some(&0))
    };
    // The broker's counts do not show a copy its dead-lettering holds between a bucket and the
    // work queue, and quorum counts lag: wait for every valid order to succeed as well, then
    // for two empty readings a second apart. A copy still in a bucket is read back below.
    let succeeded = |n: usize| expected_dead(n) || handled.ok_count(&format!("order-{n}")) > 0;
    let waiting = Instant::now();
    eventually(Duration::from_secs(90), || (0..orders).all(succeeded)).await;
    let waited = waiting.elapsed();
    for _ in 0..2 {
        eventually(Duration::from_secs(60), || empty(&cluster.depths())).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let report = running.stop().await;

    // Read back through the node that went down last: the cluster serves through it again.
    let client = Client::connect(&cluster.url(second)).await;
    let dead = client.drain_ids(&dlq).await;
    let parked = client.drain_ids(&parking).await;
    let left = client.drain_ids(&queue).await;
    let mut in_buckets = BTreeMap::new();
    for (b, _) in topology.buckets() {
        in_buckets.extend(client.drain_ids(b).await);
    }
    let unresolved: Vec<String> = report
        .unresolved
        .iter()
        .filter_map(|u| u.message_id.clone())
        .collect();

    let mut violations = Vec::new();
    for n in 0..orders {
        let id = format!("order-{n}");
        let in_dlq = dead.get(&id).copied().unwrap_or(0);
        let named = unresolved.contains(&id);
        let in_bucket = in_buckets.contains_key(&id);
        if left.contains_key(&id) && !named {
            violations.push(format!("{id}: left in the work queue"));
        }
        if parked.contains_key(&id) {
            violations.push(format!("{id}: parked"));
        }
        if expected_dead(n) {
            if in_dlq == 0 && !named && !in_bucket {
                violations.push(format!(
                    "{id}: lost (not in the DLQ, {} calls)",
                    handled.calls(&id)
                ));
            }
        } else {
            if handled.ok_count(&id) == 0 && !named && !in_bucket {
                violations.push(format!(
                    "{id}: lost (never handled to success, {} calls)",
                    handled.calls(&id)
                ));
            }
            if in_dlq > 0 {
                violations.push(format!("{id}: a valid order in the DLQ"));
            }
        }
    }
    let strangers: Vec<_> = dead
        .keys()
        .chain(parked.keys())
        .filter(|id| {
            id.trim_start_matches("order-")
                .parse::<usize>()
                .map_or(true, |n| n >= tried)
        })
        .collect();
    assert!(
        strangers.is_empty(),
        "ids that were never published: {strangers:?}"
    );
    let doubled = dead.values().filter(|n| **n > 1).count();
    // A second success is allowed (at least once; the inbox absorbs it): an order published
    // twice, a delivery whose authority was lost, or an ACK the broker lost with its leader.
    let rerun: Vec<String> = (0..orders)
        .map(|n| format!("order-{n}"))
        .filter(|id| handled.ok_count(id) > 1)
        .collect();
    let rerun_unnamed = rerun.iter().filter(|id| !unresolved.contains(id)).count();
    eprintln!(
        "{fault:?} {locator:?}: {orders} orders, {} in the DLQ ({doubled} doubled), {} handled \
         to success more than once ({rerun_unnamed} of them not named unresolved), {} \
         unresolved, {} still in a bucket, connections lost {}, every valid order succeeded \
         {:.1} s after publishing stopped, totals {:?}",
        dead.len(),
        rerun.len(),
        unresolved.len(),
        in_buckets.len(),
        report.incidents.connections_lost,
        waited.as_secs_f64(),
        report.totals
    );
    assert!(
        violations.is_empty(),
        "{} violations, the first: {:#?}",
        violations.len(),
        &violations[..violations.len().min(20)]
    );
    if locator == LeaderLocator::ClientLocal {
        assert!(
            report.incidents.connections_lost >= 1,
            "Lily's node went down, yet its connection was never lost"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_node_lily_and_the_leaders_are_on_stopped_mid_flight_loses_nothing() {
    leader_loss(Fault::StopApp, LeaderLocator::ClientLocal).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_node_lily_and_the_leaders_are_on_killed_mid_flight_loses_nothing() {
    leader_loss(Fault::Kill, LeaderLocator::ClientLocal).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn balanced_leaders_of_the_work_queue_and_a_bucket_killed_mid_flight_lose_nothing() {
    leader_loss(Fault::Kill, LeaderLocator::Balanced).await;
}

/// RabbitMQ compares `x-queue-leader-locator` on a redeclare: turning the locator on for a
/// topology that exists without it is refused at start, naming the argument, in both modes.
#[tokio::test]
async fn a_leader_locator_over_queues_declared_without_one_is_refused_at_start() {
    let broker = Broker::from_env();
    let queue = Broker::unique("locator");
    let first = common::start(
        broker.url(),
        common::config(&queue, QueueKind::Quorum),
        Router::new(),
    );
    first.wait_ready().await;
    first.stop().await;
    let config =
        common::config(&queue, QueueKind::Quorum).leader_locator(Some(LeaderLocator::Balanced));
    for mode in [TopologyMode::Declare, TopologyMode::Verify] {
        let consumer = Consumer::new(broker.url(), config.clone().topology(mode), Router::new());
        let ended =
            tokio::time::timeout(Duration::from_secs(20), consumer.run(Shutdown::default()))
                .await
                .expect("refused at start");
        let Err(err @ lily::Error::Topology { .. }) = ended else {
            panic!("{mode:?}: not refused: {:?}", ended.map(|r| r.clean));
        };
        let text = format!("{:?}", std::error::Error::source(&err));
        assert!(text.contains("x-queue-leader-locator"), "{mode:?}: {text}");
    }
}
