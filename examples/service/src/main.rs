//! A complete Lily service: a typed handler with shared state, health and metrics, and a
//! shutdown on SIGTERM whose report is the exit status. `LILY_AMQP_URL` names the broker;
//! `LILY_QUEUE` (default `orders`) and `LILY_HEALTH_ADDR` (default `127.0.0.1:8080`) are optional.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use lily::prelude::*;

#[derive(serde::Deserialize)]
struct OrderPlaced {
    quantity: u32,
}

/// Units reserved so far, shared by every delivery.
#[derive(Clone, Default)]
struct Stock(Arc<AtomicU64>);

async fn place(State(stock): State<Stock>, Json(order): Json<OrderPlaced>) -> HandlerResult {
    if order.quantity == 0 {
        return Err(QueueHandlerError::permanent("quantity must be at least 1"));
    }
    stock.0.fetch_add(order.quantity.into(), Ordering::Relaxed);
    Ok(())
}

#[tokio::main]
async fn main() -> Result<ShutdownReport, Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init(); // INFO and above
    let env = |name, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let router = Router::new()
        .route("order.placed", place)
        .with_state(Stock::default());
    let config = ConsumerConfig::new(env("LILY_QUEUE", "orders")).prefetch(50);
    let consumer = Consumer::new(std::env::var("LILY_AMQP_URL")?, config, router);
    let addr = env("LILY_HEALTH_ADDR", "127.0.0.1:8080").parse()?;
    let (addr, _health) = lily::rabbit::health::serve(addr, consumer.stats()).await?;
    eprintln!("service: /livez, /readyz and /metrics on http://{addr}");
    Ok(consumer.run_until_signal(ReportSinks::default()).await?)
}
