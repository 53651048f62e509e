//! The real `k8s-shutdown` binary as a child process, real signals, the real local RabbitMQ.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use lily_mq_testkit::{Broker, ChildProcess, Client, TcpProxy};
use serde_json::Value;
use tokio::process::Command;

/// A running service, what it printed on stderr, and where it writes its report.
struct Service {
    process: ChildProcess,
    dir: PathBuf,
    report: PathBuf,
    termination_log: PathBuf,
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Service {
    fn start(url: &str, queue: &str, env: &[(&str, &str)]) -> Self {
        let dir = std::env::temp_dir().join(Broker::unique("lily-k8s"));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let report = dir.join("report.json");
        let termination_log = dir.join("termination-log");
        std::fs::write(&termination_log, b"").expect("termination log");
        let mut command = Command::new(env!("CARGO_BIN_EXE_k8s-shutdown"));
        command
            .env("LILY_AMQP_URL", url)
            .env("LILY_QUEUE", queue)
            .env("LILY_REPORT_FILE", &report)
            .env("LILY_TERMINATION_LOG", &termination_log)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied());
        Self {
            process: ChildProcess::spawn(command),
            dir,
            report,
            termination_log,
        }
    }

    /// Waits for a stderr line containing `needle`.
    async fn wait_for_line(&self, needle: &str, timeout: Duration) -> String {
        self.process.wait_for_line(needle, timeout).await
    }

    fn signal(&self, name: &str) {
        self.process.signal(name);
    }

    async fn exit(&mut self, timeout: Duration) -> (ExitStatus, Duration) {
        self.process.exit(timeout).await
    }

    fn report(&self) -> Value {
        let text = std::fs::read_to_string(&self.report).expect("report file written");
        serde_json::from_str(&text).expect("report is JSON")
    }
}

fn props(id: &str) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(id.into())
        .with_type("work.item".into())
        .with_delivery_mode(2)
}

