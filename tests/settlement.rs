//! Settlement paths against the real local RabbitMQ node (see the book's design chapter).

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{Calls, config, header, header_str, header_u32, props, start};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lily::prelude::*;
use lily_mq_testkit::{Broker, Client, eventually};

const WAIT: Duration = Duration::from_secs(30);

#[derive(serde::Deserialize)]
struct Order {
    quantity: u32,
}

fn order(quantity: u32) -> Vec<u8> {
    serde_json::json!({ "order_id": "o-1", "quantity": quantity })
        .to_string()
        .into_bytes()
}

async fn success_path(kind: QueueKind) {
    let calls = Calls::default();
    let seen = calls.clone();
    let router = Router::new().route("order.placed", move |Json(o): Json<Order>, meta: Meta| {
        let seen = seen.clone();
        async move {
            assert_eq!(o.quantity, 2);
            seen.record(&meta);
            Ok(())
        }
    });
    let (_, queue, client, running) =
        common::scenario("success", router, |q| config(q, kind)).await;
    for i in 0..20 {
        client
            .send(&queue, "order.placed", &format!("m-{i}"), &order(2))
            .await;
    }
    common::wait_depths("every message ACKed", WAIT, &[(&queue, 0)]).await;
    let summary = running.stop().await;
    let once: BTreeMap<String, usize> = (0..20).map(|i| (format!("m-{i}"), 1)).collect();
    assert_eq!(calls.by_id(), once, "each message handled once");
    assert_eq!(summary.totals.acked, 20);
    assert_eq!(
        summary.totals.acks_confirmed, 20,
        "every ack proven by a round trip"
    );
    assert_eq!(summary.totals.acks_uncertain, 0);
    assert!(summary.clean, "{:?}", summary.unresolved);
    // After the consumer's connection closed, an unacked message would be ready again.
    assert_eq!(client.depth(&queue).await, 0);
    assert_eq!(client.depth(&format!("{queue}.dlq")).await, 0);
}

