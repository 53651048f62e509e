//! The service's handlers, in a library so that `tests/handlers.rs` can settle deliveries
//! through them with `lily::testing`, without a broker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use lily::prelude::*;

/// The payload of `order.placed`.
#[derive(serde::Deserialize, serde::Serialize)]
pub struct OrderPlaced {
    /// Units ordered.
    pub quantity: u32,
}

/// Units reserved so far, shared by every delivery.
#[derive(Clone, Default)]
pub struct Stock(pub Arc<AtomicU64>);

async fn place(State(stock): State<Stock>, Json(order): Json<OrderPlaced>) -> HandlerResult {
    if order.quantity == 0 {
        return Err(QueueHandlerError::permanent("quantity must be at least 1"));
    }
    stock.0.fetch_add(order.quantity.into(), Ordering::Relaxed);
    Ok(())
}

/// The service's routes, with `stock` as their state.
pub fn router(stock: Stock) -> Router {
    Router::new().route("order.placed", place).with_state(stock)
}
