//! A handler staging an event in its transaction, and the relay publishing it (MongoDB).

use std::sync::Arc;

use lily::mongo::mongodb::bson::{Document, doc};
use lily::mongo::{Outbox, Relay, RelayConfig, handler_error};
use lily::prelude::*;

/// The payload of `order.placed` and of the `stock.reserved` event it causes.
#[derive(serde::Deserialize, serde::Serialize)]
pub struct Order {
    /// The order.
    pub order_id: String,
    /// Units to reserve.
    pub quantity: u32,
}

// ANCHOR: handler
async fn reserve(Json(order): Json<Order>, tx: MongoTx, outbox: Outbox) -> HandlerResult {
    let stock = tx.database().collection::<Document>("stock");
    stock
        .update_one(
            doc! { "_id": "sku-1" },
            doc! { "$inc": { "reserved": i64::from(order.quantity) } },
        )
        .session(&mut *tx.session().await)
        .await
        .map_err(|e| handler_error("stock update", e))?;
    // Staged in the same transaction: it exists exactly when the update committed. Its id is
    // derived from the order's, so a downstream inbox recognises a second publish of it.
    let event = Outgoing::json(
        "stock.reserved",
        &format!("{}.reserved", order.order_id),
        &order,
    )
    .map_err(|e| QueueHandlerError::permanent("event does not serialize").with_source(e))?;
    outbox
        .stage(&Destination::exchange("stock", "reserved"), &event)
        .await
}
// ANCHOR_END: handler

/// Runs `reserve` on `orders`; the consumer runs the outbox's relay beside itself, and its
/// shutdown report counts what the relay left staged.
///
/// # Errors
/// mongod or the broker is unreachable, or refused the consumer at start.
pub async fn run(
    amqp_url: String,
    mongo_url: &str,
) -> Result<ShutdownReport, Box<dyn std::error::Error>> {
    let scope = MongoScope::connect(mongo_url, "stock", MongoConfig::new("stock-service")).await?;
    let router = Router::new().route("order.placed", reserve);
    let consumer = Consumer::new(amqp_url, ConsumerConfig::new("orders"), router).scope(scope);
    Ok(consumer.run_until_signal(ReportSinks::default()).await?)
}

/// A relay of its own, beside an application that stages in its own transactions.
///
/// # Errors
/// mongod or the broker is unreachable.
pub async fn relay_alone(
    amqp_url: &str,
    mongo_url: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    // ANCHOR: relay
    let config = MongoConfig::new("stock-api").without_relay();
    let scope = MongoScope::connect(mongo_url, "stock", config).await?;
    let publisher = Arc::new(Publisher::connect(amqp_url).await?);
    let shutdown = Shutdown::new(ShutdownBudget::default());
    let signals = shutdown.listen_for_signals()?;
    // The relay stops at the first signal, after the batch under way.
    let relay = Relay::new(&scope, publisher, RelayConfig::default());
    let relaying = tokio::spawn(relay.run(shutdown.graceful_token().clone()));
    let relayed = relaying.await?;
    // Still staged is durable, not lost: the next relay publishes it.
    eprintln!(
        "outbox: {} sent, {} failed, {:?} still staged",
        relayed.sent, relayed.failed, relayed.staged
    );
    // ANCHOR_END: relay
    signals.abort();
    Ok(())
}
