//! A memory alarm on the real node, raised while Lily consumes. The alarm blocks every
//! publishing connection of the node, so this is the only test in its binary: cargo runs test
//! binaries one after another, and the alarm is cleared however the test ends.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lily::prelude::*;
use lily_mq_testkit::{Broker, Client, eventually};

/// Clears the alarm when dropped, even when the test panics.
struct Alarm<'a>(&'a Broker);

impl<'a> Alarm<'a> {
    fn raise(broker: &'a Broker) -> Self {
        broker.ctl(&["set_vm_memory_high_watermark", "0.0000001"]);
        Self(broker)
    }
}

impl Drop for Alarm<'_> {
    fn drop(&mut self) {
        self.0.ctl(&["set_vm_memory_high_watermark", "0.4"]);
    }
}

/// While the broker blocks publishers, successful deliveries keep being ACKed on the consuming
/// connection, handoffs wait without publishing, shutdown ends within its budget with a report,
/// and after the alarm clears every message exists exactly once, checked by message id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_alarm_blocks_handoffs_but_not_acks_and_loses_or_doubles_nothing() {
    const GOOD: usize = 200;
    const FAILING: usize = 20;
    let broker = Broker::from_env();
    let queue = Broker::unique("alarm");
    let policy = common::fast_policy()
        .max_attempts(2)
        .retry_delays([Duration::from_secs(600)])
        .max_requeues(1000);
    // The topology exists and every message is published before the alarm.
    let connection = lapin::Connection::connect(broker.url(), Default::default())
        .await
        .expect("connect");
    lily::topology::Topology::new(&queue, QueueKind::Classic, &policy.retry_delays)
        .apply(
            &connection.create_channel().await.expect("channel"),
            TopologyMode::Declare,
        )
        .await
        .expect("declare topology");
    let client = Client::connect(broker.url()).await;
    let (mut good, mut failing) = (Vec::new(), Vec::new());
    for i in 0..GOOD {
        let id = format!("g-{i}");
        client.send(&queue, "order.placed", &id, b"{}").await;
        good.push(id);
        if i % (GOOD / FAILING) == 0 {
            let id = format!("f-{i}");
            client.send(&queue, "order.placed", &id, b"{}").await;
            failing.push(id);
        }
    }

    let handled = Arc::new(Mutex::new(BTreeSet::new()));
    let effects = Arc::clone(&handled);
    let router = Router::new().route("order.placed", move |meta: Meta| {
        let effects = Arc::clone(&effects);
        async move {
            if meta.message_id().starts_with('f') {
                return Err(QueueHandlerError::retryable("downstream down"));
            }
            effects.lock().unwrap().insert(meta.message_id().to_owned());
            Ok(())
        }
    });
    let alarm = Alarm::raise(&broker);
    let cfg = common::config(&queue, QueueKind::Classic)
        .policy(policy)
        .prefetch(50)
        .concurrency(50);
    let consumer = Consumer::new(broker.url(), cfg, router);
    let stats = consumer.stats();
    let budget = Duration::from_secs(8);
    let shutdown = Shutdown::new(ShutdownBudget::new(budget));
    let run = tokio::spawn(consumer.run(shutdown.clone()));

    // Every good delivery is ACKed while the node is in alarm: the broker, not Lily, says so.
    let acked = eventually(Duration::from_secs(20), || {
        broker.messages(&queue) <= FAILING as u64
    })
    .await;
    assert!(
        acked,
        "ACKs stalled behind the alarm: {} messages still in {queue}",
        broker.messages(&queue)
    );
    assert!(stats.handoffs_blocked(), "health says handoffs are blocked");
    assert_eq!(handled.lock().unwrap().len(), GOOD);

    // SIGTERM while handoffs wait: shutdown ends within its budget, with a report.
    let started = Instant::now();
    shutdown.trigger(Trigger::Sigterm);
    let report = tokio::time::timeout(budget + Duration::from_secs(3), run)
        .await
        .expect("shutdown ended within its budget")
        .expect("consumer task")
        .expect("consumer ran");
    assert!(started.elapsed() <= budget + Duration::from_secs(2));
    assert_eq!(report.totals.acked, GOOD as u64);
    assert_eq!(
        report.totals.retried, 0,
        "no handoff was published while blocked"
    );

    // The alarm clears; whatever a blocked connection still held would land now.
    drop(alarm);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut found = client.drain_ids(&queue).await;
    for lane in [
        format!("{queue}.retry.10m"),
        format!("{queue}.dlq"),
        format!("{queue}.parking"),
    ] {
        for (id, n) in client.drain_ids(&lane).await {
            *found.entry(id).or_insert(0) += n;
        }
    }
    let doubled: Vec<_> = found.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "messages that exist twice: {doubled:?}");
    let missing: Vec<_> = failing
        .iter()
        .filter(|id| !found.contains_key(*id))
        .collect();
    assert!(missing.is_empty(), "failing messages lost: {missing:?}");
    let handled = handled.lock().unwrap();
    let lost: Vec<_> = good
        .iter()
        .filter(|id| !handled.contains(*id) && !found.contains_key(*id))
        .collect();
    assert!(lost.is_empty(), "good messages lost: {lost:?}");
    assert!(
        good.iter().all(|id| !found.contains_key(id)),
        "good messages left behind after their ACK"
    );
}
