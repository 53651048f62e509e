//! The real `outbox` binary as a child process, killed at the three points that matter to a
//! transactional outbox, against the real local RabbitMQ node and the real mongod replica set:
//! after a commit (before its ACK and before the relay published its event), after the relay's
//! publishes reached the broker and before any confirm came back, and after the confirms and
//! before the sent marks. A second process takes over each time. Everything is checked by
//! message id from outside: the orders in the database, the outbox's records, and the effects
//! of a Lily consumer downstream of the events queue.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use common::{AllStaged, FirstBatch, ORDERS, Service, World};
use lily_mq_testkit::{MongoNode, TcpProxy};

/// The process aborts right after its 100th commit: that delivery is not ACKed, others are in
/// the middle of their transactions, and some committed events are not yet published. The
/// next process's inbox suppresses the redelivered commit, and its relay publishes every event
/// left staged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_a_commit_every_event_is_published_and_takes_effect_once() {
    let world = World::new("outbox-commit", "quorum").await;
    let node = MongoNode::from_env();
    let fault = [("OUTBOX_FAULT", "abort_after_commit:100")];
    let mut first = Service::start(&world, world.broker.url(), node.url(), &fault);
    first.ready().await;
    world.place_orders().await;
    let (status, _) = first.0.exit(Duration::from_secs(60)).await;
    assert_eq!(
        status.signal(),
        Some(6),
        "died by SIGABRT; stderr:\n{}",
        first.0.log()
    );
    assert!(world.in_state("staged").await + world.in_state("sent").await >= 100);
    world.recover_and_check().await;
}

/// The relay's publishes reach the broker and their confirms never come back (a proxy holds
/// them): the process is SIGKILLed then. Nothing was marked sent; the next process publishes
/// every event again, with the same id, and downstream's inbox suppresses the copies that had
/// arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_a_publish_before_its_confirm_the_event_is_published_again() {
    let world = World::new("outbox-confirm", "classic").await;
    let proxy = TcpProxy::start(world.broker.addr()).await;
    proxy.silence_reply_after(b"order.accepted", Duration::from_secs(120));
    let node = MongoNode::from_env();
    let mut first = Service::start(&world, &proxy.url(world.broker.url()), node.url(), &[]);
    first.ready().await;
    world.place_orders().await;
    let start = Instant::now();
    while !proxy.tripped() || world.delivered() == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the relay published"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.kill();
    let _ = first.0.exit(Duration::from_secs(10)).await;
    assert_eq!(world.in_state("sent").await, 0, "no confirm, no mark");
    let downstream = world.recover_and_check().await;
    assert!(
        downstream.totals.duplicates_suppressed >= 1,
        "what reached the broker before the kill came again: {:?}",
        downstream.totals
    );
}

/// The relay's first batch (up to 100 events) is confirmed and none of its sent marks reaches mongod
/// (a proxy cuts each one; the relay keeps trying the marks, publishing nothing more): the
/// process is SIGKILLed once those events took effect downstream and every order committed.
/// Everything is still staged; the next process publishes all of it, and downstream has each
/// effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_confirms_before_the_marks_every_event_comes_twice_and_acts_once() {
    let world = World::new("outbox-mark", "quorum").await;
    let node = MongoNode::from_env();
    let proxy = TcpProxy::start(node.addr()).await;
    proxy.cut_when_sent(Some(b"sent_at"));
    let mut first = Service::start(&world, world.broker.url(), &node.url_via(&proxy), &[]);
    first.ready().await;
    world.place_orders().await;
    world
        .until("every order staged", Duration::from_secs(90), AllStaged)
        .await;
    world
        .until(
            "the first batch downstream",
            Duration::from_secs(60),
            FirstBatch,
        )
        .await;
    // Marks tried again, not publishes: nothing beyond the first batch comes downstream.
    let first_batch = world.effects().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(world.effects().await, first_batch, "no further batch");
    assert_eq!(
        world.delivered(),
        first_batch,
        "no event published twice while the relay lives"
    );
    first.kill();
    let _ = first.0.exit(Duration::from_secs(10)).await;
    assert!(proxy.cut_sends() > 0, "the marks were cut");
    assert_eq!(world.in_state("sent").await, 0, "confirmed, not marked");
    assert_eq!(world.in_state("staged").await, ORDERS as u64);
    let downstream = world.recover_and_check().await;
    assert!(
        downstream.totals.duplicates_suppressed >= first_batch,
        "the first batch came twice: {:?}",
        downstream.totals
    );
}
