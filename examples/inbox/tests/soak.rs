//! The seeded chaos soak, small: 2 000 orders (duplicates, conflicts, unknown skus and orders
//! whose first attempt fails among them) through three `inbox` workers while a fault comes every
//! second, each kind at least twice (SIGKILL, SIGTERM, every connection closed, a memory alarm,
//! the DLQ deleted, the broker's app restarted, mongod restarted, the network stalled, publisher
//! confirms nacked, the consumers cancelled by the broker), reconciled by message id by `chaos`;
//! on classic and on quorum queues.

use std::time::Duration;

async fn soak(queue_type: &str, seed: &str) {
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_chaos"))
        .args(["--service", env!("CARGO_BIN_EXE_inbox")])
        .args(["--messages", "2000", "--seed", seed, "--workers", "3"])
        .args([
            "--rate",
            "200",
            "--fault-every-ms",
            "1000",
            "--min-each",
            "2",
        ])
        .args(["--queue-type", queue_type])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(600), run)
        .await
        .expect("the soak ends within 10 minutes")
        .expect("run chaos");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "the soak found violations:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("every id accounted for"), "{stdout}");
}

// One test, so the two run one after the other: each restarts the broker's app and mongod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_soak_under_faults_accounts_for_every_id() {
    soak("classic", "7").await;
    soak("quorum", "8").await;
}
