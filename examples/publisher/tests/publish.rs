//! The publisher example against the real broker: to a queue that exists every message is
//! confirmed and there once, by id; to one that does not, every message says returned, the
//! ids are printed, and the exit status says so.

use lily_mq_testkit::{Broker, Client};
use tokio::process::Command;

async fn run(url: &str, queue: &str, count: usize) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_publisher"))
        .env("LILY_AMQP_URL", url)
        .env("LILY_QUEUE", queue)
        .env("LILY_COUNT", count.to_string())
        .output()
        .await
        .expect("run the publisher example");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_is_confirmed_and_in_the_queue_once() {
    let broker = Broker::from_env();
    let queue = Broker::unique("publisher");
    let client = Client::connect(broker.url()).await;
    client.declare(&queue, true).await;
    let (ok, stdout) = run(broker.url(), &queue, 500).await;
    assert!(ok, "{stdout}");
    assert_eq!(stdout.trim(), "confirmed: 500");
    let ids = client.drain_ids(&queue).await;
    let expected: std::collections::BTreeSet<String> =
        (1..=500).map(|n| format!("A-{n}")).collect();
    assert_eq!(
        ids.keys()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>(),
        expected
    );
    assert!(ids.values().all(|n| *n == 1), "{ids:?}");
    client.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_to_a_missing_queue_come_back_returned() {
    let broker = Broker::from_env();
    let queue = Broker::unique("publisher-missing");
    let (ok, stdout) = run(broker.url(), &queue, 20).await;
    assert!(!ok, "{stdout}");
    assert!(stdout.contains("returned: 20"), "{stdout}");
    assert!(
        stdout.contains("not confirmed (returned): A-1 A-2 A-3"),
        "{stdout}"
    );
}