/// Publishes `n` items once the service declared the queue, and waits until all are in flight.
async fn publish_in_flight(client: &Client, url: &str, queue: &str, n: usize) -> BTreeSet<String> {
    for _ in 0..400 {
        let (u, q) = (url.to_owned(), queue.to_owned());
        let declared = tokio::spawn(async move { Client::connect(&u).await.depth(&q).await })
            .await
            .is_ok();
        if declared {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ids: BTreeSet<String> = (0..n).map(|i| format!("item-{i}")).collect();
    for id in &ids {
        client.publish(queue, b"{}", props(id)).await;
    }
    let start = Instant::now();
    while client.depth(queue).await > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "items never delivered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Delivered is not yet started: give the handlers a moment to begin.
    tokio::time::sleep(Duration::from_millis(200)).await;
    ids
}

fn unresolved_ids(report: &Value) -> BTreeSet<String> {
    report["unresolved"]
        .as_array()
        .expect("unresolved list")
        .iter()
        .map(|d| d["message_id"].as_str().expect("message id").to_owned())
        .collect()
}

fn phases(report: &Value) -> Vec<String> {
    report["phases"]
        .as_array()
        .expect("phases")
        .iter()
        .map(|p| p["phase"].as_str().expect("phase").to_owned())
        .collect()
}

/// The status of `GET path` on the health port.
async fn http_get(addr: &str, path: &str) -> u16 {
    lily_mq_testkit::http_get(addr, path).await.status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_slow_handlers_finishing_in_budget_acks_all_and_exits_clean() {
    let broker = Broker::from_env();
    let queue = Broker::unique("k8s-clean");
    let mut service = Service::start(
        broker.url(),
        &queue,
        &[
            ("WORK_MS", "1500"),
            ("LILY_SHUTDOWN_BUDGET_MS", "10000"),
            ("LILY_HEALTH_ADDR", "127.0.0.1:0"),
        ],
    );
    let line = service
        .wait_for_line("health on http://", Duration::from_secs(30))
        .await;
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .expect("health address")
        .to_owned();
    let client = Client::connect(broker.url()).await;
    publish_in_flight(&client, broker.url(), &queue, 5).await;
    assert_eq!(http_get(&addr, "/readyz").await, 200);

    service.signal("TERM");
    service
        .wait_for_line("Draining", Duration::from_secs(5))
        .await;
    assert_eq!(http_get(&addr, "/readyz").await, 503);
    assert_eq!(http_get(&addr, "/livez").await, 200);
    let (status, _) = service.exit(Duration::from_secs(15)).await;

    assert_eq!(status.code(), Some(0), "clean settlement exits 0");
    let report = service.report();
    assert_eq!(report["schema"], "lily.shutdown-report.v1");
    assert_eq!(report["trigger"], "sigterm");
    assert_eq!(report["clean"], true);
    assert_eq!(report["totals"]["acked"], 5);
    assert_eq!(report["totals"]["acks_confirmed"], 5);
    assert_eq!(phases(&report), ["draining", "closed"]);
    let summary = std::fs::read_to_string(&service.termination_log).expect("termination log");
    assert!(summary.starts_with("lily clean"), "{summary}");
    assert_eq!(client.depth(&queue).await, 0, "queue empty");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_handlers_ignoring_cancellation_aborts_exactly_them_and_loses_nothing() {
    let broker = Broker::from_env();
    let queue = Broker::unique("k8s-abort");
    let mut service = Service::start(
        broker.url(),
        &queue,
        &[
            ("WORK_MS", "60000"),
            ("WORK_IGNORES_CANCEL", "1"),
            ("LILY_SHUTDOWN_BUDGET_MS", "3000"),
        ],
    );
    let client = Client::connect(broker.url()).await;
    let ids = publish_in_flight(&client, broker.url(), &queue, 4).await;

    service.signal("TERM");
    let (status, took) = service.exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(3), "unresolved settlement exits 3");
    assert!(
        took < Duration::from_secs(6),
        "bounded by the 3 s budget: {took:?}"
    );
    let report = service.report();
    assert_eq!(
        unresolved_ids(&report),
        ids,
        "exactly the stuck deliveries are listed"
    );
    assert!(
        report["unresolved"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["last_evidence"] == "aborted"),
        "{report:#}"
    );
    assert_eq!(
        phases(&report),
        ["draining", "cooperating", "aborting", "closed"]
    );
    assert_eq!(report["forced"], false);

    // The broker redelivers every one of them to the next consumer.
    let mut redelivered = BTreeSet::new();
    while let Some(m) = client.take(&queue, Duration::from_secs(3)).await {
        assert!(m.delivery.redelivered);
        let id = m
            .delivery
            .properties
            .message_id()
            .as_ref()
            .unwrap()
            .as_str();
        redelivered.insert(id.to_owned());
    }
    assert_eq!(redelivered, ids, "nothing lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_sigterm_forces_at_once_and_writes_the_report() {
    let broker = Broker::from_env();
    let queue = Broker::unique("k8s-force");
    let mut service = Service::start(
        broker.url(),
        &queue,
        &[
            ("WORK_MS", "60000"),
            ("WORK_IGNORES_CANCEL", "1"),
            ("LILY_SHUTDOWN_BUDGET_MS", "25000"),
        ],
    );
    let client = Client::connect(broker.url()).await;
    let ids = publish_in_flight(&client, broker.url(), &queue, 3).await;

    service.signal("TERM");
    service
        .wait_for_line("Draining", Duration::from_secs(5))
        .await;
    service.signal("TERM");
    let (status, took) = service.exit(Duration::from_secs(10)).await;
    assert!(
        took < Duration::from_secs(3),
        "forced, not waiting for the 25 s budget: {took:?}"
    );
    assert_eq!(status.code(), Some(3));
    let report = service.report();
    assert_eq!(report["forced"], true);
    assert_eq!(unresolved_ids(&report), ids);
    assert_eq!(phases(&report), ["draining", "aborting", "closed"]);
    let summary = std::fs::read_to_string(&service.termination_log).expect("termination log");
    assert!(summary.starts_with("lily UNRESOLVED"), "{summary}");
    assert!(summary.len() <= 4096);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_killed_while_cooperating_reports_those_deliveries_as_authority_lost() {
    let broker = Broker::from_env();
    let queue = Broker::unique("k8s-kill");
    // The service reaches the broker through a proxy the test can cut at once (an operator's
    // `rabbitmqctl close_connection` takes seconds to start on a loaded machine).
    let proxy = TcpProxy::start(broker.addr()).await;
    let mut service = Service::start(
        &proxy.url(broker.url()),
        &queue,
        &[
            ("WORK_MS", "60000"),
            ("WORK_AFTER_CANCEL_MS", "1500"),
            ("LILY_SHUTDOWN_BUDGET_MS", "10000"),
        ],
    );
    let client = Client::connect(broker.url()).await;
    let ids = publish_in_flight(&client, broker.url(), &queue, 3).await;

    service.signal("TERM");
    service
        .wait_for_line("Cooperating", Duration::from_secs(10))
        .await;
    proxy.refuse(true);
    proxy.cut();
    let (status, _) = service.exit(Duration::from_secs(15)).await;

    assert_eq!(status.code(), Some(3));
    let report = service.report();
    assert_eq!(report["totals"]["authority_lost"], 3, "{report:#}");
    assert_eq!(unresolved_ids(&report), ids);
    assert!(
        report["unresolved"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["last_evidence"] == "authority_lost"),
        "{report:#}"
    );
    // The broker took them back when the connection died.
    let start = Instant::now();
    while client.depth(&queue).await < 3 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "messages returned to the queue"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
