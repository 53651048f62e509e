//! The health and metrics endpoints (feature `health`) over real HTTP, with a real client,
//! against a consumer on the real broker.

mod common;

use std::time::Duration;

use common::config;
use lily::prelude::*;
use lily_mq_testkit::{Broker, Client, http_get};

/// The sample value of the Prometheus line for `name` with exactly these labels.
fn sample(metrics: &str, name: &str, labels: &str) -> Option<f64> {
    let head = format!("{name}{{{labels}}} ");
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(&head))
        .and_then(|value| value.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn livez_readyz_and_metrics_answer_over_http_and_count_what_the_broker_saw() {
    let broker = Broker::from_env();
    let queue = Broker::unique("health");
    let router = Router::new().route("order.placed", |meta: Meta| async move {
        if meta.message_id().starts_with("bad-") {
            return Err(QueueHandlerError::permanent("unknown sku"));
        }
        Ok(())
    });
    let consumer = Consumer::new(broker.url(), config(&queue, QueueKind::Quorum), router);
    let stats = consumer.stats();
    // Before `run`: the consumer's metrics are registered with the recorder it installs.
    let (addr, server) = lily::health::serve("127.0.0.1:0".parse().expect("addr"), stats.clone())
        .await
        .expect("bind");
    let before = http_get(addr, "/readyz").await;
    assert_eq!((before.status, before.body.as_str()), (503, "not ready\n"));

    let shutdown = Shutdown::default();
    let run = tokio::spawn(consumer.run(shutdown.clone()));
    let ready = lily_mq_testkit::eventually(Duration::from_secs(30), || stats.ready()).await;
    assert!(ready, "the consumer never became ready");
    let client = Client::connect(broker.url()).await;
    for i in 0..12 {
        client
            .send(&queue, "order.placed", &format!("good-{i}"), b"{}")
            .await;
    }
    for i in 0..3 {
        client
            .send(&queue, "order.placed", &format!("bad-{i}"), b"{}")
            .await;
    }
    common::wait_settled("every order settled", &queue, 3).await;

    let live = http_get(addr, "/livez").await;
    assert_eq!((live.status, live.body.as_str()), (200, "live\n"));
    let readyz = http_get(addr, "/readyz").await;
    assert_eq!((readyz.status, readyz.body.as_str()), (200, "ready\n"));
    let metrics = http_get(addr, "/metrics").await;
    assert_eq!(metrics.status, 200);
    assert!(
        metrics
            .content_type
            .starts_with("text/plain; version=0.0.4"),
        "{}",
        metrics.content_type
    );
    let outcome = |o: &str| {
        sample(
            &metrics.body,
            "lily_deliveries_total",
            &format!("queue=\"{queue}\",outcome=\"{o}\""),
        )
    };
    assert_eq!(outcome("acked"), Some(12.0), "{}", metrics.body);
    assert_eq!(outcome("dead_lettered"), Some(3.0), "{}", metrics.body);
    assert_eq!(
        sample(
            &metrics.body,
            "lily_in_flight_deliveries",
            &format!("queue=\"{queue}\"")
        ),
        Some(0.0),
        "{}",
        metrics.body
    );
    assert!(
        metrics
            .body
            .contains("# TYPE lily_handler_duration_seconds summary"),
        "{}",
        metrics.body
    );
    let missing = http_get(addr, "/nothing").await;
    assert_eq!(missing.status, 404);

    shutdown.trigger(Trigger::Api);
    let report = run.await.expect("join").expect("run");
    assert!(report.clean);
    let after = http_get(addr, "/readyz").await;
    assert_eq!(after.status, 503, "not ready once it stopped");
    server.abort();
}
