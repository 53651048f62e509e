//! Lily on a three-node RabbitMQ cluster with quorum queues, while the node leading the work
//! queue and then the node leading a retry bucket go down mid-flight (`stop_app`, and kill -9
//! of the VM) and come back. Checked from outside, by message id: every id ends handled and
//! ACKed, in the DLQ when it should, still in a retry bucket, or named unresolved in the
//! report; nothing stays in the work queue, and every DLQ-bound id is in the DLQ or a bucket (a
//! handoff taken as confirmed without evidence would lose it there).

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::orders::{Ending, Handled, progress, publishing, router, settle};
use lily::prelude::*;
use lily_mq_testkit::{Broker, Client, Cluster};

/// The faults take nodes of the one cluster down: one scenario at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Orders published a second, until both faults are over.
const RATE: usize = 250;

/// How long consuming may take to resume after a fault.
const WITHIN: Duration = Duration::from_secs(90);

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// `rabbitmqctl stop_app`, then `start_app`.
    StopApp,
    /// kill -9 of the node's VM, then a start with its data.
    Kill,
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

    let urls = cluster.nodes().map(|n| cluster.url(n)).collect();
    let (stop, publisher) = publishing(urls, 2, &queue, RATE);

    // Mid-flight: the node leading the work queue goes down, consuming resumes elsewhere.
    progress(&handled, 300, WITHIN, "before the first fault").await;
    let first = cluster.leader(&queue).expect("the work queue has a leader");
    if locator == LeaderLocator::ClientLocal {
        // Declared through Lily's connection: the node going down is the one Lily is on.
        assert_eq!(first, 0, "client-local placed the leader on Lily's node");
    }
    eprintln!("{fault:?}: node {first} leads {queue}; taking it down");
    take_down(&cluster, first, fault);
    progress(&handled, 200, WITHIN, "with the work queue's leader down").await;
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
    progress(&handled, 200, WITHIN, "with the bucket's leader down").await;
    bring_back(&cluster, second, fault);
    assert!(
        cluster.await_members(&bucket).await,
        "node {second} did not catch up"
    );
    progress(&handled, 100, WITHIN, "with every node back").await;

    // Orders kept coming through both faults. Now every one must settle: nothing left in the
    // work queue or the buckets.
    stop.store(true, Ordering::Release);
    let sent = publisher.await.expect("publisher");
    let waited = settle(&handled, sent.0, &topology, || cluster.depths()).await;
    eprintln!(
        "{fault:?} {locator:?}: every valid order succeeded {:.1} s after publishing stopped",
        waited.as_secs_f64()
    );
    let report = running.stop().await;

    // Read back through the node that went down last: the cluster serves through it again.
    let client = Client::connect(&cluster.url(second)).await;
    Ending::read(&client, &topology, &report)
        .await
        .assert_accounted(&format!("{fault:?} {locator:?}"), &handled, sent, &report);
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
