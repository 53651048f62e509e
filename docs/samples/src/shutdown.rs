//! Shutdown on Kubernetes: a budget under the grace period, health, and a shutdown triggered
//! from elsewhere.

use std::time::Duration;

use lily::prelude::*;

/// Runs `router` on `orders` with a 25-second budget, health on `health_addr`, until SIGTERM.
///
/// # Errors
/// The health address could not be bound, or the broker refused the consumer at start.
pub async fn run_in_a_pod(
    url: String,
    router: Router,
    health_addr: std::net::SocketAddr,
) -> Result<ShutdownReport, Box<dyn std::error::Error>> {
    // ANCHOR: pod
    // terminationGracePeriodSeconds: 30; the budget stays a few seconds under it.
    let config = ConsumerConfig::new("orders")
        .prefetch(50)
        .shutdown_budget(ShutdownBudget::new(Duration::from_secs(25)));
    let consumer = Consumer::new(url, config, router);
    // /livez, /readyz (503 from the start of draining) and /metrics; before `run`.
    let (_bound, _health) = lily::health::serve(health_addr, consumer.stats()).await?;
    let sinks = ReportSinks::default().json_file("/var/run/lily/report.json");
    Ok(consumer.run_until_signal(sinks).await?)
    // ANCHOR_END: pod
}

/// Runs `router` on `orders` until something else in the application says stop.
///
/// # Errors
/// The broker refused the consumer at start, or the report could not be written.
pub async fn run_with_own_trigger(
    url: String,
    router: Router,
) -> Result<ShutdownReport, Box<dyn std::error::Error>> {
    // ANCHOR: trigger
    let shutdown = Shutdown::new(ShutdownBudget::new(Duration::from_secs(25)));
    let handle = shutdown.clone();
    tokio::spawn(async move {
        // ... whatever decides that this worker should stop:
        tokio::time::sleep(Duration::from_secs(3600)).await;
        handle.trigger(Trigger::Api); // a second call forces
    });
    let report = Consumer::new(url, ConsumerConfig::new("orders"), router)
        .run(shutdown)
        .await?;
    emit(&report, &ReportSinks::default())?; // log, stdout, termination message
    // ANCHOR_END: trigger
    Ok(report)
}
