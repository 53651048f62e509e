//! The ~30-line service as a child process against the real broker: it handles what it is
//! sent, serves its metrics, and on SIGTERM exits with its report as the status.

use std::time::{Duration, Instant};

use lily_mq_testkit::{Broker, ChildProcess, Client, http_get};
use tokio::process::Command;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_short_service_handles_serves_metrics_and_exits_with_its_report() {
    let broker = Broker::from_env();
    let queue = Broker::unique("service");
    let mut command = Command::new(env!("CARGO_BIN_EXE_service"));
    command
        .env("LILY_AMQP_URL", broker.url())
        .env("LILY_QUEUE", &queue)
        .env("LILY_HEALTH_ADDR", "127.0.0.1:0");
    let mut service = ChildProcess::spawn(command);
    let line = service
        .wait_for_line("/metrics on http://", Duration::from_secs(60))
        .await;
    let addr = line
        .rsplit("http://")
        .next()
        .expect("address")
        .trim()
        .to_owned();
    service
        .wait_for_line("consuming", Duration::from_secs(60))
        .await;

    let client = Client::connect(broker.url()).await;
    for i in 0..5 {
        client
            .send(
                &queue,
                "order.placed",
                &format!("ok-{i}"),
                br#"{"quantity":2}"#,
            )
            .await;
    }
    client
        .send(&queue, "order.placed", "zero", br#"{"quantity":0}"#)
        .await;
    let acked_line = format!("lily_deliveries_total{{queue=\"{queue}\",outcome=\"acked\"}} ");
    let deadline = Instant::now() + Duration::from_secs(30);
    let acked = loop {
        let metrics = http_get(&addr, "/metrics").await;
        let acked = metrics
            .body
            .lines()
            .find_map(|l| l.strip_prefix(&acked_line).map(str::to_owned));
        if acked.as_deref() == Some("5") || Instant::now() > deadline {
            break acked;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(acked.as_deref(), Some("5"), "acked on /metrics");

    service.signal("TERM");
    let (status, _) = service.exit(Duration::from_secs(30)).await;
    assert_eq!(status.code(), Some(0), "clean: {}", service.log());
    let report: serde_json::Value =
        serde_json::from_str(&service.stdout().await).expect("the report on stdout");
    assert_eq!(report["totals"]["acked"], 5);
    assert_eq!(report["totals"]["dead_lettered"], 1);
    assert_eq!(client.depth(&format!("{queue}.dlq")).await, 1);
}
