//! The seeded chaos soak, small: 2 000 orders (duplicates, conflicts and unknown skus among
//! them) through three `inbox` workers while a fault comes every second, each kind at least
//! twice (SIGKILL, SIGTERM, every connection closed, a memory alarm, the DLQ deleted, the
//! broker's app restarted, mongod restarted, the network stalled), reconciled by message id by
//! `chaos`.

use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_soak_under_faults_accounts_for_every_id() {
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_chaos"))
        .args(["--service", env!("CARGO_BIN_EXE_inbox")])
        .args(["--messages", "2000", "--seed", "7", "--workers", "3"])
        .args([
            "--rate",
            "200",
            "--fault-every-ms",
            "1000",
            "--min-each",
            "2",
        ])
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
