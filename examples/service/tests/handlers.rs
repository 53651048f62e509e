//! The service's handler tested without a broker: `lily::testing` settles each delivery
//! through the real gate, handler and decision machine, and says what the consumer would do.

use std::sync::atomic::Ordering;

use lily::prelude::*;
use lily::shutdown::{Lane, Outcome};
use lily::testing::{TestConsumer, TestDelivery};
use lily_mq_example_service::{OrderPlaced, Stock, router};

fn consumer(stock: &Stock) -> TestConsumer {
    TestConsumer::new(ConsumerConfig::new("orders"), router(stock.clone())).expect("valid")
}

fn order(id: &str, quantity: u32) -> TestDelivery {
    TestDelivery::json("order.placed", id, &OrderPlaced { quantity })
}

#[tokio::test]
async fn an_order_reserves_its_stock_and_is_acked() {
    let stock = Stock::default();
    let settled = consumer(&stock).deliver(order("o-1", 3)).await;
    assert_eq!(settled.outcome, Outcome::Acked);
    assert!(settled.copy.is_none());
    assert_eq!(stock.0.load(Ordering::Relaxed), 3);
}

#[tokio::test]
async fn a_zero_quantity_goes_to_the_dead_letter_queue_with_its_reason() {
    let stock = Stock::default();
    let settled = consumer(&stock).deliver(order("o-2", 0)).await;
    assert_eq!(settled.outcome, Outcome::DeadLettered);
    let copy = settled.copy.expect("a DLQ copy");
    assert_eq!(
        (copy.queue.as_str(), copy.lane),
        ("orders.dlq", Lane::DeadLetter)
    );
    assert_eq!(copy.failure_kind(), Some("permanent"));
    assert_eq!(
        copy.reason(),
        Some("handler failure: quantity must be at least 1")
    );
    assert_eq!(stock.0.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn a_body_that_is_not_an_order_never_reaches_the_handler() {
    let stock = Stock::default();
    let garbled = TestDelivery::new(
        b"{\"quantity\":".to_vec(),
        order("o-3", 1).properties().clone(),
    );
    let settled = consumer(&stock).deliver(garbled).await;
    assert_eq!(settled.outcome, Outcome::DeadLettered);
    assert!(
        settled.reason.as_str().contains("truncated JSON"),
        "{}",
        settled.reason
    );
}
