//! A complete Lily service: a typed handler with shared state, health and metrics, and a
//! shutdown on SIGTERM whose report is the exit status. `LILY_AMQP_URL` names the broker;
//! `LILY_QUEUE` (default `orders`), `LILY_HEALTH_ADDR` (default `127.0.0.1:8080`) and `RUST_LOG`
//! (default `info`) are optional.

use lily::prelude::*;
use lily_mq_example_service::{Stock, router};

#[tokio::main]
async fn main() -> Result<ShutdownReport, Box<dyn std::error::Error>> {
    // INFO and above unless RUST_LOG says otherwise; lapin's returned messages never, as they
    // carry bodies.
    lily::logging::init("info");
    let env = |name, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let config = ConsumerConfig::new(env("LILY_QUEUE", "orders")).prefetch(50);
    let consumer = Consumer::new(
        std::env::var("LILY_AMQP_URL")?,
        config,
        router(Stock::default()),
    );
    let addr = env("LILY_HEALTH_ADDR", "127.0.0.1:8080").parse()?;
    let (addr, _health) = lily::health::serve(addr, consumer.stats()).await?;
    eprintln!("service: /livez, /readyz and /metrics on http://{addr}");
    Ok(consumer.run_until_signal(ReportSinks::default()).await?)
}
