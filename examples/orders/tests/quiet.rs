//! The orders demo (what `scripts/demo.sh` runs) against the real broker, where everything
//! succeeds (issue 46): it reports OK and logs no line at ERROR or WARN, run after run.

use std::process::Command;

use lily_mq_testkit::Broker;

#[test]
fn the_demo_logs_no_error_or_warning() {
    let broker = Broker::from_env();
    // The error this guards against came from a race at close: one run may miss it.
    for _ in 0..3 {
        let out = Command::new(env!("CARGO_BIN_EXE_orders"))
            .arg("demo")
            .env("LILY_AMQP_URL", broker.url())
            .env("LILY_QUEUE", Broker::unique("quiet-orders"))
            .env_remove("RUST_LOG")
            .output()
            .expect("run the orders example");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let loud: Vec<&str> = text
            .lines()
            .filter(|line| line.contains("ERROR") || line.contains("WARN"))
            .collect();
        assert!(loud.is_empty(), "{}\n\n{text}", loud.join("\n"));
        assert!(out.status.success(), "{text}");
    }
}
