//! Poison messages and failing lanes, against the real node: metadata the client library cannot
//! parse (Lily's stream rewrites it first, see `crates/rabbit/src/wire.rs`), and a DLQ that is
//! gone. Either way the poison must end in the DLQ, its reason naming what was wrong, while the
//! messages behind it are handled at once.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{Calls, config, header_str, props};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lily::prelude::*;
use lily::shutdown::Incidents;
use lily_mq_testkit::{Client, FaultProxy};

/// Where each poison message puts its bad bytes. Every marker is six bytes, as is what the proxy
/// writes in its place: `0xff` and `0xfe` never occur in UTF-8.
const CASES: [(&str, &str); 5] = [
    ("message_id", "#BAD1#"),
    ("type", "#BAD2#"),
    ("correlation_id", "#BAD3#"),
    ("header key", "#BAD4#"),
    ("nested header key", "#BAD5#"),
];

/// Good messages published right behind each poison message.
const BEHIND: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_that_is_not_utf8_goes_to_the_dlq_without_dropping_the_connection_on_classic() {
    not_utf8_goes_to_the_dlq(QueueKind::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_that_is_not_utf8_goes_to_the_dlq_without_dropping_the_connection_on_quorum() {
    not_utf8_goes_to_the_dlq(QueueKind::Quorum).await;
}

async fn not_utf8_goes_to_the_dlq(kind: QueueKind) {
    let calls = Calls::default();
    let router = calls.recording_router();
    let (broker, queue, client, running) =
        common::scenario("not-utf8", router, |q| config(q, kind).prefetch(10)).await;

    // The publisher writes through a proxy that turns each marker into bytes that are not UTF-8.
    let proxy = FaultProxy::start(broker.addr()).await;
    proxy.disarm();
    for (_, marker) in CASES {
        let mut bad = marker.as_bytes().to_vec();
        bad[..2].copy_from_slice(&[0xff, 0xfe]);
        bad[4..].copy_from_slice(&[0xff, 0xfe]);
        proxy.rewrite(marker.as_bytes(), &bad);
    }
    let publisher = Client::connect(&proxy.url(broker.url())).await;
    let mut good = Vec::new();
    for (n, (field, marker)) in CASES.into_iter().enumerate() {
        let id = format!("poison-{n}");
        let poison = match field {
            "message_id" => props(marker, "order.placed"),
            "type" => props(&id, marker),
            "correlation_id" => {
                props(&id, "order.placed").with_correlation_id(ShortString::from(marker))
            }
            "header key" => props(&id, "order.placed").with_headers(table(marker, yes())),
            _ => props(&id, "order.placed")
                .with_headers(table("outer", AMQPValue::FieldTable(table(marker, yes())))),
        };
        publisher.publish(&queue, id.as_bytes(), poison).await;
        for i in 0..BEHIND {
            let id = format!("good-{n}-{i}");
            publisher.send(&queue, "order.placed", &id, b"{}").await;
            good.push(id);
        }
    }

    let dlq = format!("{queue}.dlq");
    common::wait_depths(
        "good ones ACKed and poison dead-lettered",
        WAIT,
        &[(&queue, 0), (&dlq, CASES.len() as u64)],
    )
    .await;
    let report = running.stop().await;
    assert_eq!(
        report.incidents,
        Incidents::default(),
        "the connection stayed up"
    );
    assert!(report.clean, "{report:?}");

    let mut handled: BTreeMap<String, usize> = BTreeMap::new();
    for (id, _, _) in calls.all() {
        *handled.entry(id).or_default() += 1;
    }
    let expected: BTreeMap<String, usize> = good.iter().map(|id| (id.clone(), 1)).collect();
    assert_eq!(
        handled, expected,
        "every good message handled once, no poison one"
    );

    let mut dead: BTreeMap<String, usize> = BTreeMap::new();
    for message in client.drain(&format!("{queue}.dlq")).await {
        let properties = &message.delivery.properties;
        let reason = header_str(properties, "x-lily-reason").unwrap_or_default();
        let body = String::from_utf8(message.delivery.data.clone()).expect("body kept");
        let n: usize = body
            .trim_start_matches("poison-")
            .parse()
            .expect("a poison body");
        let field = match CASES[n].0 {
            "header key" => "a header key",
            "nested header key" => "a nested header key",
            field => field,
        };
        assert_eq!(
            reason,
            format!("invalid envelope: {field} is not valid UTF-8"),
            "{body}"
        );
        assert!(
            properties.correlation_id().is_none() && properties.headers().is_some(),
            "sanitized metadata only"
        );
        // A rewritten text is not copied as if the sender had sent it.
        match CASES[n].0 {
            "message_id" => assert_eq!(properties.message_id(), &None, "{body}"),
            "type" => assert_eq!(properties.kind(), &None, "{body}"),
            _ => assert!(properties.kind().is_some(), "{body}"),
        }
        *dead.entry(body).or_default() += 1;
    }
    let poison: BTreeMap<String, usize> = (0..CASES.len())
        .map(|n| (format!("poison-{n}"), 1))
        .collect();
    assert_eq!(dead, poison, "each poison message once in the DLQ");
    assert_eq!(client.depth(&queue).await, 0);
}

fn table(key: &str, value: AMQPValue) -> FieldTable {
    let mut table = FieldTable::default();
    table.insert(ShortString::from(key), value);
    table
}

fn yes() -> AMQPValue {
    AMQPValue::Boolean(true)
}

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_dlq_never_fills_the_prefetch_on_classic() {
    failing_dlq(QueueKind::Classic, DlqFault::Deleted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_dlq_never_fills_the_prefetch_on_quorum() {
    failing_dlq(QueueKind::Quorum, DlqFault::Deleted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_dlq_never_fills_the_prefetch_and_takes_copies_once_drained_on_classic() {
    failing_dlq(QueueKind::Classic, DlqFault::Full).await;
}

/// RabbitMQ tells each channel publishing to a full quorum queue that it is full, and (3.10 to
/// 4.0, rabbitmq-server#12206) may never tell it otherwise once the limit is lifted: a channel
/// that was nacked must not be used again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_dlq_never_fills_the_prefetch_and_takes_copies_once_drained_on_quorum() {
    failing_dlq(QueueKind::Quorum, DlqFault::Full).await;
}

/// How the DLQ fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DlqFault {
    /// Deleted, then declared again: copies come back unroutable.
    Deleted,
    /// Full (a policy: `max-length` 0, `overflow: reject-publish`), then the policy is cleared:
    /// copies are nacked.
    Full,
}

/// Prefetch 10, the DLQ failing, 50 permanent failures interleaved with 50 good messages: the
/// good ones are ACKed at once, the failures wait as held copies, and once the DLQ takes copies
/// again they all end in it, without a restart; each message handled once, checked by id.
async fn failing_dlq(kind: QueueKind, fault: DlqFault) {
    const EACH: usize = 50;
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
    let (broker, queue, client, running) = common::scenario("failing-dlq", router, |q| {
        config(q, kind).prefetch(10).concurrency(10)
    })
    .await;
    let dlq = format!("{queue}.dlq");
    let policy = format!("full-{queue}");
    match fault {
        DlqFault::Deleted => client.delete(&dlq).await,
        DlqFault::Full => broker.set_policy(
            &policy,
            "queues",
            &queue,
            "dlq",
            r#"{"max-length":0,"overflow":"reject-publish"}"#,
        ),
    }

    let started = Instant::now();
    for i in 0..EACH {
        for id in [format!("bad-{i}"), format!("good-{i}")] {
            client.send(&queue, "order.placed", &id, b"{}").await;
        }
    }
    // Timed by Lily's count (a `rabbitmqctl` round trip would dwarf it), then checked on the
    // broker: the work queue empty, the good ones ACKed and every failure out as a held copy.
    running
        .wait_for("every good message ACKed", PROMPTLY, |t| {
            t.acked == EACH as u64
        })
        .await;
    let took = started.elapsed();
    common::wait_depths("the work queue empty", PROMPTLY, &[(&queue, 0)]).await;
    assert!(
        running.stats.failing_lanes().contains(&dlq),
        "the failing lane is named: {:?}",
        running.stats.failing_lanes()
    );
    // Readiness says so, still ready: the good messages are handled.
    let (addr, health) = lily::health::serve(
        "127.0.0.1:0".parse().expect("address"),
        running.stats.clone(),
    )
    .await
    .expect("health endpoint");
    let readyz = lily_mq_testkit::http_get(addr, "/readyz").await;
    health.abort();
    assert!(
        readyz.status == 200 && readyz.body.contains(&format!("lane failing: {dlq}")),
        "{readyz:?}"
    );
    // Held copies come back and, the DLQ still gone, wait again (in the longer bucket).
    running
        .wait_for("every failure held twice", WAIT, |t| {
            t.held >= 2 * EACH as u64
        })
        .await;
    let held = running.stats.totals().held;

    match fault {
        DlqFault::Deleted => client.declare(&dlq, kind == QueueKind::Quorum).await,
        DlqFault::Full => {
            broker.ctl(&["clear_policy", &policy]);
        }
    }
    let (first, second) = (format!("{queue}.retry.1s"), format!("{queue}.retry.2s"));
    common::wait_depths(
        "every failure dead-lettered",
        WAIT,
        &[(&queue, 0), (&first, 0), (&second, 0), (&dlq, EACH as u64)],
    )
    .await;
    assert!(running.stats.failing_lanes().is_empty());
    let report = running.stop().await;
    assert!(report.clean, "{report:?}");

    let mut handled: BTreeMap<String, usize> = BTreeMap::new();
    for (id, _, _) in calls.all() {
        *handled.entry(id).or_default() += 1;
    }
    let ids = |prefix: &'static str| (0..EACH).map(move |i| (format!("{prefix}-{i}"), 1));
    let every: BTreeMap<String, usize> = ids("bad").chain(ids("good")).collect();
    assert_eq!(
        handled, every,
        "each message handled once, a held copy never"
    );

    let mut dead: BTreeMap<String, usize> = BTreeMap::new();
    for message in client.drain(&dlq).await {
        let properties = &message.delivery.properties;
        assert_eq!(
            header_str(properties, "x-lily-reason").as_deref(),
            Some("handler failure: rejected by a business rule")
        );
        assert!(header_str(properties, "x-lily-held-for").is_none());
        let id = properties
            .message_id()
            .as_ref()
            .expect("id kept")
            .to_string();
        *dead.entry(id).or_default() += 1;
    }
    let bad: BTreeMap<String, usize> = ids("bad").collect();
    assert_eq!(dead, bad, "each failure once in the DLQ");
    assert_eq!(client.depth(&queue).await, 0);
    for delay in ["1s", "2s"] {
        assert_eq!(client.depth(&format!("{queue}.retry.{delay}")).await, 0);
    }
    eprintln!("{kind:?}, {fault:?}: 50 good messages ACKed in {took:?}; {held} holds");
}

/// How long 50 good messages may take behind 50 failing ones at prefetch 10.
const PROMPTLY: Duration = Duration::from_secs(15);

/// A message that keeps taking its consumer down with it (here its connection is closed while
/// its handler still runs) is never settled by Lily, so no count of Lily's can stop it. The
/// quorum work queue's delivery limit, declared by Lily, is the backstop: the broker
/// dead-letters it to the DLQ (at least once) while the message behind it is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_keeps_killing_its_consumer_reaches_the_dlq_through_the_delivery_limit() {
    const LIMIT: u32 = 2;
    let calls = Calls::default();
    let seen = calls.clone();
    let router = Router::new().route(
        "order.placed",
        move |meta: Meta, Cancellation(token): Cancellation| {
            let seen = seen.clone();
            async move {
                seen.record(&meta);
                if meta.message_id() == "killer" {
                    token.cancelled().await;
                    return Err(QueueHandlerError::retryable("cancelled"));
                }
                Ok(())
            }
        },
    );
    let policy = common::fast_policy().max_requeues(1);
    let (broker, queue, client, running) = common::scenario("delivery-limit", router, |q| {
        config(q, QueueKind::Quorum)
            .policy(policy)
            .delivery_limit(Some(LIMIT))
            // Only the connection's end stops the killer: a handler timeout on a slow round
            // would fail it retryably, through a retry bucket.
            .handler_timeout(Duration::from_secs(120))
    })
    .await;
    let dlq = format!("{queue}.dlq");
    for id in ["killer", "fine"] {
        client.send(&queue, "order.placed", id, b"{}").await;
    }
    let killed = |calls: &Calls| calls.all().iter().filter(|c| c.0 == "killer").count();
    let consuming = format!("lily:{queue}:consuming");
    let mut rounds = 0;
    while client.depth(&dlq).await == 0 {
        rounds += 1;
        assert!(
            rounds <= LIMIT as usize + 2,
            "never dead-lettered by the broker"
        );
        let seen = calls.clone();
        let running_again = lily_mq_testkit::eventually(WAIT, || killed(&seen) >= rounds).await;
        assert!(running_again, "the killer was not delivered again");
        broker.close_connection_named(&consuming);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    running
        .wait_for("the message behind it ACKed", WAIT, |t| t.acked >= 1)
        .await;
    let report = running.stop().await;
    assert!(report.incidents.connections_lost >= LIMIT.into());

    let dead = client.drain(&dlq).await;
    let ids: Vec<_> = dead
        .iter()
        .map(|m| {
            m.delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string())
        })
        .collect();
    assert_eq!(ids, vec![Some("killer".to_owned())], "dead-lettered once");
    assert_eq!(
        header_str(&dead[0].delivery.properties, "x-first-death-reason").as_deref(),
        Some("delivery_limit")
    );
    assert_eq!(
        killed(&calls),
        LIMIT as usize + 1,
        "delivered once past the limit"
    );
    assert_eq!(client.depth(&queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_just_under_the_header_limits_is_retried_not_dead_lettered() {
    for kind in [QueueKind::Classic, QueueKind::Quorum] {
        near_limit_messages_survive_two_retries(kind).await;
    }
}

/// Messages whose own headers sit just under the count and byte limits fail retryably twice
/// and succeed on attempt 3: each trip through a retry bucket adds Lily's headers and the
/// broker's `x-death`, which must not count against the producer's limits.
async fn near_limit_messages_survive_two_retries(kind: QueueKind) {
    let calls = Calls::default();
    let router = calls.router_succeeding_at(3, "not yet");
    let (_, queue, client, running) =
        common::scenario("near-limit", router, |q| config(q, kind)).await;
    let limits = lily::consumer::Limits::default();
    let mut headers = FieldTable::default();
    for n in 0..limits.max_headers - 1 {
        let value = vec![b'v'; limits.max_header_bytes / limits.max_headers - 16];
        headers.insert(
            format!("app-{n:02}").into(),
            AMQPValue::LongString(value.into()),
        );
    }
    let ids: Vec<String> = (0..5).map(|i| format!("near-{i}")).collect();
    for id in &ids {
        let properties = props(id, "order.placed").with_headers(headers.clone());
        client.publish(&queue, b"{}", properties).await;
    }
    running
        .wait_for("all succeed on attempt 3", Duration::from_secs(30), |t| {
            t.acked >= 5
        })
        .await;
    let report = running.stop().await;
    assert!(report.clean);
    assert_eq!(report.totals.dead_lettered, 0, "{:?}", report.totals);
    let attempts: BTreeMap<String, Vec<u32>> =
        calls
            .all()
            .into_iter()
            .fold(BTreeMap::new(), |mut by_id, (id, attempt, _)| {
                by_id.entry(id).or_default().push(attempt);
                by_id
            });
    for id in &ids {
        assert_eq!(attempts.get(id), Some(&vec![1, 2, 3]), "{id} on {kind:?}");
    }
    assert!(client.drain_ids(&format!("{queue}.dlq")).await.is_empty());
}
