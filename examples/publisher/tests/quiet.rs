//! The publisher example's log against the real broker (issue 46): publishing to a queue that
//! does not exist, every message comes back returned and no body reaches stdout or stderr,
//! whatever `RUST_LOG` is left at; publishing where everything succeeds, no line is logged at
//! ERROR or WARN, run after run.

use lily_mq_testkit::{Broker, Client};
use tokio::process::Command;

/// What the example's bodies hold (`{"order_id":"A-1","quantity":1}`), as text and as the
/// decimal bytes lapin's `Debug` of a returned message shows (`data: [123, 34, 111, ...]`).
const BODY_MARKS: [&str; 3] = ["order_id", "\"quantity\"", "123, 34, 111"];

/// Runs the example, `RUST_LOG` set to `rust_log` or unset, and returns its exit status and
/// stdout and stderr together.
async fn run(url: &str, queue: &str, count: usize, rust_log: Option<&str>) -> (bool, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_publisher"));
    command
        .env("LILY_AMQP_URL", url)
        .env("LILY_QUEUE", queue)
        .env("LILY_COUNT", count.to_string());
    match rust_log {
        Some(filter) => command.env("RUST_LOG", filter),
        None => command.env_remove("RUST_LOG"),
    };
    let out = command.output().await.expect("run the publisher example");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains("panicked"), "{text}");
    (out.status.success(), text)
}

/// The lines of `text` logged at ERROR or WARN (plain or coloured).
fn loud_lines(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|line| line.contains("ERROR") || line.contains("WARN"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returned_messages_leave_no_body_in_the_output() {
    let broker = Broker::from_env();
    for rust_log in [None, Some("warn"), Some("info"), Some("debug,lapin=info")] {
        let queue = Broker::unique("quiet-missing");
        let (ok, text) = run(broker.url(), &queue, 50, rust_log).await;
        assert!(!ok, "RUST_LOG={rust_log:?}: {text}");
        assert!(
            text.contains("returned: 50"),
            "RUST_LOG={rust_log:?}: {text}"
        );
        for mark in BODY_MARKS {
            assert!(
                !text.contains(mark),
                "RUST_LOG={rust_log:?}: a body ({mark:?}) in the output:\n{text}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successful_run_logs_no_error_or_warning() {
    let broker = Broker::from_env();
    let client = Client::connect(broker.url()).await;
    let queue = Broker::unique("quiet-happy");
    client.declare(&queue, true).await;
    // The error this guards against came from a race at close: one run may miss it.
    for _ in 0..8 {
        let (ok, text) = run(broker.url(), &queue, 100, None).await;
        let loud = loud_lines(&text);
        assert!(loud.is_empty(), "{}", loud.join("\n"));
        assert!(ok, "{text}");
        assert_eq!(text.trim(), "confirmed: 100");
    }
    client.delete(&queue).await;
}
