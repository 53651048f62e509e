//! The README's handler, and the book's first one (getting started).

// ANCHOR: handler
use lily::prelude::*;

#[derive(serde::Deserialize)]
struct OrderPlaced {
    order_id: String,
    quantity: u32,
}

async fn place(Json(order): Json<OrderPlaced>, meta: Meta) -> Result<(), QueueHandlerError> {
    if order.quantity == 0 {
        return Err(QueueHandlerError::permanent("quantity must be positive"));
    }
    reserve_stock(&order.order_id, meta.message_id())
        .await
        .map_err(|e| QueueHandlerError::retryable("stock service unavailable").with_source(e))
}

#[tokio::main]
async fn main() -> Result<ShutdownReport, lily::Error> {
    let router = Router::new().route("order.placed", place);
    let config = ConsumerConfig::new("orders")
        .queue_kind(QueueKind::Quorum)
        .prefetch(50);
    Consumer::new("amqp://127.0.0.1:5672/%2f", config, router)
        .run_until_signal(ReportSinks::default()) // SIGTERM drains within 25 s, a second forces
        .await // the report goes to the log, stdout and /dev/termination-log
} // exit status 0: every settlement known; 3: something unresolved
// ANCHOR_END: handler

/// Stands in for a call to a stock service.
async fn reserve_stock(_order_id: &str, _message_id: &str) -> std::io::Result<()> {
    Ok(())
}
