//! A permission taken from Lily's broker user while it runs, and given back: handoffs refused
//! for want of `write` on the default exchange are a failing lane with its cause, open few
//! channels, ACK nothing without its copy, requeue nothing, and resume by themselves once the
//! permission is restored, without a restart or a reconnect.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{Calls, config, declare_permissions};
use lily::prelude::*;
use lily_mq_testkit::{Broker, Client, http_get};

/// Messages of each kind: failures that need a DLQ copy, and successes.
const EACH: usize = 100;
/// Prefetch and concurrency: many deliveries in flight while the copies are refused.
const PREFETCH: u16 = 60;
/// How long the permission stays revoked.
const REFUSED_FOR: Duration = Duration::from_secs(8);
/// At most this many channel opens a second while refused (the security chapter's bound).
const OPENS_PER_SECOND: f64 = 5.0;
/// Handoffs resume this soon after the permission is granted again.
const RESUME_WITHIN: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_permission_revoked_mid_run_holds_failures_and_resumes_once_restored_on_classic() {
    revoked_mid_run(QueueKind::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_permission_revoked_mid_run_holds_failures_and_resumes_once_restored_on_quorum() {
    revoked_mid_run(QueueKind::Quorum).await;
}

/// Gives `user` these permissions on the default vhost, as an operator would.
fn set_permissions(broker: &Broker, user: &str, [configure, write, read]: &[String; 3]) {
    broker.ctl(&["set_permissions", "-p", "/", user, configure, write, read]);
}

/// The broker's process ids of Lily's connections for `queue` (named `lily:<queue>:<role>`):
/// the same before and after means nothing reconnected.
fn connections_of(broker: &Broker, queue: &str) -> Vec<String> {
    let out = broker.ctl(&[
        "list_connections",
        "-q",
        "--no-table-headers",
        "pid",
        "client_properties",
    ]);
    let prefix = format!("\"lily:{queue}:");
    let mut pids: Vec<String> = out
        .lines()
        .filter(|line| line.contains(&prefix))
        .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
        .collect();
    pids.sort();
    pids
}

/// The broker's own log lines that say it refused a channel of `user` access: one per channel
/// closed with `ACCESS_REFUSED`.
fn refusals_logged(user: &str) -> usize {
    let dir =
        std::env::var("LILY_RABBIT_DIR").expect("LILY_RABBIT_DIR names the broker's data dir");
    let needle = format!("user: '{user}'");
    let mut count = 0;
    for entry in std::fs::read_dir(format!("{dir}/log")).expect("the broker's log dir") {
        let path = entry.expect("a log file").path();
        if path.extension().is_some_and(|e| e == "log") {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            count += text
                .split("Channel error on connection")
                .skip(1)
                .filter(|e| e.contains(&needle) && e.contains("access_refused"))
                .count();
        }
    }
    count
}

async fn revoked_mid_run(kind: QueueKind) {
    let broker = Broker::from_env();
    let queue = Broker::unique("perm-revoked");
    let user = Broker::unique("perm-user");
    let granted = declare_permissions(&queue);
    let url = {
        let [c, w, r] = &granted;
        broker.add_user(&user, "perm-password", [c, w, r])
    };
    let calls = Calls::default();
    let seen = calls.clone();
    let router = Router::new().route("order.placed", move |meta: Meta| {
        let seen = seen.clone();
        async move {
            seen.record(&meta);
            if meta.message_id().starts_with("bad-") {
                Err(QueueHandlerError::permanent("rejected by a business rule"))
            } else {
                Ok(())
            }
        }
    });
    let cfg = config(&queue, kind)
        .prefetch(PREFETCH)
        .concurrency(usize::from(PREFETCH));
    let running = common::start(&url, cfg, router);
    running.wait_ready().await;
    let (addr, health) = lily::health::serve(
        "127.0.0.1:0".parse().expect("address"),
        running.stats.clone(),
    )
    .await
    .expect("health endpoint");
    let client = Client::connect(broker.url()).await;
    let dlq = format!("{queue}.dlq");

    let connections = connections_of(&broker, &queue);
    assert!(
        connections.len() >= 2,
        "the consuming and the handoff connection: {connections:?}"
    );

    // Write taken away: the default exchange (every copy goes through it) refuses the user.
    let mut revoked = granted.clone();
    revoked[1] = "^$".to_owned();
    set_permissions(&broker, &user, &revoked);
    let refusals_before = refusals_logged(&user);
    let revoked_at = Instant::now();
    for i in 0..EACH {
        for id in [format!("bad-{i}"), format!("good-{i}")] {
            client.send(&queue, "order.placed", &id, b"{}").await;
        }
    }
    // Asked while refused, after the first refusals had time to come.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let readyz = http_get(addr, "/readyz").await;
    tokio::time::sleep(REFUSED_FOR.saturating_sub(revoked_at.elapsed())).await;
    // While refused: no copy reached the DLQ and nothing was ACKed without its copy, so every
    // failure is still in the work queue (held unacknowledged, or behind the full prefetch).
    let depths: BTreeMap<String, u64> = broker
        .depths()
        .into_iter()
        .filter(|(name, _)| name.starts_with(queue.as_str()))
        .collect();
    let refused_for = revoked_at.elapsed();
    let refusals = refusals_logged(&user) - refusals_before;
    // The broker's view: no copy anywhere, and every failure still in the work queue.
    for (name, depth) in &depths {
        if *name != queue {
            assert_eq!(*depth, 0, "no copy in {name} while refused: {depths:?}");
        }
    }
    let in_queue = depths.get(&queue).copied().unwrap_or_default();
    assert!(
        in_queue >= EACH as u64,
        "every failure is still in the work queue, unacknowledged or ready: {depths:?}"
    );
    assert_eq!(running.stats.totals().dead_lettered, 0);
    assert!(
        readyz.status == 200
            && readyz
                .body
                .contains("handoffs refused: the write permission on exchange 'amq.default'"),
        "/readyz names the refusal: {readyz:?}"
    );
    let bound = (OPENS_PER_SECOND * refused_for.as_secs_f64()).ceil() as usize + 4;
    assert!(
        refusals > 0 && refusals <= bound,
        "{refusals} channels refused in {refused_for:?}, at most {bound} allowed"
    );

    // Given back: everything settles without a restart or a reconnect, checked from outside.
    set_permissions(&broker, &user, &granted);
    let restored_at = Instant::now();
    // Resumed by itself: the first copy in the DLQ within RESUME_WITHIN, as the broker counts.
    let mut timeline = Vec::new();
    let resumed = lily_mq_testkit::eventually(RESUME_WITHIN, || {
        let in_dlq = broker.depths().get(&dlq).copied().unwrap_or_default();
        timeline.push((restored_at.elapsed().as_millis(), in_dlq));
        in_dlq > 0
    })
    .await;
    assert!(
        resumed,
        "no copy within {RESUME_WITHIN:?} of the permission restored: (ms, in the DLQ) {timeline:?}"
    );
    let first_copy_in = restored_at.elapsed();
    let (first, second) = (format!("{queue}.retry.1s"), format!("{queue}.retry.2s"));
    common::wait_depths(
        "every failure in the DLQ once the permission is back",
        Duration::from_secs(30),
        &[(&queue, 0), (&first, 0), (&second, 0), (&dlq, EACH as u64)],
    )
    .await;
    let resumed_in = restored_at.elapsed();
    assert_eq!(
        connections_of(&broker, &queue),
        connections,
        "resumed on the same connections: nothing reconnected"
    );
    assert_eq!(running.stats.handoffs_refused(), None, "the refusal ended");
    let totals = running.stats.totals();
    let report = running.stop().await;
    health.abort();
    assert!(report.clean, "{report:?}");
    assert_eq!(
        report.incidents.connections_lost, 0,
        "resumed without a reconnect"
    );
    assert_eq!(
        report.incidents.handoffs_refused, 1,
        "the report counts the refusal"
    );
    let named = report.handoffs_refused_for.as_deref().unwrap_or_default();
    assert!(
        named.contains("write") && named.contains("amq.default"),
        "the report names the refused permission and its resource: {named:?}"
    );

    let ids = |prefix: &'static str| (0..EACH).map(move |i| (format!("{prefix}-{i}"), 1));
    let every: BTreeMap<String, usize> = ids("bad").chain(ids("good")).collect();
    assert_eq!(
        calls.by_id(),
        every,
        "each message handled once: nothing was NACK-requeued"
    );
    let bad: BTreeMap<String, usize> = ids("bad").collect();
    assert_eq!(
        client.drain_ids(&dlq).await,
        bad,
        "each failure once in the DLQ"
    );
    assert!(client.drain_ids(&queue).await.is_empty());
    for bucket in [&first, &second] {
        assert!(client.drain_ids(bucket).await.is_empty(), "{bucket}");
    }
    eprintln!(
        "{kind:?}: {refusals} channels refused in {refused_for:?}; first copy {first_copy_in:?} \
         and all {resumed_in:?} after the permission was restored; totals {totals:?}"
    );
}

/// The security chapter's boundary, shown: RabbitMQ 3.10 checks `read` on a queue with a
/// dead-letter exchange only when it creates the queue, so a user without `read` on the retry
/// buckets starts against an existing topology; the bucket deleted, the next session creates it,
/// and the consumer stops there, its report naming the permission and the bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_on_an_existing_bucket_is_checked_only_when_the_bucket_is_created() {
    let broker = Broker::from_env();
    let queue = Broker::unique("perm-bucket");
    let topology = lily::topology::Topology::new(
        &queue,
        QueueKind::Classic,
        &common::fast_policy().retry_delays,
    );
    let admin = Client::connect(broker.url()).await;
    let setup = lapin::Connection::connect(broker.url(), Default::default())
        .await
        .expect("connect");
    let channel = setup.create_channel().await.expect("channel");
    topology
        .apply(&channel, TopologyMode::Declare)
        .await
        .expect("declared by the administrator");
    let [configure, write, _] = declare_permissions(&queue);
    let read = format!(r"^{}(\.dlx)?$", common::escape(&queue));
    let user = Broker::unique("perm-bucket-user");
    let url = broker.add_user(&user, "perm-password", [&configure, &write, &read]);

    let running = common::start(&url, config(&queue, QueueKind::Classic), Router::new());
    running.wait_ready().await;

    let bucket = format!("{queue}.retry.1s");
    admin.delete(&bucket).await;
    broker.close_connection_named(&format!("lily:{queue}:consuming"));
    // Past the first session, `run` ends with its report, which names the error.
    let report = running.ended().await.expect("a report");
    assert_eq!(report.trigger, Some(Trigger::Error), "{report:?}");
    let err = report.error.unwrap_or_default();
    assert!(
        err.contains("the configure and read permission on queue '")
            && err.contains(&format!("declare queue '{bucket}'")),
        "{err}"
    );
}
