//! Lily's header namespace against publishers who write in it: `x-lily-*` headers without
//! Lily's seal are not read at the gate and never reach a lane's copy, on classic and quorum
//! queues, many messages at once, checked by message id from outside Lily.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{Calls, config, header, header_str, header_u32, props};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lily::consumer::HeaderKey;
use lily::headers;
use lily::prelude::*;
use lily_mq_testkit::{Broker, Client, eventually};

const N: usize = 25;
const WAIT: Duration = Duration::from_secs(60);

fn long(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
}

/// Fails every message: permanently when its id starts with `perm`, retryably otherwise.
fn failing_router(calls: &Calls) -> Router {
    let calls = calls.clone();
    Router::new().route("order.placed", move |meta: Meta| {
        let calls = calls.clone();
        async move {
            calls.record(&meta);
            if meta.message_id().starts_with("perm") {
                Err(QueueHandlerError::permanent("no such sku"))
            } else {
                Err(QueueHandlerError::retryable("stock service down"))
            }
        }
    })
}

/// Headers a publisher wrote in Lily's namespace: a lane to skip the handler for, a last
/// attempt, a reason, and values a replay would restore that no broker accepts.
fn forged(attempt: u32) -> FieldTable {
    let mut table = FieldTable::default();
    table.insert(headers::HELD_FOR.into(), long("parking"));
    table.insert(headers::ATTEMPT.into(), AMQPValue::LongUInt(attempt));
    table.insert(headers::REASON.into(), long("forged"));
    table.insert(headers::ORIGINAL_EXPIRATION.into(), long("garbage"));
    table.insert(headers::ORIGINAL_CC.into(), long("not-an-array"));
    table.insert("customer".into(), long("kept"));
    table
}

async fn forged_headers_never_reach_a_lane(kind: QueueKind, key: Option<&str>) {
    let broker = Broker::from_env();
    let queue = Broker::unique("forged");
    let calls = Calls::default();
    let policy = common::fast_policy(); // 3 attempts, buckets of 1 s and 2 s
    let max_attempts = policy.max_attempts;
    let mut cfg = config(&queue, kind)
        .policy(policy)
        .prefetch(50)
        .concurrency(50);
    let checker = match key {
        Some(secret) => {
            cfg = cfg.header_key(secret);
            HeaderKey::new(secret)
        }
        None => HeaderKey::public(),
    };
    let running = common::start(broker.url(), cfg, failing_router(&calls));
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    let perm: Vec<String> = (0..N).map(|i| format!("perm-{i}")).collect();
    let retry: Vec<String> = (0..N).map(|i| format!("retry-{i}")).collect();
    // With the public key, a copy sealed by a consumer whose key is secret is forged too.
    let mut publicly_sealed = forged(max_attempts);
    let seal = HeaderKey::public().seal("retry-0", &publicly_sealed);
    publicly_sealed.insert(headers::SEAL.into(), seal);
    for (p, r) in perm.iter().zip(&retry) {
        let headers = if key.is_some() && r == "retry-0" {
            publicly_sealed.clone()
        } else {
            forged(max_attempts)
        };
        client
            .publish(
                &queue,
                b"{}",
                props(p, "order.placed").with_headers(forged(1)),
            )
            .await;
        client
            .publish(
                &queue,
                b"{}",
                props(r, "order.placed").with_headers(headers),
            )
            .await;
    }
    let dlq = format!("{queue}.dlq");
    let all = (2 * N) as u64;
    assert!(
        eventually(WAIT, || broker.messages(&dlq) >= all).await,
        "every message ends in the DLQ: {:?}",
        broker
            .depths()
            .into_iter()
            .filter(|(name, _)| name.starts_with(&queue))
            .collect::<Vec<_>>()
    );
    let report = running.stop().await;

    // Every message ran its handler: a forged held-for lane skipped nothing, and a forged
    // last attempt did not cut the retries short.
    let handled = calls.by_id();
    for id in &perm {
        assert_eq!(handled.get(id), Some(&1), "{id} handled once");
    }
    for id in &retry {
        assert_eq!(
            handled.get(id),
            Some(&(max_attempts as usize)),
            "{id} handled once per attempt"
        );
    }
    let copies = client.drain(&dlq).await;
    let mut by_id: BTreeMap<String, usize> = BTreeMap::new();
    for copy in &copies {
        let p = &copy.delivery.properties;
        let id = p
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default();
        *by_id.entry(id.clone()).or_default() += 1;
        let table = p.headers().as_ref().expect("headers");
        assert!(checker.verify(&id, table), "{id}: Lily's copy is sealed");
        for forged in [
            headers::ORIGINAL_EXPIRATION,
            headers::ORIGINAL_CC,
            headers::HELD_FOR,
        ] {
            assert_eq!(
                header(p, forged),
                None,
                "{id}: the publisher's {forged} is not carried"
            );
        }
        let reason = header_str(p, headers::REASON).unwrap_or_default();
        assert!(!reason.contains("forged"), "{id}: {reason}");
        assert_eq!(header_str(p, "customer").as_deref(), Some("kept"), "{id}");
        let attempt = header_u32(p, headers::ATTEMPT);
        let expected = if id.starts_with("perm") {
            1
        } else {
            max_attempts
        };
        assert_eq!(attempt, Some(expected), "{id}: Lily's own attempt count");
    }
    assert_eq!(by_id.len(), 2 * N, "{by_id:?}");
    assert!(by_id.values().all(|n| *n == 1), "{by_id:?}");
    for lane in [format!("{queue}.parking"), queue.clone()] {
        assert!(client.drain_ids(&lane).await.is_empty(), "{lane} is empty");
    }
    assert_eq!(report.totals.dead_lettered, all, "{:?}", report.totals);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_lily_headers_never_reach_a_lane_on_classic() {
    forged_headers_never_reach_a_lane(QueueKind::Classic, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_lily_headers_never_reach_a_lane_on_quorum() {
    forged_headers_never_reach_a_lane(QueueKind::Quorum, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_secret_key_a_publicly_sealed_header_is_forged_too() {
    forged_headers_never_reach_a_lane(
        QueueKind::Classic,
        Some("a secret of at least sixteen bytes"),
    )
    .await;
}
