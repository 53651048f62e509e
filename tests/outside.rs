//! The application outside Lily's workspace (`outside/`), as a user builds it: from the crates
//! `cargo package` made, with no setting of Lily's workspace. `scripts/test.sh` packages the
//! crates and builds it into `target/debug/lily-outside-app` (or `LILY_OUTSIDE_BIN`) before the
//! tests run. Against the real broker, poison messages (text that is not UTF-8 in a property
//! and in header keys, written through a proxy) reach its DLQ with the field named, the
//! messages behind them are handled at once, and its connection is never lost.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{header_str, props};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lily_mq_testkit::{Broker, ChildProcess, Client, FaultProxy};

/// Each poison message's field, its six-byte marker and the reason the DLQ copy must give.
const CASES: [(&str, &str); 3] = [
    ("#BAD1#", "message_id"),
    ("#BAD2#", "a header key"),
    ("#BAD3#", "a nested header key"),
];
const BEHIND: usize = 10;

fn binary() -> PathBuf {
    let path = std::env::var_os("LILY_OUTSIDE_BIN").map_or_else(
        || {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../target/debug/lily-outside-app"
            ))
        },
        PathBuf::from,
    );
    assert!(
        path.is_file(),
        "{} is missing: scripts/test.sh builds it (cargo package, then outside/ against the packages)",
        path.display()
    );
    path
}

/// The broker's process id of the client connection named `name`, if one is open.
fn connection_pid(broker: &Broker, name: &str) -> Option<String> {
    let quoted = format!("\"{name}\"");
    broker
        .ctl(&[
            "list_connections",
            "-q",
            "--no-table-headers",
            "pid",
            "client_properties",
        ])
        .lines()
        .find(|line| line.contains(&quoted))
        .and_then(|line| line.split_whitespace().next())
        .map(str::to_owned)
}

fn table(key: &str, value: AMQPValue) -> FieldTable {
    let mut table = FieldTable::default();
    table.insert(ShortString::from(key), value);
    table
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_packaged_crates_keep_a_queue_moving_past_poison_frames() {
    let broker = Broker::from_env();
    let queue = Broker::unique("outside");
    let mut command = tokio::process::Command::new(binary());
    command
        .env("LILY_AMQP_URL", broker.url())
        .env("LILY_QUEUE", &queue)
        .env("RUST_LOG", "warn");
    let mut app = ChildProcess::spawn(command);
    let consuming = format!("lily:{queue}:consuming");
    let by = Instant::now() + Duration::from_secs(30);
    let first = loop {
        if let Some(pid) = connection_pid(&broker, &consuming) {
            break pid;
        }
        assert!(
            Instant::now() < by,
            "the application never consumed: {}",
            app.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    let proxy = FaultProxy::start(broker.addr()).await;
    proxy.disarm();
    for (marker, _) in CASES {
        let mut bad = marker.as_bytes().to_vec();
        bad[..2].copy_from_slice(&[0xff, 0xfe]);
        bad[4..].copy_from_slice(&[0xc3, 0x28]);
        proxy.rewrite(marker.as_bytes(), &bad);
    }
    let publisher = Client::connect(&proxy.url(broker.url())).await;
    let mut good = Vec::new();
    for (n, (marker, field)) in CASES.into_iter().enumerate() {
        let id = format!("poison-{n}");
        let yes = AMQPValue::Boolean(true);
        let poison = match field {
            "message_id" => props(marker, "order.placed"),
            "a header key" => props(&id, "order.placed").with_headers(table(marker, yes)),
            _ => props(&id, "order.placed")
                .with_headers(table("outer", AMQPValue::FieldTable(table(marker, yes)))),
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
        Duration::from_secs(30),
        &[(&queue, 0), (&dlq, CASES.len() as u64)],
    )
    .await;
    assert_eq!(
        connection_pid(&broker, &consuming),
        Some(first),
        "the consuming connection was never replaced"
    );

    app.signal("TERM");
    let (status, _) = app.exit(Duration::from_secs(30)).await;
    let stdout = app.stdout().await;
    assert!(
        status.success(),
        "a clean shutdown: {status:?}\n{}",
        app.log()
    );
    let mut handled: BTreeMap<String, usize> = BTreeMap::new();
    for id in stdout.lines().filter_map(|l| l.strip_prefix("handled ")) {
        *handled.entry(id.to_owned()).or_default() += 1;
    }
    let expected: BTreeMap<String, usize> = good.iter().map(|id| (id.clone(), 1)).collect();
    assert_eq!(
        handled, expected,
        "every good message handled once, no poison one"
    );
    let report: serde_json::Value =
        serde_json::from_str(&stdout[stdout.find('{').expect("a report")..])
            .expect("the report is JSON");
    let incidents = &report["incidents"];
    assert!(
        incidents
            .as_object()
            .is_some_and(|i| i.values().all(|v| v == 0)),
        "no incident (no connection lost, no frame unparsed): {incidents}"
    );

    let client = Client::connect(broker.url()).await;
    let mut dead = BTreeMap::new();
    for message in client.drain(&dlq).await {
        let body = String::from_utf8(message.delivery.data.clone()).expect("body kept");
        let n: usize = body
            .trim_start_matches("poison-")
            .parse()
            .expect("a poison body");
        let reason = header_str(&message.delivery.properties, "x-lily-reason").unwrap_or_default();
        assert_eq!(
            reason,
            format!("invalid envelope: {} is not valid UTF-8", CASES[n].1),
            "{body}"
        );
        *dead.entry(body).or_insert(0) += 1;
    }
    let poison: BTreeMap<String, i32> = (0..CASES.len())
        .map(|n| (format!("poison-{n}"), 1))
        .collect();
    assert_eq!(dead, poison, "each poison message once in the DLQ");
}
