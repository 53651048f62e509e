//! Publishing with `Publisher` (handlers and extractors).

use lily::prelude::*;

/// Publishes one order and says what became of it.
///
/// # Errors
/// The broker could not be reached, or the order could not be encoded.
pub async fn publish_order(order: &serde_json::Value) -> Result<(), Box<dyn std::error::Error>> {
    // ANCHOR: publish
    let publisher = Publisher::connect("amqp://127.0.0.1:5672/%2f").await?;
    let message = Outgoing::json("order.placed", "A-17", order)?.header("tenant", "acme");
    match publisher
        .publish(&Destination::queue("orders"), message)
        .await
    {
        Published::Confirmed => {}
        other => eprintln!("A-17 not confirmed: {other:?}"), // the id, never the body
    }
    // ANCHOR_END: publish
    Ok(())
}