/// State given once with `Router::with_state` reaches every call, across handlers, with no
/// clone-and-`async move` closure: each call of `place` records its id in the shared `Ledger`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_given_with_with_state_reaches_every_call() {
    #[derive(Clone, Default)]
    struct Ledger(std::sync::Arc<std::sync::Mutex<Vec<String>>>);
    async fn place(State(ledger): State<Ledger>, meta: Meta) -> Result<(), QueueHandlerError> {
        ledger.0.lock().unwrap().push(meta.message_id().to_owned());
        Ok(())
    }
    async fn cancel(State(ledger): State<Ledger>, meta: Meta) -> Result<(), QueueHandlerError> {
        ledger
            .0
            .lock()
            .unwrap()
            .push(format!("cancel:{}", meta.message_id()));
        Ok(())
    }
    let ledger = Ledger::default();
    let router = Router::new()
        .route("order.placed", place)
        .route("order.cancelled", cancel)
        .with_state(ledger.clone());
    let (_, queue, client, running) =
        common::scenario("state", router, |q| config(q, QueueKind::Classic)).await;
    for i in 0..10 {
        client
            .send(&queue, "order.placed", &format!("m-{i}"), &order(1))
            .await;
    }
    client
        .send(&queue, "order.cancelled", "m-x", &order(1))
        .await;
    running
        .wait_for("every message ACKed", WAIT, |t| t.acked == 11)
        .await;
    running.stop().await;
    let mut seen = ledger.0.lock().unwrap().clone();
    seen.sort();
    let mut expected: Vec<String> = (0..10).map(|i| format!("m-{i}")).collect();
    expected.push("cancel:m-x".into());
    expected.sort();
    assert_eq!(seen, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn success_acks_and_leaves_classic_queue_empty() {
    success_path(QueueKind::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn success_acks_and_leaves_quorum_queue_empty() {
    success_path(QueueKind::Quorum).await;
}

/// Fewer handlers than the prefetch: never more than `concurrency` run at once, and every
/// delivery is still settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_below_prefetch_bounds_running_handlers() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let running_now = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (now, peak) = (Arc::clone(&running_now), Arc::clone(&most));
    let router = Router::new().route("order.placed", move || {
        let (now, peak) = (Arc::clone(&now), Arc::clone(&peak));
        async move {
            let running = now.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(running, Ordering::SeqCst);
            // Long enough that the 40 messages overlap even when publishing is slow.
            tokio::time::sleep(Duration::from_millis(100)).await;
            now.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        }
    });
    let (_, queue, client, running) = common::scenario("concurrency", router, |q| {
        config(q, QueueKind::Classic).prefetch(20).concurrency(3)
    })
    .await;
    for i in 0..40 {
        client
            .send(&queue, "order.placed", &format!("c-{i}"), &order(1))
            .await;
    }
    common::wait_depths("every message ACKed", WAIT, &[(&queue, 0)]).await;
    let summary = running.stop().await;
    assert_eq!(summary.totals.acked, 40);
    assert!(summary.clean, "{:?}", summary.unresolved);
    assert_eq!(
        most.load(Ordering::SeqCst),
        3,
        "handlers ran up to, and never beyond, the concurrency"
    );
    assert_eq!(client.depth(&queue).await, 0);
}

/// Handlers that finish without waiting are run and settled on the consume loop, so the ACKs
/// of a backlog share frames as a hand-batched consumer's do. 2 000 messages wait in the queue;
/// a consumer at prefetch 100 takes them through a proxy that counts its `basic.ack` frames.
/// Handing each delivery to a worker wrote a frame per 3 to 9 deliveries; now at most one per
/// 15 is allowed (half the prefetch shares one when the backlog keeps coming). Every id is
/// handled exactly once and the queue ends empty.
async fn a_backlog_is_acked_in_shared_frames(kind: QueueKind) {
    const N: usize = 2_000;
    let broker = Broker::from_env();
    let queue = Broker::unique("frames");
    let calls = Calls::default();
    let cfg = || config(&queue, kind).prefetch(100).concurrency(100);
    // A first consumer declares the topology and stops: the messages wait for the second.
    let declaring = start(broker.url(), cfg(), calls.recording_router());
    declaring.wait_ready().await;
    declaring.stop().await;
    let client = Client::connect(broker.url()).await;
    for i in 0..N {
        client
            .send(&queue, "order.placed", &format!("b-{i}"), &order(1))
            .await;
    }
    let proxy = lily_mq_testkit::FaultProxy::start(broker.addr()).await;
    proxy.disarm();
    let running = start(&proxy.url(broker.url()), cfg(), calls.recording_router());
    let stats = running.stats.clone();
    let settled = eventually(WAIT, || stats.totals().acked == N as u64).await;
    assert!(settled, "acked {} of {N}", stats.totals().acked);
    let summary = running.stop().await;
    assert!(summary.clean, "{:?}", summary.unresolved);
    let mut handled = BTreeMap::<String, usize>::new();
    for (id, _, _) in calls.all() {
        *handled.entry(id).or_default() += 1;
    }
    assert_eq!(handled.len(), N, "every id handled");
    assert!(
        handled.values().all(|&n| n == 1),
        "handled more than once: {:?}",
        handled.iter().filter(|(_, n)| **n > 1).collect::<Vec<_>>()
    );
    assert_eq!(client.depth(&queue).await, 0);
    let dead = client.drain_ids(&format!("{queue}.dlq")).await;
    assert!(dead.is_empty(), "dead-lettered: {dead:?}");
    let frames = proxy.acks_sent();
    assert!(
        frames > 0 && frames <= (N / 15) as u64,
        "{frames} basic.ack frames for {N} deliveries"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_is_acked_in_shared_frames_on_a_classic_queue() {
    a_backlog_is_acked_in_shared_frames(QueueKind::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_is_acked_in_shared_frames_on_a_quorum_queue() {
    a_backlog_is_acked_in_shared_frames(QueueKind::Quorum).await;
}

/// A handler that computes for long without waiting must not keep every delivery on the
/// consume loop's thread: after a few such first polls, deliveries go to the workers and run
/// in parallel on both of the runtime's threads. Every id is handled exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_that_compute_without_waiting_run_in_parallel() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    const N: usize = 80;
    let running_now = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let calls = Calls::default();
    let (now, peak, seen) = (Arc::clone(&running_now), Arc::clone(&most), calls.clone());
    let router = Router::new().route("order.placed", move |meta: Meta| {
        let (now, peak, seen) = (Arc::clone(&now), Arc::clone(&peak), seen.clone());
        async move {
            let running = now.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(running, Ordering::SeqCst);
            // 3 ms of work that never yields.
            let began = Instant::now();
            while began.elapsed() < Duration::from_millis(3) {
                std::hint::spin_loop();
            }
            now.fetch_sub(1, Ordering::SeqCst);
            seen.record(&meta);
            Ok(())
        }
    });
    let (_, queue, client, running) = common::scenario("compute", router, |q| {
        config(q, QueueKind::Classic).prefetch(20).concurrency(8)
    })
    .await;
    for i in 0..N {
        client
            .send(&queue, "order.placed", &format!("h-{i}"), &order(1))
            .await;
    }
    common::wait_depths("every message ACKed", WAIT, &[(&queue, 0)]).await;
    let summary = running.stop().await;
    assert_eq!(summary.totals.acked, N as u64);
    let mut ids: Vec<String> = calls.all().into_iter().map(|c| c.0).collect();
    ids.sort();
    let mut expected: Vec<String> = (0..N).map(|i| format!("h-{i}")).collect();
    expected.sort();
    assert_eq!(ids, expected, "every id handled exactly once");
    let dead = client.drain_ids(&format!("{queue}.dlq")).await;
    assert!(dead.is_empty(), "dead-lettered: {dead:?}");
    assert!(
        most.load(Ordering::SeqCst) >= 2,
        "handlers that compute never ran in parallel"
    );
}

/// ACKs that become ready together may be written as one `multiple` ACK, which must never cover
/// a delivery still being handled. One delivery in the middle of a burst is held while the 50
/// around it are ACKed: the broker must still count it unacknowledged, and after a forced
/// shutdown it must be back in the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_delivery_is_never_covered_by_the_acks_of_later_ones() {
    let router = Router::new().route("order.placed", move |Json(o): Json<Order>| async move {
        if o.quantity == 0 {
            // Held until the consumer is forced down.
            std::future::pending::<()>().await;
        }
        Ok(())
    });
    let (broker, queue, client, running) = common::scenario("held", router, |q| {
        config(q, QueueKind::Quorum)
            .prefetch(50)
            .concurrency(50)
            .handler_timeout(Duration::from_secs(300))
    })
    .await;
    for i in 0..51 {
        let (body, id) = match i {
            20 => (order(0), "held".to_owned()),
            _ => (order(1), format!("f-{i}")),
        };
        client.send(&queue, "order.placed", &id, &body).await;
    }
    // The broker holds exactly one: the held delivery, unacknowledged.
    common::wait_depths("50 ACKed", WAIT, &[(&queue, 1)]).await;
    let unacked = || {
        let listing = broker.ctl(&["list_queues", "-q", "name", "messages_unacknowledged"]);
        listing.lines().find_map(|line| {
            let (name, count) = line.split_once('\t')?;
            (name == queue).then(|| count.trim().parse::<u32>().ok())?
        })
    };
    let settled = lily_mq_testkit::eventually(WAIT, || unacked() == Some(1)).await;
    assert!(
        settled,
        "the broker should hold exactly the held delivery unacked, has {:?}",
        unacked()
    );
    assert_eq!(running.stats.in_flight(), 1);
    running.shutdown.force(Trigger::Api);
    let summary = running.stop().await;
    assert_eq!(summary.totals.acked, 50);
    assert_eq!(summary.unresolved.len(), 1, "{:?}", summary.unresolved);
    assert_eq!(
        summary.totals.unresolved, 1,
        "the totals count what the list holds"
    );
    let back = client
        .take(&queue, WAIT)
        .await
        .expect("the held message is back in the queue");
    assert_eq!(
        back.properties.message_id().as_ref().map(|id| id.as_str()),
        Some("held")
    );
    assert_eq!(client.depth(&queue).await, 0);
}

async fn retry_then_success(kind: QueueKind) {
    let calls = Calls::default();
    let router = calls.router_succeeding_at(3, "stock service busy");
    let (_, queue, client, running) = common::scenario("retry", router, |q| config(q, kind)).await;
    client
        .send(&queue, "order.placed", "retry-1", &order(1))
        .await;

    // Two copies through the buckets, then the ACK: the broker holds nothing anywhere.
    let first_bucket = format!("{queue}.retry.1s");
    let second_bucket = format!("{queue}.retry.2s");
    let handled = eventually(WAIT, || calls.count() == 3).await;
    assert!(handled, "three attempts: {:?}", calls.all());
    common::wait_depths(
        "the third attempt ACKed",
        WAIT,
        &[(&queue, 0), (&first_bucket, 0), (&second_bucket, 0)],
    )
    .await;
    let summary = running.stop().await;

    let attempts: Vec<u32> = calls.all().iter().map(|c| c.1).collect();
    assert_eq!(
        attempts,
        vec![1, 2, 3],
        "each retry comes back with attempt + 1"
    );
    assert!(
        calls.all().iter().all(|c| c.0 == "retry-1"),
        "message id is preserved"
    );
    assert_eq!((summary.totals.retried, summary.totals.acked), (2, 1));
    assert_eq!(client.depth(&format!("{queue}.dlq")).await, 0);
}

/// The holding-queue policy the guide gives for RabbitMQ before 4.0 (version 2, lazy: the
/// book's "Holding queues on RabbitMQ before 4.0"), applied to a consumer's buckets while
/// retries pass through them: every message waits in its lazy bucket, comes back when it
/// expires and is ACKed, each id handled at attempts 1 and 2. RabbitMQ reads a bucket when its
/// messages expire, and 3.10 before 3.10.7 could crash a lazy version-2 queue on a read
/// (rabbitmq-server#5252). On 4.0, which has only version 2 and no lazy mode, the run is the
/// same without the policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_come_back_through_buckets_under_the_holding_queue_policy() {
    const N: usize = 200;
    let calls = Calls::default();
    let router = calls.router_succeeding_at(2, "stock service busy");
    let (broker, queue, client, running) = common::scenario("holding-policy", router, |q| {
        config(q, QueueKind::Classic).prefetch(50).concurrency(50)
    })
    .await;
    let bucket = format!("{queue}.retry.1s");
    let policy = format!("holding-{queue}");
    let lazy = broker.ctl(&["-q", "version"]).starts_with("3.");
    if lazy {
        broker.set_policy(
            &policy,
            "queues",
            &queue,
            r"retry\..+|dlq|parking",
            r#"{"queue-version":2,"queue-mode":"lazy"}"#,
        );
        let applied = eventually(WAIT, || {
            let listing = broker.ctl(&["list_queues", "-q", "name", "policy"]);
            listing
                .lines()
                .any(|line| line == format!("{bucket}\t{policy}"))
        })
        .await;
        assert!(applied, "the policy reaches the bucket");
    }
    for i in 0..N {
        client
            .send(&queue, "order.placed", &format!("m-{i}"), &order(1))
            .await;
    }
    running
        .wait_for("every message back and ACKed", WAIT * 2, |t| {
            t.acked == N as u64
        })
        .await;
    common::wait_depths("nothing held", WAIT, &[(&queue, 0), (&bucket, 0)]).await;
    let summary = running.stop().await;

    let mut attempts: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for (id, attempt, _) in calls.all() {
        attempts.entry(id).or_default().push(attempt);
    }
    let expected: BTreeMap<String, Vec<u32>> =
        (0..N).map(|i| (format!("m-{i}"), vec![1, 2])).collect();
    assert_eq!(attempts, expected, "each id handled at attempts 1 and 2");
    assert_eq!(
        (summary.totals.retried, summary.totals.acked),
        (N as u64, N as u64)
    );
    assert!(summary.clean, "{:?}", summary.unresolved);
    for lane in ["dlq", "parking", "retry.2s"] {
        assert_eq!(client.depth(&format!("{queue}.{lane}")).await, 0, "{lane}");
    }
    if lazy {
        broker.ctl(&["clear_policy", &policy]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retryable_failure_waits_in_bucket_and_comes_back_with_next_attempt() {
    let broker = Broker::from_env();
    let queue = Broker::unique("bucket");
    let router = Router::new().route("order.placed", |_: Meta| async {
        Err(QueueHandlerError::retryable("later"))
    });
    let mut cfg = config(&queue, QueueKind::Classic);
    cfg.policy.retry_delays = vec![Duration::from_secs(30)];
    let running = start(broker.url(), cfg, router);
    let client = Client::connect(broker.url()).await;
    common::wait_declared(broker.url(), &queue).await;
    client
        .send(&queue, "order.placed", "bucketed", &order(1))
        .await;
    let bucket = format!("{queue}.retry.30s");
    common::wait_depths("the copy in the bucket", WAIT, &[(&queue, 0), (&bucket, 1)]).await;
    let summary = running.stop().await;
    assert_eq!(summary.totals.retried, 1);
    let copy = client
        .take(&bucket, Duration::from_secs(2))
        .await
        .expect("copy in the 30 s bucket");
    let p = &copy.delivery.properties;
    assert_eq!(
        p.message_id().as_ref().map(ShortString::as_str),
        Some("bucketed")
    );
    assert_eq!(header_u32(p, "x-lily-attempt"), Some(2));
    assert_eq!(
        header_str(p, "x-lily-failure-kind").as_deref(),
        Some("retryable")
    );
    assert_eq!(
        header_str(p, "x-lily-reason").as_deref(),
        Some("handler failure: later")
    );
    assert_eq!(
        header_str(p, "x-lily-source-queue").as_deref(),
        Some(queue.as_str())
    );
    assert_eq!(p.delivery_mode(), &Some(2));
    assert_eq!(copy.delivery.data, order(1), "body is carried unchanged");
    assert_eq!(client.depth(&queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retryable_failure_retries_then_succeeds_on_classic() {
    retry_then_success(QueueKind::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retryable_failure_retries_then_succeeds_on_quorum() {
    retry_then_success(QueueKind::Quorum).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_exhausted_goes_to_dlq_with_failure_headers_and_message_id() {
    let router = Router::new().route("order.placed", |_: Meta| async {
        Err(QueueHandlerError::retryable("warehouse closed"))
    });
    let (_, queue, client, running) =
        common::scenario("exhaust", router, |q| config(q, QueueKind::Classic)).await;
    let mut original = props("doomed-1", "order.placed");
    let mut headers = FieldTable::default();
    headers.insert(
        "tenant".into(),
        AMQPValue::LongString(LongString::from(b"acme".to_vec())),
    );
    original = original
        .with_headers(headers)
        .with_correlation_id("corr-9".into());
    client.publish(&queue, &order(1), original).await;
    let dlq = format!("{queue}.dlq");
    let (first, second) = (format!("{queue}.retry.1s"), format!("{queue}.retry.2s"));
    common::wait_depths(
        "dead-lettered",
        WAIT,
        &[(&queue, 0), (&first, 0), (&second, 0), (&dlq, 1)],
    )
    .await;
    let summary = running.stop().await;
    assert_eq!(
        (summary.totals.retried, summary.totals.dead_lettered),
        (2, 1)
    );

    let dead = client
        .take(&format!("{queue}.dlq"), Duration::from_secs(2))
        .await
        .expect("message in the DLQ");
    let p = &dead.delivery.properties;
    assert_eq!(
        p.message_id().as_ref().map(ShortString::as_str),
        Some("doomed-1")
    );
    assert_eq!(
        p.correlation_id().as_ref().map(ShortString::as_str),
        Some("corr-9")
    );
    assert_eq!(
        header_str(p, "tenant").as_deref(),
        Some("acme"),
        "original headers kept"
    );
    assert_eq!(header_u32(p, "x-lily-attempt"), Some(3));
    assert_eq!(
        header_str(p, "x-lily-failure-kind").as_deref(),
        Some("retryable")
    );
    assert_eq!(
        header_str(p, "x-lily-reason").as_deref(),
        Some("attempts exhausted: warehouse closed")
    );
    assert!(header(p, "x-lily-first-failure-at").is_some());
    assert!(header(p, "x-lily-last-failure-at").is_some());
    assert_eq!(
        header_str(p, "x-lily-original-routing-key").as_deref(),
        Some(queue.as_str())
    );
    assert_eq!(client.depth(&queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_failure_and_unknown_type_go_straight_to_dlq() {
    let calls = Calls::default();
    let seen = calls.clone();
    let router = Router::new().route("order.placed", move |Json(o): Json<Order>, meta: Meta| {
        let seen = seen.clone();
        async move {
            seen.record(&meta);
            if o.quantity == 0 {
                return Err(QueueHandlerError::permanent("quantity must be positive"));
            }
            Ok(())
        }
    });
    let (_, queue, client, running) =
        common::scenario("permanent", router, |q| config(q, QueueKind::Classic)).await;
    client.send(&queue, "order.placed", "zero", &order(0)).await;
    client
        .send(&queue, "order.cancelled", "unknown", &order(1))
        .await;
    client
        .send(&queue, "order.placed", "garbled", b"{not json")
        .await;
    let v2 = props("v2", "order.placed").with_headers({
        let mut h = FieldTable::default();
        h.insert("schema-version".into(), AMQPValue::LongInt(2));
        h
    });
    client.publish(&queue, &order(1), v2).await;
    client
        .publish(
            &queue,
            &order(1),
            props("xml", "order.placed").with_content_type("application/xml".into()),
        )
        .await;
    let dlq = format!("{queue}.dlq");
    common::wait_depths("five dead letters", WAIT, &[(&queue, 0), (&dlq, 5)]).await;
    let summary = running.stop().await;
    assert_eq!(summary.totals.retried, 0);
    assert_eq!(
        calls.count(),
        1,
        "only the well-formed order reached the handler"
    );
    let mut reasons = Vec::new();
    while let Some(m) = client
        .take(&format!("{queue}.dlq"), Duration::from_millis(500))
        .await
    {
        let p = &m.delivery.properties;
        let id = p
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned())
            .unwrap_or_default();
        reasons.push((id, header_str(p, "x-lily-reason").unwrap_or_default()));
    }
    reasons.sort();
    assert_eq!(
        reasons,
        vec![
            (
                "garbled".into(),
                "handler failure: payload is not valid JSON (line 1, column 2)".into()
            ),
            (
                "unknown".into(),
                "dispatch failure: no handler for this message type".into()
            ),
            (
                "v2".into(),
                "dispatch failure: unsupported schema version".into()
            ),
            (
                "xml".into(),
                "dispatch failure: unsupported content type".into()
            ),
            (
                "zero".into(),
                "handler failure: quantity must be positive".into()
            ),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_is_rejected_to_broker_dlx_without_calling_handler() {
    let broker = Broker::from_env();
    let queue = Broker::unique("oversized");
    let calls = Calls::default();
    let router = calls.recording_router();
    let mut cfg = config(&queue, QueueKind::Classic);
    cfg.limits.max_body_bytes = 1024;
    let running = start(broker.url(), cfg, router);
    let client = Client::connect(broker.url()).await;
    common::wait_declared(broker.url(), &queue).await;
    client
        .publish(&queue, &vec![b'x'; 4096], props("big", "order.placed"))
        .await;
    client
        .send(&queue, "order.placed", "small", &order(1))
        .await;
    // The broker dead-letters the rejected one through the work queue's DLX.
    let dlq = format!("{queue}.dlq");
    common::wait_depths("reject and ACK", WAIT, &[(&queue, 0), (&dlq, 1)]).await;
    let summary = running.stop().await;
    assert_eq!(
        summary.totals.dead_lettered, 0,
        "no Lily handoff for oversized bodies"
    );
    let ids: Vec<String> = calls.all().into_iter().map(|c| c.0).collect();
    assert_eq!(
        ids,
        vec!["small".to_owned()],
        "handler never saw the oversized body"
    );
    let dead = client
        .take(&format!("{queue}.dlq"), Duration::from_secs(2))
        .await
        .expect("rejected message dead-lettered by the broker");
    assert_eq!(dead.delivery.data.len(), 4096);
    let death = header(&dead.delivery.properties, "x-death").expect("broker x-death header");
    let AMQPValue::FieldArray(deaths) = death else {
        panic!("x-death is an array")
    };
    let AMQPValue::FieldTable(first) = &deaths.as_slice()[0] else {
        panic!("x-death entry is a table")
    };
    let reason = first.inner().get("reason").expect("x-death reason");
    assert_eq!(
        reason,
        &AMQPValue::LongString(LongString::from(b"rejected".to_vec()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_envelope_goes_to_dlq_with_sanitized_reason_without_calling_handler() {
    let calls = Calls::default();
    let router = calls.recording_router();
    let (_, queue, client, running) =
        common::scenario("invalid", router, |q| config(q, QueueKind::Classic)).await;
    // No type property.
    let untyped = BasicProperties::default().with_message_id("no-type".into());
    client.publish(&queue, &order(1), untyped).await;
    // Too many headers, one of them carrying something that must not be copied.
    let mut hostile = FieldTable::default();
    for i in 0..100 {
        hostile.insert(
            ShortString::from(format!("h{i}")),
            AMQPValue::LongString(LongString::from(b"secret-token-value".to_vec())),
        );
    }
    client
        .publish(
            &queue,
            &order(1),
            props("crowded", "order.placed").with_headers(hostile),
        )
        .await;
    let dlq = format!("{queue}.dlq");
    common::wait_depths("two dead letters", WAIT, &[(&queue, 0), (&dlq, 2)]).await;
    let summary = running.stop().await;
    assert_eq!(calls.count(), 0, "handler never called");
    assert_eq!(summary.totals.acked, 0);
    let mut seen = Vec::new();
    while let Some(m) = client
        .take(&format!("{queue}.dlq"), Duration::from_millis(500))
        .await
    {
        let p = &m.delivery.properties;
        let table = p.headers().clone().unwrap_or_default();
        assert!(
            table
                .inner()
                .keys()
                .all(|k| k.as_str().starts_with("x-lily-")),
            "only Lily's bounded headers are carried: {:?}",
            table.inner().keys().collect::<Vec<_>>()
        );
        assert_eq!(
            header_str(p, "x-lily-failure-kind").as_deref(),
            Some("rejected")
        );
        seen.push((
            p.message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default(),
            header_str(p, "x-lily-reason").unwrap_or_default(),
        ));
    }
    seen.sort();
    assert_eq!(
        seen,
        vec![
            (
                "crowded".into(),
                "invalid envelope: too many headers".into()
            ),
            (
                "no-type".into(),
                "invalid envelope: type property missing".into()
            ),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_panic_is_retried_and_consumer_stays_alive() {
    let calls = Calls::default();
    let seen = calls.clone();
    let router = Router::new().route("order.placed", move |meta: Meta| {
        let seen = seen.clone();
        async move {
            seen.record(&meta);
            if meta.message_id() == "boom" && meta.attempt() == 1 {
                panic!("handler bug");
            }
            Ok(())
        }
    });
    let (_, queue, client, running) =
        common::scenario("panic", router, |q| config(q, QueueKind::Classic)).await;
    client.send(&queue, "order.placed", "boom", &order(1)).await;
    client
        .send(&queue, "order.placed", "after", &order(1))
        .await;
    let handled = eventually(WAIT, || calls.count() == 3).await;
    assert!(handled, "boom twice, after once: {:?}", calls.all());
    let bucket = format!("{queue}.retry.1s");
    common::wait_depths("both ACKed", WAIT, &[(&queue, 0), (&bucket, 0)]).await;
    let summary = running.stop().await;
    assert_eq!(summary.totals.retried, 1);
    let mut ids: Vec<(String, u32)> = calls.all().into_iter().map(|c| (c.0, c.1)).collect();
    ids.sort();
    assert_eq!(
        ids,
        vec![("after".into(), 1), ("boom".into(), 1), ("boom".into(), 2)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_timeout_is_retried_and_fires_the_cancellation_token() {
    let cancelled = Calls::default();
    let seen = cancelled.clone();
    let router = Router::new().route(
        "order.placed",
        move |meta: Meta, Cancellation(token): Cancellation| {
            let seen = seen.clone();
            async move {
                if meta.attempt() == 1 {
                    let watcher = token.clone();
                    let meta2 = meta.clone();
                    tokio::spawn(async move {
                        watcher.cancelled().await;
                        seen.record(&meta2);
                    });
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
                Ok(())
            }
        },
    );
    let (_, queue, client, running) = common::scenario("timeout", router, |q| {
        config(q, QueueKind::Classic).handler_timeout(Duration::from_millis(300))
    })
    .await;
    client.send(&queue, "order.placed", "slow", &order(1)).await;
    let fired = eventually(WAIT, || cancelled.count() == 1).await;
    assert!(fired, "the token fires when the timeout expires");
    let bucket = format!("{queue}.retry.1s");
    common::wait_depths("retried, then ACKed", WAIT, &[(&queue, 0), (&bucket, 0)]).await;
    let summary = running.stop().await;
    assert_eq!((summary.totals.retried, summary.totals.acked), (1, 1));
    assert_eq!(
        cancelled.count(),
        1,
        "the token fired when the timeout expired"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_mode_refuses_a_missing_topology_and_consumes_a_declared_one() {
    let broker = Broker::from_env();
    let queue = Broker::unique("verify");
    let router = || Router::new().route("order.placed", |_: Meta| async { Ok(()) });
    let cfg = || config(&queue, QueueKind::Quorum).topology(TopologyMode::Verify);

    let refused = Consumer::new(broker.url(), cfg(), router())
        .run(Shutdown::default())
        .await;
    assert!(
        matches!(refused, Err(lily::Error::Topology { .. })),
        "missing topology is a startup error, not a retry loop"
    );

    let connection = lapin::Connection::connect(broker.url(), Default::default())
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    let policy = common::fast_policy();
    // As Lily declares it, with the default delivery limit.
    lily::topology::Topology::new(&queue, QueueKind::Quorum, &policy.retry_delays)
        .delivery_limit(cfg().delivery_limit)
        .apply(&channel, TopologyMode::Declare)
        .await
        .expect("declare topology");

    let running = start(broker.url(), cfg(), router());
    let client = Client::connect(broker.url()).await;
    client
        .send(&queue, "order.placed", "verified", &order(1))
        .await;
    common::wait_depths("ACKed", WAIT, &[(&queue, 0)]).await;
    let summary = running.stop().await;
    assert_eq!(summary.totals.acked, 1);
}
