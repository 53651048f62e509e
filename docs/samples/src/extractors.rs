//! Extractors and shared state (handlers and extractors).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

// ANCHOR: state
use lily::prelude::*;

/// The payload of `order.placed`.
#[derive(serde::Deserialize)]
pub struct OrderPlaced {
    /// Units ordered.
    pub quantity: u32,
}

/// Units reserved so far, shared by every delivery (each call gets a clone).
#[derive(Clone, Default)]
pub struct Stock(pub Arc<AtomicU64>);

async fn place(
    State(stock): State<Stock>,
    Json(order): Json<OrderPlaced>,
    meta: Meta,
    Cancellation(cancel): Cancellation,
) -> HandlerResult {
    if order.quantity == 0 {
        return Err(QueueHandlerError::permanent("quantity must be at least 1"));
    }
    if cancel.is_cancelled() {
        // The handler timed out or shutdown is cooperating: stop, the message comes back.
        return Err(QueueHandlerError::retryable(
            "cancelled before the reservation",
        ));
    }
    stock.0.fetch_add(order.quantity.into(), Ordering::Relaxed);
    let _attempt = meta.attempt(); // 1 on the first delivery, then as the retry copy says
    Ok(())
}

/// The routes, with `stock` as their state.
pub fn router(stock: Stock) -> Router {
    Router::new().route("order.placed", place).with_state(stock)
}
// ANCHOR_END: state
