//! Poison messages: metadata the client library could not parse until Lily's patch, against the
//! real node. Each must end in the DLQ while the messages behind it are handled at once, on the
//! same connection.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{Calls, config, header_str, props};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lily::core::Incidents;
use lily::prelude::*;
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
    let seen = calls.clone();
    let router = Router::new().route("order.placed", move |meta: Meta| {
        let seen = seen.clone();
        async move {
            seen.record(&meta);
            Ok(())
        }
    });
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
            publisher
                .publish(&queue, b"{}", props(&id, "order.placed"))
                .await;
            good.push(id);
        }
    }

    running
        .wait_for("good ones ACKed and poison dead-lettered", WAIT, |t| {
            t.acked == good.len() as u64 && t.dead_lettered == CASES.len() as u64
        })
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
        assert!(reason.contains("not valid UTF-8"), "reason: {reason}");
        assert!(
            properties.correlation_id().is_none() && properties.headers().is_some(),
            "sanitized metadata only"
        );
        let body = String::from_utf8(message.delivery.data).expect("body kept");
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
