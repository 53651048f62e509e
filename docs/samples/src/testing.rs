//! Testing a handler without a broker (handlers and extractors). This one runs as a unit test.

use lily::prelude::*;

#[derive(serde::Deserialize)]
struct Order {
    quantity: u32,
}

async fn place(Json(order): Json<Order>) -> HandlerResult {
    if order.quantity == 0 {
        return Err(QueueHandlerError::permanent("quantity must be at least 1"));
    }
    Ok(())
}

/// The routes under test.
pub fn router() -> Router {
    Router::new().route("order.placed", place)
}

/// Settles an order of zero in process and checks that it is dead-lettered with its reason.
///
/// # Panics
/// When the prediction is not the one stated.
pub async fn an_order_of_zero_is_dead_lettered() {
    // ANCHOR: test
    use lily::shutdown::{Lane, Outcome};
    use lily::testing::{TestConsumer, TestDelivery};

    let consumer = TestConsumer::new(ConsumerConfig::new("orders"), router()).unwrap();
    let settled = consumer
        .deliver(TestDelivery::json(
            "order.placed",
            "o-2",
            &serde_json::json!({"quantity": 0}),
        ))
        .await;
    assert_eq!(settled.outcome, Outcome::DeadLettered);
    let copy = settled.copy.unwrap();
    assert_eq!(
        (copy.queue.as_str(), copy.lane),
        ("orders.dlq", Lane::DeadLetter)
    );
    assert_eq!(
        copy.reason(),
        Some("handler failure: quantity must be at least 1")
    );
    // ANCHOR_END: test
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn the_books_testing_sample_holds() {
        super::an_order_of_zero_is_dead_lettered().await;
    }
}
