//! A handler inside the MongoDB scope: transaction, inbox, lease (MongoDB).

use lily::mongo::handler_error;
use lily::mongo::mongodb::bson::{Document, doc};
use lily::prelude::*;

/// The payload of `stock.reserved`.
#[derive(serde::Deserialize)]
pub struct StockReserved {
    /// The order the stock is for.
    pub order_id: String,
    /// Units reserved.
    pub quantity: u32,
}

// ANCHOR: handler
async fn reserve(Json(order): Json<StockReserved>, meta: Meta, tx: MongoTx) -> HandlerResult {
    if order.quantity == 0 {
        return Err(QueueHandlerError::permanent("quantity must be at least 1"));
    }
    let ledger = tx.database().collection::<Document>("ledger");
    let mut session = tx.session().await;
    ledger
        .insert_one(doc! {
            "order_id": &order.order_id,
            "quantity": i64::from(order.quantity),
            "message_id": meta.message_id(),
        })
        .session(&mut *session) // inside the transaction Lily opened, after the inbox record
        .await
        // A write conflict or an election runs the whole transaction again, in process,
        // without using an attempt; anything else is an ordinary retryable failure.
        .map_err(|e| handler_error("ledger insert", e))?;
    Ok(()) // Lily commits, then ACKs; it never commits or aborts in the handler's place
}
// ANCHOR_END: handler

/// Runs `reserve` on `stock` inside the MongoDB scope.
///
/// # Errors
/// mongod is unreachable or refused the indexes, or the broker refused the consumer at start.
pub async fn run(
    amqp_url: String,
    mongo_url: &str,
) -> Result<ShutdownReport, Box<dyn std::error::Error>> {
    // ANCHOR: scope
    // A replica set: transactions need one. `with_lease()` adds the fenced lease, for handlers
    // with effects outside the database.
    let scope = MongoScope::connect(mongo_url, "stock", MongoConfig::new("stock-service")).await?;
    let router = Router::new().route("stock.reserved", reserve);
    let consumer = Consumer::new(amqp_url, ConsumerConfig::new("stock"), router).scope(scope);
    Ok(consumer.run_until_signal(ReportSinks::default()).await?)
    // ANCHOR_END: scope
}
